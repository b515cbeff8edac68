"""llama.cpp server policy driven by hand: slots, slot choice, iteration shape, ubatch forwards, KV limits."""

import dataclasses
from unittest import mock

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.dtypes import WEIGHT_FORMATS
from simengine.config.loader import from_dict
from simengine.config.scenario import EngineEntry, Scenario
from simengine.core.batch import BatchShape
from simengine.core.request import Status
from simengine.engines.llamacpp import LlamaCppEngine, LlamaCppParams
from simengine.engines.llamacpp_kernels import FA_FLOPS_PER_SM_CYCLE, GGML_LAYER_KERNELS, MMQ_FLOPS_PER_SM_CYCLE
from simengine.errors import CannotRun, InputError
from simengine.sim.build import build_engine, cost_model
from tests.conftest import make_dep, make_request
from tests.engines.harness import run_step


def engine(dep=None, **params) -> LlamaCppEngine:
    return LlamaCppEngine(LlamaCppParams(**params), dep or make_dep())


def run_until_done(eng, reqs, now=0.0):
    while not all(r.is_finished for r in reqs):
        _, _ = run_step(eng, now)
        now += 0.01
    return now


def slot_of(eng, req):
    return next(s.id for s in eng.slots if s.req is req)


def test_defaults_four_unified_slots_and_model_context():
    eng = engine()
    assert (eng.n_parallel, eng.kv_unified) == (4, True)
    assert eng.n_ctx == eng.n_ctx_slot == 131072          # -c 0: training context, fits an H100
    assert (eng.n_batch, eng.n_ubatch) == (2048, 512)
    assert engine(n_parallel=1).n_parallel == 4           # -np 1 without -kvu is the auto case (server.cpp)
    two = engine(n_parallel=2)
    assert not two.kv_unified and two.n_ctx_slot == two.n_ctx // 2


def test_fit_shrinks_the_context_on_a_small_device_or_refuses():
    small = engine(make_dep("jetson_orin_nano", weight_dtype="q4_0"))
    assert 4096 <= small.n_ctx < 131072
    with pytest.raises(InputError, match="--fit would move layers to the CPU"):
        engine(make_dep("jetson_orin_nano", model="llama-2-70b", weight_dtype="q4_0"))


def test_deployment_refusals_name_the_field():
    # what llama.cpp cannot run is CannotRun: a comparison lists it and runs the other engines
    with pytest.raises(CannotRun, match=r"deployment.weight_dtype.*q8_0, q4_0"):
        engine(make_dep(weight_dtype="fp8"))
    with pytest.raises(CannotRun, match="deployment.tp"):
        engine(make_dep(tp=2))
    assert not LlamaCppEngine.runs_on(make_dep("gaudi3").hardware)   # no Gaudi (HPU) backend
    with pytest.raises(CannotRun, match="llamacpp does not run on gaudi3"):
        build_engine(EngineEntry(engine="llamacpp"), make_dep("gaudi3", weight_dtype="q4_0"))
    with pytest.raises(InputError, match="context_shift"):
        LlamaCppParams(context_shift=True)
    with pytest.raises(InputError, match="slot_prompt_similarity"):
        LlamaCppParams(slot_prompt_similarity=1.5)


def test_runs_on_every_device_class_with_a_source():
    for hw in ("apple_m2_ultra", "snapdragon_8_elite", "jetson_agx_orin_64g", "mi300x", "ascend_910b3", "arc_pro_b60"):
        eng = build_engine(EngineEntry(engine="llamacpp"), make_dep(hw, model="llama-2-7b", weight_dtype="q4_0"))
        assert eng.num_running() == 0
    assert {"edge", "mobile"} <= LlamaCppEngine.device_classes and "qualcomm" in LlamaCppEngine.vendors
    assert "Metal" in LlamaCppEngine.support_source


def test_iteration_decodes_first_then_prompts_in_slot_order_in_ubatch_forwards():
    eng = engine(n_parallel=2, kv_unified=True, batch_size=64, ubatch_size=32)
    a, b = make_request(40, 3), make_request(100, 3)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    out, _ = run_step(eng)
    assert (slot_of(eng, a), slot_of(eng, b)) == (1, 0)    # LRU ties go to the later slot
    assert out.scheduled == [(b, 32)]                      # slot 0's prompt fills n_batch=64 -> 2 forwards of 32
    out, _ = run_step(eng, 0.01)
    assert out.scheduled == [(b, 32)] and b.num_output_tokens == 0
    out, _ = run_step(eng, 0.02)                           # next iteration: b's last 36, a's first 28 (= 64)
    assert out.scheduled == [(b, 32)]
    out, _ = run_step(eng, 0.03)
    assert dict(out.scheduled) == {b: 4, a: 28}            # b's sampled token sits in the last forward
    assert b.num_output_tokens == 1 and b.first_token_s == pytest.approx(0.04)
    out, _ = run_step(eng, 0.04)
    assert out.scheduled == [(b, 1), (a, 12)]              # decode first, then the rest of a's prompt
    assert out.shape.num_decode == 1 and out.shape.prefill_chunks == [(12, 28)]


def test_no_continuous_batching_waits_for_generation_to_end():
    eng = engine(n_parallel=2, kv_unified=True, cont_batching=False)
    a = make_request(20, 3)
    eng.add_request(a, 0.0)
    run_step(eng)
    eng.add_request(make_request(30, 3), 0.01)
    out, _ = run_step(eng, 0.01)
    assert out.scheduled == [(a, 1)]                       # prompts join only a batch without decodes


def test_slot_chosen_by_prompt_similarity_keeps_its_cached_prefix():
    eng = engine(n_parallel=2, kv_unified=True, cache_ram=0)
    a = make_request(64, 2)
    eng.add_request(a, 0.0)
    now = run_until_done(eng, [a])
    a_slot = next(s for s in eng.slots if len(s.cache))
    follow = make_request(96, 2, tokens=np.concatenate([a.token_ids[:64], np.arange(32) + 7]))
    other = make_request(96, 2)
    eng.add_request(follow, now)
    eng.add_request(other, now)
    run_step(eng, now)
    assert slot_of(eng, follow) == a_slot.id and follow.num_cached_tokens == 64
    assert other.num_cached_tokens == 0
    assert eng.prefix_hit_rate() == pytest.approx(64 / (64 + 96 + 96))


def test_a_fully_cached_prompt_still_recomputes_one_token():
    eng = engine(n_parallel=1, kv_unified=True, cache_ram=0)
    a = make_request(50, 2)
    eng.add_request(a, 0.0)
    now = run_until_done(eng, [a])
    again = make_request(50, 2, tokens=a.token_ids[:50])
    eng.add_request(again, now)
    out, _ = run_step(eng, now)
    assert again.num_cached_tokens == 49 and out.scheduled == [(again, 1)]


def test_ram_prompt_cache_restores_a_conversation_after_its_slot_was_reused():
    def turn_two(with_ram: bool) -> int:
        eng = engine(n_parallel=1, kv_unified=True, **({} if with_ram else {"cache_ram": 0}))
        a = make_request(200, 5, seed=1)
        eng.add_request(a, 0.0)
        now = run_until_done(eng, [a])
        b = make_request(150, 3, seed=2)                   # unrelated: takes the only slot (LRU), a is saved
        eng.add_request(b, now)
        now = run_until_done(eng, [b], now)
        history = a.token_ids[:a.prompt_len + a.output_len - 1]
        a2 = make_request(len(history) + 40, 3, tokens=np.concatenate([history, np.arange(40) + 9]))
        eng.add_request(a2, now)
        run_step(eng, now)
        return a2.num_cached_tokens
    assert turn_two(with_ram=True) == 200 + 5 - 1            # prompt + outputs fed to the KV
    assert turn_two(with_ram=False) == 0


def test_generation_stops_at_the_slot_context_when_shift_is_off():
    eng = engine(n_parallel=1, kv_unified=True, ctx_size=256)
    r = make_request(200, 100)
    eng.add_request(r, 0.0)
    run_until_done(eng, [r])
    assert r.status is Status.FINISHED and r.num_output_tokens == 56 and "truncated" in r.fail_reason
    assert eng.num_truncated == 1 and eng.num_running() == 0


def test_prompt_at_the_slot_context_is_rejected():
    eng = engine(n_parallel=2, ctx_size=512)               # per-slot streams of 256 cells
    r = make_request(256, 2)
    assert not eng.add_request(r, 0.0) and "exceeds the available context size" in r.fail_reason


def test_full_unified_kv_purges_idle_slots_first():
    eng = engine(n_parallel=2, kv_unified=True, ctx_size=256, cache_ram=0)
    a = make_request(150, 2)
    eng.add_request(a, 0.0)
    now = run_until_done(eng, [a])
    b = make_request(200, 2)
    eng.add_request(b, now)
    out, _ = run_step(eng, now)
    assert out.scheduled == [(b, 200)] and not out.rejected
    assert all(len(s.cache) == 0 for s in eng.slots)       # a's 151 cached cells were purged to place b


def test_full_unified_kv_fails_every_processing_slot_no_preemption():
    eng = engine(n_parallel=2, kv_unified=True, ctx_size=256)
    a, b = make_request(100, 200), make_request(100, 200)
    for r in (a, b):
        eng.add_request(r, 0.0)
    now, rejected = 0.0, []
    while not rejected:
        out, _ = run_step(eng, now)
        now += 0.01
        assert not out.preempted
        rejected = out.rejected
    assert set(rejected) == {a, b} and all("Context size has been exceeded" in r.fail_reason for r in rejected)
    assert a.num_output_tokens == b.num_output_tokens == 29  # 2 x (100 + 28) + 2 > 256 cells
    assert eng.num_running() == 0 and eng.kv_usage() == 0
    eng.check_invariants()


def test_fifo_queue_when_no_slot_is_idle():
    eng = engine(n_parallel=1, kv_unified=True)
    reqs = [make_request(30, 2) for _ in range(3)]
    for r in reqs:
        eng.add_request(r, 0.0)
    run_step(eng)
    assert eng.num_running() == 1 and eng.num_waiting() == 2 and reqs[0].status is Status.RUNNING
    now = run_until_done(eng, reqs[:1])
    run_step(eng, now)
    assert reqs[1].status is Status.RUNNING and reqs[2].status is Status.WAITING


def test_cuda_graph_only_for_single_token_batches():
    eng = engine(n_parallel=2, kv_unified=True)
    eng.add_request(make_request(20, 5), 0.0)
    run_step(eng)
    out, _ = run_step(eng, 0.01)
    assert out.shape.num_decode == 1 and out.shape.cuda_graph
    eng.add_request(make_request(20, 5), 0.02)
    run_step(eng, 0.02)
    out, _ = run_step(eng, 0.03)
    assert out.shape.num_decode == 2 and not out.shape.cuda_graph
    metal = engine(make_dep("apple_m2_ultra", model="llama-2-7b", weight_dtype="q4_0"))
    assert metal.timing.cuda_graph_sizes == () and metal.timing.kernel_launch_s > 0


def test_cuda_graphs_off_launches_every_decode_kernel_from_the_host():
    """GGML_CUDA_DISABLE_GRAPHS=1, or a build before PR #6766: a single-token forward is launched kernel by kernel,
    so it is an eager step lasting at least the host's launches of the whole ggml graph."""
    dep = make_dep("h100_pcie", model="llama-2-7b", weight_dtype="q4_k_m")
    steps = {}
    for graphs in (True, False):
        eng = engine(dep, cuda_graphs=graphs)
        eng.add_request(make_request(20, 5), 0.0)
        run_step(eng)
        out, _ = run_step(eng, 0.01)
        assert out.shape.num_decode == 1
        steps[graphs] = out.shape
        assert eng.timing.cuda_graph_sizes == ((1,) if graphs else ())
    assert steps[True].cuda_graph and not steps[False].cuda_graph
    eager = cost_model(engine(dep, cuda_graphs=False))
    assert eager.launch_s == pytest.approx(eager.timing.kernel_launch_s * (GGML_LAYER_KERNELS + 1) * 32)
    assert eager.step(steps[False]).seconds >= eager.launch_s


def test_every_kernel_of_the_unfused_ggml_graph_pays_the_device_floor():
    """ggml's llama graph runs q, k, v, output, gate, up and down as seven GEMMs and every norm, RoPE, cache write
    and residual add as its own kernel: a step's token-count ops pay the kernel floor GGML_LAYER_KERNELS times a
    layer, the count its eager launches use too, where an engine with fused layers pays eight."""
    dep = make_dep("a100_80g_sxm", model="llama-2-7b", weight_dtype="q4_0")
    eng = engine(dep)
    cost = cost_model(eng)
    assert cost.kernels.token_features(np.array([1.0]))["floors"][0] == 32 * GGML_LAYER_KERNELS
    assert eng.timing.kernels_per_layer == GGML_LAYER_KERNELS + 1   # FlashAttention: one kernel
    vllm = build_engine(EngineEntry(engine="vllm"), make_dep("a100_80g_sxm", model="llama-2-7b"))
    assert cost_model(vllm, kernels="roofline").kernels.token_features(np.array([1.0]))["floors"][0] == 32 * 8
    # the floors are GPU time: with the floor at zero a one-token step is that many floors shorter
    floor = cost.kernels.terms.kernel_floor_s
    bare = dataclasses.replace(cost.kernels.terms, kernel_floor_s=0.0)
    f = cost.kernels.token_features(np.array([1.0]))
    from simengine.cost.roofline import price
    assert price(f, cost.kernels.terms)[0][0] - price(f, bare)[0][0] == pytest.approx(32 * GGML_LAYER_KERNELS * floor)


def test_quantized_gemms_run_at_the_mmq_rate_per_sm_cycle_not_the_tensor_peak():
    a100 = engine(make_dep("a100_80g_sxm", model="llama-2-7b", weight_dtype="q4_0"))
    assert a100.engine_gemm_flops_s() == pytest.approx(MMQ_FLOPS_PER_SM_CYCLE * 108 * 1.41e9)
    # BF16 weights go to cuBLAS computing in FP32 (the device's GEMM fraction; F16 below); devices of unknown SMs
    # keep it too
    for hw, dtype in (("a100_80g_sxm", "bf16"), ("b200", "q4_0")):
        assert engine(make_dep(hw, model="llama-2-7b", weight_dtype=dtype)).engine_gemm_flops_s() is None
    # pp512: A100 has 4.4x the RTX 3090's fp16 tensor peak but about the same SMs x clock (1.10x), and llama.cpp's
    # published prefill speeds of the two are within 2% (docs/validation.md)
    gemm_s = {}
    for hw in ("a100_80g_sxm", "rtx_3090"):
        eng = engine(make_dep(hw, model="llama-2-7b", weight_dtype="q4_0"))
        gemm_s[hw] = cost_model(eng).step(BatchShape(prefill_chunks=[(512, 0)], num_logits=1)).compute_s
    assert 1.0 < gemm_s["rtx_3090"] / gemm_s["a100_80g_sxm"] < 1.25
    # Hopper: its tensor clock (1.83 GHz on the SXM5), not the FP32 clock, with its 132 SMs
    h100 = engine(make_dep("h100_sxm", model="llama-2-7b", weight_dtype="q4_0"))
    assert h100.engine_gemm_flops_s() == pytest.approx(MMQ_FLOPS_PER_SM_CYCLE * 132 * 1.83e9)


def test_f16_weights_run_through_cublas_in_fp16_at_llama_cpps_published_share_of_that_peak():
    """F16 weights: cuBLAS computing in FP16 (CUBLAS_COMPUTE_16F) at CUBLAS_F16_PEAK_FRACTION of the FP16-accumulate
    tensor peak, which on a GeForce die is twice the FP32-accumulate fp16 its YAML stores, not a large GEMM's share
    of the stored peak. The RTX 4090 row the fraction comes from and the same year's A100 and RTX 3090 runs
    (PRs #4766 and #6017, LLaMA 7B F16 pp512) come out within 15 %; no MMQ tiles pad F16 experts."""
    from simengine.engines.llamacpp_kernels import CUBLAS_F16_PEAK_FRACTION
    rtx = engine(make_dep("rtx_4090", model="llama-2-7b", weight_dtype="fp16"))
    assert rtx.engine_gemm_flops_s() == pytest.approx(CUBLAS_F16_PEAK_FRACTION * 330.3e12)
    a100 = engine(make_dep("a100_80g_sxm", model="llama-2-7b", weight_dtype="fp16"))
    assert a100.engine_gemm_flops_s() == pytest.approx(CUBLAS_F16_PEAK_FRACTION * 312e12)
    assert engine(make_dep("a100_80g_sxm", model="qwen3-30b-a3b", weight_dtype="fp16")).expert_tile_columns() is None
    for hw, measured in (("rtx_4090", 11048.22), ("a100_pcie", 8668.24), ("rtx_3090", 4184.85)):
        eng = engine(make_dep(hw, model="llama-2-7b", weight_dtype="fp16"))
        step = cost_model(eng).step(BatchShape(prefill_chunks=[(512, 0)], num_logits=1))
        assert 512 / step.seconds == pytest.approx(measured, rel=0.15), hw


def test_forced_cublas_dequantizes_quantized_weights_to_f16_above_32_tokens():
    """GGML_CUDA_FORCE_CUBLAS (every CUDA build before b3216): a ubatch over 32 tokens first writes an F16 copy of
    the quantized weights, then multiplies at the F16 cuBLAS rate, so quantized prefill is the F16 time plus that
    pass. Judged on the RTX 4090 run of PR #4766 that also gave CUBLAS_F16_PEAK_FRACTION: LLaMA 7B Q4_0 and Q8_0
    pp512 ran at 0.722 and 0.694 of F16's 11048.22 tok/s (7979.85 and 7664.00), which the pass reproduces within 5 %;
    MMQ's rate and expert tiles are off; decode is untouched."""
    batch = BatchShape(prefill_chunks=[(512, 0)], num_logits=1)
    f16 = engine(make_dep("rtx_4090", model="llama-2-7b", weight_dtype="fp16"))
    f16_s = cost_model(f16).step(batch).seconds
    for dtype, measured in (("q4_0", 7979.85), ("q8_0", 7664.00)):
        eng = engine(make_dep("rtx_4090", model="llama-2-7b", weight_dtype=dtype), cuda_force_cublas=True)
        assert eng.engine_gemm_flops_s() == f16.engine_gemm_flops_s()
        assert eng.dequantize_above_tokens() == 32
        cost = cost_model(eng)
        assert f16_s / cost.step(batch).seconds == pytest.approx(measured / 11048.22, rel=0.05), dtype
        mmq = cost_model(engine(make_dep("rtx_4090", model="llama-2-7b", weight_dtype=dtype)))
        one = BatchShape(num_decode=1, decode_context_tokens=512, num_logits=1)
        assert cost.step(one).seconds == pytest.approx(mmq.step(one).seconds)   # one token: no dequantization
        stored = cost.work.dense_weight_bytes   # read, and its F16 copy written
        assert cost.work.dequant_bytes(512.0) == pytest.approx(stored * (1 + 2 / WEIGHT_FORMATS[dtype].bytes_per_param))
        assert cost.work.dequant_bytes(32.0) == 0.0
    q4km = engine(make_dep("rtx_3090", model="qwen3-30b-a3b", weight_dtype="q4_k_m"), cuda_force_cublas=True)
    assert q4km.expert_tile_columns() is None
    # F16 weights and devices without the path (Metal) ignore the option
    assert engine(make_dep("rtx_4090", model="llama-2-7b", weight_dtype="fp16"),
                  cuda_force_cublas=True).dequantize_above_tokens() is None
    assert engine(make_dep("apple_m2_ultra", model="llama-2-7b", weight_dtype="q4_k_m"),
                  cuda_force_cublas=True).dequantize_above_tokens() is None


def test_layer_split_devices_pipeline_the_forwards_of_one_call():
    """Pipeline parallelism (PR #6017): with layers split over CUDA devices the ubatches of one llama_decode call
    follow each other through the devices' layer ranges, each after the first ending one stage (its time / pp)
    later; the next call starts after the last. A 2,048-token prompt on four RTX 4090s: 4 ubatches in (4 + 3) / 4
    of one ubatch's time each way round, not 4 x; the same on one device, or on Metal, steps them in turn."""
    eng = engine(make_dep("rtx_4090", model="llama-3-8b", weight_dtype="q4_k_m", pp=4), n_parallel=1)
    assert eng.pipelined
    eng.add_request(make_request(2048, 2), 0.0)
    shapes = []
    for _ in range(4):
        out, _ = run_step(eng)
        shapes.append(out.shape)
    assert [s.pipelined for s in shapes] == [False, True, True, True]
    cost = cost_model(eng)
    full = cost.step(dataclasses.replace(shapes[1], pipelined=False))
    follow = cost.step(shapes[1])
    assert follow.seconds == pytest.approx(full.seconds / 4)
    assert follow.compute_s + follow.memory_s + follow.comm_s + follow.overhead_s == pytest.approx(follow.seconds)
    out, _ = run_step(eng)   # the next iteration (the first decode) starts a new call
    assert not out.shape.pipelined
    assert not engine(make_dep("rtx_4090", model="llama-3-8b", weight_dtype="q4_k_m")).pipelined
    assert not engine(make_dep("apple_m2_ultra", model="llama-3-8b", weight_dtype="q4_k_m", pp=2)).pipelined


def test_without_flash_attention_the_scores_go_through_memory():
    """-fa off (llama-bench's default before PR #15434): QK and PV are cuBLAS GEMMs over every key the ubatch sees
    and the scores pass through memory (24 bytes a score on CUDA, 16 on Metal) in kernels of their own, so a long
    prompt slows down as published: LLaMA 7B F16 on an A100 80GB PCIe (PR #6017, a build without FlashAttention)
    keeps 0.758 of its pp512 rate at pp4096 and 0.590 at pp8192, and the simulator 0.757 and 0.593 (with
    FlashAttention priced: 0.833 and 0.700). Decode and the default (auto: on) keep the fused kernel."""
    def pp(eng, n):
        cost = cost_model(eng)
        return n / sum(cost.step(BatchShape(prefill_chunks=[(512, d)], num_logits=1)).seconds
                       for d in range(0, n, 512))
    dep = make_dep("a100_pcie", model="llama-2-7b", weight_dtype="fp16")
    off, on = engine(dep, flash_attn="off"), engine(dep)
    assert on.unfused_attention() is None and cost_model(on).work.unfused_attention is None
    u = off.unfused_attention()
    assert (u.score_bytes, u.kernels_per_layer) == (24.0, 6)
    assert off.timing.kernels_per_layer == on.timing.kernels_per_layer + 5
    assert engine(make_dep("apple_m2_ultra", model="llama-2-7b", weight_dtype="q4_0"),
                  flash_attn="off").unfused_attention().score_bytes == 16.0
    from simengine.engines.llamacpp_kernels import CUBLAS_F16_PEAK_FRACTION
    assert off.engine_attention_flops_s() == pytest.approx(CUBLAS_F16_PEAK_FRACTION * 312e12)
    base = pp(off, 512)
    assert pp(off, 4096) / base == pytest.approx(0.758, abs=0.02)
    assert pp(off, 8192) / base == pytest.approx(0.590, abs=0.02)
    assert pp(on, 4096) / pp(on, 512) > 0.8
    # the score passes are priced by the features calibration re-prices, too
    work = cost_model(off).work
    assert work.score_bytes(work.unfused_scores([(512, 512)])) == pytest.approx(
        512 * 1024 * 32 * 24.0 * 32)   # scores x heads x bytes x layers


def test_flash_attention_runs_at_its_own_rate_per_sm_cycle():
    """ggml-cuda's FlashAttention at FA_FLOPS_PER_SM_CYCLE x SMs x clock on an NVIDIA device of known SMs, not the
    FP16 peak: the RTX 3090 row it comes from (Llama-3-8B Q4_0 pp512 @ d32768, 1,470.93 tok/s in PR #17505) is
    reproduced, and a long context costs the GB10 several times what its FP16 peak would say."""
    rtx = engine(make_dep("rtx_3090", model="llama-3-8b", weight_dtype="q4_0"))
    assert rtx.engine_attention_flops_s() == pytest.approx(FA_FLOPS_PER_SM_CYCLE * 82 * 1.695e9)
    step = cost_model(rtx).step(BatchShape(prefill_chunks=[(512, 32768)], num_logits=1))
    assert 512 / step.seconds == pytest.approx(1470.93, rel=0.03)
    spark = engine(make_dep("dgx_spark_gb10", model="qwen2.5-coder-7b", weight_dtype="q8_0"))
    with_fa = cost_model(spark).step(BatchShape(prefill_chunks=[(2048, 32768)], num_logits=1)).seconds
    with mock.patch.object(type(spark), "engine_attention_flops_s", lambda self: None):
        at_peak = cost_model(spark).step(BatchShape(prefill_chunks=[(2048, 32768)], num_logits=1)).seconds
    assert with_fa > 1.5 * at_peak
    for hw in ("apple_m2_ultra", "b200"):   # no SM count and clock: the device's attention peak
        assert engine(make_dep(hw, model="llama-2-7b", weight_dtype="q4_0")).engine_attention_flops_s() is None


def test_mmq_pads_each_experts_tokens_to_whole_tiles():
    """MoE on MMQ: the tile width comes from the step's tokens (128 at 2,048) and each expert computes its tokens in
    whole tiles, so gpt-oss-120b (128 experts, top 4: ~64 tokens each) computes about twice its expert tokens and
    gpt-oss-20b (32 experts: 256 +- 16 each) about 2.5 tiles of 128 an expert; up to 8 tokens (MMVQ) nothing."""
    works = {}
    for model in ("gpt-oss-120b", "gpt-oss-20b"):
        eng = engine(make_dep("dgx_spark_gb10", model=model, weight_dtype="mxfp4"))
        assert eng.expert_tile_columns() == 128
        works[model] = cost_model(eng).work
    big, small = works["gpt-oss-120b"], works["gpt-oss-20b"]
    assert big.padded_expert_tokens(2048) == pytest.approx(128 * 128 - 2048 * 4, rel=0.01)
    assert small.padded_expert_tokens(2048) == pytest.approx(32 * 128 * 2.5 - 2048 * 4, rel=0.05)
    assert small.padded_expert_tokens(8) == 0.0
    # 100 tokens: one tile of 112 (from 48 on widths come in steps of 16), for each expert touched
    assert small.padded_expert_tokens(100) == pytest.approx(32 * 112 * (1 - (1 - 1 / 32) ** 400) - 400, rel=1e-6)
    # the vectorised view prices what the scalar one does
    tokens = np.array([1.0, 100.0, 2048.0])
    flops = small.linear(tokens)[0]
    assert flops == pytest.approx([small.linear(t)[0] for t in tokens])
    # dense models, other engines and devices without MMQ pad nothing
    assert engine(make_dep("dgx_spark_gb10", model="llama-2-7b", weight_dtype="q4_0")).expert_tile_columns() == 128
    assert cost_model(engine(make_dep("dgx_spark_gb10", model="llama-2-7b",
                                      weight_dtype="q4_0"))).work.expert_tile_columns is None
    assert engine(make_dep("apple_m2_ultra", model="qwen3-30b-a3b", weight_dtype="q4_0")).expert_tile_columns() is None


def _scenario(**deployment) -> Scenario:
    return from_dict(Scenario, {
        "name": "llamacpp-edge", "seed": 3, "horizon_s": 60.0, "drain_s": 600.0,
        "deployment": {"hardware": "apple_m2_ultra", "model": "llama-2-7b", "weight_dtype": "q4_0", **deployment},
        "workload": {"arrival": {"process": "poisson", "rate": 0.3},
                     "shared_prefix_tokens": 200,
                     "input_tokens": {"dist": "lognormal", "mean": 500, "sigma": 0.5, "max": 2000},
                     "output_tokens": {"dist": "lognormal", "mean": 120, "sigma": 0.5, "max": 400}},
        "engines": ["llamacpp"]}, source="test")


@pytest.mark.parametrize("deployment", [{}, {"hardware": "h100_sxm", "model": "llama-3.1-8b", "weight_dtype": "bf16"},
                                        {"hardware": "rtx_4090", "model": "llama-3-70b", "weight_dtype": "q4_k_m",
                                         "pp": 2}])
def test_end_to_end_conservation_and_invariants(deployment):
    sc = _scenario(**deployment)
    r = run_engine(sc, sc.engines[0], check_invariants=True)
    s = r.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 5
    assert s["completed"] > 0 and s["prefix_cache_hit_rate"] > 0
    assert (r.steps["prefill_tokens"] + r.steps["decode_tokens"] <= 512).all()
    assert (r.steps["num_running"] <= 4).all()


def test_apple_gpus_multiply_with_ggml_metal_kernels_not_the_mps_rate():
    """ggml-metal's kernel_mul_mm reaches 0.60 of the FP16 peak (PR #3084's M2 Ultra F16 pp512) for every weight
    format, below the 0.86 of Apple's MPS GEMM that the device's gemm_fraction holds: a compute-bound prefill slows
    by their ratio, and decode (the weight stream) does not change."""
    from simengine.engines.llamacpp_kernels import METAL_MUL_MM_PEAK_FRACTION
    for dtype in ("q4_0", "fp16", "q8_0"):
        eng = engine(make_dep("apple_m2_ultra", model="llama-2-7b", weight_dtype=dtype))
        assert eng.engine_gemm_flops_s() == pytest.approx(METAL_MUL_MM_PEAK_FRACTION * 27.2e12)
    eng = engine(make_dep("apple_m2_ultra", model="llama-2-7b", weight_dtype="q4_0"))
    with mock.patch.object(type(eng), "engine_gemm_flops_s", lambda self: None):
        mps = cost_model(eng)
    metal = cost_model(eng)
    prefill = BatchShape(prefill_chunks=[(512, 0)], num_logits=1)
    decode = BatchShape(num_decode=1, decode_context_tokens=600, num_logits=1, padded_decode=1)
    hw = eng.dep.hardware
    assert metal.step(prefill).compute_s / mps.step(prefill).compute_s > 0.9 * hw.gemm_fraction("fp16") / 0.60
    assert metal.step(decode).seconds == pytest.approx(mps.step(decode).seconds, rel=0.02)
