"""One engine run as the JSON `vllm bench serve --save-result --save-detailed` writes (vllm/benchmarks/serve.py), so
tools that read vLLM's result files read ours: the same keys and units, statistics over every request, per-request
lists over the scenario's detailed requests (output.detailed_requests, the first N by id), simulator facts under
`simengine_*` keys."""

from __future__ import annotations

import math

import numpy as np

from simengine.config.scenario import Scenario
from simengine.metrics.recorder import Recorder

# vLLM's result keys (vllm/benchmarks/serve.py main_async and benchmark): setup, results, per metric mean/median/std/p99
STAT_METRICS = ("ttft", "tpot", "itl", "e2el")
STAT_KEYS = ("mean", "median", "std", "p99")   # vLLM's default --metric-percentiles is "99"
LIST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
             "generated_texts", "errors")
UNFINISHED_ERROR = "unfinished when the simulation ended (horizon_s + drain_s)"


def traffic(scenario: Scenario) -> dict:
    """request_rate ("inf" unless requests arrive at a rate), burstiness and max_concurrency as vLLM names them."""
    arrival = scenario.workload.arrival
    rated = scenario.workload.trace is None and scenario.workload.sessions is None and \
        arrival.process in ("poisson", "gamma", "constant", "ramp", "diurnal")
    return {"request_rate": arrival.rate if rated else "inf",
            "burstiness": arrival.burstiness if arrival.process == "gamma" else 1.0,
            "max_concurrency": arrival.concurrency if arrival.process == "closed_loop" else None}


def peak_output_tokens_per_s(rec: Recorder, start_s: float) -> float:
    """vLLM's max_output_tokens_per_s: output tokens counted in one-second buckets from the first send, the fullest
    bucket. Every step's sampled tokens land at its end (steps.csv output_tokens), all replicas together."""
    counts: np.ndarray = np.zeros(0)
    for rows in rec.step_rows():
        buckets = np.floor(rows["end_s"] - start_s).astype(np.int64)
        keep = buckets >= 0
        add = np.bincount(buckets[keep], weights=rows["output_tokens"][keep])
        if len(add) > len(counts):
            add[:len(counts)] += counts
            counts = add
        else:
            counts[:len(add)] += add
    return float(counts.max()) if len(counts) else 0.0


def peak_concurrency(rec: Recorder) -> tuple[int, float]:
    """vLLM's max_concurrent_requests (benchmarks/serve.py calculate_metrics): one-second buckets from the first
    completed request's send, each completed request counted in every bucket from its send's to its end's
    (inclusive), the fullest bucket; and that first send time."""
    done = rec.code("completed")
    starts, ends = [], []
    for rows in rec.request_rows():
        ok = rows["status"] == done
        starts.append(rows["arrival_s"][ok])
        ends.append(rows["finish_s"][ok])
    sent = np.concatenate(starts) if starts else np.zeros(0)
    if not len(sent):
        return 0, 0.0
    first = float(sent.min())
    lo = (sent - first).astype(np.int64)
    hi = (np.concatenate(ends) - first).astype(np.int64)
    change = np.zeros(int(hi.max()) + 2, np.int64)   # +1 at each request's first bucket, -1 past its last
    np.add.at(change, lo, 1)
    np.add.at(change, hi + 1, -1)
    return int(np.cumsum(change).max()), first


def per_request_lists(rec: Recorder, limit: int) -> dict[str, list]:
    """The per-request lists over the detailed requests (ids below `limit`), in id order, as vLLM fills them: a
    failed request has ttft 0, no itls, latency 0 and its error; output_lens count the tokens it received."""
    lists: dict[str, list] = {k: [] for k in LIST_KEYS}
    strings, done = rec.strings, rec.code("completed")
    for block in rec.request_rows_by_id():
        rows = block[block["request_id"] < limit]
        for r in rows.tolist():
            row = dict(zip(rows.dtype.names or (), r))
            rid, sent = row["request_id"], row["arrival_s"]
            ok = row["status"] == done
            times = rec.token_times.get(rid)
            lists["input_lens"].append(row["prompt_len"])
            lists["output_lens"].append(row["num_output_tokens"] if ok else 0)
            lists["ttfts"].append(row["first_token_s"] - sent if ok else 0.0)
            # one gap a streamed chunk, as the client sees them: the tokens of one chunk (a verify step's accepted
            # drafts) arrive together, so the zero gaps between them are not inter-token latencies
            gaps = np.diff(times) if ok and times is not None else np.empty(0)
            lists["itls"].append(gaps[gaps > 0].tolist())
            lists["latencies"].append(row["finish_s"] - sent if ok else 0.0)
            lists["start_times"].append(sent)
            lists["queue_times"].append(0.0)   # the simulated client sends on time: no client-side semaphore wait
            lists["generated_texts"].append("")
            lists["errors"].append("" if ok else strings[row["fail_reason"]] or
                                   (UNFINISHED_ERROR if strings[row["status"]] == "unfinished" else "failed"))
        if len(rows) < len(block):   # ids ascend: the rest are past the limit
            break
    return lists


def bench_result(rec: Recorder, summary: dict, scenario: Scenario, engine: str, date: str) -> dict:
    """The whole result dict for one engine run (`summary` from metrics.summary.summarize, `date` YYYYMMDD-HHMMSS)."""
    model = scenario.deployment.model
    out = {"date": date, "endpoint_type": "openai", "backend": engine, "label": summary["label"],
           "model_id": model, "tokenizer_id": model, "num_prompts": summary["num_requests"], **traffic(scenario)}
    out.update({k: summary[k] for k in ("duration", "completed", "total_input_tokens", "total_output_tokens",
                                        "request_throughput", "request_goodput", "output_throughput",
                                        "total_token_throughput")})
    out["failed"] = summary["failed"] + summary["unfinished"]   # vLLM's client counts every unsuccessful request
    limit = scenario.output.detailed_requests
    lists = per_request_lists(rec, limit)
    out.update(lists)
    peak, first_sent_s = peak_concurrency(rec)
    out["max_output_tokens_per_s"] = peak_output_tokens_per_s(rec, first_sent_s)
    out["max_concurrent_requests"] = peak
    out["rtfx"] = 0.0   # audio transcription only
    for m in STAT_METRICS:
        for s in STAT_KEYS:
            value = summary.get(f"{s}_{m}_ms")
            out[f"{s}_{m}_ms"] = value if value is not None and not math.isnan(value) else 0.0
    out["simengine_detailed_requests"] = {
        "listed": len(lists["input_lens"]), "of": summary["num_requests"],
        "rule": f"the per-request lists hold the first {limit} requests by id (scenario output.detailed_requests); "
                "every statistic covers all requests", "start_times": "simulated seconds from the run's start",
        "unfinished": summary["unfinished"]}
    return out
