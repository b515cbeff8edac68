"""vLLM V1 policy driven by hand, like vLLM's own scheduler tests."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.core.request import Status
from simengine.engines.vllm import (
    VllmEngine,
    VllmParams,
    vllm_batch_defaults,
    vllm_capture_sizes,
    vllm_chunked_prefill,
)
from simengine.errors import InputError
from simengine.kvcache.hashing import block_hashes
from tests.conftest import make_dep, make_request
from tests.engines.harness import drive, run_step


def engine(**params) -> VllmEngine:
    return VllmEngine(VllmParams(**params), make_dep())


def test_defaults_follow_device():
    v1 = VllmParams()
    assert vllm_batch_defaults(v1, make_dep("h100_sxm")) == (1024, 8192)
    assert vllm_batch_defaults(v1, make_dep("a100_80g_sxm")) == (256, 2048)
    assert vllm_batch_defaults(v1, make_dep("b200")) == (1024, 16384)
    assert vllm_capture_sizes(1024, 8192)[:5] == (1, 2, 4, 8, 16) and max(vllm_capture_sizes(1024, 8192)) == 512


def test_token_budget_chunks_a_long_prompt():
    eng = engine(max_num_batched_tokens=512)
    req = make_request(1300, 3)
    eng.add_request(req, 0.0)
    sizes = []
    for i in range(3):
        out, _ = run_step(eng, i * 0.01)
        assert out.num_tokens <= 512
        sizes.append(out.scheduled[0][1])
    assert sizes == [512, 512, 276]
    assert req.num_output_tokens == 1 and req.first_token_s > 0


def decode_meets_new_prompt(eng: VllmEngine):
    """a decodes when b (400 tokens) arrives: (a, b, the step that follows)."""
    a = make_request(50, 10)
    eng.add_request(a, 0.0)
    run_step(eng)  # a prefills and samples its first token
    b = make_request(400, 5)
    eng.add_request(b, 0.01)
    return a, b, run_step(eng, 0.02)[0]


def test_running_decodes_are_scheduled_before_new_prefills():
    a, b, out = decode_meets_new_prompt(engine(max_num_batched_tokens=100))
    assert out.scheduled[0] == (a, 1)      # the decode first
    assert out.scheduled[1] == (b, 99)     # then the new prompt's chunk fills the budget
    assert out.shape.num_decode == 1 and out.shape.prefill_chunks == [(99, 0)]


def test_max_num_seqs_caps_running():
    eng = engine(max_num_seqs=2)
    reqs = [make_request(20, 5) for _ in range(4)]
    for r in reqs:
        eng.add_request(r, 0.0)
    out, _ = run_step(eng)
    assert len(out.scheduled) == 2 and eng.num_waiting() == 2


def test_preemption_victim_is_last_admitted_and_recomputes():
    eng = engine(kv_cache_memory_bytes=8 * 16 * 131072)  # exactly 8 blocks of 16 tokens
    assert eng.kv.num_blocks == 8
    a, b = make_request(48, 40), make_request(48, 40)  # 3 full blocks each at admission
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    now = 0.0
    preempted = []
    for _ in range(60):
        out, _ = run_step(eng, now)
        now += 0.01
        preempted += out.preempted
        if preempted:
            break
    assert preempted == [b]               # the most recently admitted request is the victim
    assert b.status is Status.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert eng.waiting[0] is b            # prepended to waiting
    eng.check_invariants()


def test_no_new_admission_in_a_step_that_preempted():
    eng = engine(kv_cache_memory_bytes=8 * 16 * 131072)
    a, b = make_request(48, 40), make_request(48, 40)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    now = 0.0
    while True:
        out = eng.schedule(now)
        if out.preempted:
            assert all(r.status is Status.RUNNING for r, _ in out.scheduled)
            assert b not in [r for r, _ in out.scheduled]
            break
        eng.update(out, now + 0.01)
        now += 0.01


def test_prefix_hit_skips_computation_and_is_capped():
    eng = engine()
    shared = np.arange(160, dtype=np.int32)
    a = make_request(160, 2, tokens=shared)
    eng.add_request(a, 0.0)
    run_step(eng)
    b = make_request(160, 2, tokens=shared)
    eng.add_request(b, 0.01)
    out, _ = run_step(eng, 0.02)
    entry = dict((r.request_id, n) for r, n in out.scheduled)
    assert b.num_cached_tokens == 144       # 9 of 10 full blocks: at least one token is recomputed
    assert entry[b.request_id] == 16
    assert eng.prefix_hit_rate() > 0


def test_prefix_caching_off_computes_everything():
    eng = engine(enable_prefix_caching=False)
    shared = np.arange(160, dtype=np.int32)
    for _ in range(2):
        eng.add_request(make_request(160, 2, tokens=shared), 0.0)
    out, _ = run_step(eng)
    assert out.num_tokens == 320


def test_admission_requires_the_whole_prompt_to_fit():
    """scheduler_reserve_full_isl (vLLM 0.33 kv_cache_manager.allocate_slots `full_sequence_must_fit`): a waiting
    request is admitted only if blocks for its whole prompt are free now, a check, not a reservation: only the
    step's chunk gets blocks."""
    eng = engine(kv_cache_memory_bytes=8 * 16 * 131072, max_num_batched_tokens=200, long_prefill_token_threshold=32)
    assert eng.max_model_len == 128  # capped to the pool, as if --max-model-len had been set to fit
    first, second = make_request(100, 2), make_request(110, 2)  # 7 blocks; then 7 blocks, 6 free after first's 2
    eng.add_request(first, 0.0)
    eng.add_request(second, 0.0)
    out, _ = run_step(eng)
    # only 32 tokens of `first` run, in 2 blocks: `second`'s whole prompt (7 blocks) does not fit the 6 left, so it
    # waits although 168 tokens of budget are left
    assert [r for r, _ in out.scheduled] == [first] and eng.kv.num_blocks_of(first) == 2
    assert eng.num_waiting() == 1
    third = make_request(60, 2)  # 4 blocks fit the 6 free, but strict FCFS: it waits behind `second`
    eng.add_request(third, 0.01)
    out, _ = run_step(eng, 0.02)
    assert [r for r, _ in out.scheduled] == [first] and eng.num_waiting() == 2


def test_prompt_longer_than_max_model_len_is_rejected():
    eng = engine(max_model_len=1000)
    r = make_request(1000, 2)
    assert not eng.add_request(r, 0.0)
    assert r.status is Status.FAILED and "max_model_len" in r.fail_reason


def test_priority_policy_serves_lower_value_first_and_preempts_worst():
    eng = engine(scheduling_policy="priority", max_num_seqs=1)
    low, high = make_request(20, 2, priority=5), make_request(20, 2, priority=0)
    eng.add_request(low, 0.0)
    eng.add_request(high, 0.1)
    out, _ = run_step(eng)
    assert [r for r, _ in out.scheduled] == [high]


def test_long_prefill_threshold_caps_chunks_when_others_run():
    eng = engine(long_prefill_token_threshold=64)
    eng.add_request(make_request(300, 3), 0.0)
    eng.add_request(make_request(300, 3), 0.0)
    out, _ = run_step(eng)
    assert [n for _, n in out.scheduled] == [64, 64]


def test_cuda_graph_padding_in_shape():
    eng = engine()
    for _ in range(3):
        eng.add_request(make_request(20, 5), 0.0)
    run_step(eng)
    out, _ = run_step(eng, 0.02)
    assert out.shape.num_decode == 3 and out.shape.cuda_graph and out.shape.padded_decode == 4


def test_bad_params_are_input_errors():
    with pytest.raises(InputError, match="gpu_memory_utilization"):
        VllmParams(gpu_memory_utilization=1.5)
    with pytest.raises(InputError, match="max_num_seqs"):
        VllmParams(max_num_seqs=-1)


# vLLM 0.19.0's own startup logs on one to four H100s at gpu_memory_utilization 0.95, max_num_seqs 1024, 8192
# batched tokens and VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: "Available KV cache memory" in GiB
# (llm-d-incubation/llm-d-planner PR #205, accuracy/results/v0.19.0)
@pytest.mark.parametrize("model, weight_dtype, tp, logged_gib", [
    ("llama-3.1-8b", "bf16", 1, 58.11), ("llama-3.1-8b", "bf16", 2, 63.76), ("llama-3.1-8b", "bf16", 4, 67.44),
    ("qwen3-8b", "bf16", 1, 57.50), ("qwen3-8b", "bf16", 4, 67.05),
    ("qwen3-30b-a3b", "bf16", 1, 15.41), ("qwen3-30b-a3b", "bf16", 4, 56.17),
    ("llama-3.3-70b", "fp8", 2, 37.28), ("llama-3.3-70b", "fp8", 4, 54.09),
    ("mixtral-8x7b", "bf16", 2, 28.44), ("mixtral-8x7b", "bf16", 4, 50.43),
    ("gpt-oss-20b", "mxfp4", 1, 58.47),
])
def test_the_kv_pool_is_sized_as_vllm_logs_it(model, weight_dtype, tp, logged_gib):
    dep = make_dep(model=model, weight_dtype=weight_dtype, tp=tp)
    eng = VllmEngine(VllmParams(gpu_memory_utilization=0.95, memory_profiler_estimate_cudagraphs=False), dep)
    pool_gib = eng.kv_capacity_tokens() * dep.kv_bytes_per_token_per_device / 2**30
    assert pool_gib == pytest.approx(logged_gib, rel=0.035)   # the profile's sampler peak and non-torch memory


def test_from_v0_21_the_cuda_graph_pool_comes_out_of_the_kv_budget():
    dep = make_dep(model="llama-3.1-70b", weight_dtype="fp8", tp=4)
    gib = [VllmEngine(VllmParams(memory_profiler_estimate_cudagraphs=on), dep).kv_capacity_tokens()
           * dep.kv_bytes_per_token_per_device / 2**30 for on in (False, True)]
    assert 1.5 < gib[0] - gib[1] < 1.9   # 80 layers: 1.66 GiB logged at TP4 (vLLM 0.19.0, 'Graph capturing')
    eager = VllmEngine(VllmParams(enforce_eager=True), dep).kv_capacity_tokens()
    assert eager * dep.kv_bytes_per_token_per_device / 2**30 == pytest.approx(gib[0], abs=0.01)   # no graphs


def test_pipeline_stages_split_the_graph_pool_and_grow_no_all_reduce_buffers():
    def pool_gib(dep, on):
        eng = VllmEngine(VllmParams(memory_profiler_estimate_cudagraphs=on), dep)
        return eng.kv_capacity_tokens() * dep.kv_bytes_per_token_per_device / 2**30

    tp2, pp2 = make_dep(model="llama-3.1-70b", weight_dtype="fp8", tp=2), make_dep(model="llama-3.1-70b",
                                                                               weight_dtype="fp8", pp=2)
    assert pool_gib(pp2, False) - pool_gib(pp2, True) == pytest.approx(0.25 + 40 * 20 / 1024, abs=0.01)   # 40 layers
    # TP's 1.85 GiB more of NCCL buffers, less the 0.3 GiB more a whole-width forward holds at PP2
    assert 1.5 < pool_gib(pp2, False) - pool_gib(tp2, False) < 1.85


def test_model_that_does_not_fit_is_refused_with_numbers():
    with pytest.raises(InputError, match=r"does not fit on h100_sxm.*GiB.*tp=2"):
        VllmEngine(VllmParams(), make_dep(model="llama-3.1-70b"))


@pytest.mark.parametrize("defer", [False, True])
def test_priority_preemption_of_a_request_scheduled_earlier_in_the_step_unschedules_it(defer, monkeypatch):
    """Priority mode can preempt a request already scheduled in the step: vLLM takes it out of the step, hands its
    tokens back to the budget and goes on with the request that needed the block (v1 scheduler `schedule`)."""
    monkeypatch.setattr(VllmEngine, "defer_output_publish", defer)
    eng = engine(block_size=4, kv_cache_memory_bytes=24 * 131072, scheduling_policy="priority")
    assert eng.kv.num_blocks == 6
    low = make_request(2, 10, priority=5, unique_outputs=True)   # fills its first block on its third step
    eng.add_request(low, 0.0)
    run_step(eng, 0.0)
    high = make_request(20, 5, priority=0, unique_outputs=True)  # 5 full blocks: needs a 6th on its first decode
    eng.add_request(high, 0.01)
    run_step(eng, 0.01)
    out, _ = run_step(eng, 0.02)
    assert out.preempted == [low] and out.scheduled == [(high, 1)]  # scheduled first, then the victim: unscheduled
    assert low.num_computed_tokens == 0 and eng.waiting_heap[0][3] is low


@pytest.mark.parametrize("lazy", [False, True])
def test_blocks_leave_the_pool_in_running_order_even_for_cohort_members(lazy, monkeypatch):
    """A block taken from the LRU front loses its cached hash, and a request publishing that same hash keeps it
    only if the eviction came first: so the decode cohort must take its members' blocks in running order with the
    other requests' allocations, as the per-request loop does. Here the earlier request X takes Z's freed block
    holding hash h1 in the same step as the later Y publishes h1; W then finds h1 cached."""
    monkeypatch.setattr(VllmEngine, "lazy_decode", lazy)
    monkeypatch.setattr(VllmEngine, "defer_output_publish", lazy)
    # synchronous loop: Z's blocks are free when the next step is scheduled (async frees them one decision later)
    eng = engine(block_size=4, kv_cache_memory_bytes=16 * 131072, max_num_batched_tokens=14, async_scheduling=False)
    assert eng.kv.num_blocks == 4
    prompt = np.arange(8, dtype=np.int32) + 7
    x = make_request(4, 6, unique_outputs=True)              # a steady decode from step 1: a block on step 1
    z = make_request(8, 1, tokens=prompt, unique_outputs=True)  # publishes h0, h1; finishes on step 0
    y = make_request(8, 2, tokens=prompt, unique_outputs=True)  # hits h0; 2 of its other 4 tokens fit step 0
    for r in (x, z, y):
        eng.add_request(r, 0.0)
    out, res = run_step(eng, 0.0)
    assert [n for _, n in out.scheduled] == [4, 8, 2] and res.finished == [z]
    free = eng.kv.pool.free_blocks()
    h1 = block_hashes(y, 4)[1]
    assert len(free) == 1 and eng.kv.pool.block_hash[free[0]] == h1  # Z's second block, the LRU front
    out, _ = run_step(eng, 0.01)  # X takes that block (evicting h1), then Y fills its block 1: h1 again
    assert [(r.request_id, n) for r, n in out.scheduled] == [(x.request_id, 1), (y.request_id, 2)]
    assert (out.num_lazy == 1) == lazy
    eng.sync()
    w = make_request(12, 1, tokens=np.concatenate([prompt, np.arange(4, dtype=np.int32)]), unique_outputs=True)
    assert eng.kv.get_computed_blocks(w).num_tokens == 8


def test_multi_step_runs_admit_nobody_until_they_end():
    """vLLM V0 --num-scheduler-steps 4: once a decode-only step starts a run, a waiting request waits for its end."""
    eng = VllmEngine(VllmParams(num_scheduler_steps=4), make_dep())
    first = make_request(64, output_len=50)
    eng.add_request(first, 0.0)
    run_step(eng)                                   # its prefill
    late = make_request(64, output_len=5)
    for i in range(4):                              # a run of four decode steps: the late request waits
        out, _ = run_step(eng, 0.01 * (i + 1))
        if i == 0:
            eng.add_request(late, 0.01)
        assert [r.request_id for r, _ in out.scheduled] == [first.request_id]
    out, _ = run_step(eng, 0.05)                    # the run is over: admitted
    assert late.request_id in {r.request_id for r, _ in out.scheduled}
    plain = VllmEngine(VllmParams(), make_dep())   # one scheduling pass a run: each of its steps bears a quarter
    assert eng.timing.scheduler_cpu_s == plain.timing.scheduler_cpu_s
    assert plain.timing.step_cpu_s - eng.timing.step_cpu_s == pytest.approx(0.75 * plain.timing.scheduler_cpu_s)


def test_a_calibrated_scheduling_pass_is_shared_by_the_steps_of_a_run():
    """calibration.yaml's vLLM scheduler_cpu_s is one scheduling pass (fitted on rows that ran 10 steps a pass):
    a single-step engine bears it every step, a run of k steps 1/k of it a step."""
    from simengine.sim.build import cost_model

    one, ten = (cost_model(VllmEngine(VllmParams(num_scheduler_steps=k), make_dep())).timing for k in (1, 10))
    assert one.scheduler_cpu_s == ten.scheduler_cpu_s > 0
    assert ten.step_cpu_s == pytest.approx(one.scheduler_cpu_s / 10 + one.output_cpu_s)
    assert one.step_cpu_s == pytest.approx(one.scheduler_cpu_s + one.output_cpu_s)


def test_multi_step_runs_stream_their_tokens_at_their_end():
    """V0 multi-step: a run's tokens reach the client when it ends, one chunk per request (one inter-token gap from
    its last delivered token); a request that finished inside the run is reported with it; step rows keep the tokens
    each step computed."""
    eng = VllmEngine(VllmParams(num_scheduler_steps=4), make_dep())
    short, long = make_request(64, output_len=3), make_request(64, output_len=20)
    eng.add_request(short, 0.0)
    eng.add_request(long, 0.0)
    _, res = run_step(eng, 0.0)                     # both prompts: first tokens at 0.01, streamed at once
    assert res.num_first_tokens == 2 and short.first_token_s == 0.01
    for i in range(3):                              # the run's first three steps: nothing streamed
        out, res = run_step(eng, 0.01 * (i + 1))
        assert res.itl_groups == {} and res.finished == [] and res.num_tokens == len(out.scheduled)
    assert short.num_output_tokens == 3 and short.status is Status.FINISHED   # computed at its second step
    out, res = run_step(eng, 0.04)                  # the last step of the run
    assert [r for r, _ in out.scheduled] == [long] and res.num_tokens == 1
    assert res.finished == [short] and short.finish_s == short.last_token_s == 0.05
    assert res.itl_groups == {0.01: 2} and long.last_token_s == 0.05 and long.num_output_tokens == 5


def test_a_multi_step_run_ends_when_every_request_of_it_finished():
    """Nothing left to run: the run ends at once, its tokens stream and a waiting request is admitted."""
    eng = VllmEngine(VllmParams(num_scheduler_steps=8), make_dep())
    only = make_request(64, output_len=3)
    eng.add_request(only, 0.0)
    run_step(eng, 0.0)
    run_step(eng, 0.01)                             # starts a run of 8
    late = make_request(64, output_len=2)
    eng.add_request(late, 0.015)
    _, res = run_step(eng, 0.02)                    # its last token: the run is over
    assert res.finished == [only] and only.finish_s == 0.03 and eng.multi_step_left == 0
    out, _ = run_step(eng, 0.03)
    assert [r for r, _ in out.scheduled] == [late]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduling_frees_a_finished_request_one_decision_later(async_scheduling):
    """vLLM's AsyncScheduler schedules step k+1 before applying step k's output: a request whose last token is in
    flight is skipped but keeps its blocks and its seat for that decision; the synchronous loop frees them first."""
    eng = engine(kv_cache_memory_bytes=8 * 16 * 131072, max_num_seqs=1, async_scheduling=async_scheduling)
    a, b = make_request(40, 2), make_request(40, 2)
    eng.add_request(a, 0.0)
    run_step(eng, 0.0)                   # a's prompt, first token
    eng.add_request(b, 0.01)
    out, res = run_step(eng, 0.01)       # a's last token; b waits (max_num_seqs 1)
    assert out.scheduled == [(a, 1)] and res.finished == [a]
    assert eng.num_running() == (1 if async_scheduling else 0)   # async: a still holds its seat and blocks
    out, _ = run_step(eng, 0.02)
    if async_scheduling:                 # a is skipped and freed after this decision: b waited one more step
        assert out.is_empty and out.released == 1 and eng.num_running() == 0 and eng.kv_usage() == 0
        out, _ = run_step(eng, 0.03)
    assert [r for r, _ in out.scheduled] == [b]


def test_a_multi_step_run_streams_one_chunk_per_run_and_loses_no_token():
    """A whole run with --num-scheduler-steps 10 against single steps: every token is computed and delivered once
    (step rows and requests agree), the streamed gaps are runs of about ten steps, and a request's TPOT never falls
    below its single-step value (its tokens only wait)."""
    from simengine.api import run_engine
    from tests.conftest import make_scenario

    results = {}
    for steps in (1, 10):
        sc = make_scenario(engines=[{"engine": "vllm", "params": {"num_scheduler_steps": steps}}], horizon_s=10.0)
        results[steps] = r = run_engine(sc, sc.engines[0])
        done = r.requests[r.requests.status == "completed"]
        assert len(done) == len(r.requests) and r.steps.output_tokens.sum() == done.num_output_tokens.sum()
    one, ten = results[1], results[10]
    decode_step_ms = 1e3 * ten.steps[ten.steps.prefill_tokens == 0].step_s.median()
    assert 8 * decode_step_ms < ten.summary["median_itl_ms"] < 11 * decode_step_ms
    assert one.summary["median_itl_ms"] < 2 * decode_step_ms
    assert ten.summary["mean_tpot_ms"] > one.summary["mean_tpot_ms"]


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(2, 12), lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40),
                                                           st.integers(0, 5)), min_size=1, max_size=12))
def test_multi_step_streaming_delivers_every_request_once_and_never_early(steps, lengths):
    """Any workload under --num-scheduler-steps: every request is reported once, whole, at a step's end no earlier
    than its last token was computed, and its finish is its last streamed token."""
    eng = VllmEngine(VllmParams(num_scheduler_steps=steps), make_dep())
    reqs = [make_request(p, o, arrival_s=0.02 * a) for p, o, a in lengths]
    computed: dict[int, float] = {}
    real_update = eng.update

    def update(out, now):
        for req, _ in out.scheduled:
            computed[req.request_id] = now
        return real_update(out, now)

    eng.update = update
    done, failed = drive(eng, reqs)
    assert not failed and sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    for req in done:
        assert req.finish_s == req.last_token_s >= computed[req.request_id] >= req.first_token_s


def test_fp8_checkpoints_run_weight_only_on_a_device_without_fp8_tensor_cores():
    """vLLM runs an FP8 checkpoint on an A100 through FP8 Marlin (W8A16): one byte a weight, 16-bit GEMMs, so a
    batch-1 decode is faster than BF16's and the KV pool larger; engines without that path refuse it."""
    from simengine.config.loader import from_dict
    from simengine.config.scenario import Scenario
    from simengine.errors import InputError as Refused
    from simengine.sim.build import build_deployment, build_engine, cost_model
    from simengine.validate.run import decode_shape

    def built(engine: str, dtype: str):
        sc = from_dict(Scenario, {"name": "x", "deployment": {"hardware": "a100_80g_sxm", "model": "llama-3.1-8b",
                                                              "weight_dtype": dtype},
                                  "workload": {"num_requests": 1}, "engines": [engine]}, source="test")
        eng = build_engine(sc.engines[0], build_deployment(sc))
        return eng, cost_model(eng)

    (fp8, fp8_cost), (bf16, bf16_cost) = built("vllm", "fp8"), built("vllm", "bf16")
    assert fp8.dep.weight_format.bytes_per_param == 1.0 and fp8_cost.work.compute_dtype == "bf16"
    assert fp8.kv.num_blocks > bf16.kv.num_blocks
    step = decode_shape(fp8, 1, 1000)
    assert fp8_cost.step(step).seconds < 0.7 * bf16_cost.step(step).seconds
    for engine in ("sglang", "trtllm"):
        with pytest.raises(Refused, match="fp8 tensor cores"):
            built(engine, "fp8")


# ---- V0 (use_v1: false, the engine of vLLM before 0.8) ---------------------------------------------------------------
def test_v0_defaults_and_when_it_chunks():
    dep = make_dep("h100_sxm")
    v0 = VllmParams(use_v1=False)
    long_context = dep.model.max_model_len > 32768
    # V0 chunks prompts only past a 32K context and not with multi-step; unchunked, the budget holds a whole context
    assert vllm_chunked_prefill(v0, dep) is long_context
    assert vllm_chunked_prefill(VllmParams(use_v1=False, num_scheduler_steps=8), dep) is False
    assert vllm_chunked_prefill(VllmParams(use_v1=False, max_model_len=4096), dep) is False
    assert vllm_batch_defaults(VllmParams(use_v1=False, max_model_len=4096), dep) == (256, 4096)
    assert vllm_batch_defaults(VllmParams(use_v1=False, max_model_len=1000), dep) == (256, 2048)
    assert vllm_batch_defaults(VllmParams(use_v1=False, enable_chunked_prefill=True), dep) == (256, 2048)
    # V1 without chunking keeps the device's defaults, floored at a whole context a step (arg_utils.py
    # _set_default_max_num_seqs_and_batched_tokens_args: max(max_model_len, the device's 8,192 on an H100))
    assert vllm_batch_defaults(VllmParams(enable_chunked_prefill=False, max_model_len=4096), dep) == (1024, 8192)
    assert vllm_batch_defaults(VllmParams(enable_chunked_prefill=False, max_model_len=32768), dep) == (1024, 32768)
    # and max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
    assert vllm_batch_defaults(VllmParams(max_num_batched_tokens=512), dep) == (512, 8192)
    assert VllmEngine(v0, dep).kv.enable_prefix_caching is False
    assert VllmEngine(VllmParams(), dep).kv.enable_prefix_caching is True


def test_v0_runs_new_prompts_in_steps_of_their_own():
    eng = engine(use_v1=False, max_model_len=2048)
    a, b, out = decode_meets_new_prompt(eng)
    assert out.scheduled == [(b, 400)]     # the new prompt alone, whole: a's decode waits
    assert out.shape.num_decode == 0
    out, _ = run_step(eng, 0.03)
    assert {r for r, _ in out.scheduled} == {a, b} and out.shape.num_decode == 2


def test_unchunked_prompt_waits_for_a_budget_that_holds_it_whole():
    for use_v1 in (True, False):
        eng = engine(use_v1=use_v1, enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=512)
        a, b = make_request(300, 5), make_request(300, 5)
        eng.add_request(a, 0.0)
        eng.add_request(b, 0.0)
        out, _ = run_step(eng)
        assert out.scheduled == [(a, 300)]  # b does not fit the 212 tokens left and is not cut
        out, _ = run_step(eng, 0.01)
        assert (b, 300) in out.scheduled and ((a, 1) in out.scheduled) is use_v1   # V1 mixes, V0 does not


def test_v0_admission_leaves_the_watermark_free():
    eng = engine(use_v1=False, max_model_len=4096, kv_cache_memory_bytes=200 * 16 * 131072)  # 200 blocks
    assert eng.kv.num_blocks == 200 and eng.watermark_blocks == 2
    a, b = make_request(16 * 190, 2), make_request(16 * 9, 2)   # 190 blocks, then 9 of the 10 left
    for r in (a, b):
        eng.add_request(r, 0.0)
    run_step(eng)
    assert eng.num_waiting() == 1          # 10 free - 9 needed < the 2-block watermark: b waits
    v1 = engine(max_model_len=4096, max_num_batched_tokens=4096, kv_cache_memory_bytes=200 * 16 * 131072)
    for r in (make_request(16 * 190, 2), make_request(16 * 9, 2)):
        v1.add_request(r, 0.0)
    run_step(v1)
    assert v1.num_waiting() == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(1, 40), st.floats(0, 0.5)), min_size=1, max_size=25),
       st.integers(8, 64), st.sampled_from([1, 4]))
def test_v0_steps_are_prompts_alone_or_decodes_alone(specs, blocks_k, steps):
    """No request lost (drive); no step mixes prompts with decodes; no prompt is cut; budgets never exceeded."""
    eng = engine(use_v1=False, max_model_len=1024, num_scheduler_steps=steps,
                 kv_cache_memory_bytes=blocks_k * 16 * 16 * 131072)
    schedule = eng.schedule

    def checked(now):
        waiting = {r.request_id: r.num_tokens - r.num_computed_tokens for r in eng.waiting}
        out = schedule(now)
        prompts = [(r, n) for r, n in out.scheduled if r.request_id in waiting]
        assert not prompts or len(prompts) == len(out.scheduled)
        assert all(n == waiting[r.request_id] for r, n in prompts)
        assert out.num_tokens <= eng.max_num_batched_tokens
        return out

    eng.schedule = checked
    drive(eng, [make_request(p, o, arrival_s=t) for p, o, t in specs])


def test_v0_refuses_kv_offload():
    with pytest.raises(InputError, match="use_v1") as err:
        engine(use_v1=False, kv_offloading_size=8.0)
    assert err.value.field == "kv_offloading_size"


def test_unchunked_budget_below_the_context_is_refused_at_startup():
    # vLLM's SchedulerConfig._verify_args: without chunked prefill a step must hold a whole max_model_len prompt
    with pytest.raises(InputError, match="smaller than max_model_len") as e:
        engine(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=4096)
    assert e.value.field == "max_num_batched_tokens"
    engine(enable_chunked_prefill=True, max_num_batched_tokens=512, max_model_len=4096)   # chunked: fine
