"""The roofline cost model checked by hand for Llama-3.1-8B on H100."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.config.dtypes import WEIGHT_FORMATS
from simengine.core.batch import BatchShape
from simengine.cost.roofline import RooflineCost
from simengine.cost.timing import EngineTiming
from tests.conftest import make_dep

NO_OVERHEAD = EngineTiming(scheduler_cpu_s=0.0, output_cpu_s=0.0, overlap=False, kernel_launch_s=0.0,
                           graph_replay_s=0.0)


def cost(dep, timing=NO_OVERHEAD):
    return RooflineCost(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=dep.kv_elem_bytes,
                        tp=dep.tp, pp=dep.pp, timing=timing)


def test_one_decode_is_bound_by_reading_the_weights():
    dep = make_dep()
    hw = dep.hardware
    c = cost(dep).step(BatchShape(num_decode=1, decode_context_tokens=1000, num_logits=1, padded_decode=1))
    bw = hw.memory_bandwidth_bytes_s * hw.memory_bandwidth_fraction
    # by hand: linear weights (32 layers x 218.1M params) + LM head (128256 x 4096), 2 bytes each
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    weights = (32 * per_layer + 128256 * 4096) * 2
    acts = 2 * 32 * 4 * 4096
    kv = 1000 * 2 * 8 * 128 * 2 * 32
    assert c.memory_s == pytest.approx((weights + acts) / bw + kv / bw, rel=1e-9)
    assert c.compute_s == 0.0 and c.comm_s == 0.0
    assert 5e-3 < c.seconds < 7e-3  # ~16 GB at ~2.85 TB/s


def test_large_prefill_is_compute_bound():
    dep = make_dep()
    hw = dep.hardware
    shape = BatchShape(prefill_chunks=[(4096, 0)], num_logits=1)
    c = cost(dep).step(shape)
    flops_s = hw.peak("bf16") * hw.gemm_fraction
    linear = 4096 * 2 * dep.model.active_linear_params + 2 * 128256 * 4096
    attn = 4096 * (0 + 4096 / 2) * 2 * 32 * (128 + 128) * 32
    assert c.compute_s == pytest.approx((linear + attn) / flops_s, rel=1e-9)
    assert c.memory_s == 0.0


def test_crossover_near_peak_over_bandwidth():
    dep = make_dep()
    cm = cost(dep)
    small = cm.step(BatchShape(num_decode=64, decode_context_tokens=64, num_logits=64, padded_decode=64))
    big = cm.step(BatchShape(num_decode=1024, decode_context_tokens=1024, num_logits=1024, padded_decode=1024))
    assert small.memory_s > 0 and small.compute_s == 0
    assert big.compute_s > 0


def test_tp2_halves_weights_per_device_and_adds_allreduce():
    one, two = make_dep(), make_dep(tp=2)
    assert two.weight_bytes_per_device == pytest.approx(one.weight_bytes_per_device / 2)
    shape = BatchShape(num_decode=8, decode_context_tokens=8000, num_logits=8, padded_decode=8)
    c1, c2 = cost(one).step(shape), cost(two).step(shape)
    assert c2.memory_s == pytest.approx(c1.memory_s / 2, rel=1e-6)
    hw = two.hardware
    per_call = hw.link_latency_s + 2 * (2 - 1) / 2 * 8 * 4096 * 2 / hw.link_bandwidth_bytes_s
    assert c2.comm_s == pytest.approx(2 * 32 * per_call, rel=1e-9)


def test_moe_reads_more_experts_as_the_batch_grows():
    dep = make_dep(hardware="h200_sxm", model="mixtral-8x7b")
    cm = cost(dep)
    assert cm.experts_touched(1) == pytest.approx(2.0)
    assert 7.9 < cm.experts_touched(64) <= 8.0


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


def test_fp8_weights_use_fp8_peak_and_are_refused_without_it():
    from simengine.errors import InputError
    dep = make_dep(weight_dtype="fp8")
    c8 = cost(dep).step(BatchShape(prefill_chunks=[(8192, 0)], num_logits=1))
    c16 = cost(make_dep()).step(BatchShape(prefill_chunks=[(8192, 0)], num_logits=1))
    assert c8.seconds < c16.seconds
    with pytest.raises(InputError, match="fp8 tensor cores"):
        cost(make_dep(hardware="a100_80g_sxm", weight_dtype="fp8"))
    assert WEIGHT_FORMATS["int4"].compute_dtype == "fp16"


def test_expert_parallel_swaps_moe_allreduce_for_all_to_all():
    import dataclasses
    tp4 = make_dep(hardware="h200_sxm", model="mixtral-8x7b", tp=4)
    ep4 = dataclasses.replace(tp4, expert_parallel=True)
    shape = BatchShape(num_decode=64, decode_context_tokens=64000, num_logits=64, padded_decode=64)
    c_tp = RooflineCost(tp4.model, tp4.hardware, weight_format=tp4.weight_format, kv_elem_bytes=2, tp=4,
                        timing=NO_OVERHEAD).step(shape)
    c_ep = RooflineCost(ep4.model, ep4.hardware, weight_format=ep4.weight_format, kv_elem_bytes=2, tp=4,
                        timing=NO_OVERHEAD, expert_parallel=True).step(shape)
    hw = tp4.hardware
    ar = hw.link_latency_s + 2 * 3 / 4 * 64 * 4096 * 2 / hw.link_bandwidth_bytes_s
    a2a = hw.link_latency_s + 64 * 2 * 4096 * 2 * 3 / 4 / hw.link_bandwidth_bytes_s
    assert c_tp.comm_s == pytest.approx(64 * ar)
    assert c_ep.comm_s == pytest.approx(32 * ar + 64 * a2a)


@settings(max_examples=200, deadline=None)
@given(model=st.sampled_from(["llama-3.1-8b", "gpt-oss-20b", "mixtral-8x7b", "qwen2.5-7b"]),
       hardware=st.sampled_from(["h100_sxm", "l4", "mi300x"]), tp=st.sampled_from([1, 2, 4]),
       pp=st.sampled_from([1, 1, 2]), overlap=st.booleans(), graph=st.booleans(),
       num_decode=st.integers(1, 300), pad=st.integers(0, 8), structured=st.integers(0, 3),
       context=st.integers(0, 2_000_000), growth=st.integers(1, 300), repeats=st.integers(1, 40),
       host_s=st.sampled_from([1e-4, 2e-3, 5e-2]))
def test_decode_steps_price_each_repeat_as_step_does_bit_for_bit(model, hardware, tp, pp, overlap, graph, num_decode,
                                                                 pad, structured, context, growth, repeats, host_s):
    """The repeated-step pricing (one numpy pass) gives step()'s floats exactly, for dense, MoE and sliding-window
    models, with communication, graphs, eager launches and overlapped or synchronous host time."""
    timing = EngineTiming(scheduler_cpu_s=host_s, output_cpu_s=4e-4, overlap=overlap, kernel_launch_s=5e-6,
                          seq_cpu_s=2e-6)
    c = RooflineCost(*(lambda d: (d.model, d.hardware))(make_dep(hardware, model, tp=tp, pp=pp)),
                     weight_format=WEIGHT_FORMATS["bf16"], kv_elem_bytes=2.0, tp=tp, pp=pp, timing=timing,
                     grammar_mask_s=3e-5)
    shape = BatchShape(num_decode=num_decode, decode_context_tokens=context, num_logits=num_decode,
                       padded_decode=num_decode + pad, cuda_graph=graph, num_structured=min(structured, num_decode))
    contexts = context + growth * np.arange(1, repeats + 1)
    rows = c.decode_steps(shape, contexts)
    for ctx, row in zip(contexts.tolist(), rows.tolist()):
        assert tuple(row) == tuple(c.step(dataclasses.replace(shape, decode_context_tokens=ctx)))
