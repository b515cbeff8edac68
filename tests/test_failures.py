"""Replica failures (deployment.failures): a failed replica loses its step, cache and requests; they are resent to
another replica up to max_retries times or fail; the router avoids it until it is back; availability is reported."""

from __future__ import annotations

import pytest

from simengine.api import run_engine
from simengine.config.scenario import load_scenario
from simengine.errors import InputError
from tests.conftest import make_scenario


def _run(replicas: int, failures: dict, engine: str = "vllm", rate: float = 8.0):
    sc = make_scenario(engines=[engine], deployment__replicas=replicas, deployment__failures=failures,
                       workload__arrival={"process": "poisson", "rate": rate}, horizon_s=30.0)
    return run_engine(sc, sc.engines[0])


def _conserved(r) -> None:
    s = r.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] == len(r.requests)
    assert r.requests["request_id"].is_unique   # a resent request is one row, counted once


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_a_failed_replica_s_requests_are_resent_and_it_runs_nothing_while_down(engine):
    r = _run(2, {"at": [{"time_s": 10.0, "replica": 0, "down_s": 8.0}], "max_retries": 1}, engine)
    _conserved(r)
    f = r.summary["faults"]
    assert f["failures"] == 1 and f["retries"] > 0 and f["failed_by_fault"] == 0
    assert r.summary["failed"] == 0 and r.summary["completed"] == r.summary["num_requests"]
    steps = r.steps[r.steps["replica"] == 0]
    assert not ((steps["end_s"] > 10.0) & (steps["start_s"] < 18.0)).any()   # no step on it while it is down
    assert (steps["start_s"] >= 18.0).any()                                  # back in service after repair
    done = r.requests[r.requests["replica"] == 0]
    assert not ((done["finish_s"] > 10.0) & (done["finish_s"] < 18.0)).any()
    end = r.steps["end_s"].max()
    assert f["availability"] == pytest.approx(1.0 - 8.0 / (2 * end), rel=0.02)
    assert r.down == [(0, 10.0, 18.0)]


def test_without_retries_the_lost_requests_fail_with_the_reason():
    r = _run(2, {"at": [{"time_s": 10.0, "replica": 1, "down_s": 5.0}], "max_retries": 0})
    _conserved(r)
    failed = r.requests[r.requests["status"] == "failed"]
    assert len(failed) == r.summary["faults"]["failed_by_fault"] > 0
    assert (failed["fail_reason"] == "replica 1 failed").all()
    assert (failed["finish_s"] == 10.0).all()


def test_with_every_replica_down_requests_wait_for_the_first_one_back():
    r = _run(1, {"at": [{"time_s": 5.0, "down_s": 10.0}]}, rate=2.0)
    _conserved(r)
    assert r.summary["failed"] == 0
    req = r.requests
    during = req[(req["arrival_s"] > 5.5) & (req["arrival_s"] < 14.0)]
    assert len(during) and ((during["arrival_s"] + during["ttft_ms"] / 1e3) >= 15.0).all()  # served after repair


def test_random_failures_are_drawn_from_the_seed():
    fail = {"mtbf_s": 6.0, "mttr_s": 2.0, "max_retries": 2}
    a, b = _run(2, fail), _run(2, fail)
    assert a.summary == b.summary and a.down == b.down and len(a.down) > 1
    assert {i for i, _, _ in a.down} == {0, 1}
    _conserved(a)


def test_a_failure_of_a_replica_that_does_not_exist_is_refused():
    with pytest.raises(InputError, match=r"failures.at\[0\].replica: replica 2 does not exist"):
        load_scenario("bursty_traffic", ["deployment.failures={at: [{time_s: 1, replica: 2}]}"])


def test_a_pipelined_replica_stops_every_micro_batch_lane_when_it_fails():
    sc = make_scenario(engines=["vllm"], deployment__replicas=2, deployment__pp=2, horizon_s=20.0,
                       deployment__failures={"at": [{"time_s": 6.0, "replica": 0, "down_s": 5.0}]},
                       workload__arrival={"process": "poisson", "rate": 8.0})
    r = run_engine(sc, sc.engines[0], check_invariants=True)
    _conserved(r)
    assert r.summary["failed"] == 0 and r.summary["faults"]["retries"] > 0
    steps = r.steps[r.steps["replica"] == 0]
    assert not ((steps["end_s"] > 6.0) & (steps["start_s"] < 11.0)).any()


def test_the_prefix_hit_rate_counts_the_lookups_a_failed_engine_served():
    """A failure replaces the replica's engine (its cache is gone); the hit rate of the run and of the replica
    still count what the failed engine served (audit 2026-12-06: replica 0 reported 0 % after a failure at the end)."""
    sc = make_scenario(engines=["vllm"], deployment__replicas=2, horizon_s=20.0,
                       deployment__failures={"at": [{"time_s": 19.9, "replica": 0, "down_s": 0.1}]},
                       workload__shared_prefix_tokens=1000,
                       workload__arrival={"process": "poisson", "rate": 8.0})
    r = run_engine(sc, sc.engines[0])
    rates = [rep["prefix_cache_hit_rate"] for rep in r.summary["replicas"]]
    assert rates[0] > 0.5 and rates[0] == pytest.approx(rates[1], abs=0.1), rates
    served = r.requests[r.requests["replica"] >= 0]
    by_tokens = served["num_cached_tokens"].sum() / served["prompt_len"].sum()
    assert r.summary["prefix_cache_hit_rate"] == pytest.approx(by_tokens, abs=0.05)


def test_reasons_that_differ_in_their_numbers_count_together_showing_each_number():
    import numpy as np

    from simengine.metrics.summary import failure_reasons
    strings = ["", "replica 0 failed", "replica 1 failed", "replica 2 failed",
               *(f"prompt of {n} tokens exceeds max_model_len 4096" for n in (5000, 6000, 7000, 8000, 9000))]
    out = failure_reasons(strings, np.array([0, 16, 50, 123, 1, 1, 1, 1, 1]))
    assert out == {"replica 0/1/2 failed": 189, "prompt of 5000-9000 tokens exceeds max_model_len 4096": 5}


def test_the_report_states_the_failures_and_the_availability():
    from simengine.report.html import insights
    r = _run(2, {"at": [{"time_s": 10.0, "replica": 0, "down_s": 8.0}], "max_retries": 1})
    lines = [ln for ln in insights({"vllm": r.summary}, {}) if "replica failure" in ln]
    f = r.summary["faults"]
    assert lines == [f"vllm: 1 replica failure(s), availability {f['availability']:.1%}; {f['retries']:,} requests "
                     f"resent, 0 failed for it."]


def test_replicas_failing_at_the_same_instant_do_not_spend_a_retry_on_each_other():
    """Audit 2026-12-06: a request lost by one replica was resent at once to another failing at the same instant,
    so one outage of the whole fleet used up its retries; now it waits for the first replica back."""
    at = [{"time_s": 10.0, "replica": 0, "down_s": 2.0}, {"time_s": 10.0, "replica": 1, "down_s": 2.0}]
    r = _run(2, {"at": at, "max_retries": 1})
    _conserved(r)
    assert r.summary["faults"]["retries"] > 0 and r.summary["faults"]["failed_by_fault"] == 0
    assert r.summary["failed"] == 0
