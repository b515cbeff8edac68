"""Radix prefix cache: matching, insertion, locks, LRU leaf eviction, slot accounting (SGLang/TGI semantics)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from simengine.kvcache.radix import RadixCache


def toks(*values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def cached(c: RadixCache, tokens: np.ndarray) -> int:
    """Insert tokens as a request would: allocate, commit, release."""
    h = c.acquire(tokens)
    assert c.grow(h, len(tokens) - h.cached)
    new = c.commit(h, tokens)
    c.release(h)
    return new


def test_insert_returns_newly_cached_and_match_finds_prefixes():
    c = RadixCache(100)
    assert cached(c, toks(1, 2, 3, 4)) == 4
    assert cached(c, toks(1, 2, 3, 4)) == 0            # already there: duplicates go back to the free pool
    assert cached(c, toks(1, 2, 5)) == 1               # splits the edge after (1, 2)
    assert c.match_prefix(toks(1, 2, 3, 9))[0] == 3
    assert c.match_prefix(toks(1, 2, 5, 6))[0] == 3
    assert c.match_prefix(toks(7))[0] == 0
    assert c.match_prefix(toks(1, 2, 3, 4), limit=2)[0] == 2
    assert c.tree_tokens == 5 and c.req_tokens == 0 and c.free_tokens == 95
    c.check_invariants()


def test_match_inside_an_edge_splits_it_so_a_lock_covers_exactly_the_match():
    c = RadixCache(100)
    cached(c, np.arange(10, dtype=np.int32))
    n, node = c.match_prefix(np.array([0, 1, 2, 3, 99], dtype=np.int32))
    assert n == 4 and len(node.key) == 4 and c.num_nodes == 2
    c.lock(node)
    assert c.evictable_tokens == 6                     # the 6-token tail stays evictable
    assert c.evict(100) == 6 and c.tree_tokens == 4    # only the unlocked tail goes
    c.unlock(node)
    assert c.evict(100) == 4 and c.tree_tokens == 0
    c.check_invariants()


def test_lru_leaf_eviction_and_parent_becomes_candidate():
    c = RadixCache(100)
    cached(c, toks(1, 2, 3, 4))          # t1
    cached(c, toks(1, 2, 7, 8))          # t2: (1,2) is now an inner node
    cached(c, toks(9, 9))                # t3
    c.match_prefix(toks(1, 2, 3, 4))     # touch (3,4) -> most recent
    assert c.evict(1) == 2               # oldest leaf (7, 8) goes whole (SGLang: no partial eviction)
    assert c.match_prefix(toks(1, 2, 7, 8))[0] == 2
    assert c.evict(1) == 2               # then (9, 9)
    assert c.evict(3) == 4               # then (3, 4), after which (1, 2) is an unlocked leaf and goes too
    assert c.tree_tokens == 0 and c.num_nodes == 0
    c.check_invariants()


def test_partial_eviction_trims_a_leaf_tail_like_tgi():
    c = RadixCache(100, partial_evict=True)
    cached(c, np.arange(10, dtype=np.int32))
    assert c.evict(3) == 3
    assert c.match_prefix(np.arange(10, dtype=np.int32))[0] == 7
    c.check_invariants()


def test_locked_paths_are_not_evictable_and_alloc_evicts_only_what_it_needs():
    c = RadixCache(10)
    cached(c, toks(1, 2, 3, 4, 5, 6))
    h = c.acquire(toks(1, 2, 3, 9))                    # locks (1, 2, 3)
    assert h.cached == 3 and c.evictable_tokens == 3 and c.available() == 4 + 3
    assert not c.alloc(8)                              # 4 free + 3 evictable
    assert c.alloc(6)                                  # evicts the (4, 5, 6) leaf
    assert c.tree_tokens == 3 and c.req_tokens == 6
    c.free(6)
    c.release(h)
    c.check_invariants()


def test_commit_moves_private_slots_into_the_tree_and_frees_duplicates():
    c = RadixCache(100)
    prompt = np.arange(20, dtype=np.int32)
    a, b = c.acquire(prompt), c.acquire(prompt)        # two requests miss at once
    assert c.grow(a, 20) and c.grow(b, 20) and c.req_tokens == 40
    assert c.commit(a, prompt) == 20                   # a's slots become the cached copy
    assert c.commit(b, prompt) == 0                    # b's duplicates are freed
    assert c.req_tokens == 0 and c.tree_tokens == 20 and a.private == b.private == 0
    assert c.evictable_tokens == 0                     # both still lock it
    c.release(a)
    c.release(b)
    assert c.evictable_tokens == 20 and c.free_tokens == 80
    c.check_invariants()


def test_page_size_aligns_matches_and_insertions():
    c = RadixCache(100, page_size=4)
    assert cached(c, np.arange(10, dtype=np.int32)) == 8          # 2 full pages; the partial page is not cached
    assert c.match_prefix(np.arange(10, dtype=np.int32))[0] == 8
    assert c.match_prefix(np.array([0, 1, 2, 3, 4, 5, 99, 7], dtype=np.int32))[0] == 4
    c.check_invariants()


def test_disabled_cache_matches_and_stores_nothing():
    c = RadixCache(100, enabled=False)
    h = c.acquire(toks(1, 2, 3))
    assert c.grow(h, 3) and c.commit(h, toks(1, 2, 3)) == 0
    c.release(h)
    assert c.tree_tokens == 0 and c.req_tokens == 0 and c.match_prefix(toks(1, 2, 3))[0] == 0


def test_dfs_weight_order_visits_heavier_subtrees_first():
    c = RadixCache(100)
    cached(c, toks(1, 1, 1))
    cached(c, toks(2, 2, 2))
    a = c.match_prefix(toks(1, 1, 1))[1]
    b = c.match_prefix(toks(2, 2, 2))[1]
    assert c.dfs_weight_order([a, b, b, c.root]) == [3, 1, 2, 0]  # root's own first, then the 2-request subtree


def test_long_prompts_and_many_requests_stay_fast():
    import time
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 128_000, 4000, dtype=np.int32)
    c = RadixCache(400_000)
    t = time.perf_counter()
    for i in range(500):
        tokens = np.concatenate([shared, rng.integers(0, 128_000, int(rng.integers(4000, 28_000)), dtype=np.int32)])
        h = c.acquire(tokens, len(tokens) - 1)
        assert h.cached == (4000 if i else 0)      # the shared prefix is always the most recently used
        assert c.grow(h, len(tokens) - h.cached)
        c.commit(h, tokens)
        c.release(h)
    assert time.perf_counter() - t < 2.0 and c.num_evicted_tokens > 0
    c.check_invariants()


ops = st.lists(st.tuples(st.sampled_from(["admit", "step", "finish", "retract", "evict"]),
                         st.integers(0, 7), st.integers(1, 40)), max_size=60)


@given(ops, st.sampled_from([1, 4]), st.booleans())
def test_random_request_lifecycles_keep_the_pool_consistent(program, page, partial):
    """Requests share a few prefixes, allocate, commit and release in random order: tree + free + private
    always equals capacity, lock refs never go negative, and evictable accounting matches a recount."""
    rng = np.random.default_rng(1)
    bases = [rng.integers(0, 5, 60, dtype=np.int32) for _ in range(3)]
    c = RadixCache(200, page_size=page, partial_evict=partial)
    live = {}
    for op, k, n in program:
        if op == "admit" and k not in live:
            tokens = np.concatenate([bases[k % 3][:n], rng.integers(0, 5, 10, dtype=np.int32)])
            h = c.acquire(tokens, len(tokens) - 1)
            if c.grow(h, 0):
                live[k] = (h, tokens, h.cached)
        elif op == "step" and k in live:
            h, tokens, done = live[k]
            m = min(n, len(tokens) - done)
            if m and c.grow(h, m):
                live[k] = (h, tokens, done + m)
                c.commit(h, tokens[:done + m])
        elif op in ("finish", "retract") and k in live:
            h, tokens, done = live.pop(k)
            if op == "finish":
                c.commit(h, tokens[:done])
            c.release(h)
        elif op == "evict":
            c.evict(n)
        c.check_invariants()
        assert sum(h.private for h, _, _ in live.values()) == c.req_tokens
        assert c.tree_tokens + c.req_tokens + c.free_tokens == c.capacity
    for h, _, _ in live.values():
        c.release(h)
    assert c.req_tokens == 0 and c.evictable_tokens == c.tree_tokens
    before = c.tree_tokens
    assert c.evict(10**6) == before and c.tree_tokens == 0
