"""A paged KV block pool with ref counts and a hashed-full-block prefix cache (vLLM V1 semantics).

Free blocks form one LRU queue: allocation takes from the front; a freed request's cached blocks join the tail in
reverse, so the end of a prefix chain is evicted before its head, and its blocks without a cached hash go to the
front, reused first. A taken block that still owns a cached hash drops it then (lazy eviction). A cached block with
ref count 0 can be touched back out of the queue by a prefix hit.

The queue is a list of block ids in LRU order from `head` on (taking n blocks is one slice; the taken prefix is
dropped once it is most of the list). A touch leaves the block's entry behind as a stale one (counted
in `stale`, skipped when reached) instead of removing it from the middle: a block's stale entries always precede
its live one, because an entry is appended when the block is freed (one with stale entries is never put at the
front). The queue is compacted when stale entries pile up.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

FRONT_SLACK = 4096   # taken entries left before the head when the queue is rebuilt for blocks freed to the front
FULL_CHECK_BLOCKS = 8192   # check_invariants compares every block on each call up to this pool size


class BlockPool:
    """`num_blocks` KV blocks. Contract: ref counts never negative; used + free == num_blocks; a block's
    `block_hash` is set exactly when the cache maps that hash to it."""

    compact_min_stale = 1024  # stale queue entries tolerated before compacting (besides one per free block)

    def __init__(self, num_blocks: int, *, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt: list[int] = [0] * num_blocks       # a list: Python-level indexing is ~5x a numpy array's
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                  # block hash -> the block a lookup returns
        self.dups: dict[int, list[int]] = {}              # block hash -> further blocks with it, oldest first
        self.free_queue: list[int] = list(range(num_blocks))  # entries before `head` were taken
        self.head = 0
        self.num_free = num_blocks
        self.stale: dict[int, int] = {}                   # block id -> its stale entries in free_queue
        # called with the hash of each cached block an allocation evicts (a host tier's store)
        self.on_evict: Callable[[int], None] | None = None
        self._calls_to_full_check = 1

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def free_blocks(self) -> list[int]:
        """The free blocks in LRU order (eviction order), without the stale entries."""
        if not self.stale:
            return self.free_queue[self.head:]
        pending = dict(self.stale)
        out = []
        for b in self.free_queue[self.head:]:
            if b in pending:
                if pending[b] == 1:
                    del pending[b]
                else:
                    pending[b] -= 1
                continue
            out.append(b)
        return out

    def lookup(self, block_hash: int) -> int | None:
        """The cached block holding this hash, or None."""
        return self.cached.get(block_hash)

    def _take(self, n: int) -> list[int]:
        """Take n live entries from the queue front (the caller checked num_free >= n and counted them)."""
        queue, head = self.free_queue, self.head
        if not self.stale:
            out = queue[head:head + n]
            head += n
        else:
            stale, out = self.stale, []
            while len(out) < n:
                b = queue[head]
                head += 1
                left = stale.get(b)
                if left is None:
                    out.append(b)
                elif left == 1:
                    del stale[b]
                else:
                    stale[b] = left - 1
        if head > 4096 and head > len(queue) >> 1:  # drop the taken prefix: amortised O(1) an entry
            del queue[:head]
            head = 0
        self.head = head
        return out

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the LRU front (evicting their cached content). Caller checked num_free >= n."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        self.num_free -= n
        out = self._take(n)
        ref_cnt, block_hash, cached = self.ref_cnt, self.block_hash, self.cached
        if not cached:  # no block holds a hash (nothing published, or only private blocks): nothing to evict
            for b in out:
                ref_cnt[b] = 1
            return out
        dups, on_evict = self.dups, self.on_evict
        for b in out:
            ref_cnt[b] = 1
            h = block_hash[b]
            if h is not None:
                block_hash[b] = None
                if dups and h in dups:
                    self._unmap(h, b)
                else:
                    del cached[h]
                    if on_evict is not None:
                        on_evict(h)
        return out

    def uncache(self, b: int) -> None:
        """Drop block b's hash from the cache (no-op if it holds none)."""
        h = self.block_hash[b]
        if h is None:
            return
        self.block_hash[b] = None
        if self.dups and h in self.dups:
            self._unmap(h, b)
        else:
            del self.cached[h]

    def _unmap(self, h: int, b: int) -> None:
        """Block b, evicted, no longer holds hash h; another block with h (the oldest) answers its lookups."""
        more = self.dups[h]
        if self.cached[h] == b:
            self.cached[h] = more.pop(0)
        else:
            more.remove(b)
        if not more:
            del self.dups[h]

    def allocate_one(self) -> int:
        """allocate(1) without the list."""
        if not self.num_free:
            raise RuntimeError("allocate(1) with no free block")
        self.num_free -= 1
        b = self._take(1)[0]
        self.ref_cnt[b] = 1
        h = self.block_hash[b]
        if h is not None:
            self.uncache(b)
            if self.on_evict is not None and h not in self.cached:
                self.on_evict(h)
        return b

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks hit by a prefix lookup."""
        ref_cnt, stale = self.ref_cnt, self.stale
        for b in blocks:
            if ref_cnt[b] == 0:  # it leaves the free queue: its entry goes stale
                stale[b] = stale.get(b, 0) + 1
                self.num_free -= 1
            ref_cnt[b] += 1
        if len(self.free_queue) - self.head - self.num_free > max(self.compact_min_stale, self.num_free):  # amortised
            self.free_queue, self.head = self.free_blocks(), 0
            stale.clear()

    def free(self, blocks: list[int], num_full: int = 0) -> None:
        """Drop one reference from each block, last first. As vLLM's BlockPool.free_blocks (v1/core/block_pool.py):
        a block reaching 0 that holds a cached hash joins the LRU tail (evicted last, in FIFO order); one without
        (a partial block, or caching off) goes to the front, to be reused first. The first `num_full` blocks count as
        cached even without a hash (full blocks the manager left unpublished, which vLLM would have cached)."""
        ref_cnt = self.ref_cnt
        split = num_full if self.enable_caching else 0
        first, last = [], []
        if split < len(blocks):   # the tail past the full blocks: mostly one partial block
            block_hash, stale, caching = self.block_hash, self.stale, self.enable_caching
            for b in reversed(blocks[split:]):
                c = ref_cnt[b] - 1
                ref_cnt[b] = c
                if not c:
                    if caching and block_hash[b] is not None or b in stale:
                        last.append(b)   # (a block with stale entries must keep its live entry after them)
                    else:
                        first.append(b)
                elif c < 0:
                    raise RuntimeError(f"block {b} ref count went negative")
        full = blocks[:split]   # (num_full may exceed the blocks: a manager's count of a longer table)
        k = len(full)
        if k > 1 and itemgetter(*full)(ref_cnt).count(1) == k:  # none shared (the usual case): all to the tail,
            for b in full:                                         # without a branch a block
                ref_cnt[b] = 0
            full.reverse()
            last += full
        else:
            for b in reversed(full):
                c = ref_cnt[b] - 1
                ref_cnt[b] = c
                if not c:
                    last.append(b)
                elif c < 0:
                    raise RuntimeError(f"block {b} ref count went negative")
        if first:
            queue, head, k = self.free_queue, self.head, len(first)
            if head >= k:    # over taken entries before the head
                queue[head - k:head] = first
                self.head = head - k
            else:            # a new list with slack before the head, so the next prepends are O(their length)
                pad = max(FRONT_SLACK, k)
                self.free_queue, self.head = [0] * (pad - k) + first + queue[head:], pad - k
        self.free_queue.extend(last)
        self.num_free += len(last) + len(first)

    def cache_blocks(self, blocks: list[int], hashes: list[int]) -> None:
        """Publish the full blocks' hashes (blocks that own none yet). A block whose hash the cache already maps is
        kept as a duplicate, as vLLM's BlockHashToBlockMap does: lookups return the oldest until it is evicted."""
        if not self.enable_caching:
            return
        cached, block_hash = self.cached, self.block_hash
        if cached.keys().isdisjoint(hashes):  # the usual case, in C
            cached.update(zip(hashes, blocks))
            for b, h in zip(blocks, hashes):
                block_hash[b] = h
            return
        for b, h in zip(blocks, hashes):
            self.cache_block(b, h)

    def cache_block(self, block: int, block_hash: int) -> None:
        """cache_blocks for one block."""
        if self.enable_caching:
            if block_hash in self.cached:
                self.dups.setdefault(block_hash, []).append(block)
            else:
                self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def num_free_after_touch(self, blocks: list[int]) -> int:
        """Free blocks left if `blocks` (cache hits) were touched: hits idle in the free queue stop being free."""
        return self.num_free - sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (tests and fuzzing check after every step).
        The counts are checked on every call; the block-by-block comparison of the free queue, the ref counts and
        the hash map (a few ms on a pool of 65,000 blocks) on every call for pools up to FULL_CHECK_BLOCKS blocks and
        on every (num_blocks / FULL_CHECK_BLOCKS)-th call for larger ones, so a test run's checks cost about the same
        per step whatever the device's memory: a broken entry is still caught, a few steps later at most."""
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        assert 0 <= self.num_free <= self.num_blocks, "free count out of range"
        assert ref_cnt.count(0) == self.num_free, "free count disagrees with the ref counts"
        assert len(self.free_queue) - self.head - sum(self.stale.values()) == self.num_free, \
            "free count disagrees with the free queue"
        assert self.num_blocks - block_hash.count(None) == len(self.cached) + sum(map(len, self.dups.values())), \
            "a block owns a hash the map lacks"
        self._calls_to_full_check -= 1
        if self._calls_to_full_check > 0:
            return
        self._calls_to_full_check = -(-self.num_blocks // FULL_CHECK_BLOCKS)
        assert min(ref_cnt) >= 0, "negative ref count"
        free_blocks = self.free_blocks()
        assert len(set(free_blocks)) == len(free_blocks), "a block twice in the free queue"
        # distinct, as many as the blocks with ref count 0 (checked above) and all with ref count 0: the same set
        assert not any(map(ref_cnt.__getitem__, free_blocks)), "free queue disagrees with ref counts"
        assert list(map(block_hash.__getitem__, self.cached.values())) == list(self.cached), \
            "hash map points at a block with another hash"
        for h, more in self.dups.items():
            assert more and h in self.cached and all(block_hash[b] == h for b in more), "a stray duplicate"
