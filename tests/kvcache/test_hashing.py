"""Chained block hashes: equal prefixes hash equal; a changed token changes its block's hash and every later one."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.kvcache import hashing
from simengine.kvcache.hashing import HashBatch, block_hashes, hash_blocks, hash_many
from tests.conftest import make_request


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


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=12), block_size=st.sampled_from([1, 4, 16, 300]),
       seed=st.integers(0, 2**32 - 1))
def test_hash_many_equals_one_pass_per_array(lengths, block_size, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 2**31 - 1, n, dtype=np.int32) for n in lengths]
    assert hash_many(arrays, block_size) == [hash_blocks(a, block_size) for a in arrays]


def test_powers_are_exact_mod_2_64():
    hash_blocks(np.zeros(16 * 3000, dtype=np.int32), 16)  # grows the power tables past 2048
    p = 0x9E3779B97F4A7C15
    for i in (0, 1, 2, 1023, 2999):
        assert int(hashing._powers[i]) == pow(p, i, 2**64)
        assert int(hashing._inv_powers[i]) * pow(p, i, 2**64) % 2**64 == 1


def test_a_batch_is_hashed_in_one_pass_with_the_same_values():
    reqs = [make_request(n, request_id=i, seed=i) for i, n in enumerate((5, 40, 33, 64))]
    batch = HashBatch([r.token_ids for r in reqs])
    for i, r in enumerate(reqs):
        r.hash_batch = (batch, i)
    assert block_hashes(reqs[2], 16) == hash_blocks(reqs[2].token_ids, 16)
    assert batch.token_arrays is None and batch.hashes[2] is None  # hashed once; taken lists are let go
    assert all(block_hashes(r, 16) == hash_blocks(r.token_ids, 16) for r in reqs)
    assert all(r.hash_batch is None for r in reqs)
    other = make_request(40, request_id=9)  # a batch hashed with one block size answers another by itself
    other.hash_batch = (HashBatch([other.token_ids]), 0)
    other.hash_batch[0].take(0, 16)
    assert block_hashes(other, 4) == hash_blocks(other.token_ids, 4)
