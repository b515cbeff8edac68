"""Steps as feature arrays, so calibration re-prices thousands of recorded steps per trial of the named terms.

`step_features(cost, shapes)` records, for each step a cost model priced, the kernel features of its ops (seconds at
efficiency 1, kernel and call counts, measured seconds: cost/roofline.py `FEATURES`) and the engine-side counts
(sequences, structured requests, CUDA graph or eager). `reprice(features, device, engine)` puts them back together
with the cost model's own two functions, `roofline.price` for the GPU and `step.step_seconds` for the launches and
host time, at trial device terms and engine terms (floats or per-step arrays).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from simengine.core.batch import BatchShape
from simengine.cost.roofline import FEATURES, DeviceTerms, price
from simengine.cost.step import CostModel, pipeline_stage, step_seconds

ENGINE_FIELDS = ("scheduler_cpu_s", "output_cpu_s", "seq_cpu_s", "graph_replay_s", "kernel_launch_s")


@dataclass
class StepFeatures:
    """One recorded sequence of steps of one replica: kernel features, engine counts and the terms it ran with."""

    f: dict[str, np.ndarray]
    seqs: np.ndarray             # sequences in each step (decodes + prefill chunks)
    structured: np.ndarray       # requests sampling under a grammar mask
    graph: np.ndarray            # bool: replayed from a CUDA graph
    gpu_factor: np.ndarray       # the step's GPU time multiplier (a torch.compile'd decode step; cost/timing.py)
    device: str                  # hardware name
    dtypes: tuple[str, str, str]  # compute dtypes of the linear op, LM head and attention ('' at the engine's own rate)
    terms: DeviceTerms           # the device terms the steps were priced with
    engine: dict[str, float] = field(default_factory=dict)  # ENGINE_FIELDS as the engine ran them
    launches: float = 0.0        # kernels an eager step enqueues (kernels_per_layer x layers)
    overlap: bool = False
    grammar_mask_s: float = 0.0
    roofline_share: float = 0.0  # share of the steps' GPU time priced by the roofline (not measured kernels)
    stages: int = 1              # pipeline micro-batches in flight: a step adds its first stage's time to the run
    steps_per_schedule: int = 1  # steps one scheduling pass serves (EngineTiming.steps_per_schedule)

    def __len__(self) -> int:
        return len(self.seqs)


def step_features(cost: CostModel, shapes: list[BatchShape], stages: int = 1) -> StepFeatures:
    """Feature arrays of `shapes` as `cost` prices them (`stages`: as CostModel.stage_seconds does)."""
    k, w, t = cost.kernels, cost.work, cost.timing
    n = len(shapes)
    tokens = np.array([s.num_prefill_tokens + max(s.padded_decode, s.num_decode) for s in shapes], dtype=float)
    logits = np.array([s.num_logits for s in shapes], dtype=float)
    num_decode = np.array([s.num_decode for s in shapes], dtype=float)
    ctx = np.array([s.decode_context_tokens for s in shapes], dtype=float)
    parts = (k.token_features(tokens), k.logit_features(logits),
             k.attention_features([s.prefill_chunks for s in shapes], num_decode, ctx))
    f = {name: sum((np.broadcast_to(np.asarray(p[name], dtype=float), (n,)) for p in parts), np.zeros(n))
         for name in FEATURES}
    measured = f["meas_c"] + f["meas_m"] + f["meas_comm"]
    gpu = price(f, cost.kernels.terms)[0]
    share = float(1.0 - measured.sum() / gpu.sum()) if n and gpu.sum() > 0 else 1.0
    return StepFeatures(
        f=f, seqs=np.array([s.num_decode + len(s.prefill_chunks) for s in shapes], dtype=float),
        structured=np.array([s.num_structured for s in shapes], dtype=float),
        graph=np.array([bool(s.cuda_graph) for s in shapes]),
        gpu_factor=np.array([t.gpu_factor(s.num_decode, not s.prefill_chunks and not s.spec_tokens, bool(s.cuda_graph))
                             for s in shapes], dtype=float), device=w.hw.name,
        dtypes=("" if w.engine_gemm_flops_s else w.compute_dtype, w.lm_head_dtype,
                "" if w.engine_attention_flops_s else w.attn_dtype), terms=k.terms,
        engine={name: float(getattr(t, name)) for name in ENGINE_FIELDS},
        launches=float(t.kernels_per_layer * w.model.num_layers), overlap=t.overlap,
        grammar_mask_s=cost.grammar_mask_s, roofline_share=share, stages=stages,
        steps_per_schedule=t.steps_per_schedule)


def reprice(sf: StepFeatures, device=None, engine: dict | None = None) -> np.ndarray:
    """Seconds of every step at `device` terms (a DeviceTerms or any object with its fields; default: as recorded)
    and `engine` terms (ENGINE_FIELDS overrides); floats or per-step arrays."""
    gpu = price(sf.f, device if device is not None else sf.terms)[0] * sf.gpu_factor
    e = {**(sf.engine or {}), **(engine or {})}
    timing = SimpleNamespace(graph_replay_s=e["graph_replay_s"],
                             exposed_host_s=lambda total, extra: exposed(total, extra, e, sf))
    host = e["seq_cpu_s"] * sf.seqs + sf.structured * sf.grammar_mask_s
    seconds = step_seconds(gpu, sf.graph, host, timing, e["kernel_launch_s"] * sf.launches,  # type: ignore[arg-type]
                           np.maximum)   # an EngineTiming's two members the pricing reads
    if np.all(sf.stages == 1):
        return seconds
    staged = pipeline_stage(seconds, step_cpu(e, sf) + host, sf.stages, sf.overlap, np.maximum)
    return np.where(sf.stages > 1, staged, seconds)


def step_cpu(e: dict, sf: StepFeatures):
    """EngineTiming.step_cpu_s with trial terms `e`."""
    return e["scheduler_cpu_s"] / sf.steps_per_schedule + e["output_cpu_s"]


def exposed(total, extra, e: dict, sf: StepFeatures):
    """EngineTiming.exposed_host_s with trial terms `e` (`sf.overlap` a bool or a bool array)."""
    cpu = step_cpu(e, sf) + extra
    excess = cpu - total
    return sf.overlap * (excess * (excess > 0.0)) + (1 - sf.overlap) * cpu
