"""BlockPool and KVCacheManager: ref counts, LRU free queue, hashed prefix hits, capacity."""

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.kvcache.block_pool import FULL_CHECK_BLOCKS, BlockPool
from simengine.kvcache.manager import KVCacheManager
from tests.conftest import make_request


def test_allocate_and_free_restore_the_pool():
    pool = BlockPool(8, enable_caching=True)
    a = pool.allocate(3)
    assert pool.num_free == 5 and all(pool.ref_cnt[b] == 1 for b in a)
    pool.free(a)
    assert pool.num_free == 8
    pool.check_invariants()


def test_freed_blocks_join_lru_tail_in_reverse_so_chain_tail_is_evicted_first():
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(4)
    pool.free(a)  # appended reversed: a[3], a[2], a[1], a[0]
    assert pool.free_blocks() == [a[3], a[2], a[1], a[0]]


def test_prefix_hit_shares_blocks_and_caps_at_one_token_short():
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=True)
    tokens = np.arange(64, dtype=np.int32)
    r1 = make_request(64, tokens=tokens)
    assert kv.allocate_slots(r1, 64)
    r1.num_computed_tokens = 64
    r2 = make_request(64, tokens=tokens)
    hit = kv.get_computed_blocks(r2)
    # 64 tokens = 4 full blocks, but the hit is capped at num_tokens - 1 -> 3 blocks
    assert hit.num_tokens == 48 and hit.blocks == kv.req_blocks[r1.request_id][:3]
    assert kv.allocate_slots(r2, 16, hit)
    assert all(kv.pool.ref_cnt[b] == 2 for b in hit.blocks)
    kv.free(r1)
    kv.free(r2)
    kv.pool.check_invariants()
    assert kv.pool.num_free == 64


def test_cached_block_survives_free_until_evicted_by_allocation():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    tokens = np.arange(9, dtype=np.int32)
    r1 = make_request(9, tokens=tokens)
    assert kv.allocate_slots(r1, 9)
    kv.free(r1)
    r2 = make_request(9, tokens=tokens)
    assert kv.get_computed_blocks(r2).num_tokens == 8  # both full blocks still cached
    # allocating every block evicts the cached content
    other = make_request(16, seed=3)
    assert kv.allocate_slots(other, 16)
    assert kv.get_computed_blocks(make_request(9, tokens=tokens)).num_tokens == 0


def test_full_block_count_past_the_end_frees_every_block_to_the_tail():
    """A manager's full-block count may exceed the blocks it frees (a longer table's count): every block, one or
    many, shared or not, then counts as cached and joins the LRU tail, last block first."""
    for n in (1, 2, 5):
        pool = BlockPool(8, enable_caching=True)
        blocks = pool.allocate(n)
        pool.touch(blocks[:1])   # the first shared: it stays in use after one free
        pool.free(blocks, n + 3)
        assert pool.num_free == 8 - 1
        if n > 1:
            assert pool.free_blocks()[-(n - 1):] == blocks[:0:-1]
        pool.free(blocks[:1], 4)
        assert pool.free_blocks()[-1] == blocks[0] and pool.num_free == 8
        pool.check_invariants()


def test_no_hits_when_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    t = np.arange(20, dtype=np.int32)
    r1 = make_request(20, tokens=t)
    assert kv.allocate_slots(r1, 20)
    assert kv.get_computed_blocks(make_request(20, tokens=t)).num_tokens == 0


def test_allocation_fails_cleanly_when_short():
    kv = KVCacheManager(num_blocks=4, block_size=16, enable_prefix_caching=True)
    r = make_request(100)
    assert not kv.allocate_slots(r, 100)
    assert kv.pool.num_free == 4 and r.request_id not in kv.req_blocks


@given(st.lists(st.tuples(st.integers(1, 200), st.booleans()), min_size=1, max_size=40))
def test_random_alloc_free_keeps_invariants(ops):
    kv = KVCacheManager(num_blocks=48, block_size=16, enable_prefix_caching=True)
    live = []
    base = np.arange(400, dtype=np.int32)
    for i, (n, shared) in enumerate(ops):
        r = make_request(n, tokens=base if shared else None, request_id=i)
        hit = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, n - hit.num_tokens, hit):
            r.num_computed_tokens = n
            live.append(r)
        elif live:
            kv.free(live.pop(0))
        kv.pool.check_invariants()
        assert kv.pool.num_used <= kv.num_blocks
    for r in live:
        kv.free(r)
    kv.pool.check_invariants()
    assert kv.pool.num_free == kv.num_blocks


def _corrupt(pool: BlockPool, how: str, used: list[int]) -> None:
    free = pool.free_blocks()
    if how == "negative_ref":        # a used block's count below zero: no count moves
        pool.ref_cnt[used[0]] = -1
    elif how == "free_block_referenced":   # a queued block referenced, a used one at 0: the counts still agree
        pool.ref_cnt[free[0]], pool.ref_cnt[used[0]] = 1, 0
    elif how == "queued_twice":      # the first entry names the second's block: one block twice, one missing
        pool.free_queue[pool.head] = free[1]
    elif how == "hash_elsewhere":    # the map sends a hash to a block that holds another
        h = next(iter(pool.cached))
        other = next(b for b in used if pool.block_hash[b] != h)
        pool.block_hash[pool.cached[h]], pool.block_hash[other] = pool.block_hash[other], h
    elif how == "free_count":
        pool.num_free -= 1


@pytest.mark.parametrize("num_blocks", [64, 8192, 40_000])
@pytest.mark.parametrize("how", ["negative_ref", "free_block_referenced", "queued_twice", "hash_elsewhere",
                                 "free_count"])
def test_check_invariants_catches_each_broken_entry_within_its_stride(how, num_blocks):
    """A large pool is compared block by block on every (num_blocks / FULL_CHECK_BLOCKS)-th call only: each kind of
    corruption still raises within that many calls, and a consistent pool never does."""
    pool = BlockPool(num_blocks, enable_caching=True)
    used = pool.allocate(8)
    pool.cache_blocks(used, [1_000 + i for i in range(len(used))])
    stride = -(-num_blocks // FULL_CHECK_BLOCKS)
    for _ in range(2 * stride):
        pool.check_invariants()
    _corrupt(pool, how, used)
    with pytest.raises(AssertionError):
        for _ in range(stride):
            pool.check_invariants()


class ReferencePool:
    """The pool's semantics written the plain way (vLLM's BlockPool): an OrderedDict LRU queue, eager removal on
    touch, freed cached blocks to the tail and uncached ones to the front, every block of a hash kept."""

    def __init__(self, num_blocks: int):
        self.ref = [0] * num_blocks
        self.lru = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, list[int]] = {}   # hash -> its blocks, oldest first (a lookup gets the first)
        self.owner: dict[int, int] = {}

    def allocate(self, n: int) -> list[int]:
        out = [self.lru.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            self.ref[b] = 1
            if b in self.owner:
                h = self.owner.pop(b)
                self.cached[h].remove(b)
                if not self.cached[h]:
                    del self.cached[h]
        return out

    def free(self, blocks: list[int], num_full: int = 0) -> None:
        front = []
        for i in reversed(range(len(blocks))):
            b = blocks[i]
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.owner or i < num_full:   # the first num_full count as cached, hash or not
                    self.lru[b] = None
                else:
                    front.append(b)
        for b in reversed(front):
            self.lru[b] = None
            self.lru.move_to_end(b, last=False)

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1

    def cache(self, blocks: list[int], hashes: list[int]) -> None:
        for b, h in zip(blocks, hashes):
            self.cached.setdefault(h, []).append(b)
            self.owner[b] = h


@pytest.mark.parametrize("compact_min_stale", [0, 1024])
@settings(max_examples=150)
@given(ops=st.lists(st.tuples(st.sampled_from("afch"), st.integers(0, 50), st.integers(1, 4)), max_size=120))
def test_pool_matches_the_plain_lru_model(compact_min_stale, ops):
    """Allocation order, LRU order after frees (full blocks counted as cached, shared blocks among them) and prefix
    touches (stale queue entries), and the hash map all match the OrderedDict model, with and without compaction."""
    pool, ref = BlockPool(6, enable_caching=True), ReferencePool(6)
    pool.compact_min_stale = compact_min_stale
    groups: list[list[int]] = []  # held block lists, as requests hold them
    fresh: list[list[int]] = []   # groups not yet published
    for kind, pick, n in ops:
        if kind == "a" and n <= pool.num_free:
            got = pool.allocate(n) if n > 1 else [pool.allocate_one()]
            assert got == ref.allocate(n)
            groups.append(got)
            fresh.append(got)
        elif kind == "f" and groups:
            g = groups.pop(pick % len(groups))
            num_full = (pick + n) % (len(g) + 2)   # up to past the blocks' end, as a manager may count
            pool.free(g, num_full)
            ref.free(g, num_full)
            fresh = [f for f in fresh if f is not g]
        elif kind == "c" and fresh:
            g = fresh.pop(pick % len(fresh))
            hashes = [(pick + i) % 7 for i in range(len(g))]  # few hashes: collisions with cached ones
            pool.cache_blocks(g, hashes) if len(g) > 1 else pool.cache_block(g[0], hashes[0])
            ref.cache(g, hashes)
        elif kind == "h" and pool.cached:
            b = pool.lookup(sorted(pool.cached)[pick % len(pool.cached)])
            pool.touch([b])
            ref.touch([b])
            groups.append([b])
        assert pool.free_blocks() == list(ref.lru)
        assert pool.cached == {h: blocks[0] for h, blocks in ref.cached.items()}
        pool.check_invariants()


@given(prompt=st.integers(1, 40), outputs=st.integers(2, 40), stop=st.integers(0, 80))
def test_deferred_output_blocks_are_published_by_the_next_allocation_or_release(prompt, outputs, stop):
    """A decode that fills a block of the request's own outputs takes the no-work path when publishing is deferred;
    the next allocation or publish_through publishes it, and the cache then equals the step-by-step one."""
    managers = [KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True) for _ in range(2)]
    managers[1].defer_output_publish = True
    reqs = [make_request(prompt, outputs, request_id=1, unique_outputs=True) for _ in managers]
    for kv, r in zip(managers, reqs):
        assert kv.allocate_slots(r, prompt)
        r.num_computed_tokens = prompt
    for _ in range(min(stop, outputs - 1) - 1):  # decode steps: allocate for one token, compute it
        for kv, r in zip(managers, reqs):
            assert kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
        eager, deferred = (set(kv.pool.cached) for kv in managers)
        assert deferred <= eager and len(eager - deferred) <= 1  # at most the block this step filled waits
    for kv, r in zip(managers, reqs):
        kv.publish_through(r, r.num_computed_tokens)
    assert managers[0].pool.cached == managers[1].pool.cached


def _twins(**kw):
    """The same request in two managers: all its tokens shared in the first, all private in the second."""
    managers = [KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True) for _ in range(2)]
    reqs = [make_request(16, 4, request_id=1, seed=3, private_from=p, **kw) for p in (None, 0)]
    return managers, reqs


def test_private_blocks_released_unfinished_are_published_through_the_last_allocation():
    """Preempted in the step that allocated for its prompt (nothing computed yet): a manager without private
    blocks had published them at allocation, so the request's own lookup on its return hits them; so it must with
    private blocks, which are published at that release."""
    managers, reqs = _twins()
    for kv, r in zip(managers, reqs):
        assert kv.allocate_slots(r, 16)
        kv.free(r)  # still RUNNING: a preemption
    assert [kv.get_computed_blocks(r).num_tokens for kv, r in zip(managers, reqs)] == [12, 12]


def test_private_blocks_freed_from_the_tail_are_published_first():
    """free_tail (LMDeploy's partial eviction) keeps the request running: its freed tail keeps the hashes a manager
    without private blocks gave it, and the recomputed tail holds them again as duplicates (vLLM's
    BlockHashToBlockMap keeps every block of a hash), so the old blocks' eviction takes nothing the request finds on
    its return; both managers agree."""
    managers, reqs = _twins()
    for kv, r in zip(managers, reqs):
        assert kv.allocate_slots(r, 16)
        r.num_computed_tokens = 16
        kv.free_tail(r, 4)              # blocks 1-3 back to the free queue, behind the 4 never used
        r.num_computed_tokens = 4
        assert kv.allocate_slots(r, 12)  # the tail again, in 3 never-used blocks
        r.num_computed_tokens = 16
        other = make_request(12, 1, request_id=2, seed=4)
        assert kv.allocate_slots(other, 12)  # the last never-used block, then old blocks 3 and 2: evicted
        kv.free(r)
        r.num_computed_tokens = 0
    assert [kv.get_computed_blocks(r).num_tokens for kv, r in zip(managers, reqs)] == [12, 12]


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20)), min_size=0, max_size=6))
def test_blocks_short_of_counts_what_each_request_lacks_to_its_horizon(reqs):
    """TensorRT-LLM's reservation to completion: per request, its horizon's blocks minus those it holds, never less
    than none; a request with no table lacks all of them."""
    kv = KVCacheManager(1000, 16, enable_prefix_caching=False)
    horizons, expected = {}, 0
    for tokens, horizon in reqs:
        req = make_request(max(tokens, 1))
        if tokens:
            assert kv.allocate_slots(req, tokens)
        horizons[req.request_id] = horizon
        expected += max(0, horizon - kv.num_blocks_of(req))
    assert kv.blocks_short_of(horizons) == expected
