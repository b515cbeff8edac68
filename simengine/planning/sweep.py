"""Sweeps: every combination of a grid's axes (any scenario field by dotted path, and `engine`) simulated as one
point each, on a local process pool or a Ray cluster, into one table appended as points finish and resumable.

A grid file:

    axes:
      engine: [vllm, sglang, {engine: vllm, label: vllm-64, params: {max_num_seqs: 64}}]
      deployment.hardware: [h100_sxm, a100_80g_sxm]
      workload.arrival.rate: [5, 10, 20]

Without an `engine` axis the scenario's engines are one. A point that cannot run (a model that does not fit, a
knob an engine refuses) is recorded with its reason and the others go on. A rerun skips the points already in
the table, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simengine.config.loader import load_yaml
from simengine.errors import InputError

ENGINE_AXIS = "engine"
MAX_POINTS = 100_000
# summary keys kept per point (numbers and flags), after the axes
SUMMARY_KEYS = ("num_requests", "completed", "failed", "unfinished", "overloaded", "offered_rate",
                "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "request_goodput",
                "mean_kv_usage", "prefix_cache_hit_rate", "preemptions", "cost_per_1m_output_tokens_usd")


@dataclass(frozen=True)
class Grid:
    """Axis name (dotted scenario path, or `engine`) -> the values it takes."""

    axes: dict[str, list]

    def points(self) -> list[dict]:
        names = list(self.axes)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.axes[n] for n in names))]


def load_grid(path: str | Path, scenario_engines: list) -> Grid:
    p = Path(path)
    if not p.exists():
        raise InputError(f"grid file '{path}' not found", field="--grid")
    data = load_yaml(p)
    if not isinstance(data, dict) or set(data) != {"axes"} or not isinstance(data["axes"], dict) or not data["axes"]:
        raise InputError("a grid is a mapping with one key, axes: {dotted.path: [values], ...}", source=str(p),
                         field="axes")
    axes = {}
    for name, values in data["axes"].items():
        if not isinstance(values, list) or not values:
            raise InputError(f"give a non-empty list of values, got {values!r}", source=str(p), field=f"axes.{name}")
        if name == "engines":
            raise InputError("name the axis `engine` (one engine per point), not `engines`", source=str(p),
                             field="axes.engines")
        axes[str(name)] = values
    if ENGINE_AXIS not in axes:
        axes = {ENGINE_AXIS: list(scenario_engines), **axes}
    grid = Grid(axes)
    n = 1
    for v in axes.values():
        n *= len(v)
    if n > MAX_POINTS:
        raise InputError(f"{n:,} points is more than a sweep should hold ({MAX_POINTS:,}); split the grid",
                         source=str(p), field="axes")
    return grid


def point_id(point: dict) -> str:
    return hashlib.sha1(json.dumps(point, sort_keys=True, default=str).encode()).hexdigest()[:12]


def overrides(point: dict) -> list[str]:
    """The point as --set overrides (values as JSON, which YAML reads)."""
    sets = []
    for name, value in point.items():
        if name == ENGINE_AXIS:
            sets.append(f"engines=[{json.dumps(value)}]")
        else:
            sets.append(f"{name}={json.dumps(value)}")
    return sets


def label(value) -> str:
    """An axis value as a table cell."""
    if isinstance(value, dict):
        return str(value.get("label") or value.get("engine")) if "engine" in value else json.dumps(value)
    return str(value)


def run_point(scenario: str, base_sets: list[str], point: dict) -> dict:
    """Simulate one point; a row of the table (status ok or failed, with the reason)."""
    from simengine.api import run_engine
    from simengine.config.scenario import load_scenario
    from simengine.sim.build import plan_pools

    t0 = time.perf_counter()
    row: dict[str, Any] = {"point": point_id(point), **{name: label(v) for name, v in point.items()}}
    try:
        sc = load_scenario(scenario, base_sets + overrides(point))
        summary = run_engine(sc, sc.engines[0]).summary
        devices = sum(p.num_devices for p in plan_pools(sc, sc.engines[0]))
    except InputError as exc:
        return {**row, "status": "failed", "reason": str(exc), "wall_s": round(time.perf_counter() - t0, 3)}
    row.update({"status": "ok", "reason": "", "devices": devices, **{k: summary.get(k) for k in SUMMARY_KEYS}})
    row["output_throughput_per_device"] = summary["output_throughput"] / devices
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    return row


class Table:
    """The sweep's CSV: one line per finished point, appended and flushed at once; read back to resume."""

    def __init__(self, path: Path, columns: list[str]):
        self.path, self.columns = path, columns

    def done(self) -> set[str]:
        if not self.path.exists():
            return set()
        import pandas as pd
        text = self.path.read_text()
        header = text.split("\n", 1)[0].split(",") if text else []
        if header and header != self.columns:
            raise InputError(f"{self.path} holds another grid's points (columns {', '.join(header[1:4])}...); "
                             "give another --out or remove it", field="--grid")
        if text and not text.endswith("\n"):   # a line cut by an interrupt: dropped, its point runs again
            text = text[:text.rfind("\n") + 1]
            self.path.write_text(text)
        if not text.strip():
            return set()
        frame = pd.read_csv(self.path, usecols=["point"], dtype=str)
        return set(frame["point"])

    def append(self, row: dict) -> None:
        import csv
        import io
        new = not self.path.exists() or self.path.stat().st_size == 0
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n")
        if new:
            w.writeheader()
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in self.columns})
        with open(self.path, "a") as f:
            f.write(buf.getvalue())     # one write per line: an interrupt leaves whole lines and at most one cut
            f.flush()


def columns(grid: Grid) -> list[str]:
    return ["point", *grid.axes, "status", "reason", "devices", *SUMMARY_KEYS, "output_throughput_per_device",
            "wall_s"]


def run_local(scenario: str, base_sets: list[str], points: list[dict], jobs: int) -> Iterator[dict]:
    """Rows as points finish, on a pool of `jobs` processes (in this process when jobs is 1)."""
    if jobs == 1:
        for p in points:
            yield run_point(scenario, base_sets, p)
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        pending = {pool.submit(run_point, scenario, base_sets, p) for p in points}
        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    yield f.result()
        finally:
            for f in pending:
                f.cancel()


def run_ray(scenario: str, base_sets: list[str], points: list[dict], jobs: int, address: str | None
            ) -> Iterator[dict]:
    """Rows as points finish, on Ray: a local Ray with `jobs` CPUs, or the cluster at `address`."""
    try:
        import ray
    except ImportError:
        raise InputError("the ray executor needs Ray: pip install -e '.[ray]'", field="--executor") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address) if address else ray.init(num_cpus=jobs, include_dashboard=False,
                                                           log_to_driver=False)
    try:
        remote = ray.remote(run_point)
        pending = [remote.remote(scenario, base_sets, p) for p in points]
        while pending:
            finished, pending = ray.wait(pending, num_returns=1)
            for ref in finished:
                yield ray.get(ref)
    finally:
        if started:
            ray.shutdown()


def sweep(scenario: str, base_sets: list[str], grid: Grid, out: Path, *, jobs: int = 0, executor: str = "local",
          address: str | None = None, progress: Callable[[int, int, dict], None] | None = None) -> Path:
    """Run the grid's points not yet in out/points.csv; returns the CSV's path."""
    if executor not in ("local", "ray"):
        raise InputError(f"'{executor}' is not an executor; use local or ray", field="--executor")
    jobs = jobs or os.cpu_count() or 1
    if not 1 <= jobs <= 4096:
        raise InputError(f"must be between 1 and 4096 processes, got {jobs}", field="--jobs")
    out.mkdir(parents=True, exist_ok=True)
    table = Table(out / "points.csv", columns(grid))
    done = table.done()
    todo = [p for p in grid.points() if point_id(p) not in done]
    rows = run_local(scenario, base_sets, todo, jobs) if executor == "local" else \
        run_ray(scenario, base_sets, todo, jobs, address)
    for k, row in enumerate(rows, 1):
        table.append(row)
        if progress:
            progress(k, len(todo), row)
    return table.path


def write_parquet(csv_path: Path) -> Path | None:
    """The whole table as Parquet beside the CSV (None when pyarrow is not installed)."""
    import pandas as pd
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return None
    from simengine.report.files import write_whole
    return write_whole(csv_path.with_suffix(".parquet"), lambda tmp: pd.read_csv(csv_path).to_parquet(tmp, index=False))


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (p99 TTFT, throughput per device) points no other beats on both (lower TTFT, higher
    throughput), in order of TTFT."""
    front, best = [], float("-inf")
    for i, (_ttft, thr) in sorted(enumerate(points), key=lambda x: (x[1][0], -x[1][1])):
        if thr > best:
            front.append(i)
            best = thr
    return front


def figure(csv_path: Path, title: str, path: Path) -> Path:
    """Output throughput per GPU against p99 TTFT, a colour per engine, the Pareto front drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from simengine.report.plots import engine_colors, save_figure

    df = pd.read_csv(csv_path)
    ok = df[df["status"] == "ok"].dropna(subset=["p99_ttft_ms"])
    fig, ax = plt.subplots(figsize=(9, 6))
    engines = sorted(ok[ENGINE_AXIS].astype(str).unique())
    colors = engine_colors(engines)
    for e in engines:
        d = ok[ok[ENGINE_AXIS].astype(str) == e]
        ax.scatter(d["p99_ttft_ms"], d["output_throughput_per_device"], color=colors[e], label=e, s=28, alpha=0.8)
    xy = list(zip(ok["p99_ttft_ms"], ok["output_throughput_per_device"]))
    front = [xy[i] for i in pareto(xy)]
    if front:
        ax.plot(*zip(*front), "k--", linewidth=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("p99 TTFT (ms)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    failed = int((df["status"] != "ok").sum())
    ax.set_title(title + (f" ({failed} point(s) failed: see points.csv)" if failed else ""), fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
