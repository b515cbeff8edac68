"""The simulator's speed devices change no result: with each on or off, every run gives identical figures.

* The lazy decode cohort (`EnginePolicy.lazy_decode`: vLLM, Sarathi-Serve, TensorRT-LLM, SGLang, TGI, Orca and LMDeploy,
  taken from the registry): random scenarios (the fuzz generator's, plus the engine's own scheduling knobs: for vLLM
  long_prefill_token_threshold, priority scheduling, prefix caching off, block size; for Sarathi-Serve chunk size,
  block size and watermark; for TensorRT-LLM the capacity policy, chunked prefill, overlap, block reuse and block
  size; for SGLang the schedule policy, page size, radix cache off, chunk size, conservativeness, priority and
  overlap; for TGI prefill chunking, attention backend, prefix caching, prefill budget and the unchunked batching
  ratios; for Orca the batch cap, block size and reservation rule; for LMDeploy the forward and context budgets,
  batch size, block size, prefix caching, async and stateful sessions) run with the cohort off (every request walked
  every step) and on.
* Repeated steps (`EnginePolicy.repeat_steps`: every engine that overrides it, llama.cpp, MLC and the static
  baseline): random scenarios run with the engine's proof of repeated steps and with none (every step scheduled);
  on a replica alone the repeats run through arrivals (`repeats_outlast_arrivals`).
* Private tokens (`Request.private_from`, set by the generator's `mark_private`): every engine with a prefix cache
  on the paged KV manager runs random scenarios with the fresh draws marked private and not.
The request rows, the step rows, the inter-token gaps and the detailed requests' token times must be equal.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from unittest import mock

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simengine import api
from simengine.config.loader import from_dict
from simengine.config.scenario import EngineEntry, OutputConfig, Scenario, load_scenario
from simengine.engines import ENGINES
from simengine.engines.base import EnginePolicy
from simengine.errors import InputError
from simengine.sim.runner import Runner
from simengine.workload.config import RequestClass
from simengine.workload.generator import RequestFactory
from tests.conftest import make_scenario
from tests.test_fuzz_invariants import build, kv_params, scenarios


def _busy(engine: str, num_requests: int, params: dict, max_tokens: int | None = None, *, horizon_s: float = 1e6,
          drain_s: float = 1e6, failures: dict | None = None) -> Scenario:
    """More arrivals than the replica serves: long busy periods of many concurrent decodes (`max_tokens`: the
    client's, above the output lengths)."""
    return from_dict(Scenario, {
        "name": "busy", "seed": 5, "horizon_s": horizon_s, "drain_s": drain_s,
        "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b", "failures": failures},
        "workload": {"arrival": {"process": "poisson", "rate": 40.0}, "num_requests": num_requests,
                     "input_tokens": {"dist": "lognormal", "mean": 800, "sigma": 0.8, "max": 6000},
                     "output_tokens": {"dist": "lognormal", "mean": 200, "sigma": 0.8, "max": 1500},
                     "client_max_tokens": max_tokens, "shared_prefix_tokens": 256},
        "engines": [{"engine": engine, "params": params}]}, source="test")


# engines that advance steady decodes in a DecodeCohort, from the registry
COHORT = sorted(n for n in ENGINES.names() if ENGINES.get(n).lazy_decode)


def _run(sc, lazy: bool, detailed: int = 0) -> api.EngineResult:
    """The scenario's engine with its cohort (and vLLM's deferred output publishing, which the cohort counts on) on
    or off; the first `detailed` requests record every token's time (members of the cohort too)."""
    sc = dataclasses.replace(sc, output=OutputConfig(detailed_requests=detailed))
    cls = ENGINES.get(sc.engines[0].engine)
    defer = "defer_output_publish" in vars(cls)
    with mock.patch.object(cls, "lazy_decode", lazy), \
            mock.patch.object(cls, "defer_output_publish", lazy if defer else False, create=not defer):
        return api.run_engine(sc, sc.engines[0])


def _gaps(res: api.EngineResult) -> Counter:
    gaps: Counter = Counter()
    for value, count in zip(res.itl_ms, res.itl_counts):
        gaps[value] += int(count)
    return gaps


# each cohort engine's own scheduling knobs
COHORT_KNOBS = {
    "vllm": st.fixed_dictionaries({"long_prefill_token_threshold": st.sampled_from([0, 0, 48]),
                                   "scheduling_policy": st.sampled_from(["fcfs", "fcfs", "priority"]),
                                   "enable_prefix_caching": st.sampled_from([True, True, False]),
                                   "block_size": st.sampled_from([16, 16, 8, 64])}),
    "sarathi": st.fixed_dictionaries({"block_size": st.sampled_from([16, 16, 8, 64]),
                                      "watermark_blocks_fraction": st.sampled_from([0.01, 0.0, 0.2]),
                                      "chunk_size": st.sampled_from([32, 512, 512])}),
    "trtllm": st.fixed_dictionaries({
        "capacity_scheduler_policy": st.sampled_from(["GUARANTEED_NO_EVICT", "GUARANTEED_NO_EVICT", "STATIC_BATCH"]),
        "enable_chunked_prefill": st.booleans(), "disable_overlap_scheduler": st.booleans(),
        "enable_block_reuse": st.booleans(), "tokens_per_block": st.sampled_from([32, 32, 8, 64])}),
    "sglang": st.fixed_dictionaries({
        "schedule_policy": st.sampled_from(["fcfs", "fcfs", "lpm", "dfs-weight", "lof"]),
        "page_size": st.sampled_from([1, 1, 16]), "disable_radix_cache": st.sampled_from([False, False, True]),
        "chunked_prefill_size": st.sampled_from([None, 64, -1]),
        "schedule_conservativeness": st.sampled_from([1.0, 0.3]),
        "enable_priority_scheduling": st.booleans(), "disable_overlap_schedule": st.booleans()}),
    "tgi": st.fixed_dictionaries({
        "prefill_chunking": st.booleans(), "attention": st.sampled_from(["flashinfer", "flashinfer", "paged"]),
        "prefix_caching": st.booleans(), "max_batch_prefill_tokens": st.sampled_from([None, 64, 512]),
        "waiting_served_ratio": st.sampled_from([0.3, 0.0, 1.2]), "max_waiting_tokens": st.sampled_from([20, 2])}),
    "orca": st.fixed_dictionaries({"max_num_seqs": st.sampled_from([128, 4]), "block_size": st.sampled_from([16, 8]),
                                   "reserve": st.sampled_from(["max_tokens", "max_tokens", "max_model_len"])}),
    "lmdeploy": st.fixed_dictionaries({
        "max_prefill_token_num": st.sampled_from([8192, 8192, 64, 512]),
        "max_context_token_num": st.sampled_from([None, None, 600, 3000]),
        "max_batch_size": st.sampled_from([None, None, 4]), "cache_block_seq_len": st.sampled_from([64, 64, 16]),
        "enable_prefix_caching": st.sampled_from([False, False, True]), "async_": st.sampled_from([1, 0]),
        "interactive_sessions": st.booleans()}),
}


def test_every_cohort_engine_draws_its_knobs():
    assert set(COHORT) == set(COHORT_KNOBS)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("engine", sorted(COHORT_KNOBS))
def test_cohort_changes_no_result(engine, data):
    _, draw, kv_tokens, caps = data.draw(scenarios(engine=engine))
    try:
        sc = build(engine, draw, kv_tokens, caps)
    except InputError:
        return  # a configuration the tool refuses: nothing to compare
    entry = sc.engines[0]
    params = {**entry.params, **data.draw(COHORT_KNOBS[engine])}
    # a client max_tokens above the output length: SGLang's reservation clip, TGI's 1,024-token visits
    max_tokens = data.draw(st.sampled_from([None, None, 1500, 5000]))
    sc = dataclasses.replace(sc, engines=[dataclasses.replace(entry, params=params)],
                             workload=dataclasses.replace(sc.workload, client_max_tokens=max_tokens))
    detailed = data.draw(st.sampled_from([0, 3, 1000]))
    try:
        eager = _run(sc, lazy=False, detailed=detailed)
    except InputError:
        return
    _assert_same(_run(sc, lazy=True, detailed=detailed), eager)


# a KV pool small enough that some steps preempt (the cohort falls back to the exact loop); SGLang's admission
# reserves decode growth, so it over-commits (and retracts) only when told to be less conservative
BUSY_KV = {"vllm": {"kv_cache_memory_bytes": 40000 * 131072}, "sarathi": {"num_gpu_blocks": 40000 // 16},
           "trtllm": {"kv_cache_max_tokens": 40000},
           "sglang": {"max_total_tokens": 40000, "schedule_conservativeness": 0.1},
           "tgi": {"max_batch_total_tokens": 40000, "prefill_chunking": False}, "orca": {"num_blocks": 40000 // 16},
           "lmdeploy": {"cache_max_entry_count": 40000 // 64}}
# GUARANTEED_NO_EVICT, TGI's whole-visit and Orca's whole-life reservations: admission waits
NEVER_PREEMPTS = {"trtllm", "tgi", "orca"}


@pytest.mark.parametrize("engine", COHORT)
def test_cohort_is_used_and_equal_on_a_busy_run(engine):
    """A loaded replica (hundreds of concurrent decodes, KV near full so some steps fall back) gives the same
    figures with the cohort as without, token times of the first half included, and the cohort really carries most
    decodes."""
    # TGI: a client max_tokens past the outputs, so visits (min(max_tokens, 1024)) outlast them
    sc = _busy(engine, 600, BUSY_KV[engine], max_tokens=1200 if engine == "tgi" else None)
    lazy_steps = []
    cls = ENGINES.get(engine)
    real_update = cls.update

    def spy(self, out, now):
        lazy_steps.append((out.num_lazy, out.shape.num_decode))
        return real_update(self, out, now)

    eager = _run(sc, lazy=False, detailed=300)
    with mock.patch.object(cls, "update", spy):
        lazy = _run(sc, lazy=True, detailed=300)
    _assert_same(lazy, eager)
    assert len(lazy.recorder.token_times) == 300
    # the fallback to the exact loop ran too
    assert lazy.summary["preemptions"] > 0 or engine in NEVER_PREEMPTS
    carried = sum(k for k, _ in lazy_steps) / sum(d for _, d in lazy_steps)
    assert carried > 0.7, f"the cohort carried only {carried:.0%} of decodes"


def test_cohort_is_equal_under_priority_preemption_and_multi_turn_hits():
    """Priority scheduling preempts requests already scheduled in the step (whose filled blocks vLLM published
    when it scheduled them), and later turns hit the blocks of earlier turns' outputs: both see the same cache
    with the cohort and deferred output publishing as without."""
    sc = _busy("vllm", 400, {"kv_cache_memory_bytes": 30000 * 131072, "scheduling_policy": "priority"})
    classes = [{"name": "chat", "weight": 1.0, "priority": 0}, {"name": "batch", "weight": 2.0, "priority": 1}]
    sc = dataclasses.replace(sc, workload=dataclasses.replace(
        sc.workload, classes=[from_dict(RequestClass, c, source="test") for c in classes]))
    eager = _run(sc, lazy=False)
    _assert_same(_run(sc, lazy=True), eager)
    assert eager.summary["preemptions"] > 0
    agent = load_scenario("agent_multiturn", ["horizon_s=60", "drain_s=600", "engines=[vllm]"])
    eager = _run(agent, lazy=False)
    _assert_same(_run(agent, lazy=True), eager)
    assert eager.summary["prefix_cache_hit_rate"] > 0.5


@pytest.mark.parametrize("decode", [e for e in COHORT if "decode" in ENGINES.get(e).disaggregation_roles])
def test_cohort_is_equal_on_a_decode_pool(decode):
    """A decode-role replica starts requests whose KV arrived from a prefill pool outside its own admission (they
    join the cohort's running order then): the same figures with the cohort as without."""
    pools = [{"role": "prefill", "replicas": 1, "engine": "vllm"},
             {"role": "decode", "replicas": 1, "engine": decode}]
    sc = make_scenario(seed=3, horizon_s=20.0, workload__arrival__rate=14.0, engines=[{"engine": "vllm",
                                                                                       "pools": pools}])
    sc = dataclasses.replace(sc, output=OutputConfig(detailed_requests=50))
    cls = ENGINES.get(decode)
    with mock.patch.object(cls, "lazy_decode", False):
        eager = api.run_engine(sc, sc.engines[0], check_invariants=True)
    carried = []
    real_update = cls.update

    def spy(self, out, now):
        carried.append(out.num_lazy)
        return real_update(self, out, now)

    with mock.patch.object(cls, "update", spy):
        lazy = api.run_engine(sc, sc.engines[0], check_invariants=True)
    _assert_same(lazy, eager)
    assert eager.summary["completed"] > 100 and sum(carried) > 1000   # the decode side's cohort carried decodes


def test_cohort_keeps_trtllms_arrival_order_when_kv_arrives_out_of_order():
    """TensorRT-LLM's decode side runs its requests in arrival order; a request whose KV arrives before an earlier
    arrival's (a shorter prompt, prefilled first) starts ahead of it there, so the cohort numbers the running list
    afresh (two requests finishing in one step finish in that order, and multi-turn users' next questions follow
    it). Found by test_cohort_changes_no_result."""
    trt = {"engine": "trtllm", "params": {"enable_chunked_prefill": False, "tokens_per_block": 32}}
    sc = from_dict(Scenario, {
        "name": "pd", "seed": 0, "horizon_s": 2.0, "drain_s": 0.5,
        "deployment": {"hardware": "l4", "model": "llama-3.1-8b"},
        "workload": {"input_tokens": {"dist": "uniform", "low": 1, "high": 64},
                     "output_tokens": {"dist": "constant", "value": 8},
                     "prompt_groups": {"groups": 1, "prompts_per_group": 3, "prefix_tokens": 0, "multi_turn": True},
                     "arrival": {"process": "stages", "stages": [{"rate": 40.0, "duration_s": 0.5}]}},
        "engines": [trt], "pools": [{"role": "prefill", "replicas": 1, "kv_transfer": "layerwise"},
                                    {"role": "decode", "replicas": 1}]}, source="test")
    eager = _run(sc, lazy=False)
    renumbered = []
    cls = ENGINES.get("trtllm")
    real_start = cls._start

    def spy(self, req):
        real_start(self, req)
        renumbered.append(getattr(self, "renumber", False))

    with mock.patch.object(cls, "_start", spy):
        _assert_same(_run(sc, lazy=True), eager)
    assert any(renumbered)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw=scenarios(), detailed=st.sampled_from([0, 3, 1000]))
def test_exact_mode_gives_the_same_results_for_every_engine(draw, detailed):
    """Scenario.exact runs the reference path alone (no cohort, no deferred publishing, no repeats, no private
    tokens): on random scenarios of every engine the request rows, step rows and gaps equal the default run's."""
    engine, data, kv_tokens, caps = draw
    try:
        sc = dataclasses.replace(build(engine, data, kv_tokens, caps),
                                 output=OutputConfig(detailed_requests=detailed))
        fast = api.run_engine(sc, sc.engines[0])
    except InputError:
        return
    _assert_same(api.run_engine(dataclasses.replace(sc, exact=True), sc.engines[0]), fast)


def test_exact_mode_switches_every_device_off():
    sc = dataclasses.replace(_busy("vllm", 20, {}), exact=True)
    runner = Runner(sc, sc.engines[0])
    eng = runner.engines[0]
    assert eng.cohort is None and not eng.kv.defer_output_publish and not runner.factory.mark_private
    sarathi = Runner(dataclasses.replace(_busy("sarathi", 5, {}), exact=True), EngineEntry(engine="sarathi"))
    assert sarathi.engines[0].cohort is None
    static = Runner(dataclasses.replace(_busy("static", 5, {}), exact=True), EngineEntry(engine="static"))
    assert static.engines[0].repeat_steps(None) == 0


def _assert_same(a: api.EngineResult, b: api.EngineResult) -> None:
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    assert _gaps(a) == _gaps(b)
    assert a.recorder.token_times == b.recorder.token_times


# engines that prove repeated steps (override EnginePolicy.repeat_steps), from the registry
REPEATING = sorted(n for n in ENGINES.names() if ENGINES.get(n).repeat_steps is not EnginePolicy.repeat_steps)


def test_repeating_engines_are_found():
    assert {"llamacpp", "static", "mlc"} <= set(REPEATING)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=st.sampled_from(REPEATING), data=st.data())
def test_repeated_steps_change_no_result(engine, data):
    engine, scenario, kv_tokens, caps = data.draw(scenarios(engine=engine))
    try:
        sc = build(engine, scenario, kv_tokens, caps)
        every_step = _run_without_repeats(sc, engine)
    except InputError:
        return
    _assert_same(api.run_engine(sc, sc.engines[0]), every_step)


def _run_without_repeats(sc, engine: str) -> api.EngineResult:
    with mock.patch.object(ENGINES.get(engine), "repeat_steps", EnginePolicy.repeat_steps):
        return api.run_engine(sc, sc.engines[0])


def test_repeated_steps_are_used_and_equal_on_a_busy_run():
    """Overloaded llama.cpp (4 slots), MLC (local mode: 4 sequences) and static batches: most steps are repeats,
    and the figures are the same."""
    for engine in REPEATING:
        sc = _busy(engine, 60, {})
        calls: list[float] = []
        cls = ENGINES.get(engine)

        def spy(self, now, real=cls.schedule, calls=calls):
            calls.append(now)
            return real(self, now)

        with mock.patch.object(cls, "schedule", spy):
            fast = api.run_engine(sc, sc.engines[0])
        _assert_same(fast, _run_without_repeats(sc, engine))
        assert len(calls) < 0.2 * len(fast.steps), f"{engine}: {len(calls)} schedule calls for {len(fast.steps)} steps"


def test_repeats_run_through_arrivals_on_a_replica_alone():
    """An arrival in the middle of repeats (llama.cpp's slots all busy, a static batch, MLC's queue blocked) only
    queues: on a replica nobody else reads, the repeats run on through it under one timeout. Fewer
    schedule calls than when arrivals end the repeats, and the same figures as every step scheduled; with two
    replicas (a router reads both) arrivals end the repeats."""
    for engine in REPEATING:
        sc = _busy(engine, 60, {})
        cls = ENGINES.get(engine)
        assert cls.repeats_outlast_arrivals is not EnginePolicy.repeats_outlast_arrivals, engine
        calls: dict[bool, int] = {}
        for outlast in (True, False):
            runner = Runner(sc, sc.engines[0])
            with mock.patch.object(cls, "repeats_outlast_arrivals", outlast):
                runner.run()
            calls[outlast] = runner.replicas[0].schedules
        assert calls[True] < calls[False], f"{engine}: {calls}"
        _assert_same(api.run_engine(sc, sc.engines[0]), _run_without_repeats(sc, engine))
    two = dataclasses.replace(sc, deployment=dataclasses.replace(sc.deployment, replicas=2))
    runner = Runner(two, two.engines[0])
    assert all(rep.watched for rep in runner.replicas)
    assert not Runner(sc, sc.engines[0]).replicas[0].watched


@pytest.mark.parametrize("engine", REPEATING)
def test_repeats_in_flight_meet_failures_and_the_end_of_the_run_as_steps_do(engine):
    """Repeats running through arrivals are applied when their timeout ends; a failure in the middle applies those
    that ended before it (the step in flight is lost), and so does the end of the run (horizon and drain reached
    with requests still decoding). Step rows, queue lengths included, equal every step scheduled."""
    failures = {"at": [{"replica": 0, "time_s": 3.0, "down_s": 0.7}, {"replica": 0, "time_s": 9.1, "down_s": 0.2}],
                "max_retries": 1}
    sc = _busy(engine, 400, {}, horizon_s=14.0, drain_s=2.5, failures=failures)
    fast = api.run_engine(sc, sc.engines[0])
    _assert_same(fast, _run_without_repeats(sc, engine))
    assert fast.summary["unfinished"] > 0 and fast.steps["num_waiting"].nunique() > 20


def test_repeats_leave_the_engine_counters_as_steps_do():
    """`apply_repeats` in closed form (the static baseline's reserved and written KV token-steps) ends where the
    step-by-step updates do."""
    sc = _busy("static", 60, {})
    fast = Runner(sc, sc.engines[0])
    fast.run()
    with mock.patch.object(ENGINES.get("static"), "repeat_steps", EnginePolicy.repeat_steps):
        slow = Runner(sc, sc.engines[0])
        slow.run()
    assert fast.engines[0].kv_reserved_vs_used() == slow.engines[0].kv_reserved_vs_used()


# engines with a prefix cache on the paged KV manager, turned on (LMDeploy's is off by default); the others never
# publish a block, so private tokens change nothing for them by construction
PAGED_CACHING = {"vllm": {}, "trtllm": {}, "lmdeploy": {"enable_prefix_caching": True}, "mlc": {}}


def _run_marking(sc, private: bool) -> api.EngineResult:
    with mock.patch.object(RequestFactory, "mark_private", private):
        return api.run_engine(sc, sc.engines[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=st.sampled_from(sorted(PAGED_CACHING)), data=st.data())
def test_private_tokens_change_no_result(engine, data):
    engine, scenario, kv_tokens, caps = data.draw(scenarios(engine=engine))
    try:
        sc = build(engine, scenario, kv_tokens, caps)
        entry = sc.engines[0]
        sc = dataclasses.replace(sc, engines=[dataclasses.replace(entry, params={**entry.params,
                                                                                 **PAGED_CACHING[engine]})])
        shared = _run_marking(sc, private=False)
    except InputError:
        return
    _assert_same(_run_marking(sc, private=True), shared)


def test_private_tokens_are_off_where_an_engine_speculates():
    """The case the property above found: vLLM drafting with a model, a shared prefix, one request preempted. Its
    accepted drafts had moved its computed tokens a block past its last allocation, whose end is what vLLM caches,
    so the private request published one block more when it gave its blocks up and resumed with a longer hit. Where
    an engine speculates, requests are not marked private, and the figures are the same either way."""
    data = {"name": "fuzz", "seed": 100, "horizon_s": 2.0, "drain_s": 5.0,
            "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b", "replicas": 1, "router": "round_robin"},
            "workload": {"input_tokens": {"dist": "lognormal", "mean": 512, "sigma": 1.0, "max": 2048},
                         "output_tokens": {"dist": "exponential", "mean": 100, "max": 300},
                         "shared_prefix_tokens": 1500, "arrival": {"process": "constant", "rate": 4.0},
                         "num_requests": 15}, "engines": ["vllm"]}
    spec = {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 1, "acceptance": [0.3],
                                   "model": "llama-3.2-1b"}}
    sc = build("vllm", data, 2500, {"batch": None, "tokens": None, "spec": spec})
    assert not Runner(sc, sc.engines[0]).factory.mark_private
    private, shared = _run_marking(sc, private=True), _run_marking(sc, private=False)
    assert private.requests["num_preemptions"].sum() >= 1
    _assert_same(private, shared)


def test_private_tokens_change_no_result_under_preemption_and_shared_prefixes():
    """Overloaded paged engines with a shared system prompt: requests are preempted (and look their own blocks up
    again when they come back) and hit each other's prefix; the figures are the same with private tokens."""
    preempted = 0
    for engine, params in PAGED_CACHING.items():
        sc = _busy(engine, 150, {})
        sc = _busy(engine, 150, {**params, **kv_params(engine, 9000, sc)})
        shared = _run_marking(sc, private=False)
        _assert_same(_run_marking(sc, private=True), shared)
        assert shared.summary["prefix_cache_hit_rate"] > 0.1, engine
        preempted += shared.summary["preemptions"] > 0
    assert preempted >= 2  # vLLM and LMDeploy preempt here


def test_the_default_apply_repeats_agrees_with_the_closed_forms():
    """`EnginePolicy.apply_repeats` (one `update` a repeat, for engines without a closed form) and llama.cpp's and
    static's closed forms give the same figures."""
    for engine in ("llamacpp", "static"):
        sc = _busy(engine, 60, {})
        closed = api.run_engine(sc, sc.engines[0])
        with mock.patch.object(ENGINES.get(engine), "apply_repeats", EnginePolicy.apply_repeats):
            _assert_same(api.run_engine(sc, sc.engines[0]), closed)
