"""End-to-end simulator properties: conservation, determinism, invariants, sessions, queueing theory."""

import json
import subprocess
import sys

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.sim.runner import Runner
from tests.conftest import frontend_reach_s, make_scenario


def test_conservation_and_invariants_every_step():
    sc = make_scenario()
    r = run_engine(sc, sc.engines[0], check_invariants=True)
    s = r.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 50
    assert r.requests["request_id"].is_unique
    steps = r.steps
    assert (steps["prefill_tokens"] + steps["decode_tokens"] <= 8192).all()
    assert (steps["num_running"] <= 1024).all() and (steps["kv_usage"] <= 1.0).all()
    done = r.requests[r.requests["status"] == "completed"]
    assert (done["first_token_s"] >= done["arrival_s"]).all()
    assert (done["finish_s"] >= done["first_token_s"]).all()
    assert (done["ttft_ms"] <= done["e2el_ms"]).all()
    assert (done["num_output_tokens"] == done["output_len"]).all()


def test_everything_is_freed_at_the_end():
    sc = make_scenario()
    runner = Runner(sc, sc.engines[0])
    runner.run()
    eng = runner.engines[0]
    assert eng.num_running() == 0 and eng.num_waiting() == 0
    assert eng.kv.pool.num_free == eng.kv.num_blocks
    eng.kv.pool.check_invariants()


def test_same_seed_identical_different_seed_differs():
    a = run_engine(make_scenario(), EngineEntry(engine="vllm")).summary
    b = run_engine(make_scenario(), EngineEntry(engine="vllm")).summary
    c = run_engine(make_scenario(seed=2), EngineEntry(engine="vllm")).summary
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(c)


def test_identical_files_across_processes(tmp_path):
    outs = []
    for i in range(2):
        d = tmp_path / f"run{i}"
        subprocess.run([sys.executable, "-m", "simengine", "run", "agent_multiturn", "--out", str(d),
                        "--no-plots", "--set", "horizon_s=20", "--set", "workload.sessions.population=8"],
                       check=True, capture_output=True)
        outs.append(d / "agent_multiturn--horizon_s-20+workload.sessions.population-8")
    for label in ("vllm", "vllm-no-prefix-cache"):
        for f in ("summary.json", "requests.csv", "steps.csv", "trace.json"):
            assert (outs[0] / label / f).read_bytes() == (outs[1] / label / f).read_bytes(), f


def test_overload_leaves_backlog_unfinished_and_flags_it():
    sc = make_scenario(workload__arrival={"process": "poisson", "rate": 200.0}, horizon_s=10.0, drain_s=5.0)
    s = run_engine(sc, sc.engines[0]).summary
    assert s["unfinished"] > 0 and s["overloaded"] is True
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"]


def test_sessions_grow_context_and_hit_the_prefix_cache():
    sc = make_scenario(workload__sessions={"population": 6, "turns": {"dist": "constant", "value": 4},
                                           "think_time_s": {"dist": "constant", "value": 1.0},
                                           "user_tokens": {"dist": "constant", "value": 100}},
                       workload__shared_prefix_tokens=1000,
                       workload__output_tokens={"dist": "constant", "value": 50}, horizon_s=30.0)
    r = run_engine(sc, sc.engines[0])
    req = r.requests.sort_values(["session_id", "turn"])
    first = req[req["turn"] == 0]
    assert (first["prompt_len"] == 1100).all()
    for _, g in req.groupby("session_id"):
        lens = g["prompt_len"].to_numpy()
        assert (np.diff(lens) == 150).all()  # + previous output (50) + new user tokens (100)
        # each next turn arrives after the previous finished plus the think time
        gaps = g["arrival_s"].to_numpy()[1:] - g["finish_s"].to_numpy()[:-1]
        assert np.allclose(gaps, 1.0)
    later = req[req["turn"] > 0]
    assert (later["num_cached_tokens"] >= later["prompt_len"] - 150 - 16).all()
    assert r.summary["prefix_cache_hit_rate"] > 0.5


@pytest.mark.parametrize("rho", [0.6])
def test_md1_mean_wait_matches_theory(rho):
    """Batch size 1 and identical requests: a deterministic server, so Pollaczek-Khinchine gives
    W = rho * S / (2 (1 - rho)) for Poisson arrivals."""
    base = make_scenario(workload__input_tokens={"dist": "constant", "value": 32},
                         workload__output_tokens={"dist": "constant", "value": 4},
                         engines=[{"engine": "vllm", "params": {"max_num_seqs": 1, "enable_prefix_caching": False}}])
    probe = run_engine(make_scenario(**{**_md1(base), "workload__num_requests": 3,
                                        "workload__arrival": {"process": "constant", "rate": 1.0}}),
                       base.engines[0]).requests
    service_s = float((probe["finish_s"] - probe["first_scheduled_s"]).iloc[0])
    rate = rho / service_s
    n = 40000
    sc = make_scenario(**{**_md1(base), "workload__num_requests": n, "horizon_s": 1e6,
                          "workload__arrival": {"process": "poisson", "rate": rate}})
    req = run_engine(sc, base.engines[0]).requests
    from simengine.sim.runner import Runner
    runner = Runner(sc, base.engines[0])   # the frontend, before the engine's queue: not waiting in it
    frontend = runner.frontend_s + runner.tokenize_s_per_token * req["prompt_len"].to_numpy()
    wait = (req["first_scheduled_s"] - req["arrival_s"]).to_numpy() - frontend
    theory = rho * service_s / (2 * (1 - rho))
    assert np.mean(wait) == pytest.approx(theory, rel=0.05)


def _md1(base):
    return {"workload__input_tokens": {"dist": "constant", "value": 32},
            "workload__output_tokens": {"dist": "constant", "value": 4},
            "engines": [{"engine": "vllm", "params": {"max_num_seqs": 1, "enable_prefix_caching": False}}]}


def _pipelined_engines() -> list[str]:
    from simengine.engines.base import ENGINES
    return [n for n in ENGINES.names() if ENGINES.get(n).supports_pipeline_microbatches]


@pytest.mark.parametrize("engine", _pipelined_engines())
def test_pipeline_parallel_keeps_micro_batches_in_flight(engine):
    """Under pp=4 an engine with pipeline micro-batches keeps 4 batches in the pipeline: throughput well above running
    the stages in sequence (one batch at a time), the same requests complete, the invariants hold every step (no
    request in two micro-batches at once), and no batch enters the first stage before the one ahead has left it."""
    from simengine.engines.base import ENGINES
    cls = ENGINES.get(engine)
    sc = make_scenario(deployment={"hardware": "h100_sxm", "model": "llama-3.1-70b", "pp": 4, "tp": 2},
                       workload={"arrival": {"process": "offline"}, "num_requests": 200,
                                 "input_tokens": {"dist": "constant", "value": 500},
                                 "output_tokens": {"dist": "constant", "value": 100}}, horizon_s=0.0, drain_s=1e5)
    # batches of at most 64, so 200 requests fill the 4 micro-batches (TensorRT-LLM's default 2048 takes them all)
    entry = EngineEntry(engine=engine, params={"trtllm": {"max_batch_size": 64}}.get(engine, {}))
    piped = run_engine(sc, entry, check_invariants=True)
    cls.supports_pipeline_microbatches = False
    try:
        serial = run_engine(sc, entry).summary
    finally:
        cls.supports_pipeline_microbatches = True
    assert piped.summary["completed"] == serial["completed"] == 200
    assert piped.summary["output_throughput"] > 2.0 * serial["output_throughput"]
    steps = piped.steps.sort_values("start_s")
    assert steps["step_s"].sum() > 2.0 * (steps["end_s"].max() - steps["start_s"].min())   # overlapping batches


def test_a_pipeline_stage_keeps_the_host_work_of_each_micro_batch():
    """A micro-batch holds the first stage for its share of the GPU work plus the whole host work (every rank
    schedules and prepares each micro-batch): with no host work the stage is the step / stages; each second of
    synchronous host work adds a whole second to the stage; an overlapped loop hides it behind the stage's GPU."""
    import dataclasses

    from simengine.core.batch import BatchShape
    from simengine.sim.build import build_deployment, build_engine, cost_model
    sc = make_scenario(deployment={"hardware": "h100_sxm", "model": "llama-3.1-70b", "pp": 4, "tp": 2})
    cost = cost_model(build_engine(EngineEntry(engine="trtllm"), build_deployment(sc)))
    shape = BatchShape(num_decode=64, decode_context_tokens=64 * 600, num_logits=64)
    for overlap in (False, True):
        for host_s in (0.0, 0.004):
            cost.timing = dataclasses.replace(cost.timing, overlap=overlap, scheduler_cpu_s=host_s, output_cpu_s=0.0,
                                              seq_cpu_s=0.0)
            step = cost.step(shape).seconds
            stage = cost.stage_seconds(shape, step, 4)
            gpu = step - (0.0 if overlap else host_s)
            assert stage == pytest.approx(max(gpu / 4, host_s) if overlap else gpu / 4 + host_s)


def test_the_frontend_delays_every_request_by_its_latency():
    """frontend_s shifts each request's TTFT and E2E by exactly its size (open loop: the schedule is the same)."""
    from simengine.sim import build as runner

    sc = make_scenario(workload__num_requests=40, engines=["sglang"])
    base = run_engine(sc, sc.engines[0]).requests
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "read_engine_terms", lambda path=None: {"sglang": {"frontend_s": 0.25}})
        late = run_engine(sc, sc.engines[0]).requests
    prior = Runner(sc, sc.engines[0]).frontend_s   # the engine's own value (or the shipped fit's)
    np.testing.assert_allclose(late["ttft_ms"], base["ttft_ms"] + (0.25 - prior) * 1e3, atol=1e-6)
    np.testing.assert_allclose(late["tpot_ms"], base["tpot_ms"], atol=1e-9)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "tgi", "llamacpp"])
def test_the_frontend_tokenises_each_prompt_before_the_engine_sees_it(engine):
    """A served engine's frontend tokenises the whole prompt first: with requests far apart (none waits), each
    TTFT is longer by exactly tokenize_s_per_token x its prompt length than with no tokenising, and the engine's
    steps are the same; an engine no server fronts (the generic one) tokenises nothing."""
    from simengine.metrics.frames import requests_frame

    sc = make_scenario(workload__num_requests=30, workload__arrival={"process": "constant", "rate": 0.2},
                       deployment={"hardware": "h100_sxm", "model": "llama-3.1-8b"}, engines=[engine])
    rate = Runner(sc, sc.engines[0]).tokenize_s_per_token
    assert rate == pytest.approx(2e-6)
    runs = []
    for per_token_s in (rate, 0.0):
        runner = Runner(sc, sc.engines[0])
        runner.tokenize_s_per_token = per_token_s
        runs.append(requests_frame(runner.run().recorder).set_index("request_id"))
    on, off = runs
    np.testing.assert_allclose(on["ttft_ms"] - off["ttft_ms"], 1e3 * rate * on["prompt_len"], atol=1e-6)
    np.testing.assert_allclose(on["e2el_ms"] - off["e2el_ms"], 1e3 * rate * on["prompt_len"], atol=1e-6)
    assert Runner(sc, EngineEntry(engine="generic")).tokenize_s_per_token == 0.0


def _schedules_ahead_engines() -> list[str]:
    from simengine.engines.base import ENGINES
    return [n for n in ENGINES.names() if ENGINES.get(n).overlap_schedules_ahead]


@pytest.mark.parametrize("engine", _schedules_ahead_engines())
def test_an_overlapped_loop_takes_an_arrival_one_step_later(engine):
    """Where the loop schedules step k+1 as step k starts (SGLang's and TensorRT-LLM's overlap schedulers, vLLM's
    async scheduling), a request that reaches the engine while step k runs is first computed no earlier than step
    k+2; with the overlap knob off, requests join the step right after the one they arrived in."""
    off = {"sglang": {"disable_overlap_schedule": True}, "trtllm": {"disable_overlap_scheduler": True},
           "vllm": {"async_scheduling": False}}[engine]
    sc = make_scenario(workload__num_requests=120, workload__arrival={"process": "poisson", "rate": 8.0})
    late = {}
    for params in ({}, off):
        res = run_engine(sc, EngineEntry(engine=engine, params=params), check_invariants=True)
        steps = res.steps.sort_values("start_s")
        starts, ends = steps["start_s"].to_numpy(), steps["end_s"].to_numpy()
        req = res.requests
        reached = frontend_reach_s(Runner(sc, EngineEntry(engine=engine, params=params)), req)
        k = np.searchsorted(starts, reached, side="left") - 1   # the step in flight when each request came
        mid = (k >= 0) & (k + 1 < len(ends)) & (reached < ends[np.maximum(k, 0)])
        first = req["first_scheduled_s"].to_numpy()[mid]
        assert mid.sum() > 20 and res.summary["completed"] == 120
        late[bool(params)] = first >= ends[k[mid] + 1] - 1e-12   # not in the step right after
    assert late[False].all()
    assert not late[True].all()


def test_prompts_sent_together_leave_the_frontend_together():
    """A burst is tokenised as one batch: every prompt sent at one instant reaches the engine when the longest is
    tokenised, in the order sent, so the first step holds them all (no short prompt runs ahead alone)."""
    sc = make_scenario(workload__num_requests=20, workload__arrival={"process": "offline"},
                       workload__input_tokens={"dist": "uniform", "low": 20, "high": 200}, engines=["vllm"])
    runner = Runner(sc, sc.engines[0])
    from simengine.metrics.frames import requests_frame
    req = requests_frame(runner.run().recorder)
    expected = runner.frontend_s + runner.tokenize_s_per_token * req["prompt_len"].max()
    assert req["prompt_len"].nunique() > 5
    np.testing.assert_allclose(req["first_scheduled_s"], expected, rtol=0, atol=1e-12)
