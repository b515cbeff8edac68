"""Steps as feature arrays, so calibration re-prices thousands of steps per trial of the named terms at once.

`step_features(cost, shapes)` splits each step of `cost` (a RooflineCost) into the parts each
named term scales: GEMM-bound and bandwidth-bound seconds at efficiency 1, ring all-reduce seconds at nominal
link bandwidth, hop count, layers, sequences and host time. `price(features, terms)` puts them back together
exactly as `RooflineCost.step` does (tests/validate/test_features.py holds the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simengine.core.batch import BatchShape
from simengine.cost.calibrated import PROPOSED_TERMS
from simengine.cost.roofline import RooflineCost


@dataclass
class StepFeatures:
    """Per-step arrays (seconds at gemm_fraction = memory_bandwidth_fraction = 1, counts, flags)."""

    lin_c: np.ndarray
    lin_m: np.ndarray
    att_c: np.ndarray
    att_m: np.ndarray
    comm_fixed: np.ndarray     # link latency per call, MoE all-to-all, pipeline send/recv (not calibrated terms)
    ring: np.ndarray           # ring all-reduce seconds at nominal link bandwidth
    hops: np.ndarray           # all-reduce calls x 2 (tp - 1)
    seqs: np.ndarray           # sequences in the step
    host_extra: np.ndarray     # per-step host work that is not a calibrated term (grammar masks)
    graph: np.ndarray          # bool: replayed from a CUDA graph
    layers: float
    launch_s: float
    replay_s: float
    overlap: bool
    scheduler_cpu_s: float
    output_cpu_s: float
    gemm_fraction: float       # the values the features were built with (reported, not used to price)
    memory_bandwidth_fraction: float

    def __len__(self) -> int:
        return len(self.lin_c)


def attention_work(cost: RooflineCost, s: BatchShape) -> tuple[float, float]:
    """Attention FLOPs and bytes of a step (the roofline's own formula, sliding-window layers included)."""
    pairs = sum(c * (k + c / 2.0) for c, k in s.prefill_chunks) + s.decode_context_tokens
    read = sum(k + c for c, k in s.prefill_chunks) + s.decode_context_tokens
    flops = pairs * cost.attn_flops_per_pair * cost.full_layers
    nbytes = read * cost.kv_bytes_layer * cost.full_layers
    if cost.sliding_layers:
        w = cost.window
        mean_ctx = s.decode_context_tokens / max(s.num_decode, 1)
        sl_pairs = sum(c * min(k + c / 2.0, w) for c, k in s.prefill_chunks) + s.num_decode * min(w, mean_ctx)
        sl_read = sum(min(k + c, w) for c, k in s.prefill_chunks) + s.num_decode * min(w, mean_ctx)
        flops += sl_pairs * cost.attn_flops_per_pair * cost.sliding_layers
        nbytes += sl_read * cost.kv_bytes_layer * cost.sliding_layers
    return flops, nbytes


def step_features(cost: RooflineCost, shapes: list[BatchShape]) -> StepFeatures:
    """Feature arrays of `shapes` priced by `cost`'s model, device and engine timing."""
    hw, m, n = cost.hw, cost.model, len(shapes)
    g, mb = hw.gemm_fraction, hw.memory_bandwidth_fraction
    lin_peak, att_peak, bw = cost.linear_flops_s / g, cost.attn_flops_s / g, cost.bytes_s / mb
    a = {k: np.zeros(n) for k in ("lin_c", "lin_m", "att_c", "att_m", "comm_fixed", "ring", "seqs", "host_extra")}
    graph = np.zeros(n, dtype=bool)
    for i, s in enumerate(shapes):
        tokens = s.num_prefill_tokens + max(s.padded_decode, s.num_decode)
        wbytes = cost.dense_weight_bytes + cost.lm_head_bytes
        if m.num_experts:
            wbytes += m.num_moe_layers * cost.experts_touched(tokens) * cost.expert_bytes
        a["lin_m"][i] = (wbytes + tokens * cost.act_bytes_per_token) / bw
        a["lin_c"][i] = (tokens * cost.active_linear_flops_per_token
                         + s.num_logits * cost.lm_head_flops_per_token) / lin_peak
        flops, nbytes = attention_work(cost, s)
        a["att_c"][i], a["att_m"][i] = flops / att_peak, nbytes / bw
        fixed = cost.num_allreduce * hw.link_latency_s
        if cost.num_all_to_all:
            fixed += cost.num_all_to_all * (hw.link_latency_s + tokens * cost.a2a_bytes_per_token
                                            / hw.link_bandwidth_bytes_s)
        if cost.pp > 1:
            fixed += (cost.pp - 1) * (hw.link_latency_s + tokens * cost.allreduce_bytes_per_token
                                      / hw.link_bandwidth_bytes_s)
        a["comm_fixed"][i] = fixed
        if cost.num_allreduce:
            a["ring"][i] = (cost.num_allreduce * cost.ring_factor * tokens * cost.allreduce_bytes_per_token
                            / hw.link_bandwidth_bytes_s)
        a["seqs"][i] = s.num_decode + len(s.prefill_chunks)
        a["host_extra"][i] = getattr(s, "num_structured", 0) * cost.grammar_mask_s
        graph[i] = s.cuda_graph
    t = cost.timing
    return StepFeatures(**a, hops=np.full(n, cost.num_allreduce * 2.0 * max(cost.tp - 1, 0)), graph=graph,
                        layers=float(m.num_layers), launch_s=cost.launch_s, replay_s=t.graph_replay_s,
                        overlap=t.overlap, scheduler_cpu_s=t.scheduler_cpu_s, output_cpu_s=t.output_cpu_s,
                        gemm_fraction=g, memory_bandwidth_fraction=mb)


def price(f: StepFeatures, gemm_fraction: float, memory_bandwidth_fraction: float,
          terms: dict[str, float] | None = None) -> np.ndarray:
    """Seconds of every step for the given efficiency fractions and engine terms (RooflineCost.step's sum)."""
    x = {**PROPOSED_TERMS, "scheduler_cpu_s": f.scheduler_cpu_s, "output_cpu_s": f.output_cpu_s, **(terms or {})}
    g, mb = gemm_fraction, memory_bandwidth_fraction
    gpu = (np.maximum(f.lin_c / g, f.lin_m / mb) + np.maximum(f.att_c / g, f.att_m / mb) + f.comm_fixed
           + f.ring / x["allreduce_bandwidth_fraction"] + f.hops * x["allreduce_hop_latency_s"]
           + f.layers * x["layer_latency_s"])
    total = np.where(f.graph, gpu + f.replay_s, np.maximum(gpu, f.launch_s))
    host = x["scheduler_cpu_s"] + x["output_cpu_s"] + x["seq_cpu_s"] * f.seqs + f.host_extra
    exposed = np.maximum(0.0, host - total) if f.overlap else host
    return total + exposed
