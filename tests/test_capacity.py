"""Capacity under an SLO: the search recovers queueing theory's answer, is monotone in the SLO and the device,
needs few runs, and refuses what it cannot search with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simengine.errors import InputError
from simengine.planning.capacity import parse_slo, search
from tests.conftest import make_scenario
from tests.test_theory import CONSTANT, SERVER, _frontend_s, _mean_service, _scenario

REPO = Path(__file__).resolve().parents[1]


def test_md1_capacity_matches_pollaczek_khinchine():
    """One server (vLLM, max_num_seqs=1), constant one-step services S, Poisson arrivals: an M/D/1 queue. With a
    limit on the mean TTFT (frontend F + wait + S), the capacity is the rate where Pollaczek-Khinchine's mean
    wait lambda S^2 / (2 (1 - lambda S)) reaches the limit's slack: here the rate of load 0.5."""
    s = _mean_service("l4", CONSTANT)
    sc = _scenario("l4", CONSTANT, 20_000, {"process": "poisson", "rate": 1.0}, seed=5)
    f = _frontend_s(sc, CONSTANT["value"])
    limit_ms = (f + 1.5 * s) * 1e3          # the mean wait at load 0.5 is S/2
    slack = limit_ms / 1e3 - f - s
    theory = 2 * slack / (s * s + 2 * s * slack)
    cap = search(sc, SERVER, parse_slo(f"ttft_mean_ms={limit_ms}"), tolerance=0.005)
    assert cap.rate == pytest.approx(theory, rel=0.03), (cap.rate, theory, cap.rate * s)
    assert cap.runs <= 12


def _small(**kw):
    return make_scenario(horizon_s=120.0, workload__arrival__rate=5.0, **kw)   # 600 requests per probe


def test_capacity_is_monotone_in_the_slo_and_the_device():
    tight, loose = parse_slo("ttft_p99_ms=1000"), parse_slo("ttft_p99_ms=3000")
    entry = _small().engines[0]
    on_l4 = _small(deployment={"hardware": "l4", "model": "llama-3.1-8b"})
    on_h100 = _small(deployment={"hardware": "h100_sxm", "model": "llama-3.1-8b"})
    a, b = search(on_l4, entry, tight), search(on_l4, entry, loose)
    c = search(on_h100, entry, tight)
    assert 0 < a.rate <= b.rate
    assert a.rate < c.rate
    for cap in (a, b, c):
        assert cap.runs <= 12
        assert cap.operating_point is not None and cap.operating_point.rate == cap.rate
        assert all(p.feasible == (p.rate <= cap.rate) for p in cap.points)


def test_an_slo_no_load_can_meet_gives_zero():
    cap = search(_small(), _small().engines[0], parse_slo("ttft_p50_ms=0.001"))
    assert cap.rate == 0 and "2% of" in cap.why_not_higher and cap.devices_for(10) is None


@pytest.mark.parametrize("text", ["ttft_p99=500", "ttft_p42_ms=5", "latency_p99_ms=5", "ttft_p99_ms=abc",
                                  "ttft_p99_ms=-3"])
def test_bad_slo_items_are_refused(text):
    with pytest.raises(InputError) as e:
        parse_slo(text)
    assert e.value.field == "--slo"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "simengine", "capacity", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("args,field", [
    (["agent_multiturn", "--slo", "ttft_p99_ms=500"], "workload.arrival"),       # sessions have no rate
    (["chat_high_concurrency", "--slo", "ttft_p99=5"], "--slo"),
    (["chat_high_concurrency", "--slo", "ttft_p99_ms=500", "--attainment", "1.5"], "--attainment"),
    (["chat_high_concurrency", "--slo", "ttft_p99_ms=500", "--price", "b200=3"], "--price"),
    (["chat_high_concurrency", "--slo", "ttft_p99_ms=500", "--target-rate", "-1"], "--target-rate"),
])
def test_capacity_cli_refuses_with_one_line(args, field, tmp_path):
    r = run_cli(*args, "--out", str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and field in r.stderr and "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir())


def test_capacity_cli_writes_its_table_files_and_figure(tmp_path):
    r = run_cli("chat_high_concurrency", "--engines", "vllm", "--set", "horizon_s=20", "--slo", "ttft_p99_ms=1500",
                "--target-rate", "100", "--price", "h100_sxm=2.0", "--out", str(tmp_path / "r"),
                "--plots", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(next((tmp_path / "r").rglob("capacity.json")).read_text())
    e = doc["engines"]["vllm"]
    assert e["capacity_req_s"] > 0 and e["runs"] <= 12 and e["price_usd_per_hour"] == 2.0
    assert e["devices_for_target"] == -(-100 // e["per_replica_req_s"])
    assert e["cost_per_1m_output_tokens_usd"] > 0
    assert next((tmp_path / "p").rglob("capacity.png")).stat().st_size > 0
    assert "capacity req/s" in r.stdout and "GPUs for 100/s" in r.stdout


def test_overload_is_flagged_when_finishes_fall_behind_arrivals():
    """chat_high_concurrency's replica serves about 29 req/s: offered 40 it is overloaded even though the drain
    lets every request finish; offered 10 it is not. The console marks the overloaded run's cost."""
    from simengine.api import run_engine
    from simengine.config.scenario import load_scenario
    from simengine.report.tables import format_table

    out = {}
    for rate in (10, 40):
        sc = load_scenario("chat_high_concurrency", [f"workload.arrival.rate={rate}", "engines=[vllm]"])
        out[rate] = run_engine(sc, sc.engines[0]).summary
    assert out[40]["overloaded"] is True and out[40]["unfinished"] == 0
    assert out[40]["offered_rate"] == pytest.approx(40, rel=0.05) and out[40]["request_throughput"] < 35
    assert out[10]["overloaded"] is False and out[10]["offered_rate"] == pytest.approx(10, rel=0.05)
    table = format_table({"at10": out[10], "at40": out[40]})
    assert "overloaded" in table.splitlines()[-1]
    cost = [ln for ln in table.splitlines() if ln.startswith("at40")][0].split()[-1]
    assert cost.endswith("!")


def test_a_deployment_of_pools_scales_as_a_whole():
    """Audit 2026-12-06: 2 prefill + 1 decode replicas of one GPU each counted as three one-GPU replicas, so the GPUs
    for a target rate could be a number no whole 2P+1D layout gives."""
    from simengine.planning.capacity import Capacity, scaling_unit
    from simengine.sim.build import plan_pools
    sc = make_scenario(pools=[{"role": "prefill", "replicas": 2}, {"role": "decode", "replicas": 1}])
    assert scaling_unit(plan_pools(sc, sc.engines[0])) == (1, 3)
    plain = make_scenario(deployment__replicas=4, deployment__tp=2)
    assert scaling_unit(plan_pools(plain, plain.engines[0])) == (4, 2)
    unit = Capacity("pd", 7.71, 10.0, 1, 3)
    assert unit.devices_for(20.0) == 9 and unit.rate_per_device == pytest.approx(7.71 / 3)
