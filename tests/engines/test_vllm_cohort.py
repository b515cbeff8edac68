"""vLLM's lazy decode cohort is a speed device only: with it on or off, every run gives identical results.

Random scenarios (the fuzz generator's, plus vLLM's own scheduling knobs: long_prefill_token_threshold, priority
scheduling, prefix caching off, block size) run twice, with `VllmEngine.lazy_decode` off (every request walked
every step) and on; the request rows, the step rows and the inter-token gaps must be equal.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from unittest import mock

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simengine import api
from simengine.engines.vllm import VllmEngine
from simengine.errors import InputError
from tests.test_fuzz_invariants import build, scenarios


def _run(sc, lazy: bool) -> api.EngineResult:
    with mock.patch.object(VllmEngine, "lazy_decode", lazy):
        return api.run_engine(sc, sc.engines[0])


def _gaps(res: api.EngineResult) -> Counter:
    gaps: Counter = Counter()
    for value, count in zip(res.itl_ms, res.itl_counts):
        gaps[value] += int(count)
    return gaps


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw=scenarios(engine="vllm"), threshold=st.sampled_from([0, 0, 48]),
       policy=st.sampled_from(["fcfs", "fcfs", "priority"]), caching=st.sampled_from([True, True, False]),
       block_size=st.sampled_from([16, 16, 8, 64]))
def test_cohort_changes_no_result(draw, threshold, policy, caching, block_size):
    engine, data, kv_tokens, caps = draw
    try:
        sc = build(engine, data, kv_tokens, caps)
    except InputError:
        return  # a configuration the tool refuses: nothing to compare
    entry = sc.engines[0]
    params = {**entry.params, "long_prefill_token_threshold": threshold, "scheduling_policy": policy,
              "enable_prefix_caching": caching, "block_size": block_size}
    sc = dataclasses.replace(sc, engines=[dataclasses.replace(entry, params=params)])
    try:
        eager = _run(sc, lazy=False)
    except InputError:
        return
    lazy = _run(sc, lazy=True)
    pd.testing.assert_frame_equal(lazy.requests, eager.requests)
    pd.testing.assert_frame_equal(lazy.steps, eager.steps)
    assert _gaps(lazy) == _gaps(eager)


def test_cohort_is_used_and_equal_on_a_busy_run():
    """A loaded replica (hundreds of concurrent decodes, KV near full so some steps fall back) gives the same
    figures with the cohort as without, and the cohort really carries most decodes."""
    from simengine.config.loader import from_dict
    from simengine.config.scenario import Scenario
    sc = from_dict(Scenario, {
        "name": "cohort", "seed": 5, "horizon_s": 1e6, "drain_s": 1e6,
        "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b"},
        "workload": {"arrival": {"process": "poisson", "rate": 40.0}, "num_requests": 600,
                     "input_tokens": {"dist": "lognormal", "mean": 800, "sigma": 0.8, "max": 6000},
                     "output_tokens": {"dist": "lognormal", "mean": 200, "sigma": 0.8, "max": 1500},
                     "shared_prefix_tokens": 256},
        "engines": [{"engine": "vllm", "params": {"kv_cache_memory_bytes": 40000 * 131072}}]}, source="test")
    lazy_steps = []
    real_update = VllmEngine.update

    def spy(self, out, now):
        lazy_steps.append((out.num_lazy, out.shape.num_decode))
        return real_update(self, out, now)

    eager = _run(sc, lazy=False)
    with mock.patch.object(VllmEngine, "update", spy):
        lazy = _run(sc, lazy=True)
    pd.testing.assert_frame_equal(lazy.requests, eager.requests)
    pd.testing.assert_frame_equal(lazy.steps, eager.steps)
    assert _gaps(lazy) == _gaps(eager)
    assert lazy.summary["preemptions"] > 0  # the fallback to the exact loop ran too
    carried = sum(k for k, _ in lazy_steps) / sum(d for _, d in lazy_steps)
    assert carried > 0.7, f"the cohort carried only {carried:.0%} of decodes"
