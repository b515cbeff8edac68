"""Chained block hashes: equal prefixes hash equal; a changed token changes its block's hash and every later one."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.kvcache.hashing import hash_blocks


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300), block_size=st.sampled_from([1, 4, 16]),
       where=st.integers(0, 299), delta=st.integers(1, 1000), tail=st.lists(st.integers(0, 2**31 - 1), max_size=40))
def test_hash_equal_iff_prefix_equal(tokens, block_size, where, delta, tail):
    a = np.array(tokens, dtype=np.int32)
    ha = hash_blocks(a, block_size)
    assert len(ha) == len(a) // block_size
    # a block's hash does not depend on anything after it
    extended = hash_blocks(np.concatenate([a, np.array(tail, dtype=np.int32)]), block_size)
    assert extended[:len(ha)] == ha
    # changing one token changes the hash of its block and of every later block, and nothing before
    where %= len(a)
    b = a.copy()
    b[where] = (int(b[where]) + delta) % 2**31
    hb = hash_blocks(b, block_size)
    first = where // block_size
    assert hb[:first] == ha[:first]
    assert all(x != y for x, y in zip(ha[first:], hb[first:]))


def test_hashes_are_distinct_across_random_blocks():
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(200):
        seen.update(hash_blocks(rng.integers(0, 128_000, 160, dtype=np.int32), 16))
    assert len(seen) == 2000
