"""Run scenarios end to end: simulate each engine, build frames and summaries, write results and plots."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from simengine.config.scenario import EngineEntry, Scenario
from simengine.metrics.frames import itl_arrays, requests_frame, steps_frame
from simengine.metrics.summary import summarize
from simengine.sim.runner import Runner


@dataclass
class EngineResult:
    """One engine's frames and summary."""

    label: str
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    itl_ms: np.ndarray
    itl_counts: np.ndarray
    wall_s: float
    kv_capacity_tokens: int
    cost_model: str = ""          # which step-time model priced the run (measured kernels, fallbacks, roofline)
    down: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)  # replica failures (from, to)


def run_engine(scenario: Scenario, entry: EngineEntry, *, check_invariants: bool = False,
               deadline: float | None = None) -> EngineResult:
    """Simulate one engine on the scenario's request stream; with `deadline` (a time.monotonic() value) the run
    stops there and its summary says `partial: true`."""
    t0 = time.perf_counter()
    runner = Runner(scenario, entry, check_invariants=check_invariants)
    res = runner.run(deadline=deadline)
    req = requests_frame(res.recorder)
    steps = steps_frame(res.recorder)
    itl, counts = itl_arrays(res.recorder)
    dep = res.deployment
    hits = [e.prefix_hit_rate() for e in res.engines]
    summary = summarize(req, steps, itl, counts, slo=scenario.slo, end_s=res.end_s,
                        num_devices=dep.num_devices * scenario.deployment.replicas,
                        price_usd_per_hour=dep.hardware.price_usd_per_hour,
                        prefix_hit_rate=float(np.mean(hits)) if hits else 0.0, horizon_s=scenario.horizon_s,
                        replicas=scenario.deployment.replicas, classes=scenario.workload.classes)
    summary = {"engine": entry.engine, "label": entry.display, **summary,
               "kv_capacity_tokens": res.engines[0].kv_capacity_tokens(), "partial": res.partial}
    if res.faults is not None:
        summary["faults"] = res.faults
    return EngineResult(entry.display, summary, req, steps, itl, counts, time.perf_counter() - t0,
                        res.engines[0].kv_capacity_tokens(), runner.replicas[0].cost.describe(), res.down)


def compare(scenario: Scenario, engines: list[EngineEntry] | None = None, *, max_wall_s: float | None = None,
            **kw) -> dict[str, EngineResult]:
    """Every engine on the identical request stream (same seed). `max_wall_s` bounds the whole comparison's wall
    time: an engine still running then stops where it is, later ones simulate nothing; both are marked partial."""
    deadline = None if max_wall_s is None else time.monotonic() + max_wall_s
    return {e.display: run_engine(scenario, e, deadline=deadline, **kw) for e in (engines or scenario.engines)}


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def write_results(scenario: Scenario, results: dict[str, EngineResult], out_dir: Path) -> Path:
    """Write results/<scenario>/<label>/{summary.json,requests.csv,steps.csv,run_info.json,config.yaml}. The files
    go to a hidden temporary folder that replaces the old one only when complete, so an interrupt or a failure
    leaves either the previous results or the new ones, never a mix or a half-written file."""
    from simengine.cost.measured import package_version

    final = out_dir / scenario.name
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{scenario.name}-", dir=final.parent))
    old = final.with_name(f".{scenario.name}.old-{os.getpid()}")
    try:
        (tmp / "config.yaml").write_text(yaml.safe_dump(_jsonable(scenario), sort_keys=False))
        for label, r in results.items():
            d = tmp / label
            d.mkdir()
            (d / "summary.json").write_text(json.dumps(r.summary, indent=2, sort_keys=False) + "\n")
            r.requests.to_csv(d / "requests.csv", index=False, float_format="%.6f")
            r.steps.to_csv(d / "steps.csv", index=False, float_format="%.6f")
            (d / "run_info.json").write_text(json.dumps({"wall_seconds": round(r.wall_s, 3),
                                                         "python_pid": os.getpid(), "cost_model": r.cost_model,
                                                         "aiconfigurator_core": package_version(),
                                                         "partial": r.summary["partial"]}, indent=2) + "\n")
        if final.exists():
            final.rename(old)       # two renames: at every instant the name holds a complete folder or none
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            old.rename(final)       # interrupted between the renames: the previous results come back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_plots(scenario: Scenario, results: dict[str, EngineResult], plots_dir: Path) -> list[Path]:
    """Draw plots/<scenario>/*.png; each figure is saved under a temporary name and renamed when complete."""
    from simengine.report import plots

    pdir = plots_dir / scenario.name
    pdir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for label, r in results.items():
        jobs.append((plots.latency_timeline, (r.requests, f"{scenario.name} · {label}: TTFT and TPOT", r.down),
                     f"{label}_latency_timeline.png"))
        jobs.append((plots.kv_timeline, (r.steps, f"{scenario.name} · {label}: KV cache and queues"),
                     f"{label}_kv_timeline.png"))
    jobs.append((plots.engines_grid, ({k: (v.requests, v.steps) for k, v in results.items()},
                                      {k: v.summary for k, v in results.items()},
                                      f"{scenario.name}: engines side by side "
                                      f"({scenario.deployment.model} on {scenario.deployment.hardware})"),
                 "engines_side_by_side.png"))
    written = []
    for draw, args, name in jobs:
        tmp = pdir / f".{name}.tmp.png"
        try:
            draw(*args, tmp)
            os.replace(tmp, pdir / name)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(pdir / name)
    return written
