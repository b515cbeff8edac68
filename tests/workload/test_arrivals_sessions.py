"""Arrival processes, sessions, classes, documents and trace replay through the simulator."""

from pathlib import Path

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.errors import InputError
from simengine.workload.arrivals import ArrivalConfig, arrival_times
from tests.conftest import make_scenario

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"


def gaps(cfg, n=200_000, seed=0):
    return np.diff(arrival_times(cfg, np.random.default_rng(seed), n, 0.0), prepend=0.0)


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("constant", 0.0)])
def test_rate_and_cv(process, cv):
    g = gaps(ArrivalConfig(process=process, rate=5.0))
    assert 1 / g.mean() == pytest.approx(5.0, rel=0.01)
    assert g.std() / g.mean() == pytest.approx(cv, abs=0.01)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_matches_vllm_definition(burstiness):
    """vLLM bench: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, CV 1/sqrt(burstiness)."""
    g = gaps(ArrivalConfig(process="gamma", rate=2.0, burstiness=burstiness))
    assert g.mean() == pytest.approx(0.5, rel=0.01)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.02)


def test_ramp_and_diurnal_follow_their_curves():
    ramp = ArrivalConfig(process="ramp", rate=10.0, ramp_start_rate=0.0, ramp_duration_s=1000.0)
    t = arrival_times(ramp, np.random.default_rng(1), 5000, 0.0)
    first, second = np.sum(t < 500), np.sum((t >= 500) & (t < 1000))
    assert second / first == pytest.approx(3.0, rel=0.1)  # integral of a linear ramp: 1/4 vs 3/4
    di = ArrivalConfig(process="diurnal", rate=10.0, amplitude=0.8, period_s=100.0)
    t = arrival_times(di, np.random.default_rng(2), 50_000, 0.0) % 100.0
    assert np.sum(t < 50) / np.sum(t >= 50) > 2.0  # the sine's positive half carries more traffic


def test_bad_arrival_values_name_the_field():
    with pytest.raises(InputError, match="rate: must be in"):
        ArrivalConfig(process="poisson", rate=-1.0)
    with pytest.raises(InputError, match="burstiness"):
        ArrivalConfig(process="gamma", rate=1.0, burstiness=0.0)


def test_closed_loop_keeps_concurrency():
    sc = make_scenario(workload__arrival={"process": "closed_loop", "concurrency": 4}, horizon_s=10.0)
    req = run_engine(sc, sc.engines[0]).requests
    events = sorted([(a, 1) for a in req["arrival_s"]] + [(f, -1) for f in req["finish_s"] if f >= 0])
    level = np.cumsum([e for _, e in events])
    assert level.max() == 4


def test_session_arrival_rate_and_classes():
    sc = make_scenario(workload__sessions={"arrival_rate": 0.5, "turns": {"dist": "constant", "value": 3},
                                           "think_time_s": {"dist": "constant", "value": 2.0}},
                       workload__classes=[{"name": "a", "weight": 1, "priority": 0, "slo": {"ttft_ms": 100}},
                                          {"name": "b", "weight": 3, "priority": 1}],
                       horizon_s=60.0)
    r = run_engine(sc, sc.engines[0])
    req = r.requests
    assert req.groupby("session_id")["turn"].max().max() == 2
    share = (req["slo_class"] == "b").mean()
    assert 0.55 < share < 0.95
    assert set(r.summary["classes"]) == {"a", "b"}


def test_structured_output_delays_by_compile_time_and_costs_mask_time():
    base = dict(workload__arrival={"process": "poisson", "rate": 2.0}, horizon_s=20.0)
    plain = run_engine(make_scenario(**base), make_scenario().engines[0]).requests
    sc = make_scenario(**base, workload__structured_output={"fraction": 1.0, "backend": "outlines"})
    js = run_engine(sc, sc.engines[0]).requests
    assert js["structured"].all()
    # outlines compiles for ~2 s before the scheduler may run the request
    assert (js["first_scheduled_s"] - js["arrival_s"]).min() >= 2.0 - 1e-9
    assert js["ttft_ms"].median() > plain["ttft_ms"].median() + 1900


def test_context_overflow_truncate_keeps_sessions_going():
    sc = make_scenario(deployment={"hardware": "h100_sxm", "model": "llama-2-7b"},  # 4096-token context
                       workload__sessions={"population": 2, "turns": {"dist": "constant", "value": 12},
                                           "think_time_s": {"dist": "constant", "value": 0.1},
                                           "user_tokens": {"dist": "constant", "value": 500},
                                           "context_overflow": "truncate"},
                       workload__output_tokens={"dist": "constant", "value": 100}, horizon_s=60.0)
    req = run_engine(sc, sc.engines[0]).requests
    assert req["prompt_len"].max() <= 4096 - 100
    assert (req["status"] == "completed").all() and req["turn"].max() == 11


def test_context_overflow_reject_fails_the_turn():
    sc = make_scenario(deployment={"hardware": "h100_sxm", "model": "llama-2-7b"},
                       workload__sessions={"population": 1, "turns": {"dist": "constant", "value": 12},
                                           "think_time_s": {"dist": "constant", "value": 0.1},
                                           "user_tokens": {"dist": "constant", "value": 500}},
                       workload__output_tokens={"dist": "constant", "value": 100}, horizon_s=60.0)
    r = run_engine(sc, sc.engines[0])
    s, req = r.summary, r.requests
    assert s["failed"] >= 1 and s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"]
    for _, g in req.sort_values("turn").groupby("session_id"):
        failed = g[g["status"] == "failed"]
        # the grown context exceeds max_model_len: that turn is rejected and the conversation ends there
        assert len(failed) <= 1
        if len(failed):
            assert failed["turn"].iloc[0] == g["turn"].max()
            assert (failed["prompt_len"] + 1 > 4096).all()


@pytest.mark.skipif(not (TRACES / "conversation_trace.jsonl").exists(), reason="shared traces absent")
def test_mooncake_replay_hit_rate_equals_trace_reuse_with_unlimited_cache():
    import json
    rows = [json.loads(x) for x in (TRACES / "conversation_trace.jsonl").read_text().splitlines()[:400]]
    t0 = rows[0]["timestamp"]
    keep = [r for r in rows if (r["timestamp"] - t0) / 1e3 < 120]
    seen, reused, total = set(), 0, 0
    for r in sorted(keep, key=lambda r: r["timestamp"]):  # independent: token-weighted reuse of earlier blocks
        for i, h in enumerate(r["hash_ids"]):
            n = min(512, r["input_length"] - 512 * i)
            total += n
            reused += n if h in seen else 0
        seen.update(r["hash_ids"])
    sc = make_scenario(workload={"trace": {"kind": "mooncake", "path": str(TRACES / "conversation_trace.jsonl"),
                                           "end_s": 120}},
                       deployment={"hardware": "b200", "model": "llama-3.1-8b"}, horizon_s=120.0,
                       engines=[{"engine": "vllm", "params": {"kv_cache_memory_bytes": 10**12}}])
    s = run_engine(sc, sc.engines[0]).summary
    # vLLM recomputes at least the last token of a fully cached prompt, hence the small tolerance
    assert s["prefix_cache_hit_rate"] == pytest.approx(reused / total, abs=0.002)


@pytest.mark.skipif(not (TRACES / "AzureLLMInferenceTrace_conv.csv").exists(), reason="shared traces absent")
def test_azure_replay_preserves_inter_arrival_times():
    from simengine.workload.traces import ReplayOptions, read_trace
    sc = make_scenario(workload={"trace": {"kind": "azure", "path": str(TRACES / "AzureLLMInferenceTrace_conv.csv"),
                                           "end_s": 30}}, horizon_s=30.0)
    req = run_engine(sc, sc.engines[0]).requests
    tr = read_trace("azure", TRACES / "AzureLLMInferenceTrace_conv.csv", ReplayOptions(end_s=30))
    assert np.allclose(np.sort(req["arrival_s"].to_numpy()), tr.arrival_s)
    assert (np.sort(req["prompt_len"].to_numpy()) == np.sort(tr.input_tokens)).all()


def test_missing_trace_file_is_a_clear_input_error():
    sc = make_scenario(workload={"trace": {"kind": "azure", "path": "no/such/file.csv"}})
    with pytest.raises(InputError, match="trace file not found"):
        run_engine(sc, sc.engines[0])


def test_rag_documents_are_shared_across_requests():
    sc = make_scenario(workload__documents={"count": 3, "tokens": {"dist": "constant", "value": 2000}, "zipf_s": 0},
                       workload__input_tokens={"dist": "constant", "value": 50}, horizon_s=20.0)
    s = run_engine(sc, sc.engines[0]).summary
    assert s["prefix_cache_hit_rate"] > 0.8


@pytest.mark.parametrize("table, mean, lo, hi", [("sharegpt_input", 202, 4, 1024), ("sharegpt_output", 179, 4, 2044)])
def test_empirical_length_table_hits_the_stated_mean_within_its_bounds(table, mean, lo, hi):
    from simengine.workload.distributions import Dist

    x = Dist(dist="empirical", table=table, mean=mean, min=lo, max=hi).sample_int(np.random.default_rng(3), 200_000)
    assert x.mean() == pytest.approx(mean, rel=0.02) and x.min() >= lo and x.max() <= hi
    assert np.median(x) < 0.75 * mean       # ShareGPT is long-tailed: the median sits well below the mean
    with pytest.raises(InputError, match="table"):
        Dist(dist="empirical", table="nosuch")
    with pytest.raises(InputError, match="mean"):
        Dist(dist="empirical", table=table, mean=5000)
