"""report.html: one self-contained page per run (figures embedded) with the side-by-side table, what the runs
show in words generated from their own figures, failed requests by reason, and the resolved configuration.
Built from a results folder, so `simengine report DIR` can remake it from any earlier run."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pandas as pd

from simengine.errors import InputError
from simengine.report.tables import OVERLOADED_MARK, side_by_side

TEMPLATE = "report.html.j2"


def _first_preemption(steps_csv: Path) -> tuple[float, float] | None:
    """(time, KV usage) of the first step that preempted, read from steps.csv in chunks."""
    if not steps_csv.exists():
        return None
    for chunk in pd.read_csv(steps_csv, usecols=["end_s", "kv_usage", "preempted"], chunksize=200_000):
        hit = chunk[chunk["preempted"] > 0]
        if len(hit):
            return float(hit["end_s"].iloc[0]), float(hit["kv_usage"].iloc[0])
    return None


def insights(summaries: dict[str, dict], folders: dict[str, Path]) -> list[str]:
    """Sentences from the runs' own figures: leaders and laggards, prefix reuse, preemption, overload, failures."""
    out = []
    labels = list(summaries)
    if len(labels) > 1:
        by_thr = sorted(labels, key=lambda k: -summaries[k]["output_throughput"])
        best, worst = by_thr[0], by_thr[-1]
        b, w = summaries[best]["output_throughput"], summaries[worst]["output_throughput"]
        if w > 0 and b / w > 1.05:
            out.append(f"{best} served the most output tokens per second ({b:,.0f}), {b / w - 1:.0%} more than "
                       f"{worst} ({w:,.0f}).")
        ttft = {k: summaries[k]["p99_ttft_ms"] for k in labels if summaries[k].get("p99_ttft_ms") is not None}
        if len(ttft) > 1:
            lo, hi = min(ttft, key=ttft.__getitem__), max(ttft, key=ttft.__getitem__)
            if ttft[hi] > 1.2 * ttft[lo]:
                out.append(f"{lo} has the lowest p99 TTFT ({ttft[lo]:,.0f} ms); {hi} the highest "
                           f"({ttft[hi]:,.0f} ms).")
        hits = {k: summaries[k]["prefix_cache_hit_rate"] for k in labels}
        top, bottom = max(hits, key=hits.__getitem__), min(hits, key=hits.__getitem__)
        if hits[top] - hits[bottom] >= 0.10:
            out.append(f"{top}'s prefix hit rate is {hits[top]:.0%} against {bottom}'s {hits[bottom]:.0%}: "
                       f"{top} computes {hits[top] - hits[bottom]:.0%} fewer of the prompt tokens it looks up.")
    for k in labels:
        s = summaries[k]
        if s.get("preemptions"):
            first = _first_preemption(folders[k] / "steps.csv")
            when = f" after KV usage reached {first[1]:.0%} at {first[0]:,.0f} s" if first else ""
            out.append(f"{k} preempted {s['preemptions']:,} times{when}; its KV pool holds "
                       f"{s.get('kv_capacity_tokens', 0):,} tokens.")
        if s.get("overloaded"):
            offered = s.get("offered_rate")
            served = f"offered {offered:.2f} req/s, served {s['request_throughput']:.2f}" if offered else \
                f"served {s['request_throughput']:.2f} req/s"
            out.append(f"{k} was overloaded ({served}): its latencies grow with the run's length, and its cost is "
                       "that of a saturated deployment.")
        if s.get("failed"):
            reason = next(iter(s.get("failure_reasons") or {"": 0}))
            out.append(f"{k}: {s['failed']:,} of {s['num_requests']:,} requests failed" +
                       (f" ({reason})." if reason else "."))
        if s.get("faults", {}).get("failures"):
            f = s["faults"]
            out.append(f"{k}: {f['failures']} replica failure(s), availability {f['availability']:.1%}; "
                       f"{f['retries']:,} requests resent, {f['failed_by_fault']:,} failed for it.")
        if s.get("partial"):
            out.append(f"{k}'s run stopped at the wall-clock limit: its figures are partial.")
    return out


def _hardware_name(spec: str) -> str:
    """The catalog name of a scenario's `deployment.hardware` (a name or a YAML path); the text when unreadable."""
    from simengine.config.hardware import load_hardware
    try:
        return load_hardware(spec).name
    except (InputError, OSError):
        return spec


def accuracy(summaries: dict[str, dict], hardware: str) -> tuple[list[list[str]], str]:
    """The simulator's error on published measurements of the run's engines (validate/accuracy.py) as table rows,
    and a sentence on how many of them were measured on the run's device."""
    from simengine.validate import accuracy as acc

    def cells(st: dict) -> list[str]:
        if not st["rows"]:
            return ["0", "", ""]
        return [str(st["rows"]), f"{st['median_abs_error_pct']:.1f}%", f"{st['median_error_pct']:+.1f}%"]

    found = {e: acc.for_engine(e, hardware) for e in dict.fromkeys(s.get("engine", k) for k, s in summaries.items())}
    rows = [[a["engine"], a["family"], a["scope"], *cells(a["calibration"]), *cells(a["judged"])]
            for families in found.values() for a in families]
    missing = [e for e, families in found.items() if not families]
    note = acc.device_line(hardware)
    if missing:
        note += f" No published measurement of {', '.join(missing)} was validated."
    return rows, note


def _figures(plots_dir: Path | None, labels: list[str]) -> list[dict]:
    """The run's figures, embedded: the side-by-side grid, each engine's timelines, then any capacity or sweep
    figure drawn for the same scenario."""
    if plots_dir is None or not plots_dir.exists():
        return []
    names = ["engines_side_by_side.png", *(f"{lb}_{kind}.png" for lb in labels
                                           for kind in ("latency_timeline", "kv_timeline"))]
    names += sorted(p.name for p in [*plots_dir.glob("capacity*.png"), *plots_dir.glob("sweep_*.png")])
    return [{"name": n, "data": base64.b64encode((plots_dir / n).read_bytes()).decode()}
            for n in names if (plots_dir / n).exists()]


def build(results_dir: Path, plots_dir: Path | None = None) -> str:
    """The report's HTML for results/<scenario>, with the figures in plots_dir (none when it is None)."""
    from importlib.metadata import PackageNotFoundError, version

    import jinja2

    folders = {p.parent.name: p.parent for p in sorted(results_dir.glob("*/summary.json"))}
    if not folders:
        raise InputError(f"{results_dir} holds no engine results (no <engine>/summary.json); give a folder that "
                         "`simengine run` wrote, e.g. results/agent_multiturn", field="DIR")
    newest = max(folders.values(), key=lambda d: (d / "summary.json").stat().st_mtime)
    config = (newest / "config.yaml").read_text() if (newest / "config.yaml").exists() else ""
    import yaml
    cfg = yaml.safe_load(config) if config else {}
    order = [e if isinstance(e, str) else e.get("label") or e.get("engine") for e in (cfg or {}).get("engines", [])]
    folders = dict(sorted(folders.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order),
                                                           kv[0])))   # the scenario's order, then the others
    summaries = {k: json.loads((d / "summary.json").read_text()) for k, d in folders.items()}
    dep = (cfg or {}).get("deployment", {})
    table = side_by_side(summaries)
    try:
        ver = version("simengine")
    except PackageNotFoundError:
        ver = "(not installed)"
    env = jinja2.Environment(loader=jinja2.PackageLoader("simengine", "report/templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    overloaded = [k for k, s in summaries.items() if s.get("overloaded")]
    hardware = _hardware_name(str(dep.get("hardware", "?")))
    accuracy_rows, device_note = accuracy(summaries, hardware)
    return env.get_template(TEMPLATE).render(
        title=f"{results_dir.name}: engines side by side",
        subtitle=(f"{dep.get('model', '?')} ({dep.get('weight_dtype', '?')}) on {dep.get('replicas', 1)} x "
                  f"{dep.get('tp', 1) * dep.get('pp', 1)} {dep.get('hardware', '?')} (TP {dep.get('tp', 1)}, "
                  f"PP {dep.get('pp', 1)}), seed {(cfg or {}).get('seed', '?')}"),
        description=(cfg or {}).get("description", ""),
        insights=insights(summaries, folders),
        table_headers=list(table.columns), table_rows=[(k, list(row)) for k, row in table.iterrows()],
        overloaded_note=(f"{OVERLOADED_MARK}: overloaded ({', '.join(overloaded)}); the cost is a saturated "
                         "deployment's, not that of serving the offered rate") if overloaded else "",
        failures=[(k, n, reason) for k, s in summaries.items()
                  for reason, n in (s.get("failure_reasons") or {}).items()],
        accuracy_rows=accuracy_rows, device_note=device_note,
        figures=_figures(plots_dir, list(folders)),
        config=config, version=ver)


def write(results_dir: Path, plots_dir: Path | None = None) -> Path:
    """results/<scenario>/report.html, written under a temporary name and renamed."""
    from simengine.report.files import write_whole
    page = build(results_dir, plots_dir)
    return write_whole(results_dir / "report.html", lambda tmp: tmp.write_text(page))
