"""Routers across replicas: every registered router conserves requests; round robin balances; session affinity keeps
a session on one replica; the cache-aware routers raise the prefix hit rate over round robin on agent sessions."""

from __future__ import annotations

import pytest

from simengine.api import compare
from simengine.config.scenario import load_scenario
from simengine.errors import InputError
from simengine.routers import ROUTERS
from tests.conftest import make_scenario


@pytest.mark.parametrize("router", ROUTERS.names())
def test_every_router_conserves_requests_and_is_deterministic(router):
    sc = make_scenario(horizon_s=10.0, workload__arrival__rate=12.0, deployment__replicas=3, deployment__router=router,
                       workload__shared_prefix_tokens=256)
    a, b = compare(sc)["vllm"], compare(sc)["vllm"]
    s = a.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 50
    assert a.summary == b.summary   # power_of_two draws from the scenario's seed
    assert set(a.requests["replica"]) <= {0, 1, 2}


def test_round_robin_balances_within_one_request():
    sc = make_scenario(horizon_s=20.0, workload__arrival__rate=10.0, deployment__replicas=4,
                       deployment__router="round_robin")
    counts = compare(sc)["vllm"].requests["replica"].value_counts()
    assert len(counts) == 4 and counts.max() - counts.min() <= 1


@pytest.fixture(scope="module")
def agents():
    """agent_multiturn on 4 replicas for 60 s, per router: (summary, requests)."""
    out = {}
    for router in ("round_robin", "session_affinity", "prefix_aware", "kv_aware"):
        sc = load_scenario("agent_multiturn", ["deployment.replicas=4", f"deployment.router={router}", "horizon_s=60"])
        r = compare(sc, ["vllm"])["vllm"]
        out[router] = (r.summary, r.requests)
    return out


def test_session_affinity_keeps_every_turn_of_a_session_on_one_replica(agents):
    _, req = agents["session_affinity"]
    per_session = req.groupby("session_id")["replica"].nunique()
    assert (per_session == 1).all() and req["replica"].nunique() > 1


@pytest.mark.parametrize("router", ["prefix_aware", "kv_aware", "session_affinity"])
def test_cache_aware_routers_raise_the_hit_rate_over_round_robin(agents, router):
    assert agents[router][0]["prefix_cache_hit_rate"] > agents["round_robin"][0]["prefix_cache_hit_rate"] + 0.03


def test_prefix_aware_with_the_cli_thresholds_piles_on_the_replica_holding_the_system_prompt(agents):
    """The SGLang router's cache_aware with its command-line defaults: every session shares the agent's system
    prompt, which only the first replica ever saw, and the load gap never reaches balance_abs_threshold 64."""
    s, req = agents["prefix_aware"]
    assert req["replica"].nunique() == 1
    assert s["completed"] < agents["round_robin"][0]["completed"]


def test_bad_router_input_names_the_field():
    with pytest.raises(InputError, match="deployment.router"):
        make_scenario(deployment__replicas=2, deployment__router="fastest")
    with pytest.raises(InputError, match="deployment.router_params"):
        make_scenario(deployment__replicas=2, deployment__router="prefix_aware",
                      deployment__router_params={"cache_treshold": 0.5})
    with pytest.raises(InputError, match="deployment.router_params"):
        make_scenario(deployment__replicas=2, deployment__router="kv_aware",
                      deployment__router_params={"overlap_score_weight": -1})


def test_the_summary_has_a_section_per_replica(agents):
    for s, _ in agents.values():
        rows = s["replicas"]
        assert [r["replica"] for r in rows] == [0, 1, 2, 3]
        assert sum(r["completed"] for r in rows) == s["completed"]
        assert s["completed"] <= sum(r["requests"] for r in rows) <= s["completed"] + s["failed"]
    rr = agents["round_robin"][0]["replicas"]
    assert min(r["requests"] for r in rr) > 0 and all(0 < r["prefix_cache_hit_rate"] < 1 for r in rr)
    assert sum(r["requests"] > 0 for r in agents["prefix_aware"][0]["replicas"]) == 1


def test_a_router_reading_old_load_reports_misplaces_requests():
    """least_loaded with live state balances a burst; reading reports sent every 1,000 s it sees the idle replicas
    of time 0 throughout and sends everything to the first of equals."""
    base = dict(horizon_s=10.0, workload__arrival__rate=20.0, deployment__replicas=3, deployment__router="least_loaded")
    live = compare(make_scenario(**base))["vllm"].requests["replica"]
    stale = compare(make_scenario(**base, deployment__router_state_delay_s=1000.0))["vllm"].requests["replica"]
    assert live.nunique() == 3 and set(stale) == {0}


def test_a_routing_decision_delays_every_request_by_its_time():
    base = dict(horizon_s=10.0, workload__arrival__rate=2.0, deployment__replicas=2, deployment__router="round_robin")
    fast = compare(make_scenario(**base))["vllm"].requests.set_index("request_id")
    slow = compare(make_scenario(**base, deployment__router_decision_s=0.25))["vllm"].requests.set_index("request_id")
    assert ((slow["ttft_ms"] - fast["ttft_ms"]) - 250.0).abs().max() < 1.0   # light load: nothing else changes
