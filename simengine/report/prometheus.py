"""The series vLLM's /metrics endpoint exposes, as the simulated engine would have shown them: metrics.csv over
simulated time (gauges, counters, and the histograms' counts and sums) and metrics.prom, a text-exposition
snapshot at the end of the run (prometheus_client), so dashboards and scrapers built for vLLM read our runs.

Every engine is reported under vLLM's names: the quantities are the same (running and waiting requests, KV usage,
preemptions, prompt and generation tokens, prefix-cache queries and hits, TTFT, inter-token and end-to-end
latency), whatever the engine calls them. Built from the recorder's chunks: memory stays bounded.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simengine.metrics.recorder import Recorder

# vLLM v1 vllm/v1/metrics/loggers.py PrometheusStatLogger: the histograms' bucket upper bounds (seconds)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
MAX_SAMPLES = 5000          # rows of metrics.csv at most: one per second of simulated time, coarser past that
COMPLETED = 0


def sample_interval_s(end_s: float) -> float:
    return max(1.0, end_s / MAX_SAMPLES)


def series(rec: Recorder, end_s: float) -> pd.DataFrame:
    """One row per sample time (the end of each interval): gauges as the engine's last step left them, counters
    and histogram counts/sums cumulative."""
    dt = sample_interval_s(end_s)
    n = int(end_s // dt) + 1
    times = (np.arange(n) + 1) * dt

    def bins(t: np.ndarray) -> np.ndarray:
        return np.minimum((t // dt).astype(np.intp), n - 1)

    replicas = 1 + int(max((rows["replica"].max() for rows in rec.step_rows() if len(rows)), default=0))
    gauges = {c: np.full((replicas, n), np.nan) for c in ("num_running", "num_waiting", "kv_usage")}
    per_bin = {c: np.zeros(n) for c in ("preempted", "output_tokens")}
    for rows in rec.step_rows():
        b = bins(rows["end_s"])
        for c in per_bin:
            per_bin[c] += np.bincount(b, weights=rows[c], minlength=n)
        for r in range(replicas):
            mine = np.flatnonzero(rows["replica"] == r)
            if not len(mine):
                continue
            rb = b[mine]
            last = len(rb) - 1 - np.unique(rb[::-1], return_index=True)[1]   # each bin's last step (time order)
            for c in gauges:
                gauges[c][r, rb[last]] = rows[c][mine[last]]
    for c in gauges:   # a bin without a step keeps the last state; before the first step, empty
        g = pd.DataFrame(gauges[c].T).ffill().fillna(0.0).to_numpy().T
        gauges[c] = g
    req = {c: np.zeros(n) for c in ("queries", "hits", "first_tokens", "prompts", "ttft_sum", "success", "e2e_sum")}
    for rows in rec.request_rows():
        scheduled = rows["first_scheduled_s"] >= 0
        b = bins(rows["first_scheduled_s"][scheduled])
        req["queries"] += np.bincount(b, weights=rows["prompt_len"][scheduled], minlength=n)
        req["hits"] += np.bincount(b, weights=rows["num_cached_tokens"][scheduled], minlength=n)
        first = rows["first_token_s"] >= 0
        b = bins(rows["first_token_s"][first])
        req["first_tokens"] += np.bincount(b, minlength=n)
        req["prompts"] += np.bincount(b, weights=rows["prompt_len"][first], minlength=n)
        req["ttft_sum"] += np.bincount(b, weights=(rows["first_token_s"] - rows["arrival_s"])[first], minlength=n)
        done = rows["status"] == COMPLETED
        b = bins(rows["finish_s"][done])
        req["success"] += np.bincount(b, minlength=n)
        req["e2e_sum"] += np.bincount(b, weights=(rows["finish_s"] - rows["arrival_s"])[done], minlength=n)
    cum = np.cumsum
    return pd.DataFrame({
        "time_s": times,
        "vllm:num_requests_running": gauges["num_running"].sum(axis=0),
        "vllm:num_requests_waiting": gauges["num_waiting"].sum(axis=0),
        "vllm:kv_cache_usage_perc": gauges["kv_usage"].mean(axis=0),
        "vllm:num_preemptions_total": cum(per_bin["preempted"]),
        # as vLLM v1 counts it (IterationStats.update_from_output): a request's whole prompt, cached part
        # included, when its first token comes out
        "vllm:prompt_tokens_total": cum(req["prompts"]),
        # every token a step emits (a request's first out of its last prefill step, a verify step's accepted drafts
        # and its own token), as each instance counts them: a P/D prefill instance's first token too
        "vllm:generation_tokens_total": cum(per_bin["output_tokens"]),
        "vllm:prefix_cache_queries_total": cum(req["queries"]),
        "vllm:prefix_cache_hits_total": cum(req["hits"]),
        "vllm:request_success_total": cum(req["success"]),
        "vllm:time_to_first_token_seconds_count": cum(req["first_tokens"]),
        "vllm:time_to_first_token_seconds_sum": cum(req["ttft_sum"]),
        "vllm:e2e_request_latency_seconds_count": cum(req["success"]),
        "vllm:e2e_request_latency_seconds_sum": cum(req["e2e_sum"]),
    })


def _buckets(bounds: tuple[float, ...], chunks) -> tuple[list[tuple[str, float]], float]:
    """Cumulative bucket counts (le, count) including +Inf, and the sum, from (values, weights) chunks."""
    edges = np.asarray(bounds)
    counts, total = np.zeros(len(edges) + 1), 0.0
    for values, weights in chunks:
        idx = np.searchsorted(edges, values, side="left")   # le: a value equal to a bound falls in its bucket
        counts += np.bincount(idx, weights=weights, minlength=len(edges) + 1)
        total += float(np.dot(values, weights)) if weights is not None else float(values.sum())
    cumulative = np.cumsum(counts)
    return [*((repr(float(b)), float(c)) for b, c in zip(bounds, cumulative)), ("+Inf", float(cumulative[-1]))], total


def exposition(rec: Recorder, end_s: float, model: str, engine: str) -> str:
    """The text exposition of the metrics at the end of the run."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["model_name", "engine"]
    values = [model, engine]
    last = series(rec, end_s).iloc[-1] if end_s > 0 else None

    def latency(kind):
        for rows in rec.request_rows():
            ok = rows["status"] == COMPLETED
            end = rows["first_token_s"] if kind == "ttft" else rows["finish_s"]
            yield (end - rows["arrival_s"])[ok], None

    class Snapshot:
        def collect(self):
            for name, doc in (("num_requests_running", "Number of requests in model execution batches."),
                              ("num_requests_waiting", "Number of requests waiting to be processed."),
                              ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")):
                g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
                g.add_metric(values, 0.0 if last is None else float(last[f"vllm:{name}"]))
                yield g
            for name, doc in (("num_preemptions", "Cumulative number of preemptions from the engine."),
                              ("prompt_tokens", "Number of prefill tokens processed."),
                              ("generation_tokens", "Number of generation tokens processed."),
                              ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                              ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                              ("request_success", "Count of successfully processed requests.")):
                c = CounterMetricFamily(f"vllm:{name}", doc, labels=labels)
                c.add_metric(values, 0.0 if last is None else float(last[f"vllm:{name}_total"]))
                yield c
            for name, doc, bounds, chunks in (
                    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS_S,
                     latency("ttft")),
                    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S,
                     ((g["gap_s"], g["tokens"].astype(float)) for g in rec.itl_rows())),
                    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS_S,
                     latency("e2e"))):
                buckets, total = _buckets(bounds, chunks)
                h = HistogramMetricFamily(f"vllm:{name}", doc, labels=labels)
                h.add_metric(values, buckets, total)
                yield h

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return generate_latest(registry).decode()
