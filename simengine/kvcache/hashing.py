"""Chained block hashes over token ids: equal hashes mean equal prefixes (vLLM's parent-chained scheme)."""

from __future__ import annotations

from simengine.core.request import Request


def extend_block_hashes(req: Request, block_size: int, num_tokens: int) -> list[int]:
    """Make req.block_hashes cover every full block within the first `num_tokens` tokens; return it."""
    hashes = req.block_hashes
    full = min(num_tokens, len(req.token_ids)) // block_size
    if len(hashes) < full:
        parent = hashes[-1] if hashes else block_size
        start = len(hashes)
        raw = req.token_ids[start * block_size:full * block_size].tobytes()  # one copy, sliced per block
        step = len(raw) // (full - start)
        for i in range(0, len(raw), step):
            parent = hash((parent, raw[i:i + step]))
            hashes.append(parent)
    return hashes
