"""A paged KV block pool with ref counts and a hashed-full-block prefix cache (vLLM V1 semantics).

Free blocks sit in one LRU queue (an OrderedDict: O(1) pop from the front and removal from the middle):
allocation pops from the front; a freed
request's blocks are appended tail-first, so the end of a prefix chain is evicted before its head. A popped
block that still carries a hash leaves the hash map then (lazy eviction). A cached block with ref count 0
can be touched back out of the free queue by a prefix hit.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class BlockPool:
    """`num_blocks` KV blocks. Contract: ref counts never negative; used + free == num_blocks."""

    def __init__(self, num_blocks: int, *, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt: list[int] = [0] * num_blocks       # a list: Python-level indexing is ~5x a numpy array's
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                  # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def lookup(self, block_hash: int) -> int | None:
        """The cached block holding this hash, or None."""
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """Pop n blocks from the LRU front (evicting their cached content). Caller checked num_free >= n."""
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}) with only {len(self.free_queue)} free blocks")
        block_hash, cached, ref_cnt = self.block_hash, self.cached, self.ref_cnt
        popitem = self.free_queue.popitem
        out = [popitem(last=False)[0] for _ in range(n)]
        for b in out:
            ref_cnt[b] = 1
            h = block_hash[b]
            if h is not None:
                if cached.get(h) == b:
                    del cached[h]
                block_hash[b] = None
                self.num_evictions += 1
        return out

    def allocate_one(self) -> int:
        """allocate(1) without the list."""
        if not self.free_queue:
            raise RuntimeError("allocate(1) with no free block")
        b = self.free_queue.popitem(last=False)[0]
        self.ref_cnt[b] = 1
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
            self.num_evictions += 1
        return b

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks hit by a prefix lookup."""
        free_queue, ref_cnt = self.free_queue, self.ref_cnt
        for b in blocks:
            if ref_cnt[b] == 0:
                del free_queue[b]
            ref_cnt[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the LRU tail in reverse order."""
        free_queue, ref_cnt, block_hash = self.free_queue, self.ref_cnt, self.block_hash
        caching = self.enable_caching
        for b in reversed(blocks):
            c = ref_cnt[b] - 1
            ref_cnt[b] = c
            if c == 0:
                if not caching and block_hash[b] is not None:
                    block_hash[b] = None
                free_queue[b] = None
            elif c < 0:
                raise RuntimeError(f"block {b} ref count went negative")

    def cache_blocks(self, blocks: list[int], hashes: list[int]) -> None:
        """Publish full blocks' hashes. An existing mapping for a hash is kept (no de-duplication)."""
        if not self.enable_caching:
            return
        block_hash, add = self.block_hash, self.cached.setdefault
        for b, h in zip(blocks, hashes):
            if block_hash[b] is None:
                block_hash[b] = h
                add(h, b)

    def cache_block(self, block: int, block_hash: int) -> None:
        """cache_blocks for one block."""
        if self.enable_caching and self.block_hash[block] is None:
            self.block_hash[block] = block_hash
            self.cached.setdefault(block_hash, block)

    def num_free_after_touch(self, blocks: list[int]) -> int:
        """Free blocks left if `blocks` (cache hits) were touched: hits idle in the free queue stop being free."""
        return len(self.free_queue) - sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (tests and fuzzing)."""
        ref_cnt = np.asarray(self.ref_cnt)
        assert (ref_cnt >= 0).all(), "negative ref count"
        free = np.zeros(self.num_blocks, dtype=bool)
        free[list(self.free_queue)] = True
        assert ((ref_cnt == 0) == free).all(), "free queue disagrees with ref counts"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, "hash map points at a block with another hash"
