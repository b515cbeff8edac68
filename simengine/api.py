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


def run_engine(scenario: Scenario, entry: EngineEntry, *, check_invariants: bool = False) -> EngineResult:
    """Simulate one engine on the scenario's request stream."""
    t0 = time.perf_counter()
    runner = Runner(scenario, entry, check_invariants=check_invariants)
    res = runner.run()
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
               "kv_capacity_tokens": res.engines[0].kv_capacity_tokens()}
    return EngineResult(entry.display, summary, req, steps, itl, counts, time.perf_counter() - t0,
                        res.engines[0].kv_capacity_tokens(), runner.replicas[0].cost.describe())


def compare(scenario: Scenario, engines: list[EngineEntry] | None = None, **kw) -> dict[str, EngineResult]:
    """Every engine on the identical request stream (same seed)."""
    return {e.display: run_engine(scenario, e, **kw) for e in (engines or scenario.engines)}


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def write_results(scenario: Scenario, results: dict[str, EngineResult], out_dir: Path, plots_dir: Path,
                  *, make_plots: bool = True) -> list[Path]:
    """Write results/<scenario>/<label>/{summary.json,requests.csv,steps.csv,run_info.json,config.yaml} and
    plots/<scenario>/*.png. Files are written to a temporary folder and moved in place at the end, so a
    failure leaves nothing half-written."""
    from simengine.report import plots

    final = out_dir / scenario.name
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{scenario.name}-", dir=final.parent))
    written: list[Path] = []
    try:
        config = yaml.safe_dump(_jsonable(scenario), sort_keys=False)
        (tmp / "config.yaml").write_text(config)
        for label, r in results.items():
            d = tmp / label
            d.mkdir()
            (d / "summary.json").write_text(json.dumps(r.summary, indent=2, sort_keys=False) + "\n")
            r.requests.to_csv(d / "requests.csv", index=False, float_format="%.6f")
            r.steps.to_csv(d / "steps.csv", index=False, float_format="%.6f")
            from simengine.cost.measured import package_version
            (d / "run_info.json").write_text(json.dumps({"wall_seconds": round(r.wall_s, 3),
                                                         "python_pid": os.getpid(), "cost_model": r.cost_model,
                                                         "aiconfigurator_core": package_version()},
                                                        indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written.append(final)
    if make_plots:
        pdir = plots_dir / scenario.name
        pdir.mkdir(parents=True, exist_ok=True)
        for label, r in results.items():
            written.append(plots.latency_timeline(r.requests, f"{scenario.name} · {label}: TTFT and TPOT",
                                                  pdir / f"{label}_latency_timeline.png"))
            written.append(plots.kv_timeline(r.steps, f"{scenario.name} · {label}: KV cache and queues",
                                             pdir / f"{label}_kv_timeline.png"))
        written.append(plots.engines_grid({k: (v.requests, v.steps) for k, v in results.items()},
                                          {k: v.summary for k, v in results.items()},
                                          f"{scenario.name}: engines side by side "
                                          f"({scenario.deployment.model} on {scenario.deployment.hardware})",
                                          pdir / "engines_side_by_side.png"))
    return written
