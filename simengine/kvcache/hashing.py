"""Chained block hashes over token ids: equal hashes mean equal prefixes (vLLM's parent-chained scheme).

Block i's hash covers blocks 0..i, so two requests share a block hash only if they share the whole prefix up to
and including that block (barring a 2**-64 collision). A request's token_ids (prompt and every output) are known
in advance, so all its full blocks are hashed in one numpy pass the first time any hash is asked for:

    content_i = mix(tokens of block i . W)            W: fixed odd 64-bit weights, one per position in a block
    chain_i   = sum_{j<=i} content_j * P**(i-j)       (mod 2**64), computed as P**i * cumsum(content_j * P**-j)
    hash_i    = mix(chain_i + block_size)             mix: the splitmix64 finaliser, so hashes are not linear
"""

from __future__ import annotations

import numpy as np

from simengine.core.request import Request

_U64 = np.uint64
_P = 0x9E3779B97F4A7C15                                    # odd, so invertible mod 2**64
_P_INV = pow(_P, -1, 2**64)
_weights = np.random.default_rng(0x5EED).integers(0, 2**63, 256, dtype=np.uint64) * _U64(2) + _U64(1)
_powers = np.ones(0, dtype=np.uint64)                      # P**i, grown on demand
_inv_powers = np.ones(0, dtype=np.uint64)                  # P**-i


def _mix(x: np.ndarray) -> np.ndarray:
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


def _grow_powers(n: int) -> None:
    global _powers, _inv_powers
    size = max(n, 2 * len(_powers), 1024)
    _powers = np.array([pow(_P, i, 2**64) for i in range(size)], dtype=np.uint64)
    _inv_powers = np.array([pow(_P_INV, i, 2**64) for i in range(size)], dtype=np.uint64)


def hash_blocks(token_ids: np.ndarray, block_size: int) -> list[int]:
    """Chained hashes of every full block of `token_ids`."""
    full = len(token_ids) // block_size
    if not full:
        return []
    if full > len(_powers):
        _grow_powers(full)
    blocks = token_ids[:full * block_size].reshape(full, block_size).astype(np.uint64)
    weights = _weights[:block_size] if block_size <= len(_weights) else \
        np.resize(_weights, block_size)  # blocks wider than 256 tokens reuse the weights cyclically
    content = _mix(blocks @ weights)
    chain = np.cumsum(content * _inv_powers[:full], dtype=np.uint64) * _powers[:full]
    return _mix(chain + _U64(block_size)).tolist()


def block_hashes(req: Request, block_size: int) -> list[int]:
    """The chained hashes of every full block of the request's tokens (computed once, kept on the request;
    a request is hashed with one block size, its engine's)."""
    hashes = req.block_hashes
    if hashes is None:
        hashes = req.block_hashes = hash_blocks(req.token_ids, block_size)
    return hashes
