"""summary.json: vLLM `bench serve` keys (completed, failed, throughputs, mean/median/std/p99 of ttft, tpot,
itl, e2el in ms, request_goodput) plus simulator extras (unfinished, prefix hits, preemptions, KV usage, cost).
Computed from the recorder's rows chunk by chunk (exact percentiles by metrics/stream_stats.py), so a run of any
length is summarised in bounded memory."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from simengine.config.slo import SloConfig
from simengine.metrics.frames import COMPLETED, latencies_ms
from simengine.metrics.recorder import Recorder
from simengine.metrics.stream_stats import sample_stats

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "e2el", "queue")


def _keys(prefix: str, stats: dict | None) -> dict[str, float | None]:
    if stats is None:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"std_{prefix}_ms": None,
                **{f"p{p}_{prefix}_ms": None for p in PERCENTILES}}
    return {f"mean_{prefix}_ms": stats["mean"], f"median_{prefix}_ms": stats[50], f"std_{prefix}_ms": stats["std"],
            **{f"p{p}_{prefix}_ms": stats[p] for p in PERCENTILES}}


def metric_stats(prefix: str, values: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float | None]:
    """mean/median/std/p90/p99 of one sample held in memory (NaN dropped; weights: copies of each value, as the
    token-weighted inter-token gaps)."""
    keep = ~np.isnan(values)
    sample = (values[keep], None if weights is None else weights[keep])
    return _keys(prefix, sample_stats(lambda: [{prefix: sample}], [prefix], PERCENTILES)[prefix])


def meets_slo(lat: dict[str, np.ndarray], slo: SloConfig) -> np.ndarray:
    """Per completed request (latencies_ms of completed rows): does it meet every objective given."""
    good = np.ones(len(lat["ttft_ms"]), dtype=bool)
    if slo.ttft_ms is not None:
        good &= lat["ttft_ms"] <= slo.ttft_ms
    if slo.tpot_ms is not None:
        good &= np.nan_to_num(lat["tpot_ms"], nan=0.0) <= slo.tpot_ms
    if slo.e2el_ms is not None:
        good &= lat["e2el_ms"] <= slo.e2el_ms
    return good


# Requests needed in the second half of the arrival window to judge whether completions kept up with arrivals.
BALANCE_MIN_ARRIVALS = 50


def arrival_balance(rec: Recorder, first: float, last: float, n: int) -> tuple[float | None, bool | None]:
    """(offered rate, kept up): the arrival rate over the arrival window (first to last send; None when all came
    at once), and whether the requests that finished (completed or failed) in the window's second half number at
    least the arrivals in it, within a tolerance of max(10%, 3 / sqrt(arrivals)): a stable engine finishes as
    many as arrive, an overloaded one only its service rate while its backlog grows. None when that half holds
    fewer than BALANCE_MIN_ARRIVALS arrivals. `first`, `last`, `n`: the first and last send and the requests."""
    if n < 2 or last - first <= 1e-9:
        return None, None
    mid = 0.5 * (first + last)
    arrived = finished = 0
    for rows in rec.request_rows():
        arrived += int(((rows["arrival_s"] >= mid) & (rows["arrival_s"] <= last)).sum())
        done = rows["status"] != 2
        finish = rows["finish_s"][done]
        finished += int(((finish >= mid) & (finish <= last)).sum())
    offered = (n - 1) / (last - first)
    if arrived < BALANCE_MIN_ARRIVALS:
        return offered, None
    return offered, finished >= arrived * (1 - max(0.1, 3 / arrived ** 0.5))


def slo_attainment(rec: Recorder, slo: SloConfig) -> float | None:
    """The share of all requests (failed and unfinished ones miss) that completed meeting every objective; None
    without objectives."""
    if not slo.any:
        return None
    good = total = 0
    for rows in rec.request_rows():
        done = rows["status"] == COMPLETED
        lat = latencies_ms(rows[done])
        good += int(meets_slo(lat, slo).sum())
        total += len(rows)
    return good / total if total else None


class _Totals:
    """Counts and sums of one set of requests (all, or one class) over the chunks."""

    def __init__(self, num_codes: int = 0):
        self.requests = self.completed = self.failed = self.unfinished = self.shed = self.good = 0
        self.in_tokens = self.out_tokens = 0
        self.last_finish_s = 0.0
        self.first_arrival_s, self.last_arrival_s = float("inf"), float("-inf")
        self.failed_by_code = np.zeros(num_codes, dtype=np.int64)   # failed requests per fail_reason code

    def add(self, rows: np.ndarray, lat: dict, done: np.ndarray, slo: SloConfig, shed_codes: np.ndarray) -> None:
        status = rows["status"]
        self.requests += len(rows)
        if len(rows):
            self.first_arrival_s = min(self.first_arrival_s, float(rows["arrival_s"].min()))
            self.last_arrival_s = max(self.last_arrival_s, float(rows["arrival_s"].max()))
        if len(self.failed_by_code):
            self.failed_by_code += np.bincount(rows["fail_reason"][status == 1], minlength=len(self.failed_by_code))
        self.completed += int(done.sum())
        self.failed += int((status == 1).sum())
        self.unfinished += int((status == 2).sum())
        self.shed += int(np.isin(rows["fail_reason"][status == 1], shed_codes).sum())
        self.in_tokens += int(rows["prompt_len"][done].sum())
        self.out_tokens += int(rows["num_output_tokens"][done].sum())
        if done.any():
            self.last_finish_s = max(self.last_finish_s, float(rows["finish_s"][done].max()))
        if slo.any:
            self.good += int(meets_slo({k: v[done] for k, v in lat.items()}, slo).sum())


def _request_passes(rec: Recorder, classes):
    """Per chunk: the latency samples (completed rows, NaN dropped) of all requests and of each class."""
    class_codes = {c.name: rec.code(c.name) for c in classes}

    def passes():
        for rows in rec.request_rows():
            lat = latencies_ms(rows)
            done = rows["status"] == COMPLETED
            out = {}
            for m in LATENCIES:   # of completed requests, like the other latencies
                v = lat[f"{m}_ms"][done]
                out[m] = (v[~np.isnan(v)], None)
            for name, code in class_codes.items():
                mine = rows["slo_class"] == code
                for m in ("ttft", "tpot"):
                    v = lat[f"{m}_ms"][done & mine]
                    out[f"{name}/{m}"] = (v[~np.isnan(v)], None)
            yield out
    return passes


def summarize(rec: Recorder, *, slo: SloConfig, end_s: float, num_devices: int, price_usd_per_hour: float | None,
              prefix_hit_rate: float, horizon_s: float, replicas: int = 1, classes=()) -> dict:
    """The summary dict for one engine run. No wall-clock values (same seed -> identical file)."""
    shed_codes = np.array([i for i, s in enumerate(rec.strings) if s.startswith("429")], dtype=np.int32)
    total, per_class = _Totals(len(rec.strings)), {c.name: _Totals() for c in classes}
    for rows in rec.request_rows():
        lat = latencies_ms(rows)
        done = rows["status"] == COMPLETED
        total.add(rows, lat, done, slo, shed_codes)
        for c in classes:
            code = rec.code(c.name)
            mine = rows["slo_class"] == (code if code is not None else -1)
            if mine.any():
                per_class[c.name].add(rows[mine], {k: v[mine] for k, v in lat.items()}, done[mine], c.slo, shed_codes)
    names = [*LATENCIES, *(f"{c.name}/{m}" for c in classes for m in ("ttft", "tpot"))]
    stats = sample_stats(_request_passes(rec, classes), names, PERCENTILES)
    itl = sample_stats(lambda: ({"itl": (g["gap_s"] * 1e3, g["tokens"])} for g in rec.itl_rows()), ["itl"],
                       PERCENTILES)["itl"]

    steps = busy = kv_weighted = kv_max = batch = preempted = measured = 0.0
    for rows in rec.step_rows():
        steps += len(rows)
        busy += float(rows["step_s"].sum())
        kv_weighted += float(np.dot(rows["kv_usage"], rows["step_s"]))
        kv_max = max(kv_max, float(rows["kv_usage"].max()))
        batch += float(rows["batch_size"].sum())
        preempted += float(rows["preempted"].sum())
        measured += float(rows["measured_s"].sum())

    duration = total.last_finish_s
    if total.unfinished:
        duration = end_s
    duration = max(duration, 1e-9)
    cost = None
    if price_usd_per_hour is not None and total.out_tokens:
        cost = price_usd_per_hour * num_devices * duration / 3600.0 / total.out_tokens * 1e6
    # Overloaded: more than 5% of arrivals were still queued when the drain limit cut the run, or were turned away
    # by the engine's own load limit (HTTP 429, e.g. TGI max_concurrent_requests; such reasons start with "429").
    backlog = total.unfinished if end_s > horizon_s else 0
    offered, kept_up = arrival_balance(rec, total.first_arrival_s, total.last_arrival_s, total.requests)
    overloaded = bool(backlog + total.shed > 0.05 * max(total.requests, 1)) or kept_up is False
    summary: dict[str, Any] = {
        "num_requests": total.requests,
        "completed": total.completed,
        "failed": total.failed,
        "unfinished": total.unfinished,
        "overloaded": overloaded,
        "offered_rate": offered,
        "duration": duration,
        "total_input_tokens": total.in_tokens,
        "total_output_tokens": total.out_tokens,
        "request_throughput": total.completed / duration,
        "request_goodput": total.good / duration if slo.any else None,
        "output_throughput": total.out_tokens / duration,
        "total_token_throughput": (total.in_tokens + total.out_tokens) / duration,
        **_keys("ttft", stats["ttft"]),
        **_keys("tpot", stats["tpot"]),
        **_keys("itl", itl),
        **_keys("e2el", stats["e2el"]),
        **_keys("queue", stats["queue"]),
        "prefix_cache_hit_rate": prefix_hit_rate,
        "preemptions": int(preempted),
        "mean_kv_usage": kv_weighted / busy if busy > 0 else 0.0,
        "max_kv_usage": kv_max,
        "mean_batch_size": batch / steps if steps else 0.0,
        "num_steps": int(steps),
        "busy_fraction": float(busy / (duration * replicas)),
        # share of the steps' time priced from measured kernel tables (the rest: roofline, floors, host time)
        "measured_kernel_share": measured / busy if busy > 0 else 0.0,
        "cost_per_1m_output_tokens_usd": cost,
    }
    summary["failure_reasons"] = failure_reasons(rec.strings, total.failed_by_code)
    if classes:
        summary["classes"] = {c.name: _class_summary(per_class[c.name], stats, c, duration) for c in classes}
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in summary.items()}


def failure_reasons(strings: list[str], counts: np.ndarray, top: int = 10) -> dict[str, int]:
    """Failed requests by reason (`counts` per string code), most frequent first: reasons that differ only in their
    numbers (prompt lengths, replicas) count together, each number that differs shown as the values it took (up to
    four, 'replica 0/1/2 failed') or their range ('prompt of 4012-9000 tokens'); past `top` kinds the rest count
    under "other"."""
    kinds: dict[str, list] = {}
    for code in np.flatnonzero(counts):
        reason = strings[code] or "(no reason given)"
        kind = kinds.setdefault(re.sub(r"\d+", "#", reason), [[], 0])
        kind[0].append(reason)
        kind[1] += int(counts[code])
    ranked = sorted(((_merged(reasons), n) for reasons, n in kinds.values()), key=lambda k: -k[1])
    out = {reason: n for reason, n in ranked[:top]}
    if len(ranked) > top:
        out["other"] = sum(n for _, n in ranked[top:])
    return out


def _merged(reasons: list[str]) -> str:
    """One label for reasons that differ only in their numbers (failure_reasons)."""
    if len(reasons) == 1:
        return reasons[0]
    numbers = [re.findall(r"\d+", r) for r in reasons]
    parts = re.split(r"\d+", reasons[0])
    shown = []
    for values in zip(*numbers, strict=True):
        distinct = sorted(set(values), key=int)
        shown.append(distinct[0] if len(distinct) == 1 else "/".join(distinct) if len(distinct) <= 4
                     else f"{distinct[0]}-{distinct[-1]}")
    return "".join(p + s for p, s in zip(parts, [*shown, ""], strict=True))


def _class_summary(t: _Totals, stats: dict, c, duration: float) -> dict:
    """Per request class: counts, latency percentiles and goodput against the class's own SLOs."""
    out = {"num_requests": t.requests, "completed": t.completed,
           "request_goodput": float(t.good) / duration if c.slo.any else None,
           "slo_attainment": float(t.good) / t.completed if c.slo.any and t.completed else None}
    for m in ("ttft", "tpot"):
        s = stats[f"{c.name}/{m}"]
        out[f"median_{m}_ms"] = s[50] if s else None
        out[f"p99_{m}_ms"] = s[99] if s else None
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def replica_sections(rec: Recorder, prefix_tokens: list[tuple[int, int]], decisions: list[int],
                     pools: list[str]) -> list[dict]:
    """Per replica (a deployment of several): its pool, the requests its router sent it (`decisions`), those that
    finished on it (completed or failed; with prefill/decode pools, on the decode side), its completed ones, its
    prefix-cache hit rate (`prefix_tokens`: its engine's (queried, hit) prompt tokens) and its mean KV usage over
    its steps."""
    n = len(prefix_tokens)
    placed, completed = np.zeros(n, np.int64), np.zeros(n, np.int64)
    done = rec.code("completed")
    for rows in rec.request_rows():
        on = rows["replica"] >= 0
        placed += np.bincount(rows["replica"][on], minlength=n)[:n]
        completed += np.bincount(rows["replica"][on & (rows["status"] == done)], minlength=n)[:n]
    kv_sum, steps = np.zeros(n), np.zeros(n)
    for rows in rec.step_rows():
        r = rows["replica"].astype(np.int64)
        kv_sum += np.bincount(r, weights=rows["kv_usage"], minlength=n)[:n]
        steps += np.bincount(r, minlength=n)[:n]
    return [{"replica": i, "pool": pools[i], "router_decisions": decisions[i], "requests": int(placed[i]),
             "completed": int(completed[i]),
             "prefix_cache_hit_rate": round(hit / queried, 6) if queried else 0.0,
             "mean_kv_usage": round(float(kv_sum[i] / steps[i]), 6) if steps[i] else 0.0}
            for i, (queried, hit) in enumerate(prefix_tokens)]


def stage_sections(frame, stages_run: list[tuple[float, float, int, int]], stages: list) -> list[dict]:
    """Per load stage (arrival process stages): its rate and requests, and over its requests the latencies and
    output throughput (tokens over the stage's span, from its start until its last request finished), as
    inference-perf reports each stage. `frame`: requests_frame; `stages_run`: Runner.stages_run."""
    out = []
    for cfg, (start, end, first, stop) in zip(stages, stages_run, strict=False):
        mine = frame[(frame["request_id"] >= first) & (frame["request_id"] < stop)]
        done = mine[mine["status"] == "completed"]
        section = {"rate": cfg.rate, "duration_s": cfg.duration_s, "start_s": start, "end_s": end,
                   "requests": len(mine), "completed": len(done),
                   "output_throughput_tok_s": float(done["num_output_tokens"].sum()) / (end - start)
                   if end > start else None}
        for q in ("ttft", "tpot", "e2el"):
            section |= metric_stats(q, done[f"{q}_ms"].to_numpy(dtype=float))
        out.append(section)
    return out
