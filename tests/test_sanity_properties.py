"""Physical sanity properties every engine's predictions must keep, over models, devices and loads (hypothesis).

- batch-1 decode does not get slower from TP2 to TP8 on an NVLink node for a model whose weights dominate;
- more memory bandwidth never slows decode, more FLOP/s never slow prefill;
- a larger model is never faster on the same deployment;
- more KV memory never lowers throughput at saturation;
- FP8 weights are not slower than BF16 at batch 1 on a device with FP8 units;
- halving tensor parallelism at most doubles a decode step (each rank does at most twice the work, and less
  communication);
- a rank's batch-1 MoE kernels do not slow from TP4 to TP8 (its share of the weights halves);
- a batch-1 decode step streams its layers' weights no faster than the datasheet's DRAM bandwidth.
Step-level properties price the batch shapes the engine itself builds with the simulator's own step-time model
(measured kernels where the device has tables); the throughput property runs the simulator.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.batch import BatchShape
from simengine.engines import ENGINES
from simengine.errors import InputError
from simengine.sim.build import build_engine, cost_model
from simengine.validate.run import decode_shape, prefill_shapes
from tests.conftest import make_dep, make_scenario

ENGINE_NAMES = sorted(ENGINES.names())
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def engine_on(name: str, dep):
    """The engine on `dep`, or None where it refuses the deployment (vendor, memory, parallelism)."""
    try:
        return build_engine(EngineEntry(engine=name), dep)
    except InputError:
        return None


def decode_s(eng, batch: int = 1, context: int = 1024) -> float:
    return cost_model(eng).step(decode_shape(eng, batch, context)).seconds


def prefill_s(eng, tokens: int) -> float:
    return sum(cost_model(eng).step(s).seconds for s in prefill_shapes(eng, 1, tokens, 0, None))


@settings(max_examples=30, **SETTINGS)
@given(engine=st.sampled_from(ENGINE_NAMES), model=st.sampled_from(["llama-3.1-70b", "qwen2.5-72b", "llama-2-70b"]),
       hardware=st.sampled_from(["h100_sxm", "h200_sxm", "b200", "a100_80g_sxm", "mi300x"]),
       context=st.integers(16, 4096))
def test_batch1_decode_does_not_slow_from_tp2_to_tp8_on_nvlink(engine, model, hardware, context):
    dtype = "fp8" if hardware not in ("a100_80g_sxm",) and model != "llama-2-70b" else "bf16"
    tp2, tp8 = (engine_on(engine, make_dep(hardware, model, weight_dtype=dtype, tp=tp)) for tp in (2, 8))
    assume(tp2 is not None and tp8 is not None)
    assert decode_s(tp8, 1, context) <= decode_s(tp2, 1, context) * 1.0001


@settings(max_examples=30, **SETTINGS)
@given(engine=st.sampled_from(ENGINE_NAMES), model=st.sampled_from(["llama-3.1-8b", "qwen2.5-7b", "mixtral-8x7b"]),
       hardware=st.sampled_from(["l4", "mi300x", "apple_m2_ultra", "rtx_4090", "ascend_910b3", "h100_sxm"]),
       factor=st.floats(1.05, 4.0), batch=st.integers(1, 64), tokens=st.integers(64, 8192))
def test_more_bandwidth_never_slows_decode_and_more_flops_never_slow_prefill(engine, model, hardware, factor, batch,
                                                                             tokens):
    base = make_dep(hardware, model, weight_dtype="fp16" if hardware.startswith("apple") else "bf16")
    eng = engine_on(engine, base)
    assume(eng is not None)
    hw = base.hardware
    wider = engine_on(engine, dataclasses.replace(base, hardware=dataclasses.replace(
        hw, memory_bandwidth_bytes_s=hw.memory_bandwidth_bytes_s * factor)))
    faster = engine_on(engine, dataclasses.replace(base, hardware=dataclasses.replace(
        hw, peak_flops={k: v * factor for k, v in hw.peak_flops.items()})))
    assert decode_s(wider, batch) <= decode_s(eng, batch) * 1.0001
    assert prefill_s(faster, tokens) <= prefill_s(eng, tokens) * 1.0001


@settings(max_examples=30, **SETTINGS)
@given(engine=st.sampled_from(ENGINE_NAMES),
       pair=st.sampled_from([("llama-3.1-8b", "llama-3.1-70b"), ("qwen3-8b", "qwen3-32b"),
                             ("llama-2-7b", "llama-2-70b"), ("gpt-oss-20b", "gpt-oss-120b"),
                             ("gemma-2-9b", "gemma-2-27b")]),
       hardware=st.sampled_from(["h100_sxm", "h200_sxm", "mi300x", "b200"]), tp=st.sampled_from([4, 8]),
       batch=st.integers(1, 128), context=st.integers(16, 8192), tokens=st.integers(16, 8192))
def test_a_larger_model_is_never_faster_on_the_same_deployment(engine, pair, hardware, tp, batch, context, tokens):
    small, large = (engine_on(engine, make_dep(hardware, m, tp=tp)) for m in pair)
    assume(small is not None and large is not None)
    assert decode_s(large, batch, context) >= decode_s(small, batch, context) * 0.9999
    assert prefill_s(large, tokens) >= prefill_s(small, tokens) * 0.9999


@settings(max_examples=20, **SETTINGS)
@given(engine=st.sampled_from(ENGINE_NAMES), hardware=st.sampled_from(["h100_sxm", "h200_sxm", "b200", "l40s"]),
       model=st.sampled_from(["llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "qwen3-30b-a3b", "mixtral-8x7b"]),
       context=st.integers(16, 8192))
def test_fp8_weights_are_not_slower_than_bf16_at_batch_one(engine, hardware, model, context):
    """Dense and MoE models: the measured MoE tables time some FP8 expert kernels above BF16 ones of the same shape,
    which cost/measured.py's MoE curve does not let through."""
    tp = 4 if model in ("llama-3.1-70b", "mixtral-8x7b") else 1
    bf16 = engine_on(engine, make_dep(hardware, model, weight_dtype="bf16", tp=tp))
    fp8 = engine_on(engine, make_dep(hardware, model, weight_dtype="fp8", tp=tp))
    assume(bf16 is not None and fp8 is not None)
    assert decode_s(fp8, 1, context) <= decode_s(bf16, 1, context) * 1.0001


@settings(max_examples=30, **SETTINGS)
@given(engine=st.sampled_from(ENGINE_NAMES), hardware=st.sampled_from(["h100_sxm", "h200_sxm", "b200"]),
       model=st.sampled_from([("llama-4-scout-17b-16e", "fp8"), ("mixtral-8x7b", "bf16"), ("qwen3-30b-a3b", "fp8"),
                              ("llama-3.1-70b", "fp8"), ("qwen3-32b", "bf16")]),
       tp=st.sampled_from([1, 2, 4]), batch=st.sampled_from([1, 8, 64, 256]), context=st.integers(16, 4096))
@example(engine="trtllm", hardware="h100_sxm", model=("llama-4-scout-17b-16e", "fp8"), tp=2, batch=64, context=1024)
def test_halving_tensor_parallelism_at_most_doubles_a_decode_step(engine, hardware, model, tp, batch, context):
    """The measured MoE tables time some coarse expert slicings far above their finer ones (Llama-4 Scout at moe tp 2
    on H100: 5.9x its tp 4 at batch 64), which cost/measured.py's MoE curve does not let through."""
    name, dtype = model
    narrow, wide = (engine_on(engine, make_dep(hardware, name, weight_dtype=dtype, tp=t)) for t in (tp, 2 * tp))
    assume(narrow is not None and wide is not None)
    assert decode_s(narrow, batch, context) <= 2 * decode_s(wide, batch, context) * 1.0001


@settings(max_examples=20, **SETTINGS)
@given(engine=st.sampled_from(ENGINE_NAMES), hardware=st.sampled_from(["h100_sxm", "h200_sxm", "b200"]),
       model=st.sampled_from([("mixtral-8x22b", "bf16"), ("mixtral-8x22b", "fp8"), ("qwen3-235b-a22b", "fp8"),
                              ("llama-4-maverick-17b-128e", "fp8")]),
       context=st.integers(16, 4096))
@example(engine="trtllm", hardware="h200_sxm", model=("mixtral-8x22b", "bf16"), context=512)
def test_a_rank_s_batch1_moe_kernels_do_not_slow_from_tp4_to_tp8(engine, hardware, model, context):
    """Each rank's share of the weights halves from TP4 to TP8, so its kernels' time (communication and host aside:
    a latency-bound NCCL all-reduce at 8 ranks may cost more than the halved weights save) does not grow. The H200
    trtllm MoE table times Mixtral-8x22B's experts at moe tp 8 at 3x its moe tp 4 for one token, which made
    TensorRT-LLM's TP8 decode 2.3x its TP4 one until cost/measured.py bounded a finer slicing by the coarser."""
    name, dtype = model
    tp4, tp8 = (engine_on(engine, make_dep(hardware, name, weight_dtype=dtype, tp=t)) for t in (4, 8))
    assume(tp4 is not None and tp8 is not None)
    four, eight = (cost_model(e).step(decode_shape(e, 1, context)) for e in (tp4, tp8))
    assert eight.memory_s + eight.compute_s <= (four.memory_s + four.compute_s) * 1.0001


@settings(max_examples=20, **SETTINGS)
@given(engine=st.sampled_from(ENGINE_NAMES), hardware=st.sampled_from(["l40s", "rtx_pro_6000_blackwell", "h100_sxm",
                                                                         "b200", "a100_80g_sxm"]),
       model=st.sampled_from(["llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b"]), context=st.integers(16, 2048))
@example(engine="trtllm", hardware="l40s", model="llama-3.1-8b", context=16)
def test_a_batch1_decode_step_streams_its_weights_no_faster_than_the_datasheet_bandwidth(engine, hardware, model,
                                                                                         context):
    """Measured GEMM tables time a small GEMM with its weights in L2 (L40S: 1.27x DRAM at m = 1); a step streams
    every layer's weights from DRAM."""
    eng = engine_on(engine, make_dep(hardware, model))
    assume(eng is not None)
    layer_weights = cost_model(eng).work.stored_weight_bytes(1)   # the dense layers and the experts one token touches
    assert decode_s(eng, 1, context) >= 0.999 * layer_weights / eng.dep.hardware.memory_bandwidth_bytes_s


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_more_kv_memory_never_lowers_throughput_at_saturation(engine):
    """A saturated offline batch on an L4 (KV-bound for long contexts): twice the memory, at least the throughput."""
    def throughput(memory_scale: float) -> float:
        sc = make_scenario(deployment__hardware="l4", workload__arrival={"process": "offline"},
                           workload__num_requests=120, engines=[engine],
                           workload__input_tokens={"dist": "constant", "value": 2000},
                           workload__output_tokens={"dist": "constant", "value": 200})
        from simengine.sim import build as runner_mod
        real = runner_mod.load_hardware

        def bigger(name, **kw):
            hw = real(name, **kw)
            return dataclasses.replace(hw, memory_bytes=hw.memory_bytes * memory_scale)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runner_mod, "load_hardware", bigger)
            try:
                res = run_engine(sc, EngineEntry(engine=engine))
            except InputError:
                return float("nan")
        return res.summary["output_throughput"]

    small, large = throughput(1.0), throughput(2.0)
    if small != small:   # the engine refuses the small device; nothing to compare
        pytest.skip(f"{engine} does not run this model on an L4")
    assert large >= small * 0.99


def test_shapes_are_the_engines_own():
    """The helpers price what the engine builds (CUDA-graph padding included), not a hand-made shape."""
    eng = engine_on("vllm", make_dep())
    shape = decode_shape(eng, 3, 100)
    assert isinstance(shape, BatchShape) and shape.padded_decode == 4 and shape.cuda_graph
