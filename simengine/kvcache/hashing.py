"""Chained block hashes over token ids: equal hashes mean equal prefixes (vLLM's parent-chained scheme).

Block i's hash covers blocks 0..i, so two requests share a block hash only if they share the whole prefix up to
and including that block (barring a 2**-64 collision). A request's token_ids (prompt and every output) are known
in advance, so all its full blocks are hashed in one numpy pass the first time any hash is asked for:

    content_i = mix(tokens of block i . W)            W: fixed odd 64-bit weights, one per position in a block
    chain_i   = sum_{j<=i} content_j * P**(i-j)       (mod 2**64), computed as P**i * cumsum(content_j * P**-j)
    hash_i    = mix(chain_i + block_size)             mix: the splitmix64 finaliser, so hashes are not linear

Requests generated together (open-loop requests, 512 at a time) share a `HashBatch`: the first one whose hashes
are asked for hashes them all in one numpy pass (`hash_many`, the same values as one `hash_blocks` each), which
costs a fraction of one pass per request.
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
    ones = np.ones(1, dtype=np.uint64)
    _powers = np.concatenate([ones, np.cumprod(np.full(size - 1, _P, dtype=np.uint64))])  # wraps mod 2**64
    _inv_powers = np.concatenate([ones, np.cumprod(np.full(size - 1, _P_INV, dtype=np.uint64))])


def _weights_for(block_size: int) -> np.ndarray:
    # blocks wider than 256 tokens reuse the weights cyclically
    return _weights[:block_size] if block_size <= len(_weights) else np.resize(_weights, block_size)


def hash_blocks(token_ids: np.ndarray, block_size: int) -> list[int]:
    """Chained hashes of every full block of `token_ids`."""
    full = len(token_ids) // block_size
    if not full:
        return []
    if full > len(_powers):
        _grow_powers(full)
    blocks = token_ids[:full * block_size].reshape(full, block_size).astype(np.uint64)
    content = _mix(blocks @ _weights_for(block_size))
    chain = np.cumsum(content * _inv_powers[:full], dtype=np.uint64) * _powers[:full]
    return _mix(chain + _U64(block_size)).tolist()


def hash_many(token_arrays: list[np.ndarray], block_size: int) -> list[list[int]]:
    """hash_blocks of each array, in one pass over their concatenated full blocks.

    With g a block's index in the concatenation and g0 its request's first: the request's chain is
    P**g * (S_g - S_(g0-1)) with S the running sum of content_g * P**-g over all blocks (exact mod 2**64)."""
    fulls = np.fromiter((len(a) // block_size for a in token_arrays), dtype=np.int64, count=len(token_arrays))
    num = int(fulls.sum())
    if not num:
        return [[] for _ in token_arrays]
    if num > len(_powers):
        _grow_powers(num)
    tokens = np.concatenate([a[:f * block_size] for a, f in zip(token_arrays, fulls.tolist())])
    content = _mix(tokens.reshape(num, block_size).astype(np.uint64) @ _weights_for(block_size))
    running = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(content * _inv_powers[:num], dtype=np.uint64)])
    ends = np.cumsum(fulls)
    before = running[ends - fulls]  # S_(g0-1) of each request (running is shifted by one)
    chain = (running[1:] - np.repeat(before, fulls)) * _powers[:num]
    flat = _mix(chain + _U64(block_size)).tolist()
    return [flat[e - f:e] for e, f in zip(ends.tolist(), fulls.tolist())]


class HashBatch:
    """The token arrays of requests made together (open-loop requests, HASH_BATCH at a time): the first whose
    hashes are asked for hashes them all in one pass; each request then takes its own list (holding no reference
    back, so no cycle keeps finished requests alive)."""

    __slots__ = ("token_arrays", "hashes", "block_size")

    def __init__(self, token_arrays: list[np.ndarray]):
        self.token_arrays: list[np.ndarray] | None = token_arrays
        self.hashes: list[list[int] | None] | None = None
        self.block_size = 0

    def take(self, index: int, block_size: int) -> list[int] | None:
        """Request `index`'s hashes (None if the batch was hashed with another block size)."""
        if self.hashes is None:
            assert self.token_arrays is not None   # dropped only once hashed
            self.hashes = list(hash_many(self.token_arrays, block_size))
            self.token_arrays, self.block_size = None, block_size
        if block_size != self.block_size:
            return None
        hashes, self.hashes[index] = self.hashes[index], None
        return hashes


def block_hashes(req: Request, block_size: int) -> list[int]:
    """The chained hashes of every full block of the request's tokens (computed once, kept on the request with
    their block size: a request is hashed with its engine's, and again only if a router asked a replica with
    another first), from its batch's single pass when it has one."""
    hashes = req.block_hashes
    if hashes is None or req.block_hash_size != block_size:
        hashes = None
        if req.hash_batch is not None:
            batch, index = req.hash_batch
            req.hash_batch = None
            hashes = batch.take(index, block_size)
        if hashes is None:
            hashes = hash_blocks(req.token_ids, block_size)
        if req.lora_id >= 0:   # KV computed under a LoRA adapter is its own: the adapter keys its blocks (vLLM's
            # extra hash keys), so equal tokens under different adapters share nothing
            salt = (req.lora_id + 1) * 0xD6E8FEB86659FD93
            hashes = _mix(np.array(hashes, dtype=np.uint64) ^ _U64(salt & (2**64 - 1))).tolist()
        req.block_hashes, req.block_hash_size = hashes, block_size
    return hashes
