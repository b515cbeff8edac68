"""The request generator's block draws (plain requests' lengths, token ids drawn ahead) equal the one-by-one draws they
replace."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.workload.generator import LENGTH_BLOCK, STREAM_TOKENS, TOKEN_BLOCK, RequestFactory
from tests.conftest import make_scenario

DISTS = [
    {"dist": "lognormal", "mean": 600, "sigma": 0.9},
    {"dist": "lognormal", "mean": 90, "sigma": 1.4, "min": 20, "max": 300},
    {"dist": "normal", "mean": 20, "sigma": 9, "max": 25},
    {"dist": "exponential", "mean": 40},
    {"dist": "constant", "value": 128},
    {"dist": "uniform", "low": 5, "high": 50},       # integers: drawn one by one
    {"dist": "empirical", "table": "sharegpt_output"},
]


def plain_lengths(factory: RequestFactory, n: int) -> list[tuple[int, int, int | None]]:
    return [(r.prompt_len, r.output_len, r.max_tokens) for r in (factory.plain_request(float(i)) for i in range(n))]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DISTS), st.sampled_from(DISTS), st.integers(0, 2**32 - 1),
       st.sampled_from([None, 64]), st.integers(1, 2 * LENGTH_BLOCK + 3))
def test_block_drawn_lengths_are_the_one_by_one_draws(dist_in, dist_out, seed, cap, n):
    sc = make_scenario(workload__input_tokens=dist_in, workload__output_tokens=dist_out,
                       workload__client_max_tokens=cap)
    blocked = RequestFactory(sc.workload, seed, 32000, 131072)
    one_by_one = RequestFactory(sc.workload, seed, 32000, 131072)
    one_by_one._block_lengths = False
    families = {dist_in["dist"], dist_out["dist"]} - {"constant"}
    assert blocked._block_lengths == (len(families) <= 1 and not families & {"uniform", "empirical"})
    assert plain_lengths(blocked, n) == plain_lengths(one_by_one, n)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(1, TOKEN_BLOCK // 3), min_size=1, max_size=12),
       st.sampled_from([0.0, 0.5]))
def test_token_ids_drawn_ahead_are_the_one_by_one_draws(seed, sizes, structured):
    """Consecutive draws of a numpy integer stream give the values one draw of their total gives, so slicing
    requests' token ids from blocks drawn ahead changes no request; with a structured-output coin drawn from the same
    stream the generator draws one by one."""
    sc = make_scenario(workload__structured_output={"fraction": structured})
    factory = RequestFactory(sc.workload, seed, 32000, 131072)
    reference = np.random.default_rng(np.random.SeedSequence(seed).spawn(6)[STREAM_TOKENS])
    for n in sizes:
        got = factory.tokens(factory.rng_tokens, n)
        assert got.dtype == np.int32 and len(got) == n
        assert np.array_equal(got, reference.integers(0, 32000, n, dtype=np.int32))
        if structured:
            assert factory.rng_tokens.uniform() == reference.uniform()
    assert (len(factory._token_pool) == 0) == bool(structured)   # drawn ahead only without the coin


LOWEST_DISTS = DISTS + [
    {"dist": "uniform", "low": 300, "high": 900, "min": 500},
    {"dist": "constant", "value": 5000, "max": 700},
    {"dist": "empirical", "table": "sharegpt_input", "mean": 500, "min": 64},
]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(LOWEST_DISTS), st.integers(0, 2**32 - 1), st.integers(0, 400))
def test_no_prompt_is_shorter_than_the_workload_says_it_can_be(dist_in, seed, prefix):
    """shortest_prompt, which refuses a workload whose every prompt is beyond the model's context, is a true lower
    bound of the prompts the generator makes (prefix included), and the bound is reached where the lengths are
    fixed."""
    from simengine.workload.config import shortest_prompt

    sc = make_scenario(seed=seed, workload__input_tokens=dist_in, workload__shared_prefix_tokens=prefix)
    factory = RequestFactory(sc.workload, seed, 32000, 131072)
    prompts = [r.prompt_len for r in (factory.plain_request(float(i)) for i in range(300))]
    low = shortest_prompt(sc.workload)
    assert low is not None and min(prompts) >= low
    if dist_in["dist"] == "constant":
        assert min(prompts) == low


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(LOWEST_DISTS), st.sampled_from(LOWEST_DISTS), st.integers(0, 2**32 - 1),
       st.integers(0, 400))
def test_no_rag_prompt_or_first_session_turn_is_shorter_than_the_bound(dist_a, dist_b, seed, prefix):
    """The same bound for prompts of a document pool (prefix + document + question) and for sessions, whose first
    turn (prefix + the user's tokens) is their shortest; reached where the lengths are fixed."""
    from simengine.workload.config import shortest_prompt

    rag = make_scenario(seed=seed, workload__input_tokens=dist_a, workload__shared_prefix_tokens=prefix,
                        workload__documents={"count": 5, "tokens": dist_b})
    factory = RequestFactory(rag.workload, seed, 32000, 1 << 20)
    prompts = [factory.plain_request(float(i)).prompt_len for i in range(200)]
    low = shortest_prompt(rag.workload)
    assert low is not None and min(prompts) >= low
    if dist_a["dist"] == dist_b["dist"] == "constant":
        assert min(prompts) == low
    chat = make_scenario(seed=seed, workload__shared_prefix_tokens=prefix,
                         workload__sessions={"arrival_rate": 1.0, "user_tokens": dist_a})
    factory = RequestFactory(chat.workload, seed, 32000, 1 << 20)
    firsts = [factory.session_turn(factory.session(i), 0.0, None).prompt_len for i in range(100)]
    low = shortest_prompt(chat.workload)
    assert low is not None and min(firsts) >= low
    if dist_a["dist"] == "constant":
        assert min(firsts) == low
