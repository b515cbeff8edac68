"""The step-time model: the roofline checked by hand, the engine tail, measured kernels against their tables, and
repeated steps priced bit for bit as single steps."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.config.dtypes import WEIGHT_FORMATS
from simengine.config.model import load_model
from simengine.core.batch import BatchShape
from simengine.cost import step as step_module
from simengine.cost.measured import (
    GEMM_ELEMENT_BYTES,
    MOE_DISTRIBUTIONS,
    MeasuredKernels,
    MoeShape,
    _moe_split_curve,
    data_root,
    read_table,
    table_file,
)
from simengine.cost.roofline import DeviceTerms, RooflineKernels, price
from simengine.cost.step import CostModel
from simengine.cost.timing import EngineTiming
from simengine.cost.work import StepWork
from tests.conftest import make_dep

NO_OVERHEAD = EngineTiming(scheduler_cpu_s=0.0, output_cpu_s=0.0, overlap=False, kernel_launch_s=0.0,
                           graph_replay_s=0.0)
TERMS = dict(gemm_fractions={"default": 0.5, "fp8": 0.4}, memory_bandwidth_fraction=0.8, kernel_floor_s=2e-6,
             link_latency_s=10e-6, link_bandwidth_fraction=0.5, custom_allreduce_latency_s=None)
needs_tables = pytest.mark.skipif(data_root() is None, reason="aiconfigurator-core is not installed")


def work_of(dep, **terms):
    hw = dataclasses.replace(dep.hardware, **{**TERMS, **terms})
    return StepWork(dep.model, hw, weight_format=dep.weight_format, kv_elem_bytes=dep.kv_elem_bytes, tp=dep.tp,
                    pp=dep.pp, expert_parallel=dep.expert_parallel, attention_dp=dep.attention_dp)


def cost(dep, timing=NO_OVERHEAD, custom=False, **terms) -> CostModel:
    w = work_of(dep, **terms)
    return CostModel(RooflineKernels(w, DeviceTerms.of(w, w.hw, custom_allreduce=custom)), timing)


def test_one_decode_is_bound_by_reading_the_weights():
    dep = make_dep()
    hw = dep.hardware
    c = cost(dep).step(BatchShape(num_decode=1, decode_context_tokens=1000, num_logits=1, padded_decode=1))
    bw = hw.memory_bandwidth_bytes_s * 0.8
    # by hand: linear weights (32 layers x 218.1M params) + LM head (128256 x 4096), 2 bytes each
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    weights = (32 * per_layer + 128256 * 4096) * 2
    elementwise = 2 * 32 * (8 * 4096 + 3 * 14336 + 2 * (32 + 8) * 128) + 2 * 32 * 8 * 128 * 2   # + the KV write
    kv = 1000 * 2 * 8 * 128 * 2 * 32
    assert c.memory_s == pytest.approx((weights + elementwise + kv) / bw, rel=1e-9)
    assert c.compute_s == 0.0 and c.comm_s == 0.0
    kernels = 32 * 8 + 1 + 32   # GEMMs and elementwise per layer, the LM head, decode attention per layer
    assert c.overhead_s == pytest.approx(kernels * 2e-6, rel=1e-9)
    assert 5e-3 < c.seconds < 8e-3  # ~16 GB at ~2.7 TB/s


def test_large_prefill_is_compute_bound():
    dep = make_dep()
    hw = dep.hardware
    c = cost(dep).step(BatchShape(prefill_chunks=[(4096, 0)], num_logits=1))
    flops_s = hw.peak("bf16") * hw.sustained_compute_fraction * 0.5   # the peak a device holds under load
    assert hw.sustained_compute_fraction < 1.0
    linear = 4096 * 2 * dep.model.active_linear_params       # the LM head for one logit is memory-bound
    attn = 4096 * (0 + 4096 / 2) * 2 * 32 * (128 + 128) * 32
    assert c.compute_s == pytest.approx((linear + attn) / flops_s, rel=1e-9)


def test_crossover_near_peak_over_bandwidth():
    cm = cost(make_dep())
    small = cm.step(BatchShape(num_decode=64, decode_context_tokens=64, num_logits=64, padded_decode=64))
    big = cm.step(BatchShape(num_decode=1024, decode_context_tokens=1024, num_logits=1024, padded_decode=1024))
    assert small.compute_s == 0 and big.compute_s > 0


@pytest.mark.parametrize("custom", [False, True])
def test_tp2_halves_weights_per_device_and_adds_allreduce(custom):
    one, two = make_dep(), make_dep(tp=2)
    shape = BatchShape(num_decode=8, decode_context_tokens=8000, num_logits=8, padded_decode=8)
    c2 = cost(two, custom=custom, custom_allreduce_latency_s=4e-6).step(shape)
    lat = 4e-6 if custom else 10e-6
    per_call = lat + 2 * (2 - 1) / 2 * 8 * 4096 * 2 / (two.hardware.link_bandwidth_bytes_s * 0.5)
    assert c2.comm_s == pytest.approx(2 * 32 * per_call, rel=1e-9)
    w1, w2 = work_of(one), work_of(two)
    assert w2.dense_weight_bytes == pytest.approx(w1.dense_weight_bytes / 2)


def test_moe_reads_more_experts_as_the_batch_grows():
    w = work_of(make_dep(hardware="h200_sxm", model="mixtral-8x7b"))
    assert w.experts_touched(1) == pytest.approx(2.0)
    assert 7.9 < w.experts_touched(64) <= 8.0


def test_overheads_sync_vs_overlap_and_eager_launches():
    dep = make_dep()
    shape = BatchShape(num_decode=1, decode_context_tokens=100, num_logits=1, padded_decode=1)
    gpu = cost(dep).step(shape).seconds
    sync = EngineTiming(scheduler_cpu_s=2e-3, output_cpu_s=1e-3, overlap=False, kernel_launch_s=0.0)
    over = EngineTiming(scheduler_cpu_s=2e-3, output_cpu_s=1e-3, overlap=True, kernel_launch_s=0.0)
    assert cost(dep, sync).step(shape).seconds == pytest.approx(gpu + 3e-3)
    assert cost(dep, over).step(shape).seconds == pytest.approx(gpu)  # hidden behind a ~6 ms GPU step
    eager = EngineTiming(scheduler_cpu_s=0, output_cpu_s=0, overlap=True, kernel_launch_s=50e-6)
    assert cost(dep, eager).step(shape).seconds == pytest.approx(max(gpu, 50e-6 * 12 * 32))
    graph = dataclasses.replace(shape, cuda_graph=True)
    assert cost(dep, dataclasses.replace(eager, graph_replay_s=20e-6)).step(graph).seconds == pytest.approx(gpu + 2e-5)


def test_fp8_weights_use_the_fp8_peak_and_fraction_and_keep_a_16_bit_lm_head():
    from simengine.errors import InputError
    dep8 = make_dep(weight_dtype="fp8")
    w = work_of(dep8)
    assert (w.compute_dtype, w.lm_head_dtype) == ("fp8", "bf16")
    t = DeviceTerms.of(w, w.hw, custom_allreduce=False)
    assert (t.g_linear, t.g_lm_head, t.g_attn) == (0.4, 0.5, 0.5)
    big = BatchShape(prefill_chunks=[(8192, 0)], num_logits=1)
    assert cost(dep8).step(big).seconds < cost(make_dep()).step(big).seconds
    assert w.lm_head_bytes == dep8.model.lm_head_params * 2.0
    with pytest.raises(InputError, match="fp8 tensor cores"):
        work_of(make_dep(hardware="a100_80g_sxm", weight_dtype="fp8"))


def test_expert_parallel_under_tensor_parallel_attention_keeps_the_allreduces():
    """Every rank holds every token after attention's all-reduce, computes its own experts' tokens, and the MoE
    layer's all-reduce sums the parts: the same two all-reduces a layer as tensor parallelism, no all-to-all."""
    tp4 = make_dep(hardware="h200_sxm", model="mixtral-8x7b", tp=4)
    ep4 = dataclasses.replace(tp4, expert_parallel=True)
    shape = BatchShape(num_decode=64, decode_context_tokens=64000, num_logits=64, padded_decode=64)
    c_tp, c_ep = cost(tp4).step(shape), cost(ep4).step(shape)
    hw = tp4.hardware
    ar = 10e-6 + 2 * 3 / 4 * 64 * 4096 * 2 / (hw.link_bandwidth_bytes_s * 0.5)
    assert c_tp.comm_s == pytest.approx(64 * ar)
    assert c_ep.comm_s == pytest.approx(c_tp.comm_s)


def kernel_models(hardware, model, tp, weight_dtype="bf16", kv=2.0, backend="trtllm", timing=NO_OVERHEAD):
    dep = make_dep(hardware, model, weight_dtype=weight_dtype, kv_dtype="fp8" if kv == 1.0 else "bf16", tp=tp)
    w = StepWork(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=kv, tp=tp)
    t = DeviceTerms.of(w, dep.hardware, custom_allreduce=True)
    out = [CostModel(RooflineKernels(w, t), timing)]
    if data_root() is not None and dep.hardware.kernel_tables:
        out.append(CostModel(MeasuredKernels(w, t, system=dep.hardware.kernel_tables, backend=backend,
                                             custom_allreduce=True), timing))
    return out


@pytest.mark.parametrize("measured", [False, True])
def test_sustained_fraction_slows_compute_bound_work_only(measured):
    """A device's sustained compute fraction (the power-capped clock under continuous load over the burst clock
    tables are timed at) divides compute-bound seconds and leaves memory-bound decode alone."""
    if measured and data_root() is None:
        pytest.skip("aiconfigurator-core is not installed")
    dep = make_dep("h100_sxm", "llama-3.1-8b")
    steps = (BatchShape(prefill_chunks=[(4096, 0)], num_logits=1),
             BatchShape(num_decode=8, decode_context_tokens=8 * 500, num_logits=8, padded_decode=8))

    def priced(fraction):
        hw = dataclasses.replace(dep.hardware, sustained_compute_fraction=fraction)
        w = StepWork(dep.model, hw, weight_format=dep.weight_format, kv_elem_bytes=dep.kv_elem_bytes, tp=1)
        t = DeviceTerms.of(w, hw, custom_allreduce=True)
        k = (MeasuredKernels(w, t, system="h100_sxm", backend="vllm", custom_allreduce=True) if measured
             else RooflineKernels(w, t))
        return [CostModel(k, NO_OVERHEAD).step(s) for s in steps]

    (pre1, dec1), (pre2, dec2) = priced(1.0), priced(0.8)
    assert pre1.compute_s > 0.8 * pre1.seconds
    assert pre2.compute_s == pytest.approx(pre1.compute_s / 0.8, rel=1e-9)
    assert pre2.memory_s == pytest.approx(pre1.memory_s, rel=1e-12)
    assert dec1.compute_s == 0.0 and dec2.seconds == pytest.approx(dec1.seconds, rel=1e-12)


@pytest.mark.parametrize("measured", [False, True])
def test_decode_kv_rereads_add_a_pass_over_the_cache_at_the_memory_fraction(measured):
    """A decode kernel that reads each KV head's cache twice a step (StepWork.decode_kv_reads: TurboMind before 0.3
    on a group of 8) pays one more pass over the decodes' KV at the device's memory fraction, in the step and in
    the features calibration re-prices alike; the tables, which time a kernel reading it once, keep their time."""
    if measured and data_root() is None:
        pytest.skip("aiconfigurator-core is not installed")
    dep = make_dep("h100_sxm", "llama-3.1-8b")

    def kernels(reads):
        w = StepWork(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=dep.kv_elem_bytes,
                     decode_kv_reads=reads)
        t = DeviceTerms.of(w, dep.hardware, custom_allreduce=True)
        return (MeasuredKernels(w, t, system="h100_sxm", backend="vllm", custom_allreduce=True) if measured
                else RooflineKernels(w, t))

    once, twice = kernels(1.0), kernels(2.0)
    n, ctx = 32, 32 * 2000.0
    one_pass_s = once.work.decode_attention(n, ctx)[1] / once.bandwidth / once.terms.memory_fraction
    assert twice.work.decode_attention(n, ctx)[1] == 2 * once.work.decode_attention(n, ctx)[1]
    assert twice.decode(n, ctx)[0] == pytest.approx(once.decode(n, ctx)[0] + one_pass_s, rel=1e-12)
    assert twice.decode(n, ctx)[3] == once.decode(n, ctx)[3]      # the measured share is the tables' own
    for k in (once, twice):
        f = k.attention_features([[]], np.array([float(n)]), np.array([ctx]))
        assert price(f, k.terms)[0][0] == pytest.approx(k.decode(n, ctx)[0], rel=1e-12)
    prefill = [(512, 0)]
    assert twice.prefill(prefill) == once.prefill(prefill)


@needs_tables
def test_measured_gemms_and_attention_are_the_tables_values_at_measured_points():
    """A measured point is its table value, less where a larger problem was timed faster (curves are made
    non-decreasing: a smaller problem could run padded)."""
    (_, m) = kernel_models("h100_sxm", "llama-3.1-8b", 1)
    k = m.kernels
    gemm = read_table(table_file("h100_sxm", "gemm", "trtllm", "gemm_perf.parquet"))
    site = gemm[(gemm.gemm_dtype == "bfloat16") & (gemm.n == 4096) & (gemm.k == 4096)]
    qkv_like = k.gemm.latency("bfloat16", 4096, 4096, np.array([64.0]))[0]
    assert qkv_like == pytest.approx(site[site.m >= 64].latency.min() * 1e-3, rel=1e-12)
    gen = read_table(table_file("h100_sxm", "attention", "trtllm", "generation_attention_perf.parquet"))
    cell = gen[(gen.batch_size == 64) & (gen.num_heads == 32) & (gen.num_key_value_heads == 8) & (gen.head_dim == 128)
               & (gen.kv_cache_dtype == "bfloat16") & (gen.window_size == 0) & (gen.isl + gen.step == 1024)]
    sec = k.decode(64, 64 * 1024)[0]
    assert cell.latency.iloc[0] * 1e-3 * 32 * 0.95 <= sec <= cell.latency.iloc[0] * 1e-3 * 32 * (1 + 1e-9)
    assert not k.fallbacks and "measured kernels (h100_sxm, trtllm)" == k.describe()


@needs_tables
@pytest.mark.parametrize("model", ["mixtral-8x7b", "llama-4-scout-17b-16e", "qwen3-30b-a3b"])
def test_measured_moe_gemms_take_off_only_the_kernel_floors_the_roofline_counted(model):
    """Every op the tables time replaces its own roofline kernels: what is left are the four elementwise kernels a
    layer (router and shared-expert GEMMs included in the count)."""
    (_, m) = kernel_models("h100_sxm", model, 2)
    k, layers = m.kernels, m.kernels.work.model.num_layers
    assert not any(name in k.fallbacks for name in ("gemm", "moe"))
    floors = k.token_features(np.array([1.0, 64.0, 4096.0]))["floors"]
    assert np.all(floors == 4 * layers)


@needs_tables
@pytest.mark.parametrize("backend", ["vllm", "trtllm"])
def test_mla_is_priced_by_the_backends_module_tables_at_the_ranks_heads(backend):
    """DeepSeek's latent attention: a decode step's MLA is the module table's cell (16 heads a rank at TP8, the
    block-scaled FP8 projections, the faster kernel) times the layers, and the projections leave the GEMMs."""
    (roof, m) = kernel_models("h200_sxm", "deepseek-v3", 8, weight_dtype="fp8", backend=backend)
    k = m.kernels
    assert not {"mla", "attn_decode", "qkv, attn_out", "moe"} & set(k.fallbacks), k.describe()
    gen = read_table(table_file("h200_sxm", "mla", backend, "mla_generation_module_perf.parquet"))
    cell = gen[(gen.num_heads == 16) & (gen.batch_size == 4) & (gen.step == 512) & (gen.gemm_type == "fp8_block")
               & (gen.kv_cache_dtype == "bfloat16")].latency.min() * 1e-3
    layers = k.work.model.num_layers
    sec = k.decode(4, 4 * 512)[0]
    assert cell * layers * 0.9 <= sec <= cell * layers * (1 + 1e-9)   # (made non-decreasing in batch and length)
    # the projections' roofline left the token features: fewer linear bytes than the roofline reads
    tok = np.array([4.0])
    assert k.token_features(tok)["lin_m"][0] + 1e-12 < roof.kernels.token_features(tok)["lin_m"][0]
    # a prefill after a cached prefix costs more than the same new tokens alone (its pairs with the cached keys)
    assert k.prefill([(2048, 8192)])[0] > k.prefill([(2048, 0)])[0] > 0


@needs_tables
def test_an_mla_model_without_module_tables_keeps_the_roofline_and_says_why():
    (_, m) = kernel_models("h200_sxm", "deepseek-v3", 8, weight_dtype="fp8", kv=2.0, backend="vllm")
    assert "mla" not in m.kernels.fallbacks
    (_, a100) = kernel_models("a100_80g_sxm", "deepseek-v3", 8, weight_dtype="bf16", backend="vllm")
    assert a100.kernels.mla_decode is None and {"mla", "attn_decode"} <= set(a100.kernels.fallbacks)


@needs_tables
def test_fp8_experts_fall_back_to_the_block_scaled_rows_where_the_per_tensor_ones_lack_the_shape():
    """DeepSeek's experts (7168 x 2048, top-8 of 256) have only block-scaled FP8 rows in the vLLM tables; SGLang's
    tables have no per-tensor FP8 MoE rows at all: both are priced from the block-scaled ones, not the roofline."""
    for model, backend in (("deepseek-v3", "vllm"), ("deepseek-v3", "sglang")):
        (_, m) = kernel_models("h200_sxm", model, 8, weight_dtype="fp8", backend=backend)
        assert m.kernels.moe_curve is not None and "moe" not in m.kernels.fallbacks, (model, m.describe())


@needs_tables
def test_an_unmeasured_expert_shape_is_priced_from_near_shapes_and_they_predict_held_out_ones():
    """Leave one expert shape out of a table: the near shapes' utilisation at the same tokens per expert predicts its
    measured times far better than the roofline does (every shape of SGLang's A100 table, both dtypes)."""
    (_, m) = kernel_models("a100_80g_sxm", "qwen3-30b-a3b", 1, backend="sglang")
    k = m.kernels
    df = read_table(table_file("a100_sxm", "moe", "sglang", "moe_perf.parquet"))
    df = df[(df.moe_ep_size == 1) & df.distribution.isin(MOE_DISTRIBUTIONS)]
    errors = []
    for dtype in ("bfloat16", "int4_wo"):
        rows = df[df.moe_dtype == dtype]
        for key in rows[["hidden_size", "inter_size", "topk", "num_experts"]].drop_duplicates().itertuples(index=False):
            shape = MoeShape(*map(int, key))
            sel = rows[(rows.hidden_size == shape.hidden) & (rows.inter_size == shape.inter)
                       & (rows.topk == shape.topk) & (rows.num_experts == shape.experts)]
            near = k._moe_near(df, shape, dtype, 1, GEMM_ELEMENT_BYTES[dtype])   # excludes the shape itself
            assert near is not None, shape
            measured = _moe_split_curve(sel, dtype, 1)
            tokens = np.array([1.0, 16.0, 128.0, 1024.0, 8192.0])
            errors += list(np.interp(tokens, *near) / np.interp(tokens, *measured) - 1)
    assert len(errors) >= 80 and np.median(np.abs(errors)) < 0.1


@needs_tables
def test_gpt_oss_experts_on_ampere_are_marlin_w4a16_from_the_nearest_backend():
    """vLLM and SGLang run gpt-oss's MXFP4 experts on an A100 through the Marlin MoE kernel (4-bit weights, 16-bit
    math): vLLM's tables time only bf16 experts there, SGLang's time Marlin's W4A16 ones, at other shapes."""
    for backend in ("vllm", "sglang"):
        (roof, m) = kernel_models("a100_80g_sxm", "gpt-oss-120b", 1, weight_dtype="mxfp4", backend=backend)
        k = m.kernels
        assert k.moe_curve is not None and "moe" not in k.fallbacks, k.describe()
        assert "near shapes for moe (experts 2880x2880" in k.describe()
        assert ("moe from sglang's tables" in k.describe()) == (backend == "vllm")
        # Marlin's measured utilisation at a large prefill is well below the roofline's
        prefill = BatchShape(prefill_chunks=[(8192, 0)], num_logits=1)
        assert m.step(prefill).seconds > 1.3 * roof.step(prefill).seconds
    (_, h100) = kernel_models("h100_sxm", "gpt-oss-120b", 1, weight_dtype="mxfp4", backend="vllm")
    assert not h100.kernels.near_shapes and "moe" not in h100.kernels.borrowed   # measured as it is on Hopper
    # every linear op is measured there: none of the roofline's weight bytes is left, the BF16 attention included
    features = h100.kernels.token_features(np.array([1.0, 64.0, 4096.0]))
    assert np.all(np.abs(features["lin_m"]) < 1e-12) and np.all(np.abs(features["lin_c"]) < 1e-12)


@needs_tables
def test_fp8_experts_on_ampere_carry_the_4_bit_marlin_utilisation_to_8_bit_weights():
    """FP8 experts on an A100 run as W8A16 Marlin, which the tables time only with 4-bit weights: even the model's
    own timed shape is a neighbour, its utilisation carried to one byte a weight, so a token's experts take longer
    than the 4-bit table's and no more than twice (the bytes double, the math does not)."""
    from simengine.engines.vllm_config import fp8_weight_only

    dep = fp8_weight_only(make_dep("a100_80g_sxm", "qwen3-235b-a22b", weight_dtype="fp8", tp=2))
    w = StepWork(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=2.0, tp=2)
    k = MeasuredKernels(w, DeviceTerms.of(w, dep.hardware, custom_allreduce=True), system="a100_sxm", backend="vllm",
                        custom_allreduce=True)
    assert "from 4096x1536" in k.near_shapes["moe"] and k.borrowed["moe"] == "sglang"
    df = read_table(table_file("a100_sxm", "moe", "sglang", "moe_perf.parquet"))
    own = df[(df.hidden_size == 4096) & (df.inter_size == 1536) & (df.topk == 8) & (df.num_experts == 128)
             & (df.moe_ep_size == 1) & df.distribution.isin(MOE_DISTRIBUTIONS)]
    four_bit = np.interp(1.0, *_moe_split_curve(own, "int4_wo", 2))
    assert four_bit < np.interp(1.0, *k.moe_curve) <= 2 * four_bit
    ep = StepWork(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=2.0, tp=2,
                  expert_parallel=True)   # what EP rows time differs between collectors: no neighbours there
    assert MeasuredKernels(ep, k.terms, system="a100_sxm", backend="vllm", custom_allreduce=True).moe_curve is None


def test_attention_grid_of_roots_grows_time_in_proportion_beyond_the_largest_batch():
    from simengine.cost.measured import AttentionGrid
    b, s = np.array([1.0, 2.0, 4.0]), np.array([128.0, 256.0])
    seconds = np.outer(b, s) * 1e-6                        # time linear in the batch and the length
    grid = AttentionGrid(b, s, np.sqrt(seconds), lambda bb, ss: np.sqrt(bb * ss * 1e-7), root=2)
    assert np.asarray(grid.row(16)) ** 2 == pytest.approx(4 * seconds[-1], rel=1e-12)
    plain = AttentionGrid(b, s, seconds.copy(), lambda bb, ss: bb * ss * 1e-7)
    assert np.asarray(plain.row(16)) == pytest.approx(4 * seconds[-1], rel=1e-12)


@needs_tables
def test_measured_kernels_fall_back_to_the_roofline_where_tables_miss_and_say_so():
    (_, m) = kernel_models("a100_80g_sxm", "llama-3.1-8b", 1, backend="trtllm", kv=1.0)
    assert "attn_decode" in m.kernels.fallbacks and "roofline for" in m.describe()
    step = m.step(BatchShape(num_decode=8, decode_context_tokens=8000, num_logits=8, padded_decode=8))
    assert 0 < step.measured_s < step.seconds      # the GEMMs measured, the fp8-KV attention by the roofline


@needs_tables
def test_fp8_static_scales_take_the_activation_quantisation_off_the_measured_gemm():
    (_, m) = kernel_models("h100_sxm", "llama-3.1-70b", 4, weight_dtype="fp8")
    k = m.kernels
    raw = k.gemm.latency("fp8", 8192, 2048, np.array([1.0]))[0]
    static = k._gemm_s(("attn_out", 8192, 2048, 80, "fp8"), np.array([1.0]))[0]
    assert static < raw


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from([("h100_sxm", "llama-3.1-8b", 1), ("h100_sxm", "gpt-oss-20b", 1),
                             ("h200_sxm", "mixtral-8x7b", 2), ("l4", "qwen2.5-7b", 1), ("mi300x", "llama-3.1-8b", 2),
                             ("a100_80g_sxm", "llama-2-70b", 4), ("h200_sxm", "deepseek-v3", 8)]),
       measured=st.booleans(), overlap=st.booleans(), graph=st.booleans(), compiled=st.booleans(),
       num_decode=st.integers(1, 300),
       pad=st.integers(0, 8), structured=st.integers(0, 3), context=st.integers(0, 2_000_000),
       growth=st.integers(1, 300), repeats=st.integers(1, 40), host_s=st.sampled_from([1e-4, 2e-3, 5e-2]))
def test_decode_steps_price_each_repeat_as_step_does_bit_for_bit(case, measured, overlap, graph, compiled, num_decode,
                                                                 pad, structured, context, growth, repeats, host_s):
    """The repeated-step pricing (one numpy pass) gives step()'s floats exactly, for dense, MoE and sliding-window
    models, roofline and measured kernels, with communication, graphs (compiled or not), eager launches and host
    time."""
    timing = EngineTiming(scheduler_cpu_s=host_s, output_cpu_s=4e-4, overlap=overlap, kernel_launch_s=5e-6,
                          seq_cpu_s=2e-6, compiled_max_bs=32 * compiled)
    models = kernel_models(*case, backend="vllm", timing=timing)
    c = models[-1] if measured else models[0]
    c.grammar_mask_s = 3e-5
    shape = BatchShape(num_decode=num_decode, decode_context_tokens=context, num_logits=num_decode,
                       padded_decode=num_decode + pad, cuda_graph=graph, num_structured=min(structured, num_decode))
    contexts = context + growth * np.arange(1, repeats + 1)
    rows = c.decode_steps(shape, contexts)
    for ctx, row in zip(contexts.tolist(), rows.tolist()):
        assert tuple(row) == tuple(c.step(dataclasses.replace(shape, decode_context_tokens=ctx)))


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from([("h100_sxm", "llama-3.1-8b", 1), ("h200_sxm", "mixtral-8x7b", 2),
                             ("l4", "gemma-2-9b", 1)]),
       measured=st.booleans(), graph=st.booleans(),
       runs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 70_000), st.integers(1, 60)), min_size=1,
                     max_size=12))
def test_decode_runs_from_tables_are_decode_steps_bit_for_bit(case, measured, graph, runs):
    """`decode_run` (a shape's rows kept by context, grown as later runs read further, and priced run by run past the
    table bound or once every table is taken) returns `decode_steps`'s rows for the run's contexts exactly."""
    timing = EngineTiming(scheduler_cpu_s=2e-4, output_cpu_s=1e-4, overlap=False, kernel_launch_s=5e-6,
                          seq_cpu_s=2e-6)
    models = kernel_models(*case, backend="vllm", timing=timing)
    c = models[-1] if measured else models[0]
    for num_decode, context, steps in runs:
        shape = BatchShape(num_decode=num_decode, decode_context_tokens=context, num_logits=num_decode,
                           padded_decode=num_decode, cuda_graph=graph)
        contexts = context + num_decode * np.arange(1, steps + 1)
        assert c.decode_run(shape, num_decode, steps).tolist() == c.decode_steps(shape, contexts).tolist()
    assert len(c._decode_tables) <= step_module.DECODE_TABLES
    assert all(len(t) <= step_module.DECODE_TABLE_CONTEXTS for t in c._decode_tables.values())


def test_weight_formats_know_their_lm_head_bytes():
    assert WEIGHT_FORMATS["q4_0"].lm_head_bytes_per_param == 210 / 256
    assert WEIGHT_FORMATS["q4_k_m"].lm_head_bytes_per_param == 210 / 256
    assert WEIGHT_FORMATS["bf16"].lm_head_bytes_per_param == 2.0


@pytest.mark.parametrize("model, gib", [("llama-3-8b", 4.58), ("llama-3-70b", 39.59), ("llama-2-7b", 3.80)])
def test_q4_k_m_files_weigh_what_llama_bench_prints(model, gib):
    """Q4_K_M's layer average, q6_K output and q4_K token embedding add up to the GGUF sizes llama-bench prints
    (XiongjieDai/GPU-Benchmarks-on-LLM-Inference for Llama 3, ggml-org/llama.cpp PR #3776 for Llama 2)."""
    m = load_model(model)
    fmt = WEIGHT_FORMATS["q4_k_m"]
    total = m.dense_linear_params * fmt.bytes_per_param + m.lm_head_params * (fmt.lm_head_bytes_per_param + 144 / 256)
    assert total / 2**30 == pytest.approx(gib, rel=0.01)


def test_a_local_profile_is_read_as_measured_tables_for_any_engine(tmp_path, monkeypatch):
    """`simengine profile` writes kernels/<system>/ in the package's columns; a device that names it is priced from
    it, whatever the engine's backend (the nearest measured one: the local torch profile)."""
    from simengine.cost import measured
    from simengine.validate.profile import gemm_shapes, write_tables

    monkeypatch.setattr(measured, "LOCAL_ROOT", tmp_path)
    measured.systems.cache_clear()
    dep = make_dep()
    gemm = [("bfloat16", m, n, k, 0.001 * m + 0.01) for n, k in set(gemm_shapes(dep.model, 1).values())
            for m in (1, 64, 4096)]
    decode = [(b, 1, 32, 8, 128, 0, "bfloat16", "bfloat16", s - 1, 0.002 * b + 1e-5 * s)
              for b in (1, 8, 64) for s in (64, 1024, 8192)]
    prefill = [(b, s, 32, 8, 128, 0, "bfloat16", "bfloat16", 0, 1e-6 * b * s * s / 1024) for b in (1, 4)
               for s in (128, 1024)]
    write_tables(tmp_path, "mygpu", "2.9.0", gemm, decode, prefill, {"device": "test"})
    try:
        assert "mygpu" in measured.systems() and measured.backend_for("mygpu", "vllm") == "torch"
        hw = dataclasses.replace(dep.hardware, kernel_tables="mygpu")
        w = StepWork(dep.model, hw, weight_format=dep.weight_format, kv_elem_bytes=2.0)
        k = MeasuredKernels(w, DeviceTerms.of(w, hw, custom_allreduce=False), system="mygpu", backend="vllm",
                            custom_allreduce=False)
        assert k.backend == "torch" and not {"gemm", "attn_decode", "attn_prefill"} & set(k.fallbacks)
        n, kk = gemm_shapes(dep.model, 1)["mlp_up"]
        assert k.gemm.latency("bfloat16", n, kk, np.array([64.0]))[0] == pytest.approx((0.001 * 64 + 0.01) * 1e-3)
        assert k.decode(8, 8 * 1024)[0] == pytest.approx((0.002 * 8 + 1e-5 * 1024) * 1e-3 * 32)
    finally:
        measured.systems.cache_clear()


def test_profile_writes_tables_the_measured_model_reads(tmp_path):
    pytest.importorskip("torch")
    from simengine.validate.profile import profile_command

    text = profile_command("llama-3.1-8b", out=str(tmp_path), device="cpu", dtype="bf16", tp=8, quick=True)
    system = text.rsplit("kernel_tables: ", 1)[1]
    gemm = read_table(next(tmp_path.glob(f"{system}/gemm/torch/*/gemm_perf.csv")))
    assert {"gemm_dtype", "m", "n", "k", "latency"} <= set(gemm.columns) and (gemm.latency > 0).all()


def test_bad_profile_arguments_are_input_errors():
    from simengine.errors import InputError
    from simengine.validate.profile import profile_command

    with pytest.raises(InputError, match="--dtype"):
        profile_command("llama-3.1-8b", out=None, device="cpu", dtype="int3", tp=1, quick=True)
    with pytest.raises(InputError, match="--tp"):
        profile_command("llama-3.1-8b", out=None, device="cpu", dtype="bf16", tp=0, quick=True)


def test_the_disk_cache_builds_once_reads_back_the_same_arrays_and_survives_a_bad_entry(tmp_path, monkeypatch):
    from simengine.cost import measured
    monkeypatch.setenv("SIMENGINE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "table.csv"
    source.write_text("m,latency\n1,0.5\n")
    builds = []

    def build():
        builds.append(1)
        return {"x": np.array([0.1, 1 / 3]), "names": np.array(["a", "bb"])}
    first = measured.cached_arrays("t", source, (1, "k"), build)
    again = measured.cached_arrays("t", source, (1, "k"), build)
    assert len(builds) == 1 and again["x"].tobytes() == first["x"].tobytes() and again["names"].tolist() == ["a", "bb"]
    measured.cached_arrays("t", source, (2, "k"), build)          # another key: built
    assert len(builds) == 2
    for p in (tmp_path / "cache" / "kernels").iterdir():
        p.write_bytes(b"not a zip")                              # a damaged entry: built again and rewritten
    assert measured.cached_arrays("t", source, (1, "k"), build)["x"].tolist() == [0.1, 1 / 3] and len(builds) == 3
    assert measured.cached_arrays("t", source, (1, "k"), build) and len(builds) == 3
    source.write_text("m,latency\n1,0.5\n2,0.7\n")                # the table changed: a new entry
    measured.cached_arrays("t", source, (1, "k"), build)
    assert len(builds) == 4
    assert not any(p.name.endswith(".tmp.npz") for p in (tmp_path / "cache" / "kernels").iterdir())


def test_the_disk_cache_is_off_with_an_empty_directory_and_quiet_when_it_cannot_write(tmp_path, monkeypatch):
    from simengine.cost import measured
    source = tmp_path / "table.csv"
    source.write_text("m\n1\n")
    monkeypatch.setenv("SIMENGINE_CACHE_DIR", "")
    assert measured.cached_arrays("t", source, (), lambda: {"x": np.ones(2)})["x"].tolist() == [1.0, 1.0]
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SIMENGINE_CACHE_DIR", str(blocker))       # not a directory: nothing can be written there
    assert measured.cached_arrays("t", source, (), lambda: {"x": np.zeros(1)})["x"].tolist() == [0.0]


@needs_tables
def test_measured_kernels_price_the_same_from_a_cold_and_a_warm_cache(tmp_path, monkeypatch):
    from simengine.cost import measured
    shapes = [BatchShape(num_decode=b, decode_context_tokens=b * c, num_logits=b, padded_decode=b)
              for b, c in ((1, 100), (37, 2500), (256, 900))] + \
             [BatchShape(prefill_chunks=[(n, p)], num_logits=1) for n, p in ((17, 0), (2048, 512), (8192, 0))]

    def priced():
        measured.gemm_sites.cache_clear()
        return [m.step(s) for m in kernel_models("h100_sxm", "llama-3.1-70b", 4, weight_dtype="fp8")[1:]
                for s in shapes]
    monkeypatch.setenv("SIMENGINE_CACHE_DIR", "")
    off = priced()
    monkeypatch.setenv("SIMENGINE_CACHE_DIR", str(tmp_path))
    cold, warm = priced(), priced()
    assert off == cold == warm and len(off) == len(shapes)
    assert {p.name.split("-")[0] for p in (tmp_path / "kernels").iterdir()} == {"gemm", "attention"}


@pytest.mark.skipif(data_root() is None, reason="aiconfigurator-core tables not installed")
def test_a_device_whose_tables_time_their_host_prices_all_reduce_from_its_link():
    """`kernel_tables_comm: false` (l40s: the collecting host's all-reduce reached 1.45 GB/s at 8 GPUs): GEMMs and
    attention still come from the tables, the all-reduce from the interconnect terms, as the roofline prices it, and
    the step says so; with the tables' times it would cost several times more."""
    dep = make_dep(hardware="l40s", model="llama-3.1-70b", weight_dtype="fp8", tp=8)
    assert not dep.hardware.kernel_tables_comm
    tokens = np.array([1.0, 512.0, 8192.0])

    def features(hw):
        w = StepWork(dep.model, hw, weight_format=dep.weight_format, kv_elem_bytes=1.0, tp=8)
        terms = DeviceTerms.of(w, hw, custom_allreduce=False)
        k = MeasuredKernels(w, terms, system="l40s", backend="trtllm", custom_allreduce=False)
        return k, terms, k.token_features(tokens), RooflineKernels(w, terms).token_features(tokens)

    kernels, terms, f, link = features(dep.hardware)
    assert "allreduce" in kernels.fallbacks and "gemm" not in kernels.fallbacks
    for name in ("ar_calls", "ar_link"):
        np.testing.assert_allclose(f[name], link[name])
    assert not np.any(f["meas_comm"])
    by_link = link["ar_calls"][-1] * terms.allreduce_latency_s + link["ar_link"][-1] / terms.link_fraction
    timed = features(dataclasses.replace(dep.hardware, kernel_tables_comm=True))[2]
    assert timed["meas_comm"][-1] > 3 * by_link


@pytest.mark.skipif(data_root() is None, reason="aiconfigurator-core tables not installed")
@pytest.mark.parametrize("part, sibling", [("h800_sxm", "h100_sxm"), ("a800_80g_sxm", "a100_80g_sxm")])
def test_an_export_part_runs_its_siblings_kernels_over_its_own_slower_link(part, sibling):
    """H800 and A800: the H100 SXM's and A100 SXM's die and clocks with NVLink cut to 400 GB/s both ways. Their
    steps take the sibling's measured GEMMs and attention (the same seconds on one GPU) and price all-reduce from
    their own link terms (`kernel_tables_comm: false`), so a large tensor-parallel prefill communicates longer."""
    from simengine.config.scenario import EngineEntry
    from simengine.sim.build import build_engine, cost_model
    from simengine.validate.run import prefill_shapes

    def steps(hardware, tp):
        eng = build_engine(EngineEntry(engine="vllm"), make_dep(hardware, "llama-3.1-8b", tp=tp))
        return [cost_model(eng).step(s) for s in prefill_shapes(eng, 1, 8192, 0, None)]

    assert [s.seconds for s in steps(part, 1)] == [s.seconds for s in steps(sibling, 1)]
    cut, full = steps(part, 8), steps(sibling, 8)
    assert [s.compute_s for s in cut] == [s.compute_s for s in full]
    # large all-reduces at 8 GPUs: H800 200 against the H100's 445 GB/s bus bandwidth, A800 156 against 222
    assert sum(s.comm_s for s in cut) > 1.2 * sum(s.comm_s for s in full)
