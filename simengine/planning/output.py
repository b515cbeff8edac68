"""What `simengine capacity` writes and prints: capacity.json, capacity_points.csv, a latency-against-load figure
and a console table."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from simengine.planning.capacity import Capacity, StatLimit
from simengine.report.files import write_whole

POINT_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
              "mean_ttft_ms", "mean_e2el_ms", "request_throughput", "output_throughput", "completed", "failed",
              "unfinished")


def engine_record(cap: Capacity, target_rate: float | None, price: float | None, price_source: str) -> dict:
    return {
        "capacity_req_s": round(cap.rate, 6), "per_replica_req_s": round(cap.rate_per_replica, 6),
        "per_device_req_s": round(cap.rate_per_device, 6), "offline_req_s": round(cap.offline_rate, 6),
        "devices_for_target": cap.devices_for(target_rate) if target_rate else None,
        "cost_per_1m_output_tokens_usd": _round(cap.cost_per_1m_output_tokens(price)),
        "price_usd_per_hour": price, "price_source": price_source, "limited_by": cap.why_not_higher,
        "requests_per_run": cap.requests_per_run, "runs": cap.runs, "points": [point_record(p) for p in cap.points]}


def point_record(p) -> dict:
    return {"rate_req_s": round(p.rate, 6), "feasible": p.feasible, "why": p.why,
            "slo_attainment": _round(p.attainment), **{k: _round(p.stat(k)) for k in POINT_KEYS}}


def _round(v):
    return None if v is None else round(v, 6)


def table(caps: dict[str, Capacity], target_rate: float | None, price: float | None) -> str:
    rows = {}
    for label, c in caps.items():
        cost = c.cost_per_1m_output_tokens(price)
        rows[label] = {"capacity req/s": f"{c.rate:.3g}", "per replica": f"{c.rate_per_replica:.3g}",
                       "per GPU": f"{c.rate_per_device:.3g}", "offline req/s": f"{c.offline_rate:.3g}",
                       **({f"GPUs for {target_rate:g}/s": str(c.devices_for(target_rate) or "-")}
                          if target_rate else {}),
                       "$/1M out": "-" if cost is None else f"{cost:.3f}", "runs": str(c.runs),
                       "limited by": c.why_not_higher}
    return pd.DataFrame.from_dict(rows, orient="index").to_string()


def write(folder: Path, meta: dict, caps: dict[str, Capacity], target_rate: float | None, price: float | None,
          price_source: str) -> Path:
    """results/<scenario>/capacity.json and capacity_points.csv, each written whole under a temporary name."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "engines": {label: engine_record(c, target_rate, price, price_source)
                               for label, c in caps.items()}}
    rows = [{"engine": label, **point_record(p)} for label, c in caps.items() for p in c.points]
    path = write_whole(folder / "capacity.json", lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))
    write_whole(folder / "capacity_points.csv", lambda tmp: pd.DataFrame(rows).to_csv(tmp, index=False))
    return path


def figure(caps: dict[str, Capacity], limits: list[StatLimit], attainment: float | None, title: str,
           path: Path) -> Path:
    """p50/p99 TTFT and TPOT and SLO attainment against the offered rate, per engine; limits as dashed lines,
    each engine's capacity as a dotted vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simengine.report.plots import engine_colors, save_figure

    colors = engine_colors(list(caps))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, metric, unit in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "tpot", "TPOT (ms/token)")):
        for label, c in caps.items():
            rates = [p.rate for p in c.points]
            for stat, style in (("median", "-"), ("p99", "--")):
                ys = [p.stat(f"{stat}_{metric}_ms") for p in c.points]
                ax.plot(rates, [float("nan") if y is None else y for y in ys], style, marker=".",
                        color=colors[label], label=f"{label} {stat}")
        for lim in limits:
            if lim.metric == metric:
                ax.axhline(lim.limit_ms, color="black", linestyle=":", label=f"limit {lim.stat} {lim.limit_ms:g}")
        ax.set_yscale("log")
        ax.set_ylabel(unit)
    for label, c in caps.items():
        pts = [(p.rate, p.attainment) for p in c.points if p.attainment is not None]
        if pts:
            axes[2].plot([r for r, _ in pts], [100 * a for _, a in pts], marker=".", color=colors[label],
                         label=label)
    if attainment is not None and any(p.attainment is not None for c in caps.values() for p in c.points):
        axes[2].axhline(100 * attainment, color="black", linestyle=":", label=f"target {100 * attainment:g}%")
    axes[2].set_ylabel("requests meeting the SLO (%)")
    for ax in axes:
        for label, c in caps.items():
            if c.rate > 0:
                ax.axvline(c.rate, color=colors[label], linestyle=":", alpha=0.7)
        ax.set_xlabel("offered rate (req/s); dotted: capacity")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)
