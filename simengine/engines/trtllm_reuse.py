"""TensorRT-LLM's block reuse as its capacity scheduler sees it: a context's reusable prefix stops at a block another
context computes this step, and a context whose first new block another context is producing waits a step to reuse
it (beneficialToSkip, batch_manager/capacityScheduler.cpp). The scheduler that uses it is engines/trtllm.py.
"""

from __future__ import annotations

from simengine.core.request import Request
from simengine.kvcache.hashing import block_hashes
from simengine.kvcache.manager import NO_HIT, KVCacheManager, PrefixHit


class ContextReuse:
    """Block keys the step's contexts produce, and the lookups the capacity scheduler makes against them."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.produced: set[int] = set()   # block keys contexts compute this step (not reusable until done)

    def lookup(self, req: Request) -> PrefixHit:
        """Reusable prefix, cut at the first block another context is only computing this step."""
        if req.num_computed_tokens:
            return NO_HIT
        kv = self.kv
        hit = kv.get_computed_blocks(req)
        if not hit.blocks:
            return hit
        for i, key in enumerate(block_hashes(req, kv.block_size)[:len(hit.blocks)]):
            if key in self.produced:
                kv.hit_tokens -= hit.num_tokens - i * kv.block_size
                return PrefixHit(hit.blocks[:i], i * kv.block_size)
        return hit

    def note_produced(self, req: Request, n: int) -> None:
        """`req` computes `n` tokens this step: the full blocks they complete are being produced."""
        if self.kv.enable_prefix_caching:
            bs, start, end = self.kv.block_size, req.num_computed_tokens, req.num_computed_tokens + n
            self.produced.update(block_hashes(req, bs)[start // bs:end // bs])

    def unlookup(self, req: Request, hit: PrefixHit) -> None:
        """Un-count a lookup that did not lead to admission (the hit rate counts admissions only)."""
        if self.kv.enable_prefix_caching and req.num_computed_tokens == 0:
            self.kv.query_tokens -= req.num_tokens
            self.kv.hit_tokens -= hit.num_tokens

    def first_new_block(self, req: Request, hit: PrefixHit) -> int | None:
        """Key of the first full prompt block not in the cache (findNewContextBlock), or None."""
        bs = self.kv.block_size
        idx, full = len(hit.blocks) + req.num_computed_tokens // bs, req.prompt_len // bs
        if not self.kv.enable_prefix_caching or idx >= full:
            return None
        return block_hashes(req, bs)[idx]

    def contributed_keys(self, running: list[Request]) -> set[int]:
        """Blocks that contexts already chunking will produce (prefillWithChunkedContextsAlreadyExecuting)."""
        keys = set()
        for req in running:
            if req.num_output_tokens == 0 and (key := self.first_new_block(req, NO_HIT)) is not None:
                keys.add(key)
        return keys
