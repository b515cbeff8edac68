"""summary.json: vLLM `bench serve` keys (completed, failed, throughputs, mean/median/std/p99 of ttft, tpot,
itl, e2el in ms, request_goodput) plus simulator extras (unfinished, prefix hits, preemptions, KV usage, cost)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simengine.config.slo import SloConfig

PERCENTILES = (50, 90, 99)


def _stats(prefix: str, values: np.ndarray) -> dict[str, float | None]:
    v = values[~np.isnan(values)] if len(values) else values
    if not len(v):
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"std_{prefix}_ms": None,
                **{f"p{p}_{prefix}_ms": None for p in PERCENTILES}}
    out = {f"mean_{prefix}_ms": float(np.mean(v)), f"median_{prefix}_ms": float(np.median(v)),
           f"std_{prefix}_ms": float(np.std(v))}
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = float(np.percentile(v, p))
    return out


def weighted_stats(prefix: str, values: np.ndarray, weights: np.ndarray) -> dict[str, float | None]:
    """Statistics of a token-weighted sample, matching np.percentile's linear interpolation on the expansion."""
    if not len(values) or weights.sum() == 0:
        return _stats(prefix, np.array([]))
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    n = int(w.sum())
    mean = float(np.dot(v, w) / n)
    std = float(math.sqrt(max(np.dot(w, (v - mean) ** 2) / n, 0.0)))
    ends = np.cumsum(w)  # the expanded sample's index of each value's last copy is ends-1

    def pct(p: float) -> float:
        pos = (n - 1) * p / 100.0
        lo, hi = int(math.floor(pos)), int(math.ceil(pos))
        a = v[np.searchsorted(ends, lo, side="right")]
        b = v[np.searchsorted(ends, hi, side="right")]
        return float(a + (b - a) * (pos - lo))

    out = {f"mean_{prefix}_ms": mean, f"median_{prefix}_ms": pct(50), f"std_{prefix}_ms": std}
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = pct(p)
    return out


def meets_slo(done: pd.DataFrame, slo: SloConfig) -> np.ndarray:
    """Per completed request: does it meet every objective given."""
    good = np.ones(len(done), dtype=bool)
    if slo.ttft_ms is not None:
        good &= done["ttft_ms"].to_numpy() <= slo.ttft_ms
    if slo.tpot_ms is not None:
        good &= np.nan_to_num(done["tpot_ms"].to_numpy(), nan=0.0) <= slo.tpot_ms
    if slo.e2el_ms is not None:
        good &= done["e2el_ms"].to_numpy() <= slo.e2el_ms
    return good


def class_summary(requests: pd.DataFrame, slo: SloConfig, duration: float) -> dict:
    """Per request class: counts, latency percentiles and goodput against the class's own SLOs."""
    done = requests[requests["status"] == "completed"]
    out = {"num_requests": len(requests), "completed": len(done),
           "request_goodput": float(meets_slo(done, slo).sum()) / duration if slo.any else None,
           "slo_attainment": float(meets_slo(done, slo).mean()) if slo.any and len(done) else None}
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"):
        stat, metric = key.split("_", 1)
        v = done[metric].dropna()
        out[key] = (float(np.percentile(v, 50 if stat == "median" else 99)) if len(v) else None)
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def summarize(requests: pd.DataFrame, steps: pd.DataFrame, itl_ms: np.ndarray, itl_counts: np.ndarray, *,
              slo: SloConfig, end_s: float, num_devices: int, price_usd_per_hour: float | None,
              prefix_hit_rate: float, horizon_s: float, replicas: int = 1, classes=()) -> dict:
    """The summary dict for one engine run. No wall-clock values (same seed -> identical file)."""
    done = requests[requests["status"] == "completed"]
    n_failed = int((requests["status"] == "failed").sum())
    n_unfinished = int((requests["status"] == "unfinished").sum())
    duration = float(done["finish_s"].max()) if len(done) else 0.0
    if n_unfinished:
        duration = end_s
    duration = max(duration, 1e-9)
    out_tokens = int(done["num_output_tokens"].sum())
    in_tokens = int(done["prompt_len"].sum())
    good = meets_slo(done, slo)
    has_slo = slo.any
    busy = steps["step_s"].sum() if len(steps) else 0.0
    kv_mean = float(np.average(steps["kv_usage"], weights=steps["step_s"])) if busy > 0 else 0.0
    cost = None
    if price_usd_per_hour is not None and out_tokens:
        cost = price_usd_per_hour * num_devices * duration / 3600.0 / out_tokens * 1e6
    arrived = len(requests)
    # Overloaded: more than 5% of arrivals were still queued when the drain limit cut the run, or were turned away
    # by the engine's own load limit (HTTP 429, e.g. TGI max_concurrent_requests; such reasons start with "429").
    shed = int(requests["fail_reason"].str.startswith("429").sum()) if n_failed else 0
    backlog = n_unfinished if end_s > horizon_s else 0
    overloaded = bool(backlog + shed > 0.05 * max(arrived, 1))
    summary = {
        "num_requests": arrived,
        "completed": int(len(done)),
        "failed": n_failed,
        "unfinished": n_unfinished,
        "overloaded": overloaded,
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "request_goodput": (float(good.sum()) / duration) if has_slo else None,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **_stats("ttft", done["ttft_ms"].to_numpy()),
        **_stats("tpot", done["tpot_ms"].to_numpy()),
        **weighted_stats("itl", itl_ms, itl_counts),
        **_stats("e2el", done["e2el_ms"].to_numpy()),
        **_stats("queue", done["queue_ms"].to_numpy()),
        "prefix_cache_hit_rate": prefix_hit_rate,
        "preemptions": int(steps["preempted"].sum()) if len(steps) else 0,
        "mean_kv_usage": kv_mean,
        "max_kv_usage": float(steps["kv_usage"].max()) if len(steps) else 0.0,
        "mean_batch_size": float(steps["batch_size"].mean()) if len(steps) else 0.0,
        "num_steps": int(len(steps)),
        "busy_fraction": float(busy / (duration * replicas)),
        # share of the steps' time priced from measured kernel tables (the rest: roofline, floors, host time)
        "measured_kernel_share": float(steps["measured_s"].sum() / busy) if busy > 0 else 0.0,
        "cost_per_1m_output_tokens_usd": cost,
    }
    if classes:
        summary["classes"] = {c.name: class_summary(requests[requests["slo_class"] == c.name], c.slo, duration)
                              for c in classes}
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in summary.items()}
