"""The request generator's block draws of plain requests' lengths equal the one-by-one draws they replace."""

from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.workload.generator import LENGTH_BLOCK, RequestFactory
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
