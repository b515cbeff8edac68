"""Figures from frames: per-engine TTFT/TPOT and KV/queue timelines, and an engine side-by-side grid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Save whole (report.files.write_whole: no partial image after an interrupt), then close."""
    from simengine.report.files import write_whole

    try:
        return write_whole(path, lambda tmp: fig.savefig(tmp, dpi=dpi))
    finally:
        plt.close(fig)


def _rolling(df: pd.DataFrame, col: str, q: float) -> pd.Series:
    window = max(5, len(df) // 25)
    return df[col].rolling(window, min_periods=1, center=True).quantile(q)


def time_axis(requests: pd.DataFrame) -> tuple[str, str]:
    """The column and label to draw requests along: arrival time, or finish time when every request arrived at
    once (an offline batch, where 'by arrival' would be a single column of points)."""
    arrivals = requests["arrival_s"]
    if len(arrivals) > 1 and arrivals.max() - arrivals.min() < 1e-9:
        return "finish_s", "finish time (s)"
    return "arrival_s", "arrival time (s)"


def _slo_line(ax, slo, metric: str) -> None:
    """The per-request objective for ttft or tpot, if the scenario gives one, as a dashed line."""
    limit = getattr(slo, f"{metric}_ms", None) if slo is not None else None
    if limit is not None:
        ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")


def latency_timeline(requests: pd.DataFrame, title: str, down: list[tuple[int, float, float]], slo, path: Path
                     ) -> Path:
    """TTFT and TPOT of each completed request at its arrival (offline: finish) time, with rolling p50 and p99;
    replica failures (replica, from, to) shaded; the scenario's SLO (or None) as dashed lines."""
    x, xlabel = time_axis(requests)
    done = requests[requests["status"] == "completed"].sort_values(x)
    fig, axes = plt.subplots(2, 1, figsize=(11.5, 6.5), sharex=True, layout="constrained")
    for ax, col, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms/token)")):
        d = done.dropna(subset=[col])
        ax.scatter(d[x], d[col], s=6, alpha=0.35, label="request", color="tab:blue")
        if len(d):
            ax.plot(d[x], _rolling(d, col, 0.5), color="tab:green", label="rolling p50")
            ax.plot(d[x], _rolling(d, col, 0.99), color="tab:red", label="rolling p99")
        ax.set_ylabel(label)
        ax.set_yscale("log") if len(d) and d[col].min() > 0 else None
        for k, (_replica, start, end) in enumerate(down):
            ax.axvspan(start, end, color="tab:gray", alpha=0.2, label="replica down" if k == 0 else None)
        _slo_line(ax, slo, col.split("_")[0])
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)  # beside the data
    axes[1].set_xlabel(xlabel)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def fleet_state(steps: pd.DataFrame, points: int = 600) -> pd.DataFrame:
    """Every replica's state (KV usage, running, waiting) as its last step left it, on one time grid: KV usage the
    mean over replicas, the queues their sums (steps of different replicas end at different times, so grouping rows
    by end time would draw one replica at a time)."""
    grid = np.linspace(0.0, float(steps["end_s"].max()), points)
    kv, run, wait = np.zeros(points), np.zeros(points), np.zeros(points)
    replicas = steps.groupby("replica", sort=True)
    for _, mine in replicas:
        mine = mine.sort_values("end_s", kind="stable")
        at = np.searchsorted(mine["end_s"].to_numpy(), grid, side="right") - 1   # its last step by then (-1: none)
        seen = at >= 0
        for total, col in ((kv, "kv_usage"), (run, "num_running"), (wait, "num_waiting")):
            total[seen] += mine[col].to_numpy()[at[seen]]
    return pd.DataFrame({"end_s": grid, "kv": kv / replicas.ngroups, "run": run, "wait": wait})


def kv_timeline(steps: pd.DataFrame, title: str, path: Path) -> Path:
    """KV-cache usage (mean over replicas), running and waiting requests (summed) over simulated time."""
    fig, ax1 = plt.subplots(figsize=(10, 4.8), layout="constrained")
    if len(steps):
        s = fleet_state(steps)
        ax1.plot(s["end_s"], s["kv"] * 100, color="tab:purple", label="KV usage (%)")
        ax2 = ax1.twinx()
        ax2.plot(s["end_s"], s["run"], color="tab:green", label="running", alpha=0.8)
        ax2.plot(s["end_s"], s["wait"], color="tab:orange", label="waiting", alpha=0.8)
        ax2.set_ylabel("requests")
        lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        fig.legend(lines, [str(ln.get_label()) for ln in lines], loc="outside lower center", ncol=3, fontsize=8)
    ax1.set_ylim(0, 105)
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel("KV usage (%)")
    ax1.grid(alpha=0.3)
    ax1.set_title(title)
    return save_figure(fig, path, dpi=110)


def busy_fraction(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Fraction of each interval between consecutive `edges` that a link was busy, from its busy intervals (sorted,
    never overlapping: a link carries one transfer at a time)."""
    cum = np.concatenate(([0.0], np.cumsum(ends - starts)))

    def busy_until(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(ends, t, side="right")          # intervals over by t
        inside = np.minimum(k, len(starts) - 1)
        partial = np.where((k < len(starts)) & (starts[inside] < t), t - starts[inside], 0.0) if len(starts) else 0.0
        return cum[k] + partial

    return np.diff(busy_until(edges)) / np.diff(edges)


def cluster_timeline(steps: pd.DataFrame, pools: list[str], links: dict[str, tuple[np.ndarray, np.ndarray]],
                     end_s: float, title: str, path: Path) -> Path:
    """Per replica (`pools`: each one's pool) the KV usage and queued requests over time, and with prefilling and
    decoding pools each KV link's busy fraction (`links`: label -> its busy intervals' starts and ends)."""
    rows = 3 if links else 2
    fig, axes = plt.subplots(rows, 1, figsize=(11, 2.6 * rows + 1), sharex=True, layout="constrained")
    colors = plt.get_cmap("tab10")
    for i in sorted(steps["replica"].unique()) if len(steps) else []:
        s = steps[steps["replica"] == i].sort_values("end_s")
        label = f"{i} {pools[int(i)]}"
        style = {"color": colors(int(i) % 10), "lw": 0.9, "label": label, "drawstyle": "steps-post"}
        axes[0].plot(s["end_s"], s["kv_usage"] * 100, **style)
        axes[1].plot(s["end_s"], s["num_waiting"], **style)
    axes[0].set_ylabel("KV usage (%)")
    axes[0].set_ylim(0, 105)
    axes[1].set_ylabel("waiting requests")
    if links:
        edges = np.linspace(0.0, max(end_s, 1e-9), 201)
        for k, (label, (starts, ends)) in enumerate(links.items()):
            axes[2].plot((edges[:-1] + edges[1:]) / 2, busy_fraction(starts, ends, edges) * 100,
                         color=colors(k % 10), lw=0.9, label=label)
        axes[2].set_ylabel("KV link busy (%)")
        axes[2].set_ylim(0, 105)
        axes[2].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=7, title="replica")
    axes[-1].set_xlabel("simulated time (s)")
    fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def _cdf(ax, values: np.ndarray, total: int, label: str, color) -> None:
    """The share of all `total` requests at or below each value: requests without one (failed, unfinished) keep
    the curve below 1.0 by their share."""
    v = np.sort(values[~np.isnan(values)])
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / max(total, len(v)), label=label, color=color)


def _listed_colors(name: str) -> list:
    """The colours of a qualitative (listed) colour map."""
    cmap = plt.get_cmap(name)
    assert isinstance(cmap, ListedColormap), f"{name} is not a listed colour map"
    return [tuple(c) for c in np.asarray(cmap.colors, dtype=float).tolist()]


# A qualitative palette of 12 distinct colours (tab10, then black and olive-gold): no two engines share a hue
# family up to 12; beyond, tab20's lighter shades follow.
PALETTE = [*_listed_colors("tab10"), (0.0, 0.0, 0.0), (0.72, 0.53, 0.04)]


def engine_colors(labels: list[str]) -> dict[str, tuple]:
    """One distinct colour per engine label."""
    extra = [c for i, c in enumerate(_listed_colors("tab20")) if i % 2]   # the light shades
    colors = PALETTE + extra
    return {lb: colors[i % len(colors)] for i, lb in enumerate(labels)}


def engines_grid(frames: dict[str, tuple[pd.DataFrame, pd.DataFrame]], summaries: dict[str, dict], title: str,
                 slo, path: Path) -> Path:
    """Engines side by side: TTFT and TPOT CDFs, throughput bars, KV usage, TTFT timelines overlaid."""
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5), layout="constrained")
    (a_ttft, a_tpot, a_thr), (a_kv, a_tl, a_tpl) = axes
    labels = list(frames)
    colors = engine_colors(labels)
    x, xlabel = time_axis(pd.concat([req[["arrival_s"]] for req, _ in frames.values()]))
    for label, (req, steps) in frames.items():
        c = colors[label]
        done = req[req["status"] == "completed"].sort_values(x)
        _cdf(a_ttft, done["ttft_ms"].to_numpy(), len(req), label, c)
        # TPOT exists for outputs of 2 or more tokens: the share is of those requests, failed ones included
        _cdf(a_tpot, done["tpot_ms"].to_numpy(), int((req["output_len"] > 1).sum()), label, c)
        if len(steps):
            s = fleet_state(steps)
            a_kv.plot(s["end_s"], s["kv"] * 100, label=label, alpha=0.8, color=c)
        d = done.dropna(subset=["ttft_ms"])
        if len(d):
            a_tl.plot(d[x], _rolling(d, "ttft_ms", 0.5), label=label, color=c)
        d = done.dropna(subset=["tpot_ms"])
        if len(d):
            a_tpl.plot(d[x], _rolling(d, "tpot_ms", 0.5), label=label, color=c)
    bars = np.arange(len(labels))
    a_thr.bar(bars, [summaries[lb]["output_throughput"] for lb in labels], color=[colors[lb] for lb in labels])
    a_thr.set_xticks(bars, labels, rotation=30, ha="right", fontsize=8)
    a_thr.set_ylabel("output tokens/s")
    a_thr.set_title("output throughput")
    for ax, t, xl in ((a_ttft, "TTFT CDF", "TTFT (ms)"), (a_tpot, "TPOT CDF", "TPOT (ms/token)")):
        ax.set_xscale("log")
        ax.set_title(t)
        ax.set_xlabel(xl)
        ax.set_ylabel("fraction of requests (failed: never reached)")
    a_kv.set_title("KV usage over time")
    a_kv.set_xlabel("simulated time (s)")
    a_kv.set_ylabel("KV usage (%)")
    by = xlabel.split()[0]
    _slo_line(a_tl, slo, "ttft")
    _slo_line(a_tpl, slo, "tpot")
    a_tl.set_title(f"TTFT rolling median by {by}")
    a_tl.set_yscale("log")
    a_tl.set_xlabel(xlabel)
    a_tl.set_ylabel("TTFT (ms)")
    a_tpl.set_title(f"TPOT rolling median by {by}")
    a_tpl.set_yscale("log")
    a_tpl.set_xlabel(xlabel)
    a_tpl.set_ylabel("TPOT (ms/token)")
    legend: dict[str, Any] = {}   # one legend for every panel, below them: an entry per engine, then SLO lines
    for ax in (a_ttft, a_tpot, a_kv, a_tl, a_tpl):
        ax.grid(alpha=0.3)
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncol=min(len(legend), 7),
                   fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=100)
