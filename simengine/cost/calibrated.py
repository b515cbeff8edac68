"""Calibrated engine terms: the YAML they live in, and how they enter an engine's EngineTiming.

`simengine/engines/calibration.yaml` maps an engine's registry name to named terms, each an `EngineTiming` field
and each an engine mechanism: host time per step to schedule (`scheduler_cpu_s`) and to process outputs
(`output_cpu_s`), host time per sequence in the step (`seq_cpu_s`: sampling, stop checks, detokenisation), the
dispatch cost of one eagerly launched kernel (`kernel_launch_s`) and of a CUDA-graph replay (`graph_replay_s`).
The engine module sets a prior for every one of them, with its source; a fitted value replaces the prior. Physical
terms (GEMM and bandwidth efficiency, kernel floors, all-reduce latency and bandwidth) belong to the hardware and
are not engine terms.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

from simengine.config.loader import load_yaml
from simengine.cost.timing import EngineTiming
from simengine.errors import InputError

ENGINE_TERMS_PATH = Path(__file__).resolve().parents[1] / "engines" / "calibration.yaml"
# A trial set of terms (`simengine calibrate --test`: terms fitted on one file, judged on another) replaces the
# shipped ones for every run in this process and its workers: a YAML with `engines:` as calibration.yaml and
# `devices: {hardware name: {gemm_fraction.<dtype key> | memory_bandwidth_fraction | kernel_floor_s: value}}`.
TRIAL_TERMS_ENV = "SIMENGINE_TRIAL_TERMS"
# The engine terms calibration may fit (EngineTiming fields).
TIMING_TERMS = ("scheduler_cpu_s", "output_cpu_s", "seq_cpu_s", "kernel_launch_s", "graph_replay_s", "frontend_s")


def read_engine_terms(path: Path | None = None) -> dict[str, dict[str, float]]:
    """engine -> {term: value} from the calibration YAML (provenance keys dropped). Missing file -> {}."""
    p = path or (Path(os.environ[TRIAL_TERMS_ENV]) if os.environ.get(TRIAL_TERMS_ENV) else ENGINE_TERMS_PATH)
    if not p.exists():
        return {}
    return dict(_read_cached(p.resolve(), p.stat().st_mtime_ns))


def trial_device_terms(hardware: str) -> dict[str, float]:
    """The trial file's device terms for `hardware` (see TRIAL_TERMS_ENV); {} without a trial file."""
    path = os.environ.get(TRIAL_TERMS_ENV)
    if not path:
        return {}
    data = load_yaml(Path(path)) or {}
    return dict((data.get("devices") or {}).get(hardware) or {})


def apply_device_terms(hw, terms: dict[str, float]):
    """A Hardware with fitted device terms in place (gemm_fraction.<key>, memory_bandwidth_fraction,
    kernel_floor_s)."""
    if not terms:
        return hw
    fractions = dict(hw.gemm_fractions)
    changes = {}
    for name, v in terms.items():
        if name.startswith("gemm_fraction."):
            fractions[name.split(".", 1)[1]] = float(v)
        else:
            changes[name] = float(v)
    return dataclasses.replace(hw, gemm_fractions=fractions, **changes)


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
            if k not in TIMING_TERMS:
                raise InputError(f"unknown term; valid: {', '.join(TIMING_TERMS)}",
                                 source=str(path), field=f"engines.{name}.terms.{k}")
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise InputError(f"must be a number >= 0, got {v!r}", source=str(path),
                                 field=f"engines.{name}.terms.{k}")
            terms[k] = float(v)
        out[str(name)] = terms
    return out


def apply_terms(timing: EngineTiming, terms: dict[str, float]) -> EngineTiming:
    """The engine's timing with its calibrated terms (each an EngineTiming field) in place."""
    return dataclasses.replace(timing, **terms) if terms else timing  # type: ignore[arg-type]  # float fields


