"""Drive simengine's vLLM policy through the traces of traces.py exactly as record_vllm.py drives vLLM's scheduler
(the same calls in the same order; the policy is pure, so calls are its clock) and compare the decisions step by step.
"""

from __future__ import annotations

import gzip
import json
from collections import deque
from pathlib import Path

import numpy as np

from simengine.core.request import Request
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.vllm import VllmEngine, VllmParams
from simengine.kvcache.manager import KVCacheManager
from tests.conformance.traces import Trace, make_trace

HERE = Path(__file__).resolve().parent
MAX_CALLS = 20_000
DT_S = 0.01   # seconds per call: a label only (no decision reads the clock)


def fixtures() -> list[Path]:
    """Recorded fixture files, newest vLLM version first."""
    return sorted(HERE.glob("vllm-*/*.json.gz"), reverse=True)


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def make_engine(t: Trace, mode: str) -> VllmEngine:
    from tests.conftest import make_dep

    params = VllmParams(max_num_seqs=t.max_num_seqs, max_num_batched_tokens=t.max_num_batched_tokens,
                        block_size=t.block_size, enable_prefix_caching=t.enable_prefix_caching,
                        long_prefill_token_threshold=t.long_prefill_token_threshold, scheduling_policy=t.policy,
                        async_scheduling=mode == "async")
    eng = VllmEngine(params, make_dep())
    # the trace's pool instead of one sized from device memory: vLLM's num_blocks less its null block
    eng.kv = KVCacheManager(t.num_blocks - 1, t.block_size, enable_prefix_caching=t.enable_prefix_caching)
    eng.kv.defer_output_publish = eng.defer_output_publish
    if eng.cohort is not None:   # the cohort keys on the pool it advances
        eng.cohort = DecodeCohort(eng.kv, eng.cohort.token_limit, eng.cohort.chunk)
    eng.max_model_len = t.max_model_len
    return eng


def replay(t: Trace, mode: str) -> list[list]:
    """The step records of record_vllm.py, made by simengine's vLLM policy in the same loop: `sync` (EngineCore.step)
    or `async` (EngineCore.step_with_batch_queue with a queue of two). The policy applies a step's tokens right after
    scheduling it; in async mode it keeps the step's finished requests for one more decision itself."""
    eng = make_engine(t, mode)
    pending = deque(t.requests)
    steps: list[list] = []
    released = False   # vLLM's has_requests() stays true for one call after requests were freed
    queue = 0          # async: steps scheduled whose output vLLM has not applied yet
    for call in range(MAX_CALLS):
        now = call * DT_S
        while pending and pending[0].arrival_step <= call:
            tr = pending.popleft()
            req = Request(tr.rid, tr.arrival_step + tr.rid * 1e-6, np.asarray(tr.tokens[:-1], dtype=np.int64),
                          tr.prompt_len, tr.output_len, priority=tr.priority)
            eng.add_request(req, now)
        if eng.has_work() or released:
            waiting = {r.request_id for r in _waiting(eng)}
            out = eng.schedule(now)
            admitted = [[r.request_id, r.num_computed_tokens] for r, _ in out.scheduled if r.request_id in waiting]
            step = [[[r.request_id, n] for r, n in out.scheduled], sorted(r.request_id for r in out.preempted),
                    admitted, []]
            res = eng.update(out, now + DT_S)
            step[3] = sorted(r.request_id for r in res.finished)
            steps.append(step)
            if mode == "sync":
                released = bool(res.finished)
                continue
            released = bool(out.released)
            queue += 1
            if queue < 2 and (out.scheduled or eng.has_work() or released):
                continue
        elif mode == "sync" or not queue:
            if not pending:
                break
            continue
        queue -= 1   # vLLM applies its oldest step's output here
    else:
        raise RuntimeError(f"trace {t.seed} did not drain in {MAX_CALLS} calls")
    return steps


def _waiting(eng: VllmEngine):
    return [e[3] for e in eng.waiting_heap] if eng.priority else list(eng.waiting)


def same_step(a: list, b: list) -> bool:
    """Scheduled tokens per request (as a set: the order within a step is not a decision), preempted, admitted with
    their computed tokens, and finished requests."""
    return (sorted(map(tuple, a[0])) == sorted(map(tuple, b[0])) and a[1] == b[1]
            and sorted(map(tuple, a[2])) == sorted(map(tuple, b[2])) and a[3] == b[3])


def compare(recorded: dict, seeds: list[int] | None = None) -> dict:
    """Replay each recorded trace; count identical steps (aligned by schedule call) and keep each trace's first
    difference."""
    total = same = 0
    diffs = []
    for rec in recorded["traces"]:
        if seeds is not None and rec["seed"] not in seeds:
            continue
        ours = replay(make_trace(rec["seed"]), recorded["mode"])
        theirs = rec["steps"]
        n = max(len(ours), len(theirs))
        total += n
        first = None
        for k in range(n):
            a = theirs[k] if k < len(theirs) else None
            b = ours[k] if k < len(ours) else None
            if a is not None and b is not None and same_step(a, b):
                same += 1
            elif first is None:
                first = (k, a, b)
        if first is not None:
            diffs.append((rec["seed"], *first))
    return {"steps": total, "identical": same, "traces": len(recorded["traces"]), "diffs": diffs}
