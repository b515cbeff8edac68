"""Run scenarios end to end: simulate each engine, build frames and summaries, write results and plots."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from simengine.config.scenario import EngineEntry, Scenario
from simengine.metrics.frames import (
    itl_arrays,
    plot_requests,
    plot_steps,
    request_blocks,
    requests_frame,
    step_blocks,
    steps_frame,
)
from simengine.metrics.recorder import Recorder
from simengine.metrics.summary import replica_sections, stage_sections, summarize
from simengine.sim.runner import Runner

# Plots draw at most this many requests (every k-th by id beyond) and steps (time-binned means beyond): figures of
# a ten-million-request run take the memory and time of a small one.
PLOT_MAX_ROWS = 200_000


@dataclass
class EngineResult:
    """One engine's summary and recorded rows; the frames are built from the rows on first use (a long run's rows
    may be on disk: results files and plots read them block by block instead)."""

    label: str
    summary: dict
    recorder: Recorder
    end_s: float
    wall_s: float
    kv_capacity_tokens: int
    cost_model: str = ""          # which step-time model priced the run (measured kernels, fallbacks, roofline)
    down: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)  # replica failures (from, to)
    pools: list[str] = dataclasses.field(default_factory=list)   # each replica's pool
    links: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)  # KV link busy spans

    @cached_property
    def requests(self) -> pd.DataFrame:
        return requests_frame(self.recorder)

    @cached_property
    def steps(self) -> pd.DataFrame:
        return steps_frame(self.recorder)

    @cached_property
    def _itl(self) -> tuple[np.ndarray, np.ndarray]:
        return itl_arrays(self.recorder)

    @property
    def itl_ms(self) -> np.ndarray:
        return self._itl[0]

    @property
    def itl_counts(self) -> np.ndarray:
        return self._itl[1]


def run_engine(scenario: Scenario, entry: EngineEntry, *, check_invariants: bool = False,
               deadline: float | None = None, progress=None) -> EngineResult:
    """Simulate one engine on the scenario's request stream; with `deadline` (a time.monotonic() value) the run
    stops there and its summary says `partial: true`."""
    t0 = time.perf_counter()
    runner = Runner(scenario, entry, check_invariants=check_invariants)
    res = runner.run(deadline=deadline, progress=progress)
    pools = res.pools
    num_devices = sum(p.num_devices for p in pools)
    prices = [(p.num_devices, p.dep.hardware.price_usd_per_hour) for p in pools]
    known = [(n, v) for n, v in prices if v is not None]
    price = sum(n * v for n, v in known) / num_devices if len(known) == len(prices) else None
    # the prefix cache of the first hop (mixed or prefill replicas), by token over replicas: the decode side only
    # looks up what it is about to receive
    first_hop = [t for t, p in zip(res.prefix_tokens, runner.pool_of, strict=True) if p.role != "decode"]
    queried, hit = np.sum(first_hop, axis=0)
    summary = summarize(res.recorder, slo=scenario.slo, end_s=res.end_s, num_devices=num_devices,
                        price_usd_per_hour=price, prefix_hit_rate=float(hit / queried) if queried else 0.0,
                        horizon_s=scenario.horizon_s, replicas=len(res.engines), classes=scenario.workload.classes)
    summary = {"engine": entry.engine, "label": entry.display, **summary,
               "kv_capacity_tokens": res.engines[0].kv_capacity_tokens(), "partial": res.partial}
    if res.faults is not None:
        summary["faults"] = res.faults
    if len(res.engines) > 1:
        summary["replicas"] = replica_sections(res.recorder, res.prefix_tokens,
                                               res.decisions, [p.name for p in runner.pool_of])
    if len(pools) > 1:
        summary["pools"] = [pool_section(p, summary["replicas"], res.prefix_tokens) for p in pools]
    if res.disaggregation is not None:
        summary["disaggregation"] = res.disaggregation
    if res.stalls:
        summary["stalled"] = res.stalls
    if runner.stages_run:
        summary["stages"] = stage_sections(requests_frame(res.recorder), runner.stages_run,
                                           scenario.workload.arrival.stages)
    offload = offload_section(res.engines, runner.replicas, summary["total_input_tokens"], res.end_s)
    if offload is not None:
        summary["kv_offload"] = offload
    lora = [s for e in res.engines if (s := e.lora_stats()) is not None]
    if lora:   # adapter loads summed over the replicas; the slots are each replica's
        summary["lora"] = {**lora[0], "loads_from_host": sum(s["loads_from_host"] for s in lora),
                           "loads_from_disk": sum(s["loads_from_disk"] for s in lora)}
    return EngineResult(entry.display, summary, res.recorder, res.end_s, time.perf_counter() - t0,
                        res.engines[0].kv_capacity_tokens(), runner.replicas[0].cost.describe(), res.down,
                        [p.name for p in runner.pool_of], runner.link_spans())


def offload_section(engines: list, replicas: list, input_tokens: float, end_s: float) -> dict | None:
    """KV offload over the run's replicas: the host tier (capacity, blocks stored, loaded back; the disk tier's capacity
    and loads where there is one), the prompt
    tokens loaded from it (also as a share of the completed requests' input tokens), and the loads over the host link
    (asynchronous ones, vLLM: their queueing and link time; TRT-LLM's onboarding runs inside steps)."""
    stats = [s for e in engines if (s := e.host_tier_stats()) is not None]
    if not stats:
        return None
    loads = np.array([x for r in replicas for x in r.host_loads], dtype=float).reshape(-1, 3)
    hit = sum(s["hit_tokens"] for s in stats)

    def ms(col: int) -> dict:
        v = loads[:, col] * 1e3
        if not len(v):
            return {"mean": 0.0, "p99": 0.0}
        return {"mean": round(float(v.mean()), 4), "p99": round(float(np.percentile(v, 99)), 4)}

    busy = sum(r.host_link.busy_s for r in replicas)
    return {"capacity_gb": round(sum(s["capacity_blocks"] * s["block_bytes"] for s in stats) / 1e9, 3),
            "stored_blocks": sum(s["stored_blocks"] for s in stats),
            "loaded_blocks": sum(s["loaded_blocks"] for s in stats),
            "loaded_gb": round(sum(s["loaded_blocks"] * s["block_bytes"] for s in stats) / 1e9, 6),
            "disk_capacity_gb": round(sum(s["disk_capacity_blocks"] * s["block_bytes"] for s in stats) / 1e9, 3),
            "disk_loaded_gb": round(sum(s["disk_loaded_blocks"] * s["block_bytes"] for s in stats) / 1e9, 6),
            "host_hit_tokens": hit, "host_share_of_input": round(hit / input_tokens, 6) if input_tokens else 0.0,
            "async_loads": len(loads), "load_queue_ms": ms(1), "load_link_ms": ms(2),
            "host_link_busy_fraction": round(busy / (end_s * len(replicas)), 6) if end_s > 0 else 0.0}


def pool_section(pool, replicas: list[dict], prefix_tokens: list[tuple[int, int]]) -> dict:
    """One pool of a run: what it is, and its replicas' figures together (router decisions and requests summed,
    prefix hit rate by token over its engines, KV usage averaged over its replicas)."""
    mine = [replicas[i] for i in pool.indices]
    queried, hit = np.sum([prefix_tokens[i] for i in pool.indices], axis=0)
    return {"name": pool.name, "role": pool.role, "engine": pool.entry.engine, "hardware": pool.dep.hardware.name,
            "tp": pool.dep.tp, "pp": pool.dep.pp, "replicas": list(pool.indices), "devices": pool.num_devices,
            "router_decisions": sum(r["router_decisions"] for r in mine), "requests": sum(r["requests"] for r in mine),
            "prefix_cache_hit_rate": round(float(hit / queried), 6) if queried else 0.0,
            "mean_kv_usage": round(float(np.mean([r["mean_kv_usage"] for r in mine])), 6)}


def engine_entries(scenario: Scenario, engines: list[EngineEntry | str] | None) -> list[EngineEntry]:
    """The engines to run: the scenario's list when none are given; a name picks the scenario's entry of that
    label (its params) or else the engine with its defaults."""
    if engines is None:
        return list(scenario.engines)
    by_label = {e.display: e for e in scenario.engines}
    return [e if isinstance(e, EngineEntry) else by_label.get(e, EngineEntry(engine=e)) for e in engines]


def compare(scenario: Scenario, engines: list[EngineEntry | str] | None = None, *,
            max_wall_s: float | None = None, progress=None, **kw) -> dict[str, EngineResult]:
    """Every engine (entries or names; default the scenario's) on the identical request stream (same seed).
    `max_wall_s` bounds the whole comparison's wall time: an engine still running then stops where it is, later
    ones simulate nothing; both are marked partial. `progress(label, k, n, simulated_s, requests_done)` is called
    during each engine's run (a display only; see Runner.run)."""
    deadline = None if max_wall_s is None else time.monotonic() + max_wall_s
    entries = engine_entries(scenario, engines)
    out = {}
    for k, e in enumerate(entries, 1):
        tick = None if progress is None else \
            (lambda t, done, e=e, k=k: progress(e.display, k, len(entries), t, done))
        out[e.display] = run_engine(scenario, e, deadline=deadline, progress=tick, **kw)
    return out


@dataclass
class Simulation:
    """What `simulate` returns: the resolved scenario and each engine's result (`.summary`, `.requests`, `.steps`),
    by label; `table()` prints them side by side, `save()` writes the results files, `plot()` the figures."""

    scenario: Scenario
    results: dict[str, EngineResult]

    def __getitem__(self, label: str) -> EngineResult:
        return self.results[label]

    def __iter__(self):
        return iter(self.results)

    @property
    def summaries(self) -> pd.DataFrame:
        """One row per engine, the summary's numbers as columns."""
        return pd.DataFrame({k: {n: v for n, v in r.summary.items() if not isinstance(v, dict)}
                             for k, r in self.results.items()}).T

    def table(self) -> str:
        from simengine.report.tables import format_table
        return format_table({k: r.summary for k, r in self.results.items()})

    def save(self, out_dir: str | Path = "results") -> Path:
        return write_results(self.scenario, self.results, Path(out_dir))

    def plot(self, plots_dir: str | Path = "plots") -> list[Path]:
        return write_plots(self.scenario, self.results, Path(plots_dir))


def simulate(scenario: str | Path | dict | Scenario, engines: list[EngineEntry | str] | None = None,
             overrides: dict | None = None, *, max_wall_s: float | None = None, exact: bool = False) -> Simulation:
    """Run a scenario's engines on the same request stream. `scenario`: a name under scenarios/, a path to a YAML
    file, a mapping in the scenario file's schema, or a Scenario. `overrides`: dotted paths to values, as `--set`
    takes them ({"workload.arrival.rate": 4}). `engines`: names or entries (default the scenario's). `exact`: the
    reference path alone (Scenario.exact). Bad input raises simengine.errors.InputError naming the field."""
    if exact:
        overrides = {**(overrides or {}), "exact": True}
    from simengine.config.loader import apply_overrides, from_dict
    from simengine.config.scenario import check_engines, load_scenario
    from simengine.errors import InputError

    sets = [f"{k}={json.dumps(v)}" for k, v in (overrides or {}).items()]
    if isinstance(scenario, str | Path):
        sc = load_scenario(str(scenario), sets)
    elif isinstance(scenario, dict | Scenario):
        data = _jsonable(scenario) if isinstance(scenario, Scenario) else scenario
        data = apply_overrides(data, sets)
        data.setdefault("name", "api")
        sc = from_dict(Scenario, data, source="simulate()")
        check_engines(sc, source="simulate()")
    else:
        raise InputError(f"expected a scenario name, path, mapping or Scenario, got {type(scenario).__name__}",
                         field="scenario")
    return Simulation(sc, compare(sc, engines, max_wall_s=max_wall_s))


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def write_results(scenario: Scenario, results: dict[str, EngineResult], out_dir: Path) -> Path:
    """Write results/<scenario>/<label>/{summary.json,requests.csv,steps.csv,run_info.json,config.yaml,trace.json,
    metrics.csv,metrics.prom,vllm_bench_serve.json} and return results/<scenario>. Every engine's folder is written
    under a hidden temporary name first; only when all are complete do they replace those engines' old folders.
    Folders of engines not in `results` are left as they are. So an interrupt or a failure leaves the results as
    they were or all new, never a half-written file, and a run of some engines never removes the others' results."""
    final = out_dir / scenario.name
    fresh = not final.exists()
    final.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_dump(_jsonable(scenario), sort_keys=False)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")   # vllm_bench_serve.json's "date", as vLLM writes it
    try:
        _replace_folders(final, {label: lambda d, r=r: _write_engine(d, r, config, scenario, date)
                                 for label, r in results.items()})
    except BaseException:
        if fresh and not any(final.iterdir()):
            final.rmdir()   # an interrupted first write leaves no empty scenario folder either
        raise
    return final


def _replace_folders(parent: Path, fills: dict) -> None:
    """Fill a hidden temporary folder for each name, then put them in place of `parent/name` by renames; an
    interrupt before the last rename removes the new folders and brings every previous one back."""
    umask = os.umask(0)
    os.umask(umask)
    made: list[tuple[Path, Path, Path]] = []   # (final, temporary folder, where the previous folder is moved)
    try:
        for name, fill in fills.items():
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=parent))
            made.append((parent / name, tmp, parent / f".{name}.old-{os.getpid()}"))
            tmp.chmod(0o777 & ~umask)   # mkdtemp's folder is private; results are as readable as any new folder
            fill(tmp)
        for final, tmp, old in made:
            if final.exists():
                final.rename(old)
            tmp.rename(final)
    except BaseException:
        for final, tmp, old in made:
            shutil.rmtree(tmp if tmp.exists() else final, ignore_errors=True)   # a placed new folder goes too
            if old.exists() and not final.exists():
                old.rename(final)   # the previous results come back
        raise
    for _, _, old in made:
        shutil.rmtree(old, ignore_errors=True)


def _write_engine(d: Path, r: EngineResult, config: str, scenario: Scenario, date: str) -> None:
    from simengine.cost.measured import package_version
    from simengine.report import prometheus
    from simengine.report.trace import write_trace
    from simengine.report.vllm_bench import bench_result

    model = scenario.deployment.model

    (d / "summary.json").write_text(json.dumps(r.summary, indent=2, sort_keys=False) + "\n")
    _write_csv(request_blocks(r.recorder), d / "requests.csv")
    _write_csv(step_blocks(r.recorder), d / "steps.csv")
    (d / "run_info.json").write_text(json.dumps({"wall_seconds": round(r.wall_s, 3), "python_pid": os.getpid(),
                                                 "cost_model": r.cost_model, "aiconfigurator_core": package_version(),
                                                 "partial": r.summary["partial"]}, indent=2) + "\n")
    (d / "config.yaml").write_text(config)
    write_trace(r.recorder, r.label, d / "trace.json")
    prometheus.series(r.recorder, r.end_s).to_csv(d / "metrics.csv", index=False, float_format="%.10g")
    (d / "metrics.prom").write_text(prometheus.exposition(r.recorder, r.end_s, model, r.summary["engine"]))
    (d / "vllm_bench_serve.json").write_text(json.dumps(bench_result(r.recorder, r.summary, scenario,
                                                                     r.summary["engine"], date)) + "\n")


def _write_csv(blocks, path: Path) -> None:
    """One CSV from frames of the same columns, written block by block."""
    with open(path, "w", newline="") as f:
        for i, block in enumerate(blocks):
            block.to_csv(f, index=False, header=i == 0, float_format="%.6f")


def write_plots(scenario: Scenario, results: dict[str, EngineResult], plots_dir: Path) -> list[Path]:
    """Draw plots/<scenario>/*.png; each figure is saved under a temporary name and renamed when complete."""
    from simengine.report import plots

    pdir = plots_dir / scenario.name
    pdir.mkdir(parents=True, exist_ok=True)
    d = scenario.deployment
    setup = (f"{d.model} {d.weight_dtype} on {d.replicas} x {d.tp * d.pp} {d.hardware} (TP {d.tp}, PP {d.pp}, "
             f"{d.replicas} replica{'s' if d.replicas > 1 else ''})")
    jobs: list[tuple[Any, tuple, str]] = []
    frames = {}
    for label, r in results.items():
        req, every = plot_requests(r.recorder, PLOT_MAX_ROWS)
        steps = plot_steps(r.recorder, r.end_s, PLOT_MAX_ROWS)
        frames[label] = (req, steps)
        sampled = f" (every {every}th request)" if every > 1 else ""
        jobs.append((plots.latency_timeline, (req, f"{scenario.name} · {label}: TTFT and TPOT{sampled}\n{setup}",
                                              r.down, scenario.slo), f"{label}_latency_timeline.png"))
        jobs.append((plots.kv_timeline, (steps, f"{scenario.name} · {label}: KV cache and queues · {setup}"),
                     f"{label}_kv_timeline.png"))
        if len(r.pools) > 1:
            jobs.append((plots.cluster_timeline, (steps, r.pools, r.links, r.end_s,
                                                  f"{scenario.name} · {label}: replicas and KV links"),
                         f"{label}_cluster_timeline.png"))
    jobs.append((plots.engines_grid, (frames, {k: v.summary for k, v in results.items()},
                                      f"{scenario.name}: engines side by side · {setup}", scenario.slo),
                 "engines_side_by_side.png"))
    return [draw(*args, pdir / name) for draw, args, name in jobs]   # each saved whole (plots.save_figure)
