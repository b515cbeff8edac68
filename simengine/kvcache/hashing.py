"""Chained block hashes over token ids: equal hashes mean equal prefixes (vLLM's parent-chained scheme)."""

from __future__ import annotations

from simengine.core.request import Request


def extend_block_hashes(req: Request, block_size: int, num_tokens: int) -> list[int]:
    """Make req.block_hashes cover every full block within the first `num_tokens` tokens; return it."""
    hashes = req.block_hashes
    full = min(num_tokens, len(req.token_ids)) // block_size
    if len(hashes) < full:
        parent = hashes[-1] if hashes else block_size
        ids = req.token_ids
        for i in range(len(hashes), full):
            parent = hash((parent, ids[i * block_size:(i + 1) * block_size].tobytes()))
            hashes.append(parent)
    return hashes
