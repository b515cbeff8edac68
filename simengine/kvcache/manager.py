"""KVCacheManager: per-request block tables over a BlockPool, prefix lookups and slot allocation."""

from __future__ import annotations

from dataclasses import dataclass

from simengine.core.request import Request, Status
from simengine.kvcache.block_pool import BlockPool
from simengine.kvcache.hashing import block_hashes
from simengine.kvcache.host_tier import HostTier


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Blocks a prefix lookup found, and the tokens they cover."""

    blocks: list[int]
    num_tokens: int


NO_HIT = PrefixHit([], 0)


class KVCacheManager:
    """Paged KV for one replica. Policies call these methods; they never index the pool directly."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[int, list[int]] = {}
        self.req_hashed: dict[int, int] = {}     # blocks of the request already published to the cache
        self.req_end: dict[int, int] = {}        # a request with private tokens: the end of its last allocation
        self.query_tokens = 0                    # prefix-cache queries and hits, in tokens (vLLM metric)
        self.hit_tokens = 0
        self.host: HostTier | None = None        # a host-memory tier behind the GPU cache (attach_host)
        self.host_hit_tokens = 0
        # Simulation speed, not an engine mechanism: a block holding one of a request's unique outputs (see
        # Request.unique_outputs) is published at the request's next allocation or release instead of the step that
        # fills it. Nothing can tell: no other request can look that block's hash up, publish it or own it before.
        self.defer_output_publish = False
        # Likewise, always on: a block holding a private token (Request.private_from: in no other request, ever) is
        # neither hashed nor published, since only its own request could find it, and only after giving its blocks
        # up unfinished (a preemption, free_tail, transfer): then they are published as they would have been.

    def attach_host(self, tier: HostTier) -> None:
        """Put a host tier behind the prefix cache: it takes every published block (write-through) or the blocks
        the pool evicts."""
        if not self.enable_prefix_caching:
            raise ValueError("a host tier needs the prefix cache")
        self.host = tier
        if not tier.write_through:
            self.pool.on_evict = tier.store

    def host_hit(self, req: Request, hit: PrefixHit) -> tuple[int, int]:
        """Prompt tokens past the GPU hit `hit` that the host tier holds, and after them those its disk tier holds,
        in whole blocks and one token short of the prompt (as the GPU hit); they become the tiers' most recent.
        `take_from_host` records a load. (0, 0) without a host tier."""
        host = self.host
        if host is None:
            return 0, 0
        start = len(hit.blocks)
        last = req.num_tokens - 1
        stop = (last if last < req.private_from else req.private_from) // self.block_size
        if stop <= start:
            return 0, 0
        here, behind = host.match_tiers(block_hashes(req, self.block_size)[start:stop])
        return here * self.block_size, behind * self.block_size

    def take_from_host(self, tokens: int, disk_tokens: int = 0) -> None:
        """`tokens` found by `host_hit` (`disk_tokens` of them on disk) are loaded back (the hit counted)."""
        host = self.host
        assert host is not None, "a host load without a host tier"
        host.hit_blocks += (tokens - disk_tokens) // self.block_size
        if disk_tokens:
            assert host.spill is not None, "a disk load without a disk tier"
            host.spill.hit_blocks += disk_tokens // self.block_size
        self.host_hit_tokens += tokens

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> PrefixHit:
        """Longest cached prefix of full blocks, capped so at least one prompt token is recomputed."""
        if not self.enable_prefix_caching:
            return NO_HIT
        self.query_tokens += req.num_tokens
        last = req.num_tokens - 1
        max_blocks = (last if last < req.private_from else req.private_from) // self.block_size  # no one else's
        if not max_blocks:  # private blocks are unpublished, and cannot be anyone else's
            return NO_HIT
        hashes = block_hashes(req, self.block_size)
        blocks = []
        lookup = self.pool.lookup
        for h in hashes[:max_blocks]:
            b = lookup(h)
            if b is None:
                break
            blocks.append(b)
        hit = PrefixHit(blocks, len(blocks) * self.block_size)
        self.hit_tokens += hit.num_tokens
        return hit

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of the request's prompt that cached full blocks hold now, from its first block on, changing
        nothing (no hit counted, no block touched): what vLLM's KV events tell a router."""
        if not self.enable_prefix_caching:
            return 0
        lookup, n = self.pool.lookup, 0
        for h in block_hashes(req, self.block_size)[:req.prompt_len // self.block_size]:
            if lookup(h) is None:
                break
            n += 1
        return n * self.block_size

    def can_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT,
                     reserve_tokens: int = 0, watermark_blocks: int = 0) -> bool:
        """Whether allocate_slots would succeed (no state change)."""
        if req.num_computed_tokens + num_new_tokens <= req.kv_settled_tokens and reserve_tokens <= \
                req.kv_settled_tokens and not hit.blocks:
            return self.pool.num_free >= watermark_blocks  # nothing to allocate
        return self.blocks_needed(req, num_new_tokens, hit, reserve_tokens) <= (
            self.pool.num_free_after_touch(hit.blocks) - watermark_blocks)

    def blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT, reserve_tokens: int = 0) -> int:
        """New blocks allocate_slots would take for these arguments."""
        have = len(self.req_blocks.get(req.request_id, ())) + len(hit.blocks)
        total = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        return max(0, self.blocks_for(max(total, reserve_tokens)) - have)

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT, *,
                       reserve_tokens: int = 0, fits_tokens: int = 0, watermark_blocks: int = 0) -> bool:
        """Give `req` blocks for its computed tokens, the hit and `num_new_tokens` more.

        `reserve_tokens` allocates blocks covering at least that many tokens (vLLM v0's and Sarathi's whole-prompt
        allocation, Orca's reservation). `fits_tokens` only checks that blocks for that many tokens are free now and
        allocates the step's (vLLM V1's scheduler_reserve_full_isl admission gate, kv_cache_manager.py
        `full_sequence_must_fit`). Returns False and changes nothing when blocks are short.
        """
        if req.num_computed_tokens + num_new_tokens <= req.kv_settled_tokens and reserve_tokens <= \
                req.kv_settled_tokens and fits_tokens <= req.kv_settled_tokens and not hit.blocks:
            return True  # fast path (most decode steps): held blocks cover the tokens and none fills up
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        hit_blocks = hit.blocks
        end = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        bs = self.block_size
        pool = self.pool
        held = len(hit_blocks) + (len(blocks) if blocks else 0)
        needed = -(-(end if end > reserve_tokens else reserve_tokens) // bs) - held
        if needed < 0:
            needed = 0
        check = max(needed, -(-fits_tokens // bs) - held)
        if check > 0 or watermark_blocks:
            free = pool.num_free_after_touch(hit_blocks) if hit_blocks else pool.num_free
            if check > free - watermark_blocks:
                return False
        if blocks is None:
            blocks = self.req_blocks[rid] = []
        if hit_blocks:
            pool.touch(hit_blocks)
            blocks.extend(hit_blocks)
            self.req_hashed[rid] = len(hit_blocks)
        if needed == 1:
            blocks.append(pool.allocate_one())
        elif needed:
            blocks.extend(pool.allocate(needed))
        self._settle(req, blocks, end)
        return True

    def append_slot(self, req: Request) -> bool:
        """allocate_slots(req, 1) for a running request whose computed tokens its blocks hold (a decode, or a
        prompt's last token): at most one new block, no hit, no reservation. The cohort's per-event path."""
        blocks = self.req_blocks[req.request_id]
        end = req.num_computed_tokens + 1
        if end > len(blocks) * self.block_size:
            if not self.pool.num_free:
                return False
            blocks.append(self.pool.allocate_one())
        self._settle(req, blocks, end)
        return True

    def adopt(self, req: Request, blocks: list[int]) -> None:
        """Append blocks the pool already gave out (`BlockPool.allocate`: ref count 1, no hash) to the table of a
        running request whose computed tokens they cover, leaving them unpublished: only for a request whose full
        blocks are published later or never (caching off, `defer_output_publish` with `Request.unique_outputs`, or
        private tokens in them).
        Which free block went to which request changes nothing observable; when it was taken does (eviction order),
        so callers take them on time."""
        held = self.req_blocks[req.request_id]
        held += blocks
        req.kv_settled_tokens = len(held) * self.block_size

    def _settle(self, req: Request, blocks: list[int], end: int) -> None:
        """After `req`'s blocks were sized for `end` computed tokens: publish the blocks those tokens fill and set
        `kv_settled_tokens`, how far its computed tokens can grow before the manager has work again."""
        bs = self.block_size
        settled = len(blocks) * bs
        if self.enable_prefix_caching:
            rid = req.request_id
            hashed = self.req_hashed.get(rid, 0)
            limit = req.private_from  # blocks with a private token stay unpublished (see free)
            known = req.prompt_len + req.num_output_tokens
            if end > known:  # speculative drafts: only tokens the request has are cached (vLLM caches up to
                end = known  # request.num_tokens, without the drafts, whose KV a rejection discards)
            if limit < len(req.token_ids):
                self.req_end[rid] = end
            full = (end if end < limit else limit) // bs
            if full > hashed:  # publish the newly full blocks
                last = full if full < len(blocks) else len(blocks)
                hashes = req.block_hashes
                if hashes is None or req.block_hash_size != bs:
                    hashes = block_hashes(req, bs)
                if last == hashed + 1:
                    self.pool.cache_block(blocks[hashed], hashes[hashed])
                else:
                    self.pool.cache_blocks(blocks[hashed:last], hashes[hashed:last])
                host = self.host
                if host is not None and host.write_through:
                    stop = min(last, req.prompt_len // bs) if host.prompt_only else last
                    host.store_many(hashes[hashed:stop])
                self.req_hashed[rid] = hashed = last
            next_full = (hashed + 1) * bs
            if next_full <= limit and next_full <= settled and not (
                    next_full > req.prompt_len and req.unique_outputs and self.defer_output_publish):
                settled = next_full - 1  # stop short of filling the next block, which gets published
        req.kv_settled_tokens = settled

    def num_blocks_of(self, req: Request) -> int:
        return len(self.req_blocks.get(req.request_id, ()))

    def blocks_short_of(self, horizon_blocks: dict[int, int]) -> int:
        """Blocks the requests (request id -> a block count) still need to hold that many each; a request already
        past its count needs none."""
        tables = self.req_blocks.get
        return sum(short for rid, n in horizon_blocks.items() if (short := n - len(tables(rid, ()))) > 0)

    def free(self, req: Request, cached_tokens: int | None = None) -> None:
        """Release every block of the request (no-op if it holds none). The blocks its first `cached_tokens` tokens
        fill (default: its computed tokens) stay in the prefix cache; blocks past them it published are dropped
        from it (vLLM async scheduling caches a decode's block only when the step's output is applied)."""
        if req.private_from < len(req.token_ids):
            if req.status is not Status.FINISHED:  # it may come back and look its own blocks up
                self._unprivate(req)
        elif self.defer_output_publish:
            self.publish_through(req, req.num_computed_tokens)
        self.req_end.pop(req.request_id, None)
        blocks = self.req_blocks.pop(req.request_id, None)
        hashed = self.req_hashed.pop(req.request_id, 0)
        req.kv_settled_tokens = 0
        full = (req.num_computed_tokens if cached_tokens is None else cached_tokens) // self.block_size
        host = self.host
        if host is not None and host.write_through and blocks:   # private full blocks, copied out too, found by nobody
            stored = min(full, req.prompt_len // self.block_size) if host.prompt_only else full
            host.store_anonymous(stored - min(hashed, stored))
        if blocks:   # full blocks of computed tokens are cached in vLLM, published here or not (private ones)
            if cached_tokens is not None:
                for b in blocks[full:hashed]:
                    self.pool.uncache(b)
            self.pool.free(blocks, full)

    def _unprivate(self, req: Request) -> None:
        """From now on every block of `req` is published like any other: first those a manager without private
        blocks would have published by now (full through its last allocation or its computed tokens)."""
        req.private_from = len(req.token_ids)
        end = self.req_end.pop(req.request_id, 0)
        self.publish_through(req, end if end > req.num_computed_tokens else req.num_computed_tokens)

    def publish_through(self, req: Request, end: int) -> None:
        """Publish the request's blocks that `end` tokens fill and are not private (those `defer_output_publish` left
        unpublished, or all of them once `_unprivate` made the request ordinary)."""
        blocks = self.req_blocks.get(req.request_id)
        if blocks and self.enable_prefix_caching:
            self._settle(req, blocks, end)

    def free_tail(self, req: Request, keep_tokens: int) -> int:
        """Release the request's blocks beyond the first `keep_tokens` tokens; return blocks freed."""
        blocks = self.req_blocks.get(req.request_id)
        if req.private_from < len(req.token_ids):  # it keeps running and may look its freed blocks up again
            self._unprivate(req)
        req.kv_settled_tokens = 0
        if not blocks:
            return 0
        keep = self.blocks_for(keep_tokens)
        tail = blocks[keep:]
        del blocks[keep:]
        self.req_hashed[req.request_id] = min(self.req_hashed.get(req.request_id, 0), keep)
        self.pool.free(tail, req.num_computed_tokens // self.block_size - keep)
        return len(tail)

    def transfer(self, src: Request, dst: Request) -> None:
        """Hand `src`'s block table (and its published-block count) to `dst`, which holds none."""
        if src.private_from < len(src.token_ids):  # its blocks live on in another request
            self._unprivate(src)
        blocks = self.req_blocks.pop(src.request_id, None)
        if blocks:
            self.req_blocks[dst.request_id] = blocks
        hashed = self.req_hashed.pop(src.request_id, None)
        if hashed is not None:
            self.req_hashed[dst.request_id] = hashed
        src.kv_settled_tokens = dst.kv_settled_tokens = 0
