"""Validation outputs: DIR/validation.csv, DIR/skipped.csv, the printed table and the predicted-vs-measured plot."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

from simengine.validate.experiments import Skip
from simengine.validate.run import Prediction

CSV_COLUMNS = ("id", "metric", "measured", "predicted", "error_pct")


def abs_errors(preds: list[Prediction]) -> np.ndarray:
    return np.abs(np.array([p.error_pct for p in preds], dtype=float))


def summary_line(preds: list[Prediction], skips: list[Skip]) -> str:
    """The last line `simengine validate` prints (the issue's contract)."""
    e = abs_errors(preds)
    med = float(np.median(e)) if len(e) else float("nan")
    p90 = float(np.percentile(e, 90)) if len(e) else float("nan")
    return f"median_abs_error_pct={med:.1f} p90_abs_error_pct={p90:.1f} rows={len(preds)} skipped={len(skips)}"


def write_csv(preds: list[Prediction], skips: list[Skip], out_dir: Path) -> Path:
    """validation.csv (one line per row that ran, error signed: + means over-predicted) and skipped.csv."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "validation.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for p in preds:
            w.writerow((p.row.id, p.row.metric, f"{p.row.value:.6g}", f"{p.predicted:.6g}", f"{p.error_pct:.2f}"))
    with (out_dir / "skipped.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(("id", "metric", "reason"))
        for s in skips:
            w.writerow((s.row.id, s.row.metric, s.reason.replace("\n", " ")))
    return path


def _group_table(preds: list[Prediction], key, title: str) -> list[str]:
    groups: dict[str, list[Prediction]] = defaultdict(list)
    for p in preds:
        groups[key(p)].append(p)
    lines = [f"{title:34s} {'rows':>5s} {'median|err|%':>13s} {'p90|err|%':>10s} {'median err%':>12s}"]
    for name in sorted(groups):
        g = groups[name]
        e = abs_errors(g)
        signed = np.array([p.error_pct for p in g])
        lines.append(f"{name:34s} {len(g):5d} {np.median(e):13.1f} {np.percentile(e, 90):10.1f} "
                     f"{np.median(signed):+12.1f}")
    return lines


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two equally long lists: (concordant - discordant pairs) / pairs; ties count as neither."""
    n = len(a)
    pairs = n * (n - 1) // 2
    if not pairs:
        return float("nan")
    s = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i in range(n) for j in range(i + 1, n))
    return float(s) / pairs


def contender(p: Prediction) -> str:
    """What a side-by-side row measured: its engine, and the router its notes name (`router=`, `router_params=`)."""
    items = p.row.note_items
    router = items.get("router", "").split()[:1]
    params = items.get("router_params", "").split()[:1]
    return p.engine + (f"@{router[0]}" if router else "") + (f"[{params[0]}]" if params else "")


def ranking_groups(preds: list[Prediction]) -> list[dict]:
    """Rows that measured several engines (or routers) side by side (same source, device, model, dtype,
    parallelism, lengths, arrival and metric): does the simulator order them as the measurement does? One dict per
    group."""
    from simengine.validate.experiments import stated_means

    groups: dict[tuple, list[Prediction]] = defaultdict(list)
    for p in preds:
        r = p.row
        lengths = (r.input_len, r.output_len) if r.input_len or r.output_len else stated_means(r)
        groups[(r.source.split(" ")[0], r.hardware, r.model, r.weight_dtype, r.tp, r.pp, lengths, r.dataset,
                str(r.arrival), r.metric)].append(p)
    out = []
    for key, g in groups.items():
        if len({contender(p) for p in g}) < 2:
            continue
        g = sorted(g, key=lambda p: p.row.value)
        shown = "/".join(f"{x:g}" if x is not None else "?" for x in key[6]) if key[6] else ""
        out.append({"group": f"{key[1]} {key[2]} tp{key[4]} {key[7]} {shown} {key[8]} {key[9]}".replace("  ", " "),
                    "engines": len(g), "tau": kendall_tau([p.row.value for p in g], [p.predicted for p in g]),
                    "measured": " < ".join(contender(p) for p in g),
                    "predicted": " < ".join(contender(p) for p in sorted(g, key=lambda p: p.predicted))})
    return sorted(out, key=lambda d: d["group"])


def ranking_table(preds: list[Prediction]) -> list[str]:
    rows = ranking_groups(preds)
    if not rows:
        return []
    lines = [f"{'engines or routers side by side (Kendall tau, measured vs predicted)':70s} {'n':>3s} {'tau':>6s}"]
    for d in rows:
        lines.append(f"{d['group'][:70]:70s} {d['engines']:3d} {d['tau']:+6.2f}   measured {d['measured']}; "
                     f"predicted {d['predicted']}")
    taus = [d["tau"] for d in rows]
    lines.append(f"mean tau {np.mean(taus):+.2f} over {len(rows)} groups; {sum(t == 1 for t in taus)} in the same "
                 "order exactly")
    return lines


def terms_table(engines: list[str]) -> list[str]:
    """Per engine: each timing term, fitted (calibration.yaml) or the engine module's prior."""
    from simengine.cost.calibrated import TIMING_TERMS, read_engine_terms

    fitted = read_engine_terms()
    lines = [f"{'engine terms':12s} " + " ".join(f"{t:>16s}" for t in TIMING_TERMS)]
    for eng in engines:
        f = fitted.get(eng, {})
        cells = [f"{f[t]:.3g} fitted" if t in f else "prior" for t in TIMING_TERMS]
        lines.append(f"{eng:12s} " + " ".join(f"{c:>16s}" for c in cells))
    return lines


def format_report(preds: list[Prediction], skips: list[Skip], *, rows_detail: bool = True) -> str:
    """The printed table: every row, then per-metric / per-hardware / per-engine errors and the skips."""
    out = []
    if rows_detail:
        out.append(f"{'id':58s} {'engine':8s} {'metric':24s} {'measured':>10s} {'predicted':>10s} {'err%':>7s}")
        for p in preds:
            flag = " SUSPECT" if "SUSPECT" in p.row.flags else ""
            out.append(f"{p.row.id[:58]:58s} {p.engine[:8]:8s} {p.row.metric[:24]:24s} {p.row.value:10.4g} "
                       f"{p.predicted:10.4g} {p.error_pct:+7.1f}{flag}")
        out.append("")
    if preds:
        out += _group_table(preds, lambda p: p.row.metric, "metric") + [""]
        out += _group_table(preds, lambda p: p.row.hardware, "hardware") + [""]
        out += _group_table(preds, lambda p: p.engine, "engine") + [""]
        out += terms_table(sorted({p.engine for p in preds})) + [""]
        ranking = ranking_table(preds)
        if ranking:
            out += ranking + [""]
    if skips:
        reasons: dict[str, list[str]] = defaultdict(list)
        for s in skips:
            reasons[s.reason].append(s.row.id)
        out.append(f"skipped {len(skips)} rows:")
        for reason, ids in reasons.items():
            more = f" (+{len(ids) - 3} more)" if len(ids) > 3 else ""
            out.append(f"  {len(ids):3d} x {reason} [{', '.join(ids[:3])}{more}]")
        out.append("")
    out.append(summary_line(preds, skips))
    return "\n".join(out)


def plot(preds: list[Prediction], path: Path, skips: list[Skip] | None = None,
         title: str = "simengine validate: predicted vs measured") -> Path:
    """Log-log predicted against measured, one colour per hardware, a marker per metric family; rows flagged
    SUSPECT in their notes are crossed out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 6.5))
    hws = sorted({p.row.hardware for p in preds})
    colours = plt.get_cmap("tab10")
    markers = {"ms": "o", "tok_s": "s", "throughput": "^", "other": "D"}

    def family(metric: str) -> str:
        if "throughput" in metric:
            return "throughput"
        return "tok_s" if metric.endswith("tok_s") else ("ms" if metric.endswith("_ms") else "other")

    for i, hw in enumerate(hws):
        for fam, mk in markers.items():
            sel = [p for p in preds if p.row.hardware == hw and family(p.row.metric) == fam]
            if sel:
                ax.scatter([p.row.value for p in sel], [p.predicted for p in sel], s=18, marker=mk,
                           color=colours(i % 10), alpha=0.8, label=f"{hw} ({fam})")
    odd = [p for p in preds if "SUSPECT" in p.row.flags]
    if odd:
        ax.scatter([p.row.value for p in odd], [p.predicted for p in odd], s=60, marker="x", color="black",
                   label="flagged SUSPECT in the source")
    values = [p.row.value for p in preds] + [p.predicted for p in preds]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="black", lw=1)
    for f in (0.75, 1.25):
        ax.plot(xs, xs * f, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured (ms, tok/s or req/s as the metric names)")
    ax.set_ylabel("predicted")
    ax.set_title(f"{title}\n{summary_line(preds, skips or [])}", fontsize=9)
    ax.legend(fontsize=6.5, loc="upper left", ncol=1)
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
