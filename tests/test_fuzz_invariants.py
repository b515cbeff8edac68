"""Invariants under fuzzing: random scenarios on every registered engine, checked on every run.

Generated: engine (every one in ENGINES), device (an 80 GB H100 or a 24 GB L4 where an 8B model barely
fits), model (128k or 4k context, so some prompts are too long), KV pool from below the largest request to
plenty (each engine's own knob: vLLM kv_cache_memory_bytes, SGLang max_total_tokens, ...), batch and token
caps, replicas and router, arrivals (Poisson, gamma, constant, offline, closed loop) or multi-turn sessions,
length distributions, shared prefixes, and a drain short enough to leave work unfinished.

Checked on every run:
  * conservation: every arrived request appears once, as completed, failed or unfinished; the runner
    reported each departure once; summary counts equal the frame's and add up to what arrived;
  * KV: Runner(check_invariants=True) calls engine.check_invariants() after every step (blocks in use <=
    capacity, ref counts >= 0, pool bookkeeping); kv_usage in [0, 1] on every step; at the end every engine
    holds exactly the unfinished requests and, when none are left, no KV at all;
  * caps: tokens per step <= engine.step_token_limit, batch size and running requests <=
    engine.batch_size_limit, on every step;
  * time: steps of a replica are ordered and do not overlap; arrival <= first scheduled <= first token <=
    finish <= end of run; TTFT <= E2E; a completed request's finish is the time the runner saw it leave;
  * Little's law on the run window [0, T] (T = end of run): with each request in the system from its arrival
    to its departure (the runner's departure time; T for unfinished ones), the time-average number in system,
    integrated from a sweep of +1/-1 events, equals arrival rate x mean time in system within 2%. Both sides
    come from the same intervals, so this is an identity of the bookkeeping: it fails only if some request
    leaves before it arrives, leaves twice, never leaves, or leaves after the run ended. On one replica the
    sweep's count also matches the engine's own running + waiting count after every step.

`make fuzz` runs this file with the `fuzz` profile (1000 examples); tests/fuzz_report.py prints the tally.
"""

from __future__ import annotations

import dataclasses
import math
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine import api
from simengine.config.loader import from_dict
from simengine.config.scenario import EngineEntry, Scenario
from simengine.engines import ENGINES
from simengine.errors import InputError
from simengine.routers import ROUTERS
from simengine.sim.build import build_deployment, plan_pools
from simengine.sim.runner import Runner
from tests.conftest import frontend_reach_s
from tests.fuzz_report import FUZZ
from tests.speculation import SPEC_ENGINES, spec_params

ENGINE_NAMES = ENGINES.names()


# ---- generation ----------------------------------------------------------------------------------------------

def _fields(engine: str) -> set[str]:
    return {f.name for f in dataclasses.fields(ENGINES.get(engine).Params)}


def kv_params(engine: str, kv_tokens: int, scenario: Scenario) -> dict:
    """The engine's own knob for a KV pool of about kv_tokens tokens (empty for engines without one)."""
    if engine == "vllm":
        dep = build_deployment(scenario)
        return {"kv_cache_memory_bytes": int(kv_tokens * dep.kv_bytes_per_token_per_device)}
    if engine == "generic":  # no token knob: the utilisation that leaves ~kv_tokens after weights and buffers
        from simengine.engines.memory import NON_TORCH_BYTES, activation_reserve_bytes
        dep = build_deployment(scenario)
        need = (dep.weight_bytes_per_device + activation_reserve_bytes(dep, 8192, 256) + NON_TORCH_BYTES
                + kv_tokens * dep.kv_bytes_per_token_per_device)
        return {"gpu_memory_utilization": min(1.0, need / dep.hardware.memory_bytes)}
    table = {"orca": ("num_blocks", kv_tokens // 16), "sarathi": ("num_gpu_blocks", kv_tokens // 16),
             "tgi": ("max_batch_total_tokens", kv_tokens), "trtllm": ("kv_cache_max_tokens", kv_tokens),
             "sglang": ("max_total_tokens", kv_tokens), "mlc": ("max_total_sequence_length", kv_tokens),
             "lmdeploy": ("cache_max_entry_count", float(max(2, kv_tokens // 64))),  # > 1 means a block count
             "llamacpp": ("ctx_size", kv_tokens)}
    if engine in table and table[engine][0] in _fields(engine):
        key, value = table[engine]
        return {key: max(value, 1)}
    return {}


BATCH_KEYS = ("max_num_seqs", "max_running_requests", "max_batch_size", "batch_size", "max_num_sequence",
              "n_parallel")
TOKEN_KEYS = ("max_num_batched_tokens", "max_num_tokens", "chunk_size", "chunked_prefill_size",
              "max_prefill_token_num", "prefill_chunk_size", "ubatch_size")


@st.composite
def scenarios(draw, engine: str | None = None):
    engine = engine or draw(st.sampled_from(ENGINE_NAMES))
    hardware = draw(st.sampled_from(["h100_sxm", "l4"]))
    model = draw(st.sampled_from(["llama-3.1-8b", "llama-2-7b"]))
    seed = draw(st.integers(0, 2**31))
    longest = draw(st.sampled_from([64, 512, 2048, 6000]))
    inp = draw(st.sampled_from([
        {"dist": "constant", "value": draw(st.integers(1, longest))},
        {"dist": "uniform", "low": 1, "high": longest},
        {"dist": "lognormal", "mean": max(1, longest // 4), "sigma": 1.0, "max": longest},
    ]))
    out_max = draw(st.sampled_from([1, 8, 64, 300]))
    out = draw(st.sampled_from([{"dist": "constant", "value": out_max},
                                {"dist": "uniform", "low": 1, "high": out_max},
                                {"dist": "exponential", "mean": max(1, out_max // 3), "max": out_max}]))
    workload: dict = {"input_tokens": inp, "output_tokens": out,
                      "shared_prefix_tokens": draw(st.sampled_from([0, 0, 16, 300, 1500]))}
    mode = draw(st.sampled_from(["poisson", "gamma", "constant", "offline", "closed_loop", "sessions", "stages"]))
    n = draw(st.integers(1, 40))
    if mode != "sessions" and draw(st.sampled_from([False, False, True])):   # inference-perf's shared_prefix pool
        workload["shared_prefix_tokens"] = 0
        workload["prompt_groups"] = {"groups": draw(st.integers(1, 4)), "prompts_per_group": draw(st.integers(1, 5)),
                                     "prefix_tokens": draw(st.sampled_from([0, 16, 300])),
                                     "multi_turn": mode != "closed_loop" and draw(st.booleans())}
    if mode == "stages":   # inference-perf's load stages: each drains before the next
        workload["arrival"] = {"process": "stages", "stages": [
            {"rate": draw(st.sampled_from([1.0, 6.0, 40.0])), "duration_s": draw(st.sampled_from([0.5, 1.0, 3.0]))}
            for _ in range(draw(st.integers(1, 3)))]}
    elif mode == "sessions":
        workload["sessions"] = {"population": draw(st.integers(1, 6)),
                                "turns": {"dist": "uniform", "low": 1, "high": draw(st.integers(1, 4))},
                                "think_time_s": {"dist": "constant", "value": draw(st.sampled_from([0.0, 0.5, 2.0]))},
                                "user_tokens": {"dist": "uniform", "low": 1, "high": draw(st.sampled_from([20, 400]))},
                                "start_spread_s": draw(st.sampled_from([0.0, 2.0]))}
    elif mode == "closed_loop":
        workload["arrival"] = {"process": "closed_loop", "concurrency": draw(st.integers(1, 12))}
        workload["num_requests"] = n
    elif mode == "offline":
        workload["arrival"] = {"process": "offline"}
        workload["num_requests"] = n
    else:
        workload["arrival"] = {"process": mode, "rate": draw(st.sampled_from([0.5, 4.0, 40.0, 400.0])),
                               **({"burstiness": draw(st.sampled_from([0.3, 3.0]))} if mode == "gamma" else {})}
        workload["num_requests"] = n
    data = {"name": "fuzz", "seed": seed, "horizon_s": draw(st.sampled_from([2.0, 10.0])),
            "drain_s": draw(st.sampled_from([0.5, 5.0, 120.0])),
            "deployment": {"hardware": hardware, "model": model, "replicas": draw(st.sampled_from([1, 1, 2])),
                           "router": draw(st.sampled_from(ROUTERS.names()))},
            "workload": workload, "engines": [engine]}
    failures = draw(st.sampled_from([None, None, "stated", "random"]))   # replica failures (deployment.failures)
    if failures == "stated":
        data["deployment"]["failures"] = {"at": [{"time_s": draw(st.sampled_from([0.0, 0.5, 3.0])), "replica": 0,
                                                  "down_s": draw(st.sampled_from([0.2, 4.0]))}],
                                          "max_retries": draw(st.sampled_from([0, 1, 3]))}
    elif failures == "random":
        data["deployment"]["failures"] = {"mtbf_s": draw(st.sampled_from([0.5, 5.0])), "mttr_s": 0.5,
                                          "max_retries": draw(st.sampled_from([0, 2]))}
    prefill_role = [n for n in ENGINE_NAMES if "prefill" in ENGINES.get(n).disaggregation_roles]
    if engine in prefill_role and not failures and draw(st.sampled_from([False, False, True])):
        # prefill/decode pools: the drawn engine prefills (its knobs below); an engine with the decode role decodes
        # (the drawn knobs too when it is the drawn engine, else its defaults)
        decode = draw(st.sampled_from([n for n in ENGINE_NAMES if "decode" in ENGINES.get(n).disaggregation_roles]))
        data["pools"] = [{"role": "prefill", "replicas": draw(st.sampled_from([1, 2])),
                          "kv_transfer": draw(st.sampled_from(["after_prefill", "layerwise"]))},
                         {"role": "decode", "replicas": draw(st.sampled_from([1, 2])),
                          **({} if engine == decode else {"engine": decode})}]
    kv_tokens = draw(st.sampled_from([0, 600, 2500, 9000, 40000]))  # 0: the engine's own sizing
    caps = {"batch": draw(st.sampled_from([None, 1, 3, 16])), "tokens": draw(st.sampled_from([None, 64, 512, 4096]))}
    if engine in SPEC_ENGINES and draw(st.sampled_from([False, False, True])):   # speculative decoding
        method = draw(st.sampled_from(["eagle3", "ngram", "draft_model"] if model == "llama-3.1-8b" else
                                      ["eagle3", "ngram"]))
        if engine == "llamacpp" and model != "llama-3.1-8b":
            method = None    # llama.cpp drafts with a model, and Llama-3.2-1B shares only Llama-3's vocabulary
        if method:
            caps["spec"] = spec_params(engine, method, draw(st.integers(1, 6)),
                                       [draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))])
    if engine in ("vllm", "sglang") and "pools" not in data and "prompt_groups" not in workload and \
            draw(st.sampled_from([False, False, True])):
        workload["lora"] = {"adapters": draw(st.sampled_from([1, 3, 30])), "ranks": [8, 64],   # multi-LoRA
                            "fraction": draw(st.sampled_from([0.5, 1.0]))}
        slots = draw(st.integers(1, 4))
        caps["lora"] = {"enable_lora": True, "max_lora_rank": 64,
                        **({"max_loras": slots} if engine == "vllm" else {"max_loras_per_batch": slots})}
    if engine in ("vllm", "trtllm", "sglang") and draw(st.sampled_from([False, False, True])):   # KV offload
        gib = draw(st.sampled_from([0.01, 0.2, 8.0]))
        caps["offload"] = {"vllm": {"kv_offloading_size": gib}, "trtllm": {"host_cache_size": int(gib * 2**30)},
                           "sglang": {"enable_hierarchical_cache": True, "hicache_size": max(1, int(gib))}}[engine]
    return engine, data, kv_tokens, caps


def build(engine: str, data: dict, kv_tokens: int, caps: dict) -> Scenario:
    """The Scenario for a draw, with engine knobs; raises InputError if the config layer refuses it."""
    sc = from_dict(Scenario, data, source="fuzz")
    params: dict = kv_params(engine, kv_tokens, sc) if kv_tokens else {}
    fields = _fields(engine)
    for keys, value in ((BATCH_KEYS, caps["batch"]), (TOKEN_KEYS, caps["tokens"])):
        key = next((k for k in keys if k in fields), None)
        if key and value is not None:
            params[key] = value
    params |= (caps.get("spec") or {}) | (caps.get("offload") or {}) | (caps.get("lora") or {})
    entry = EngineEntry(engine=engine, params=params)
    sc = dataclasses.replace(sc, engines=[entry])
    plan_pools(sc, entry)  # refuse impossible knobs (does not fit, ...) as the CLI would
    return sc


# ---- running with a departure log ---------------------------------------------------------------------------

class TrackingRunner(Runner):
    """A Runner that checks engine invariants every step and logs when each request leaves."""

    last: TrackingRunner | None = None

    def __init__(self, scenario, entry, *, check_invariants: bool = False):
        super().__init__(scenario, entry, check_invariants=True)
        self.departures: dict[int, float] = {}
        finished = self.recorder.finished

        same_instant = [0.0, 0]

        def logged(req, replica):
            assert req.request_id not in self.departures, f"request {req.request_id} left twice"
            now = self.env.now
            same_instant[:] = [now, same_instant[1] + 1] if same_instant[0] == now else [now, 1]
            if same_instant[1] > 10_000:  # caught here because such a loop never yields back to SimPy
                raise TimeoutError(f"livelock: {same_instant[1]} requests left at simulated t={now:.6f} s "
                                   "without time advancing")
            self.departures[req.request_id] = now
            finished(req, replica)

        self.recorder.finished = logged
        TrackingRunner.last = self
        # bounded wall time: a run that does not end (a livelock) is a violation, not a hung suite
        step, env, t0 = self.env.step, self.env, time.perf_counter()
        count = [0]

        def timed_step():
            count[0] += 1
            if count[0] % 2000 == 0 and time.perf_counter() - t0 > WALL_LIMIT_S:
                raise TimeoutError(f"run still going after {WALL_LIMIT_S:g} s of wall time and {count[0]} events, "
                                   f"simulated t={env.now:.3f} s")
            step()

        self.env.step = timed_step


def run_checked(sc: Scenario) -> tuple[api.EngineResult, TrackingRunner]:
    with mock.patch.object(api, "Runner", TrackingRunner):
        res = api.run_engine(sc, sc.engines[0], check_invariants=True)
    return res, TrackingRunner.last


# ---- the checks ----------------------------------------------------------------------------------------------

def check_all(res: api.EngineResult, runner: TrackingRunner) -> None:
    req, steps, s = res.requests, res.steps, res.summary
    end = runner.env.now
    # conservation
    assert req["request_id"].is_unique
    assert len(req) == runner.recorder.arrived == s["num_requests"]
    counts = req["status"].value_counts().to_dict()
    assert set(counts) <= {"completed", "failed", "unfinished"}, counts
    for k in ("completed", "failed", "unfinished"):
        assert s[k] == counts.get(k, 0), (k, s[k], counts)
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"]
    left = req["status"] != "unfinished"
    assert set(req.loc[left, "request_id"]) == set(runner.departures), "departures and finished rows differ"
    # end state: engines hold exactly the unfinished requests (but those waiting for a failed replica to come
    # back); nothing else holds KV; a retried request is counted once. A layerwise prefill cut off by the end of the
    # run is on both sides: its prefill replica computes the copy while its decode replica already holds the request
    # (queued, or reserving blocks for the KV, which not every engine counts as waiting)
    held = sum(e.num_running() + e.num_waiting() for e in runner.engines)
    both = len(runner.decode_sent.keys() - runner.prefill_end_s.keys()) if runner.back is not None else 0
    unfinished = s["unfinished"] - len(runner.pending)
    assert unfinished <= held <= unfinished + both, (held, both, len(runner.pending), s["unfinished"])
    if "faults" in s:
        f = s["faults"]
        assert f["failed_by_fault"] <= s["failed"] and 0.0 <= f["availability"] <= 1.0
        assert f["retries"] <= f["failures"] * len(req) * runner.scenario.deployment.failures.max_retries
    for e in runner.engines:
        e.check_invariants()
        # held: KV a decode replica has yet to pull; loading: requests whose KV is on its way in
        if not (e.num_running() or e.num_waiting() or e.held or e.loading):
            assert_kv_released(e)
    # caps and per-step sanity
    if len(steps):
        assert (steps["batch_size"] >= 1).all()
        for i, mine in steps.groupby("replica"):   # each replica within its own engine's caps (pools differ)
            eng = runner.engines[int(i)]
            tokens = mine["prefill_tokens"] + mine["decode_tokens"] + mine["draft_tokens"]
            if eng.step_token_limit is not None:
                assert tokens.max() <= eng.step_token_limit, (tokens.max(), eng.step_token_limit)
            if eng.batch_size_limit is not None:
                assert mine["batch_size"].max() <= eng.batch_size_limit
                assert mine["num_running"].max() <= eng.batch_size_limit
        assert steps["kv_usage"].between(0.0, 1.0).all()
        assert (steps["end_s"] >= steps["start_s"]).all() and (steps["end_s"] <= end + 1e-9).all()
        for _, g in steps.groupby("replica"):
            st_, en = g["start_s"].to_numpy(), g["end_s"].to_numpy()
            assert (st_[1:] >= en[:-1] - 1e-12).all(), "a replica's steps overlap or go back in time"
    # timestamps
    assert (req["arrival_s"] >= 0).all() and (req["arrival_s"] <= end + 1e-9).all()
    sched = req["first_scheduled_s"]
    assert ((sched < 0) | (sched >= req["arrival_s"] - 1e-12)).all()
    done = req[req["status"] == "completed"]
    assert (done["first_token_s"] >= done["first_scheduled_s"] - 1e-12).all()
    assert (done["finish_s"] >= done["first_token_s"] - 1e-12).all()
    assert (done["finish_s"] <= end + 1e-9).all()
    assert (done["ttft_ms"] <= done["e2el_ms"] + 1e-9).all()
    assert ((done["num_output_tokens"] >= 1) & (done["num_output_tokens"] <= done["output_len"])).all()
    for rid, t in zip(done["request_id"], done["finish_s"], strict=True):
        assert runner.departures[rid] == t, (rid, runner.departures[rid], t)
    little(req, runner, end, steps)


def assert_kv_released(e) -> None:
    """With no request left, no KV is held for a request. Cache an engine keeps on purpose is allowed: vLLM's
    ref-0 hashed blocks (free), SGLang/TGI radix leaves (evictable), MLC's recycling sequences, llama.cpp's
    idle-slot prompts. EnginePolicy has no 'KV held by requests' view, so this looks at the common structures."""
    from simengine.kvcache.manager import KVCacheManager
    from simengine.kvcache.radix import RadixCache

    kv, cache, slots = getattr(e, "kv", None), getattr(e, "cache", None), getattr(e, "slots", None)
    if isinstance(kv, KVCacheManager):
        kept = set(getattr(e, "recycling", ()))
        stray = sorted(set(kv.req_blocks) - kept)
        assert not stray, f"{e.name} still maps blocks to requests {stray[:5]}"
        if not kept:
            assert kv.pool.num_used == 0, f"{e.name}: {kv.pool.num_used} blocks referenced with no request left"
    elif isinstance(cache, RadixCache):
        assert cache.req_tokens == 0, f"{e.name}: {cache.req_tokens} private tokens with no request left"
        assert cache.evictable_tokens == cache.tree_tokens, f"{e.name}: locked radix nodes with no request left"
    elif slots is not None:
        assert all(s.req is None for s in slots), f"{e.name}: a slot still processes a request"
    else:
        assert e.kv_usage() == pytest.approx(0.0, abs=1e-12), f"{e.name} holds KV with no request left"


def little(req, runner: TrackingRunner, end: float, steps) -> None:
    """Little's law on [0, end] from the request intervals (see the module docstring)."""
    if end <= 0 or not len(req):
        return
    a = req["arrival_s"].to_numpy()
    d = np.array([runner.departures.get(r, end) for r in req["request_id"]])
    assert (d >= a - 1e-12).all(), "a request left before it arrived"
    assert (d <= end + 1e-9).all(), "a request left after the run ended"
    times = np.concatenate([a, d])
    delta = np.concatenate([np.ones(len(a)), -np.ones(len(d))])
    order = np.lexsort((-delta, times))          # at equal times, count the arrival first
    t, n_after = times[order], np.cumsum(delta[order])
    assert n_after.min() >= 0, "more departures than arrivals at some instant"
    area = float(np.sum(n_after[:-1] * np.diff(t))) + float(n_after[-1]) * (end - t[-1])
    mean_in_system = area / end
    lam, w = len(a) / end, float(np.mean(d - a))
    assert math.isclose(mean_in_system, lam * w, rel_tol=0.02, abs_tol=1e-9), (mean_in_system, lam * w)
    if len(runner.engines) == 1 and len(steps):
        # The engine's own count after each step vs the intervals. Events at the very instant a step ends may
        # be ordered either side of its row: arrivals submitted then, and requests the next schedule() refuses
        # or fails at that instant (they leave at the row's time but after it).
        at = steps["end_s"].to_numpy()
        sa, sd = np.sort(frontend_reach_s(runner, req)), np.sort(d)   # requests reach the engine through the frontend
        arrived = np.searchsorted(sa, at, side="right")
        left = np.searchsorted(sd, at, side="right")
        arrive_now = arrived - np.searchsorted(sa, at, side="left")
        leave_now = left - np.searchsorted(sd, at, side="left")
        in_sys = arrived - left
        eng = (steps["num_running"] + steps["num_waiting"]).to_numpy()
        bad = (eng > in_sys + leave_now) | (eng < in_sys - arrive_now)
        assert not bad.any(), f"engine count {eng[bad][:3]} vs requests in system {in_sys[bad][:3]} at {at[bad][:3]}"


# Failures found by this suite in code outside the test, each to be fixed by its owner; matched by engine and
# by a fragment of the message or of the failing source line. A matching run is tallied as a known gap, not a
# violation; once fixed, its count stays 0 (the fuzz summary lists them) and the entry can go.
KNOWN_GAPS: tuple[tuple[str, str, str], ...] = ()  # both found so far are fixed (check_invariants, refusal spin)
WALL_LIMIT_S = 60.0  # one generated run (<= 40 requests or 6 sessions) takes ~0.05 s; more is a livelock


def _known_gap(engine: str, exc: BaseException) -> str | None:
    import traceback
    text = str(exc) + "\n" + "\n".join(f.line or "" for f in traceback.extract_tb(exc.__traceback__))
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        text += "\n" + "\n".join(f.line or "" for f in traceback.extract_tb(cause.__traceback__))
    for who, fragment, what in KNOWN_GAPS:
        if who in ("*", engine) and fragment in text:
            return what
    return None


def fuzz_one(engine: str, data: dict, kv_tokens: int, caps: dict) -> None:
    try:
        sc = build(engine, data, kv_tokens, caps)
    except InputError:
        FUZZ.refused += 1
        return
    try:
        res, runner = run_checked(sc)
        check_all(res, runner)
    except Exception as exc:
        gap = _known_gap(engine, exc)
        if gap is not None:
            FUZZ.known[f"{engine}: {gap}"] += 1
            return
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        FUZZ.violations.append(f"{engine}: {exc.__class__.__name__}: {first}")
        raise
    FUZZ.cases[engine] += 1


@settings(print_blob=True)
@given(scenarios())
def test_invariants_hold_on_random_scenarios(case):
    fuzz_one(*case)


@pytest.mark.parametrize("decode", ["sglang", "trtllm"])
def test_a_layerwise_prefill_cut_off_by_the_end_of_the_run_is_held_on_both_sides(decode):
    """Found by `make fuzz`: with layerwise KV transfer a request goes to its decode replica when its prefill starts,
    so a prefill the end of the run cuts off leaves it on both replicas (the decode side queued or reserving blocks
    for the KV); the end-state checks count it once and leave the reserved blocks alone."""
    data = {"name": "fuzz", "seed": 8002, "horizon_s": 2.0, "drain_s": 0.5,
            "deployment": {"hardware": "l4", "model": "llama-3.1-8b", "replicas": 1, "router": "round_robin"},
            "workload": {"input_tokens": {"dist": "uniform", "low": 1, "high": 2048},
                         "output_tokens": {"dist": "exponential", "mean": 1, "max": 1}, "shared_prefix_tokens": 0,
                         "arrival": {"process": "offline"}, "num_requests": 9},
            "engines": ["sglang"],
            "pools": [{"role": "prefill", "replicas": 1, "kv_transfer": "layerwise"},
                      {"role": "decode", "replicas": 1, "engine": decode}]}
    for batch in (None, 1):
        res, runner = run_checked(build("sglang", data, 0, {"batch": batch, "tokens": None}))
        check_all(res, runner)
        prefill, decoder = runner.engines
        cut_off = res.summary["unfinished"]
        assert cut_off >= 1 and prefill.num_running() == cut_off   # every unfinished request is a prefill under way
        assert decoder.num_running() + decoder.num_waiting() + len(decoder.loading) == cut_off


def test_a_run_cut_off_mid_step_leaves_the_vllm_cohort_s_blocks_in_their_tables():
    """Found by `make fuzz`: the drain ends while a step the decode cohort is in is still running. Its counted
    members took that step's blocks at scheduling (as vLLM allocates), so the final sync hands them over too."""
    data = {"name": "fuzz", "seed": 39, "horizon_s": 10.0, "drain_s": 0.5,
            "deployment": {"hardware": "l4", "model": "llama-3.1-8b", "replicas": 2, "router": "least_loaded"},
            "workload": {"input_tokens": {"dist": "uniform", "low": 1, "high": 64},
                         "output_tokens": {"dist": "constant", "value": 300}, "shared_prefix_tokens": 0,
                         "arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 2},
            "engines": ["vllm"]}
    fuzz_one("vllm", data, 0, {"batch": None, "tokens": None})


def test_a_run_cut_off_mid_step_leaves_sglang_s_slots_ahead_by_that_step():
    """Found by `make test`'s random scenarios: the drain ends while a decode step is in flight. SGLang took that
    step's slots when it scheduled it, so a running request holds its computed tokens plus the step's."""
    data = {"name": "fuzz", "seed": 3, "horizon_s": 2.0, "drain_s": 0.5,
            "deployment": {"hardware": "l4", "model": "llama-3.1-8b", "replicas": 1, "router": "round_robin"},
            "workload": {"input_tokens": {"dist": "constant", "value": 1},
                         "output_tokens": {"dist": "constant", "value": 64}, "shared_prefix_tokens": 0,
                         "arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 1},
            "engines": ["sglang"]}
    fuzz_one("sglang", data, 0, {"batch": None, "tokens": None})


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_invariants_every_engine_tight_memory(engine):
    """Each engine once, deterministically: sessions with a shared prefix on a KV pool near the largest request."""
    data = {"name": "fuzz", "seed": 3, "horizon_s": 10.0, "drain_s": 60.0,
            "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b"},
            "workload": {"shared_prefix_tokens": 300, "output_tokens": {"dist": "uniform", "low": 1, "high": 64},
                         "sessions": {"population": 4, "turns": {"dist": "constant", "value": 3},
                                      "think_time_s": {"dist": "constant", "value": 0.5},
                                      "user_tokens": {"dist": "uniform", "low": 1, "high": 400}}},
            "engines": [engine]}
    try:
        sc = build(engine, data, 2500, {"batch": None, "tokens": None})
    except InputError as exc:
        pytest.skip(f"{engine} refuses a 2500-token pool: {exc}")
    try:
        res, runner = run_checked(sc)
        check_all(res, runner)
    except Exception as exc:
        gap = _known_gap(engine, exc)
        if gap is None:
            raise
        pytest.xfail(f"known gap: {gap}")
    assert res.summary["num_requests"] > 0
