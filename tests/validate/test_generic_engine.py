"""The generic engine used for rows whose stack is not stated, driven by hand, plus an end-to-end smoke run."""

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.request import Status
from simengine.engines.generic import GenericEngine, GenericParams
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import run_step as step


def engine(**params) -> GenericEngine:
    return GenericEngine(GenericParams(**params), make_dep())


def test_prefill_steps_hold_whole_prompts_and_pause_decodes():
    eng = engine(max_num_batched_tokens=1000)
    a, b, c = make_request(600, 3), make_request(300, 3), make_request(300, 3)
    for r in (a, b, c):
        eng.add_request(r, 0.0)
    out, _ = step(eng)
    assert out.scheduled == [(a, 600), (b, 300)]          # c does not fit the rest of the budget: it waits
    assert out.shape.num_decode == 0 and out.shape.prefill_chunks == [(600, 0), (300, 0)]
    out, _ = step(eng, 0.02)
    assert out.scheduled == [(c, 300)]                    # a prefill-only step: a and b do not decode in it
    out, _ = step(eng, 0.04)
    assert [n for _, n in out.scheduled] == [1, 1, 1] and out.shape.num_decode == 3 and not out.shape.cuda_graph


def test_a_prompt_longer_than_the_budget_runs_alone_and_whole():
    eng = engine(max_num_batched_tokens=512)
    big, small = make_request(2000, 2), make_request(100, 2)
    eng.add_request(big, 0.0)
    eng.add_request(small, 0.0)
    out, _ = step(eng)
    assert out.scheduled == [(big, 2000)]
    assert eng.step_token_limit is None and eng.batch_size_limit == 256


def test_no_prefix_cache_and_recompute_preemption_of_the_newest():
    eng = engine(max_num_seqs=8)
    eng.kv = type(eng.kv)(6, 16, enable_prefix_caching=False)   # 96 tokens of KV
    shared = make_request(40, 30, seed=1)
    twin = make_request(40, 30, seed=1)                          # same prompt: no hit without a prefix cache
    eng.add_request(shared, 0.0)
    eng.add_request(twin, 0.0)
    step(eng)
    assert twin.num_cached_tokens == 0 and eng.prefix_hit_rate() == 0.0
    preempted = []
    for i in range(40):
        out, _ = step(eng, 0.01 * (i + 1))
        preempted += out.preempted
        eng.check_invariants()
        if preempted:
            break
    assert preempted == [twin] and twin.status is Status.PREEMPTED and twin.num_computed_tokens == 0
    assert eng.num_preemptions == 1 and eng.waiting[0] is twin


def test_timing_is_synchronous_and_eager():
    t = engine().timing
    assert t.overlap is False and t.cuda_graph_sizes == ()
    assert t.exposed_host_s(1.0) == t.scheduler_cpu_s + t.output_cpu_s


def test_end_to_end_conservation():
    sc = make_scenario(horizon_s=8.0, engines=["generic"])
    res = run_engine(sc, EngineEntry(engine="generic"), check_invariants=True)
    s = res.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 0
    assert s["completed"] > 0
