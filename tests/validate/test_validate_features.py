"""Calibration re-prices recorded steps from feature arrays; that must equal the cost model's own step times."""

import dataclasses

import numpy as np
import pytest

from simengine.core.batch import BatchShape
from simengine.cost.calibrated import apply_terms
from simengine.cost.measured import MeasuredKernels, data_root
from simengine.cost.roofline import DeviceTerms, RooflineKernels
from simengine.cost.step import CostModel
from simengine.cost.timing import EngineTiming
from simengine.cost.work import StepWork
from simengine.validate.features import reprice, step_features
from tests.conftest import make_dep

TIMINGS = {
    "sync_eager": EngineTiming(scheduler_cpu_s=1e-3, output_cpu_s=5e-4, overlap=False),
    "overlap_graphs": EngineTiming(scheduler_cpu_s=3e-3, output_cpu_s=1e-3, overlap=True,
                                   cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64, 128)),
    "multi_step": EngineTiming(scheduler_cpu_s=2e-3, output_cpu_s=5e-4, overlap=False, steps_per_schedule=10),
    "compiled_graphs": EngineTiming(scheduler_cpu_s=1e-3, output_cpu_s=5e-4, overlap=False,
                                    cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64, 128), compiled_max_bs=32),
}


def shapes(timing: EngineTiming, rng: np.random.Generator, n: int = 40) -> list[BatchShape]:
    out = []
    for _ in range(n):
        s = BatchShape()
        s.prefill_chunks = [(int(rng.integers(1, 3000)), int(rng.integers(0, 8000)))
                            for _ in range(int(rng.integers(0, 4)))]
        s.num_decode = int(rng.integers(0, 200)) if s.prefill_chunks else int(rng.integers(1, 200))
        s.decode_context_tokens = s.num_decode * int(rng.integers(1, 20000))
        s.num_logits = s.num_decode + len(s.prefill_chunks)
        s.cuda_graph, s.padded_decode = timing.graph_for(s.num_decode, not s.prefill_chunks)
        out.append(s)
    return out


def model(dep, timing, measured: bool) -> CostModel:
    w = StepWork(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=dep.kv_elem_bytes, tp=dep.tp)
    t = DeviceTerms.of(w, dep.hardware, custom_allreduce=True)
    if measured:
        return CostModel(MeasuredKernels(w, t, system=dep.hardware.kernel_tables, backend="vllm",
                                         custom_allreduce=True), timing)
    return CostModel(RooflineKernels(w, t), timing)


CASES = [dict(), dict(model="llama-2-70b", hardware="a100_80g_sxm", tp=4),
         dict(model="qwen3-235b-a22b", weight_dtype="fp8", kv_dtype="fp8", tp=8),
         dict(model="gpt-oss-20b", weight_dtype="mxfp4"),
         dict(model="deepseek-v3", weight_dtype="fp8", hardware="h200_sxm", tp=8),   # MLA modules, fp8_block MoE
         dict(model="llama-2-7b", weight_dtype="q4_0", hardware="apple_m2_ultra")]


@pytest.mark.parametrize("timing", TIMINGS.values(), ids=TIMINGS.keys())
@pytest.mark.parametrize("dep_kw", CASES)
@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.parametrize("extras", [{}, {"seq_cpu_s": 3e-4}], ids=["base", "seq_cpu"])
def test_reprice_equals_cost_model(timing, dep_kw, measured, extras):
    dep = make_dep(**dep_kw)
    if measured and (data_root() is None or not dep.hardware.kernel_tables):
        pytest.skip("no measured tables for this device here")
    cost = model(dep, apply_terms(timing, extras), measured)
    batch = shapes(timing, np.random.default_rng(len(dep_kw) + len(extras)))
    direct = np.array([cost.step(s).seconds for s in batch])
    np.testing.assert_allclose(reprice(step_features(cost, batch)), direct, rtol=1e-9)


def test_reprice_follows_the_terms_the_way_they_are_named():
    dep = make_dep(model="llama-2-70b", hardware="a100_80g_sxm", tp=8)
    cost = model(dep, TIMINGS["sync_eager"], False)
    decode = [BatchShape(num_decode=4, decode_context_tokens=4 * 600, num_logits=4, padded_decode=4)]
    f = step_features(cost, decode)
    base = reprice(f)[0]
    t = cost.kernels.terms
    assert reprice(f, engine={"seq_cpu_s": 1e-3})[0] == pytest.approx(base + 4e-3)     # synchronous: all exposed
    slower_link = dataclasses.replace(t, allreduce_latency_s=t.allreduce_latency_s + 1e-6)
    assert reprice(f, slower_link)[0] == pytest.approx(base + 160 * 1e-6)             # 2 all-reduces per layer
    floor = dataclasses.replace(t, kernel_floor_s=t.kernel_floor_s + 1e-6)
    assert reprice(f, floor)[0] == pytest.approx(base + (80 * 9 + 1) * 1e-6)          # 9 kernels a layer + LM head
    assert reprice(f, dataclasses.replace(t, memory_fraction=t.memory_fraction / 2))[0] > 1.5 * base


def test_apply_terms_sets_timing_fields():
    t = TIMINGS["sync_eager"]
    timing = apply_terms(t, {"scheduler_cpu_s": 0.02, "seq_cpu_s": 1e-4})
    assert timing.scheduler_cpu_s == 0.02 and timing.seq_cpu_s == 1e-4 and timing.output_cpu_s == t.output_cpu_s
    assert apply_terms(t, {}) is t
