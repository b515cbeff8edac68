"""Calibrated per-engine overhead terms: the YAML they live in, and the step-cost terms they add to the roofline.

`simengine/engines/calibration.yaml` maps an engine's registry name to named overhead terms. A term whose name
is an `EngineTiming` field (scheduler_cpu_s, output_cpu_s, kernel_launch_s, graph_replay_s) replaces that field;
the others are the cost-model terms proposed in docs/validation.md ("Proposed cost-model terms") and priced by
`ExtendedRoofline` until `cost/roofline.py` and `EngineTiming` carry them:

- `layer_latency_s`: fixed latency per transformer layer per step (inter-kernel bubbles and synchronisation of
  an unfused stack), added to the GPU time of every step;
- `allreduce_hop_latency_s`: software latency per ring hop of one tensor-parallel all-reduce, so one call costs
  2 (tp - 1) hops on top of the link's `latency_us` (this is what makes small-batch decode scale poorly with tp);
- `allreduce_bandwidth_fraction`: achieved / nominal link bandwidth of the engine's all-reduce;
- `seq_cpu_s`: host time per sequence in the step (sampling, stop checks, detokenisation), exposed like the other
  host time (all of it in a synchronous loop, only the excess over the GPU time when overlapped).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from simengine.config.loader import load_yaml
from simengine.core.batch import BatchShape
from simengine.cost.roofline import RooflineCost, StepCost
from simengine.cost.timing import EngineTiming
from simengine.errors import InputError

ENGINE_TERMS_PATH = Path(__file__).resolve().parents[1] / "engines" / "calibration.yaml"
# Proposed terms and the value that leaves today's roofline unchanged.
PROPOSED_TERMS: dict[str, float] = {"layer_latency_s": 0.0, "allreduce_hop_latency_s": 0.0,
                                    "allreduce_bandwidth_fraction": 1.0, "seq_cpu_s": 0.0}
TIMING_TERMS = ("scheduler_cpu_s", "output_cpu_s", "kernel_launch_s", "graph_replay_s")


def read_engine_terms(path: Path | None = None) -> dict[str, dict[str, float]]:
    """engine -> {term: value} from the calibration YAML (provenance keys dropped). Missing file -> {}."""
    p = path or ENGINE_TERMS_PATH
    if not p.exists():
        return {}
    return dict(_read_cached(p.resolve(), p.stat().st_mtime_ns))


@functools.cache
def _read_cached(path: Path, mtime_ns: int) -> dict[str, dict[str, float]]:
    data = load_yaml(path) or {}
    engines = data.get("engines", {}) if isinstance(data, dict) else None
    if not isinstance(engines, dict):
        raise InputError("expected a mapping 'engines: {name: {term: value}}'", source=str(path))
    out: dict[str, dict[str, float]] = {}
    for name, entry in engines.items():
        if not isinstance(entry, dict):
            raise InputError("expected a mapping of terms", source=str(path), field=f"engines.{name}")
        terms = {}
        for k, v in (entry.get("terms") or {}).items():
            if k not in PROPOSED_TERMS and k not in TIMING_TERMS:
                raise InputError(f"unknown term; valid: {', '.join([*TIMING_TERMS, *PROPOSED_TERMS])}",
                                 source=str(path), field=f"engines.{name}.terms.{k}")
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise InputError(f"must be a number >= 0, got {v!r}", source=str(path),
                                 field=f"engines.{name}.terms.{k}")
            terms[k] = float(v)
        out[str(name)] = terms
    return out


def split_terms(timing: EngineTiming, terms: dict[str, float]) -> tuple[EngineTiming, dict[str, float]]:
    """Apply terms that are EngineTiming fields; return the rest (the proposed ones the timing lacks)."""
    fields = {f.name for f in dataclasses.fields(EngineTiming)}
    own = {k: v for k, v in terms.items() if k in fields}
    rest = {k: v for k, v in terms.items() if k not in fields}
    return (dataclasses.replace(timing, **own) if own else timing), rest


class ExtendedRoofline(RooflineCost):
    """RooflineCost plus the proposed terms in `extras` (a no-op when `extras` is empty)."""

    def __init__(self, *args, extras: dict[str, float] | None = None, **kw):
        super().__init__(*args, **kw)
        x = {**PROPOSED_TERMS, **(extras or {})}
        self.layer_latency_s = x["layer_latency_s"]
        self.hop_latency_s = x["allreduce_hop_latency_s"]
        self.ar_bw_fraction = x["allreduce_bandwidth_fraction"]
        self.seq_cpu_s = x["seq_cpu_s"]
        self.active = bool(extras)
        self.hops_per_call = 2 * (self.tp - 1)

    def step(self, shape: BatchShape) -> StepCost:
        c = super().step(shape)
        if not self.active:
            return c
        t = self.timing
        tokens = shape.num_prefill_tokens + max(shape.padded_decode, shape.num_decode)
        extra_comm = 0.0
        if self.num_allreduce:   # single-device parts have no link (bandwidth 0) and no all-reduce
            ring_s = self.num_allreduce * self.ring_factor * tokens * self.allreduce_bytes_per_token / (
                self.hw.link_bandwidth_bytes_s)
            extra_comm = self.num_allreduce * self.hops_per_call * self.hop_latency_s + ring_s * (
                1.0 / self.ar_bw_fraction - 1.0)
        comm = c.comm_s + extra_comm
        gpu = c.compute_s + c.memory_s + comm + self.model.num_layers * self.layer_latency_s
        total = gpu + t.graph_replay_s if shape.cuda_graph else max(gpu, self.launch_s)
        extra_host = (self.seq_cpu_s * (shape.num_decode + len(shape.prefill_chunks))
                      + getattr(shape, "num_structured", 0) * self.grammar_mask_s)
        exposed = t.exposed_host_s(total, extra_host)
        seconds = total + exposed
        return StepCost(seconds, c.compute_s, c.memory_s, comm, seconds - c.compute_s - c.memory_s - comm)
