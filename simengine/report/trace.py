"""Chrome / Perfetto trace (trace-event JSON) of one engine run: a process per replica whose track holds the steps
(tokens and time breakdown as args) with counters for KV usage and queues, and a process of requests with a track
per request (queued, prefill, decode; failed ones marked). Open it at ui.perfetto.dev or chrome://tracing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from simengine.metrics.recorder import Recorder

# A long run's trace keeps its first TRACE_MAX_STEPS steps and the requests (at most TRACE_MAX_REQUESTS, by id)
# that arrived before the last of those steps ended: a viewer opens it in seconds, and the cut is stated in it.
TRACE_MAX_STEPS = 50_000
TRACE_MAX_REQUESTS = 10_000
REQUESTS_PID = 0
_US = 1e6


def _step_name(prefill: float, decode: float) -> str:
    return "prefill+decode" if prefill and decode else "prefill" if prefill else "decode" if decode else "idle"


def trace_events(rec: Recorder, label: str) -> dict:
    """The trace-event JSON object of a recorded run."""
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "args": {"name": "requests"}}]
    steps_kept, cut_s, replicas = 0, float("inf"), set()
    for rows in rec.step_rows():
        room = TRACE_MAX_STEPS - steps_kept
        if room <= 0:
            break
        rows = rows[:room]
        steps_kept += len(rows)
        if steps_kept >= TRACE_MAX_STEPS:
            cut_s = float(rows["end_s"][-1])
        for r in rows.tolist():   # a record per step: plain Python values for json
            (replica, start, end, batch, prefill, decode, running, waiting, kv, preempted, step_s, compute_s,
             memory_s, comm_s, overhead_s, measured_s, graph, tokens, drafts) = r
            pid = int(replica) + 1
            replicas.add(pid)
            events.append({"ph": "X", "name": _step_name(prefill, decode), "pid": pid, "tid": 0, "ts": start * _US,
                           "dur": (end - start) * _US,
                           "args": {"batch_size": int(batch), "prefill_tokens": int(prefill),
                                    "decode_tokens": int(decode), "output_tokens": int(tokens),
                                    "draft_tokens": int(drafts),
                                    "preempted": int(preempted),
                                    "compute_ms": compute_s * 1e3, "memory_ms": memory_s * 1e3,
                                    "comm_ms": comm_s * 1e3, "overhead_ms": overhead_s * 1e3,
                                    "measured_ms": measured_s * 1e3, "cuda_graph": bool(graph)}})
            events.append({"ph": "C", "name": "KV usage %", "pid": pid, "ts": end * _US,
                           "args": {"kv_usage": round(kv * 100, 3)}})
            events.append({"ph": "C", "name": "requests", "pid": pid, "ts": end * _US,
                           "args": {"running": int(running), "waiting": int(waiting)}})
    for pid in sorted(replicas):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"replica {pid - 1}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "steps"}})
    strings = rec.strings
    requests_kept = 0
    for rows in rec.request_rows_by_id():
        rows = rows[rows["arrival_s"] <= cut_s][:TRACE_MAX_REQUESTS - requests_kept]
        requests_kept += len(rows)
        for r in rows:
            events.extend(_request_events(r, strings))
        if requests_kept >= TRACE_MAX_REQUESTS:
            break
    events.sort(key=lambda e: (e["pid"], e.get("tid", -1), e.get("ts", -1.0)))
    note = ("every step and request of the run" if cut_s == float("inf") and requests_kept < TRACE_MAX_REQUESTS
            else f"the first {steps_kept:,} steps and {requests_kept:,} requests (by id) of {rec.num_steps:,} steps "
                 f"and {rec.num_requests:,} requests")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"engine": label, "contents": note,
                          "not_recorded": "preemption intervals (each request's count is in its args)"}}


def _request_events(r: np.void, strings: list[str]) -> list[dict]:
    rid, tid = int(r["request_id"]), int(r["request_id"]) + 1
    status = strings[r["status"]]
    args = {"prompt_len": int(r["prompt_len"]), "output_tokens": int(r["num_output_tokens"]),
            "cached_tokens": int(r["num_cached_tokens"]), "preemptions": int(r["num_preemptions"]),
            "replica": int(r["replica"]), "status": status}
    out = [{"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": tid, "args": {"name": f"request {rid}"}}]
    arrival, scheduled, first, finish = (float(r[k]) for k in ("arrival_s", "first_scheduled_s", "first_token_s",
                                                               "finish_s"))
    phases = []
    if scheduled >= 0:
        phases.append(("queued", arrival, scheduled))
        if first >= 0:
            phases.append(("prefill", scheduled, first))
            if finish >= 0:
                phases.append(("decode", first, finish))
    for name, a, b in phases:
        out.append({"ph": "X", "name": name, "pid": REQUESTS_PID, "tid": tid, "ts": a * _US, "dur": (b - a) * _US,
                    "args": args})
    if status == "failed":
        out.append({"ph": "i", "s": "t", "name": "failed", "pid": REQUESTS_PID, "tid": tid,
                    "ts": max(finish, arrival) * _US, "args": {**args, "reason": strings[r["fail_reason"]]}})
    return out


def write_trace(rec: Recorder, label: str, path: Path) -> Path:
    path.write_text(json.dumps(trace_events(rec, label), separators=(",", ":")))
    return path
