"""Calibrated per-engine overhead terms: the YAML they live in, and how they enter an engine's EngineTiming.

`simengine/engines/calibration.yaml` maps an engine's registry name to named overhead terms, each an
`EngineTiming` field that `RooflineCost.step` prices: the host terms (scheduler_cpu_s, output_cpu_s,
kernel_launch_s, graph_replay_s) replace the engine module's estimates, and four more default to nothing:

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
from simengine.cost.timing import EngineTiming
from simengine.errors import InputError

ENGINE_TERMS_PATH = Path(__file__).resolve().parents[1] / "engines" / "calibration.yaml"
# The terms calibration adds to the engine modules' own timing, and the value of each that adds nothing.
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


def apply_terms(timing: EngineTiming, terms: dict[str, float]) -> EngineTiming:
    """The engine's timing with its calibrated terms (each an EngineTiming field) in place."""
    return dataclasses.replace(timing, **terms) if terms else timing


