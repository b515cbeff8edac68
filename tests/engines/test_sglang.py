"""SGLang policy driven by hand: prefill-first steps, PrefillAdder budgets, new_token_ratio, retraction, radix."""

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.batch import BatchShape
from simengine.core.request import Status
from simengine.cost.roofline import DeviceTerms, RooflineKernels
from simengine.cost.step import CostModel
from simengine.cost.timing import TORCH_COMPILE_DECODE_FACTOR
from simengine.cost.work import StepWork
from simengine.engines.sglang import SglangEngine, SglangParams, sglang_decode_graph_sizes, sglang_gpu_defaults
from simengine.errors import InputError
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import run_step
from tests.engines.harness import run_steps as drive


def engine(**params) -> SglangEngine:
    return SglangEngine(SglangParams(**params), make_dep())


def test_defaults_follow_gpu_memory():
    assert sglang_gpu_defaults(make_dep("h100_sxm")) == (8192, 256)
    assert sglang_gpu_defaults(make_dep("a100_40g_sxm")) == (4096, 32)
    assert sglang_gpu_defaults(make_dep("b200")) == (16384, 512)
    sizes = sglang_decode_graph_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 12, 16) and sizes[-1] == 256 and 248 in sizes
    eng = engine()
    assert 0.8 < eng.mem_fraction < 0.9                      # (80 GB - ~13.5 GB reserved) / 80 GB
    assert eng.chunked_prefill_size == 8192 and eng.max_running_requests == 2048
    assert eng.cache.page == 1 and eng.cache.capacity > 300_000
    assert eng.timing.overlap and eng.timing.cuda_graph_sizes == sizes


# SGLang's startup logs on H100 ("KV Cache is allocated. #tokens"): Llama-3.1-8B at 0.88 (sgl-project/sglang PR
# #4760: 442,750 tokens), Qwen3-235B-A22B-FP8 on four at 0.93 (vllm-project/vllm issue #21348: 367,404)
@pytest.mark.parametrize("model, weight_dtype, tp, fraction, logged_tokens", [
    ("llama-3.1-8b", "bf16", 1, 0.88, 442_750), ("qwen3-235b-a22b", "fp8", 4, 0.93, 367_404),
])
def test_the_kv_pool_is_sized_as_sglang_logs_it(model, weight_dtype, tp, fraction, logged_tokens):
    dep = make_dep(model=model, weight_dtype=weight_dtype, tp=tp)
    eng = SglangEngine(SglangParams(mem_fraction_static=fraction), dep)
    assert eng.kv_capacity_tokens() == pytest.approx(logged_tokens, rel=0.02)   # the memory in use before loading


def test_prefill_first_pauses_decode_for_every_chunk():
    eng = engine(chunked_prefill_size=512)
    a = make_request(50, 20)
    eng.add_request(a, 0.0)
    drive(eng, 2)                                             # a prefills, then decodes
    assert a.num_output_tokens == 2
    b = make_request(1300, 3)
    eng.add_request(b, 0.02)
    outs = drive(eng, 4, 0.02)
    assert [o.scheduled for o in outs[:3]] == [[(b, 512)], [(b, 512)], [(b, 276)]]   # a waits every chunk
    assert all(o.shape.num_decode == 0 for o in outs[:3])
    assert sorted(r.request_id for r, _ in outs[3].scheduled) == sorted([a.request_id, b.request_id])
    assert a.num_output_tokens == 3


def test_mixed_chunk_lets_decodes_ride_along():
    eng = engine(chunked_prefill_size=512, enable_mixed_chunk=True)
    a = make_request(50, 20)
    eng.add_request(a, 0.0)
    drive(eng, 1)
    b = make_request(1300, 3)
    eng.add_request(b, 0.01)
    out, _ = run_step(eng, 0.01)
    assert (b, 511) in out.scheduled and (a, 1) in out.scheduled    # chunk budget shrinks by the decodes


def test_one_chunked_request_at_a_time_and_it_goes_first():
    eng = engine(chunked_prefill_size=512)
    b, c = make_request(1300, 3), make_request(100, 3)
    eng.add_request(b, 0.0)
    eng.add_request(c, 0.0)
    outs = drive(eng, 3)
    assert outs[0].scheduled == [(b, 512)] and outs[1].scheduled == [(b, 512)]
    assert outs[2].scheduled == [(b, 276), (c, 100)]            # leftover chunk budget admits c


def test_admission_reserves_projected_decode_growth_scaled_by_new_token_ratio():
    def blocked(conservativeness):
        eng = engine(max_total_tokens=1500, schedule_conservativeness=conservativeness)
        a = make_request(500, 300)
        eng.add_request(a, 0.0)
        drive(eng, 3)
        b = make_request(500, 300)
        eng.add_request(b, 0.03)
        out, _ = run_step(eng, 0.03)
        return b not in [r for r, _ in out.scheduled]
    # default ratio 0.7: 1000 available - 0.7 x 297 reserved for a < 500 + 300 + 1 needed by b
    assert blocked(1.0)
    assert not blocked(0.3)                                     # ratio 0.21 reserves less: b is admitted


def test_no_token_marks_the_batch_full_until_a_request_leaves():
    eng = engine(max_total_tokens=1500)
    a, b = make_request(500, 30), make_request(500, 500)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    out, _ = run_step(eng)
    assert out.scheduled == [(a, 500)] and eng.batch_is_full     # b's 1001 tokens do not fit beside a's 530
    outs = drive(eng, 29, 0.01)
    assert all(b not in [r for r, _ in o.scheduled] for o in outs) and a.status is Status.FINISHED
    out, _ = run_step(eng, 0.5)
    assert out.scheduled == [(b, 500)]


def test_new_token_ratio_decays_per_decode_step():
    eng = engine()
    eng.add_request(make_request(20, 50), 0.0)
    drive(eng, 11)                                              # 1 prefill + 10 decodes
    assert eng.new_token_ratio == pytest.approx(0.7 - 10 * (0.7 - 0.098) / 600)


def test_retraction_takes_the_fewest_outputs_and_resets_the_ratio():
    eng = engine(max_total_tokens=1000)
    a = make_request(50, 500)
    eng.add_request(a, 0.0)
    drive(eng, 5)
    b = make_request(50, 500)          # 1000 - 55 - 0.7 x 495 = 598 left > 551 needed: admitted optimistically
    eng.add_request(b, 0.05)
    out, _ = run_step(eng, 0.05)
    assert out.scheduled == [(b, 50)]
    now, preempted = 0.06, []
    for _ in range(500):
        out, _ = run_step(eng, now)
        preempted, now = out.preempted, now + 0.01
        if preempted:
            break
    assert preempted == [b] and b.status is Status.PREEMPTED and b.num_computed_tokens == 0
    assert eng.waiting[-1] is b and b.request_id not in eng.holds and b.num_preemptions == 1
    assert (a, 1) in out.scheduled                             # the decode proceeds in the same step
    assert eng.new_token_ratio == pytest.approx(min(1.0, (a.num_output_tokens - 1 + 20) / (500 + 1)))
    hits = eng.cache.hit_tokens
    for _ in range(1000):                                      # b re-prefills once memory allows
        out, _ = run_step(eng, now)
        now += 0.01
        if b in [r for r, _ in out.scheduled]:
            break
    assert eng.cache.hit_tokens - hits == 50                   # its prompt stayed in the tree: a partial recompute
    assert b.num_cached_tokens == 0                            # the metric keeps the first admission's hit


def test_retraction_tie_breaks_on_the_longest_prompt():
    eng = engine()
    a, b = make_request(100, 50), make_request(200, 50)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    drive(eng, 3)                                               # both decode with equal outputs
    filler = eng.cache.free_tokens
    assert eng.cache.alloc(filler)                              # squeeze the pool: no room for two decodes
    out = eng.schedule(0.1)
    assert out.preempted == [b] and out.scheduled == [(a, 1)]
    eng.cache.free(filler)


def test_prompt_is_matchable_right_after_prefill_while_the_first_still_decodes():
    eng = engine()
    shared = np.arange(1000, dtype=np.int32)
    a = make_request(1000, 50, tokens=shared)
    eng.add_request(a, 0.0)
    run_step(eng)
    b = make_request(1000, 5, tokens=shared)
    eng.add_request(b, 0.01)
    out, _ = run_step(eng, 0.01)
    assert out.scheduled == [(b, 1)] and b.num_cached_tokens == 999    # token-granular, capped at len - 1
    assert a.status is Status.RUNNING


def test_finished_request_caches_its_outputs():
    eng = engine()
    a = make_request(300, 5)
    eng.add_request(a, 0.0)
    drive(eng, 5)
    assert a.status is Status.FINISHED
    follow = np.concatenate([a.token_ids[:304], np.arange(50, dtype=np.int32) + 90_000])
    c = make_request(354, 2, tokens=follow)
    eng.add_request(c, 0.1)
    run_step(eng, 0.1)
    assert c.num_cached_tokens == 304                          # prompt + the 4 outputs whose KV was computed


def test_lpm_puts_long_matches_first_and_defers_in_batch_duplicates():
    eng = engine(schedule_policy="lpm")
    cached = np.arange(500, dtype=np.int32)
    eng.add_request(make_request(500, 2, tokens=cached), 0.0)
    drive(eng, 2)
    rng = np.random.default_rng(3)
    fresh = rng.integers(0, 30_000, 200, dtype=np.int32)
    r1 = make_request(200, 2, tokens=fresh)
    r3 = make_request(200, 2, tokens=np.concatenate([fresh[:100], rng.integers(0, 30_000, 100, dtype=np.int32)]))
    r2 = make_request(600, 2, tokens=np.concatenate([cached, fresh[:100]]))
    for r in (r1, r3, r2):
        eng.add_request(r, 0.1)
    eng._order_waiting()
    assert eng.waiting == [r2, r1, r3]


def test_lof_and_priority_orders():
    eng = engine(schedule_policy="lof")
    short, long_ = make_request(10, 2, max_tokens=10), make_request(10, 2, max_tokens=500)
    eng.add_request(short, 0.0)
    eng.add_request(long_, 0.0)
    eng._order_waiting()
    assert eng.waiting == [long_, short]
    for low_first, expect in ((False, [5, 0]), (True, [0, 5])):
        eng = engine(enable_priority_scheduling=True, schedule_low_priority_values_first=low_first)
        for prio in (0, 5):
            eng.add_request(make_request(10, 2, priority=prio), 0.0)
        eng._order_waiting()
        assert [r.priority for r in eng.waiting] == expect     # SGLang's default serves higher values first


def test_disabled_radix_cache_recomputes_and_cache_aware_policy_falls_back():
    eng = engine(disable_radix_cache=True, schedule_policy="lpm")
    assert eng.policy == "fcfs"
    shared = np.arange(400, dtype=np.int32)
    eng.add_request(make_request(400, 2, tokens=shared), 0.0)
    drive(eng, 2)
    b = make_request(400, 2, tokens=shared)
    eng.add_request(b, 0.1)
    out, _ = run_step(eng, 0.1)
    assert out.scheduled == [(b, 400)] and eng.prefix_hit_rate() == 0.0


def test_max_running_requests_caps_the_batch():
    eng = engine(max_running_requests=2)
    for _ in range(4):
        eng.add_request(make_request(20, 5), 0.0)
    out, _ = run_step(eng)
    assert len(out.scheduled) == 2 and eng.num_waiting() == 2 and eng.batch_size_limit == 2


def test_cuda_graph_padding_for_decode_steps():
    eng = engine()
    for _ in range(3):
        eng.add_request(make_request(20, 5), 0.0)
    run_step(eng)
    out, _ = run_step(eng, 0.02)
    assert out.shape.num_decode == 3 and out.shape.cuda_graph and out.shape.padded_decode == 4


def test_torch_compile_prices_the_decode_graphs_it_compiles_by_the_measured_factor():
    """--enable-torch-compile: decode graphs of up to torch_compile_max_bs sequences run the compiled model, whose
    GPU time is TORCH_COMPILE_DECODE_FACTOR of the plain graph's; larger decodes and prefills are untouched."""
    plain, compiled = engine(disable_overlap_schedule=True), engine(disable_overlap_schedule=True,
                                                                     enable_torch_compile=True)
    assert plain.timing.compiled_max_bs == 0 and compiled.timing.compiled_max_bs == 32
    assert engine(enable_torch_compile=True, disable_cuda_graph=True).timing.compiled_max_bs == 0
    dep = make_dep()
    w = StepWork(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=dep.kv_elem_bytes)
    terms = DeviceTerms.of(w, dep.hardware, custom_allreduce=True)
    a, b = (CostModel(RooflineKernels(w, terms), e.timing) for e in (plain, compiled))
    t = plain.timing
    for bs, factor in ((1, TORCH_COMPILE_DECODE_FACTOR), (32, TORCH_COMPILE_DECODE_FACTOR), (33, 1.0)):
        graph, padded = t.graph_for(bs, True)
        shape = BatchShape(num_decode=bs, decode_context_tokens=600 * bs, num_logits=bs, padded_decode=padded,
                           cuda_graph=graph)
        sa, sb = a.step(shape), b.step(shape)
        gpu = sa.seconds - t.graph_replay_s - t.exposed_host_s(0.0, t.seq_cpu_s * bs)
        assert sa.seconds - sb.seconds == pytest.approx((1 - factor) * gpu, rel=1e-9, abs=1e-15)
        assert sb.memory_s == pytest.approx(factor * sa.memory_s, rel=1e-12)
    prefill = BatchShape(prefill_chunks=[(500, 0)], num_logits=1)
    assert a.step(prefill) == b.step(prefill)


def test_requests_that_cannot_fit_are_rejected_and_bad_params_raise():
    eng = engine(max_total_tokens=1000)
    r = make_request(900, 2, max_tokens=200)
    assert not eng.add_request(r, 0.0) and r.status is Status.FAILED and "max request length" in r.fail_reason
    with pytest.raises(InputError, match="mem_fraction_static"):
        SglangParams(mem_fraction_static=1.2)
    with pytest.raises(InputError, match="chunked_prefill_size"):
        SglangParams(chunked_prefill_size=0)


def test_end_to_end_conserves_requests_and_keeps_invariants():
    sc = make_scenario(engines=["sglang"], workload__shared_prefix_tokens=500)
    r = run_engine(sc, EngineEntry(engine="sglang", params={"max_total_tokens": 12_000}), check_invariants=True)
    s = r.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 50
    assert s["prefix_cache_hit_rate"] > 0.2
