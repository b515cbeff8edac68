"""Calibration re-prices steps from feature arrays; that must equal RooflineCost.step exactly."""

import numpy as np
import pytest

from simengine.core.batch import BatchShape
from simengine.cost.calibrated import apply_terms
from simengine.cost.roofline import RooflineCost
from simengine.cost.timing import EngineTiming
from simengine.validate.features import price, step_features
from tests.conftest import make_dep

TIMINGS = {
    "sync_eager": EngineTiming(scheduler_cpu_s=1e-3, output_cpu_s=5e-4, overlap=False),
    "overlap_graphs": EngineTiming(scheduler_cpu_s=3e-3, output_cpu_s=1e-3, overlap=True,
                                   cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64, 128)),
}
EXTRAS = {"layer_latency_s": 2e-4, "allreduce_hop_latency_s": 6e-6, "allreduce_bandwidth_fraction": 0.3,
          "seq_cpu_s": 3e-4}


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


@pytest.mark.parametrize("timing", TIMINGS.values(), ids=TIMINGS.keys())
@pytest.mark.parametrize("dep_kw", [dict(), dict(model="llama-2-70b", hardware="a100_80g_sxm", tp=4),
                                    dict(model="qwen3-235b-a22b", weight_dtype="fp8", kv_dtype="fp8", tp=8),
                                    dict(model="gpt-oss-20b", weight_dtype="mxfp4"),
                                    dict(model="llama-2-7b", weight_dtype="q4_0", hardware="apple_m2_ultra")])
@pytest.mark.parametrize("extras", [{}, EXTRAS], ids=["base", "extras"])
def test_price_equals_cost_model(timing, dep_kw, extras):
    dep = make_dep(**dep_kw)
    cost = RooflineCost(dep.model, dep.hardware, weight_format=dep.weight_format,
                        kv_elem_bytes=dep.kv_elem_bytes, tp=dep.tp, timing=apply_terms(timing, extras))
    batch = shapes(timing, np.random.default_rng(len(dep_kw) + len(extras)))
    direct = np.array([cost.step(s).seconds for s in batch])
    repriced = price(step_features(cost, batch), dep.hardware.gemm_fraction, dep.hardware.memory_bandwidth_fraction,
                     extras)
    np.testing.assert_allclose(repriced, direct, rtol=1e-9)
    if not extras:   # the default terms add nothing
        plain = RooflineCost(dep.model, dep.hardware, weight_format=dep.weight_format,
                             kv_elem_bytes=dep.kv_elem_bytes, tp=dep.tp, timing=timing)
        np.testing.assert_allclose(direct, [plain.step(s).seconds for s in batch], rtol=1e-12)


def test_each_proposed_term_slows_steps_the_way_it_is_named():
    dep = make_dep(model="llama-2-70b", hardware="a100_80g_sxm", tp=8)
    t = TIMINGS["sync_eager"]
    decode = BatchShape(num_decode=4, decode_context_tokens=4 * 600, num_logits=4, padded_decode=4)

    def step(**x):
        return RooflineCost(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=2.0, tp=8,
                            timing=apply_terms(t, x)).step(decode).seconds

    base = step()
    assert step(layer_latency_s=1e-4) == pytest.approx(base + 80 * 1e-4)
    assert step(allreduce_hop_latency_s=1e-6) == pytest.approx(base + 160 * 14 * 1e-6)   # 2 per layer, 2(tp-1) hops
    assert step(seq_cpu_s=1e-3) == pytest.approx(base + 4e-3)                            # synchronous: all exposed
    assert step(allreduce_bandwidth_fraction=0.5) > base


def test_apply_terms_sets_timing_fields():
    t = TIMINGS["sync_eager"]
    timing = apply_terms(t, {"scheduler_cpu_s": 0.02, "seq_cpu_s": 1e-4})
    assert timing.scheduler_cpu_s == 0.02 and timing.seq_cpu_s == 1e-4 and timing.output_cpu_s == t.output_cpu_s
    assert apply_terms(t, {}) is t
