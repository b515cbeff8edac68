"""Pools and prefill/decode disaggregation: KV transfers cost bytes / bandwidth + latency and queue on a shared link,
requests are conserved, the TTFT of a disaggregated request includes its prefill, the layouts that cannot work are
refused with the field named, and the decode pool of disagg_long_prompts has a lower p99 TPOT than colocated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from simengine.api import compare, run_engine
from simengine.config.hardware import HARDWARE_DIR
from simengine.config.scenario import EngineEntry, load_scenario
from simengine.errors import CannotRun, InputError
from simengine.sim.runner import Runner
from tests.conftest import make_scenario

PD = [{"role": "prefill", "replicas": 1}, {"role": "decode", "replicas": 1}]


def disaggregated(pools=None, **kw):
    return make_scenario(**{"pools": pools or PD, **kw})


def test_a_kv_transfer_on_an_idle_link_takes_bytes_over_bandwidth_plus_latency():
    sc = disaggregated(workload__num_requests=1)
    runner = Runner(sc, sc.engines[0])
    runner.run()
    (rid, src, dst, num_bytes, queued_s, link_s, *_), = runner.transfers
    model = runner.dep.model
    req_prompt = next(runner.recorder.request_rows())["prompt_len"][0]
    assert num_bytes == req_prompt * model.kv_bytes_per_token(runner.dep.kv_elem_bytes)   # no local hit: all of it
    hw = runner.dep.hardware    # both replicas in one HGX node: over NVLink
    assert queued_s == 0
    assert link_s == pytest.approx(num_bytes / hw.link_bandwidth_bytes_s + hw.link_latency_s, rel=1e-12)


def narrow_h100(tmp_path: Path, gb_s: float) -> str:
    """An H100 whose NVLink carries `gb_s` per direction (a narrowed link)."""
    data = yaml.safe_load((HARDWARE_DIR / "nvidia" / "h100_sxm.yaml").read_text())
    data["interconnect"]["bandwidth_gb_s_per_direction"] = gb_s
    path = tmp_path / "h100_sxm.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_transfers_that_overlap_on_a_narrow_link_queue_and_take_longer(tmp_path):
    """Two prompts prefilled in one step leave the prefill replica together: the second waits for the first."""
    wl = {"arrival": {"process": "offline"}, "num_requests": 2,
          "input_tokens": {"dist": "constant", "value": 2000}, "output_tokens": {"dist": "constant", "value": 20}}
    times = {}
    for gb_s in (450.0, 2.0):
        sc = disaggregated(workload=wl, deployment__hardware=narrow_h100(tmp_path, gb_s))
        runner = Runner(sc, sc.engines[0])
        runner.run()
        times[gb_s] = sorted(runner.transfers, key=lambda t: t[4])
    one, two = times[2.0]
    assert one[4] == 0 and two[4] == pytest.approx(one[5] - runner.dep.hardware.link_latency_s, rel=1e-9)
    assert two[4] + two[5] > 1.9 * one[5]
    assert one[5] > 100 * times[450.0][0][5]   # 2 GB/s against 450: far longer


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), prefill=st.integers(1, 3), decode=st.integers(1, 3),
       layerwise=st.booleans(), small_decode_pool=st.booleans(), rate=st.sampled_from([4.0, 20.0]),
       engines=st.sampled_from([("vllm", "vllm"), ("sglang", "sglang"), ("trtllm", "vllm"), ("vllm", "sglang"),
                                ("trtllm", "trtllm"), ("vllm", "trtllm")]))
@example(seed=0, prefill=3, decode=3, layerwise=False, small_decode_pool=False, rate=4.0,
         engines=("trtllm", "trtllm"))   # a decode whose KV lands before an earlier arrival's: the cohort numbers it
def test_a_disaggregated_run_conserves_requests(seed, prefill, decode, layerwise, small_decode_pool, rate, engines):
    pools = [{"role": "prefill", "replicas": prefill, "kv_transfer": "layerwise" if layerwise else "after_prefill",
              "engine": engines[0]}, {"role": "decode", "replicas": decode, "engine": engines[1]}]
    if small_decode_pool:   # about 4,096 tokens
        pools[1]["params"] = {"vllm": {"kv_cache_memory_bytes": 2**29}, "sglang": {"max_total_tokens": 4096},
                              "trtllm": {"kv_cache_max_tokens": 4096}}[engines[1]]
    sc = make_scenario(seed=seed, horizon_s=8.0, workload__arrival__rate=rate,
                       engines=[{"engine": "vllm", "pools": pools}])
    r = run_engine(sc, sc.engines[0], check_invariants=True)
    s = r.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 0
    d = s["disaggregation"]
    assert d["transfers"] == s["completed"] + s["unfinished"] - _not_transferred(r)
    assert [x["replica"] for x in s["replicas"]] == list(range(prefill + decode))
    assert [p["engine"] for p in s["pools"]] == list(engines)
    assert all(0 <= x["busy_fraction"] <= 1 for x in d["links"])


def _not_transferred(r) -> int:
    """Unfinished requests still at the prefill or on the link when the run ended."""
    req = r.requests
    return int(((req["status"] == "unfinished") & (req["ttft_ms"].isna())).sum())


def test_a_small_decode_pool_keeps_kv_on_the_prefill_side_and_counts_the_waits():
    small = {"role": "decode", "engine": "vllm", "params": {"kv_cache_memory_bytes": 2**29}}   # 4,096 tokens
    sc = make_scenario(horizon_s=20.0, workload__arrival__rate=12.0, pools=[PD[0], small])
    s = run_engine(sc, sc.engines[0], check_invariants=True).summary
    d = s["disaggregation"]
    assert d["waits_for_room"] > 0
    assert d["kv_held_on_prefill_ms"]["p99"] > d["link_ms"]["p99"]   # held past its transfer: waiting for room
    assert s["completed"] == s["num_requests"]


def test_a_roomy_decode_pool_under_light_load_never_waits_for_room():
    """Audit 2026-12-06: an engine that schedules ahead (vLLM's async scheduling) took the decision during which a
    transfer arrived before it arrived; that extra decision is not a wait for room (115 of 117 were counted)."""
    sc = make_scenario(horizon_s=20.0, workload__arrival__rate=3.0, pools=PD, engines=["vllm"])
    d = run_engine(sc, sc.engines[0]).summary["disaggregation"]
    assert d["transfers"] > 0 and d["waits_for_room"] == 0


def test_the_routing_decision_is_paid_where_any_tier_offers_a_choice():
    """One prefill replica and two decode replicas: the router still picks the decode replica (audit 2026-12-06:
    router_decision_s changed nothing here)."""
    pools = [{"role": "prefill", "replicas": 1}, {"role": "decode", "replicas": 2}]
    ttft = {}
    for decision_s in (0.0, 0.05):
        sc = make_scenario(horizon_s=10.0, workload__arrival__rate=2.0, pools=pools,
                           deployment__router_decision_s=decision_s)
        ttft[decision_s] = run_engine(sc, sc.engines[0]).summary["median_ttft_ms"]
    assert ttft[0.05] - ttft[0.0] == pytest.approx(50.0, abs=5.0)


@pytest.mark.parametrize("kv_transfer", ["after_prefill", "layerwise"])
def test_a_decode_pool_that_refuses_long_prompts_fails_them_once(kv_transfer):
    """The decode pool's vLLM caps its context at 2,048 tokens: longer prompts are prefilled (the prefill pool takes
    them), then refused by the decode side; each is one failed request, the prefill replica frees its KV."""
    pools = [{"role": "prefill", "kv_transfer": kv_transfer},
             {"role": "decode", "engine": "vllm", "params": {"max_model_len": 2048}}]
    sc = disaggregated(pools, horizon_s=15.0, workload__arrival__rate=6.0)
    r = run_engine(sc, sc.engines[0], check_invariants=True)
    s, req = r.summary, r.requests
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] == len(req)
    assert req["request_id"].is_unique
    long = req["prompt_len"] + 1 > 2048
    assert long.any() and (req.loc[long, "status"] == "failed").all()
    assert (req.loc[~long, "status"] == "completed").all()


def test_ttft_includes_the_prefill_side_queue_and_compute():
    """Six long prompts at once on one prefill replica: each first token comes after the prefill steps before it
    (its queue and its own compute) and its transfer; the last one after all of them."""
    wl = {"arrival": {"process": "offline"}, "num_requests": 6,
          "input_tokens": {"dist": "constant", "value": 6000}, "output_tokens": {"dist": "constant", "value": 30}}
    sc = disaggregated(workload=wl)
    r = run_engine(sc, sc.engines[0])
    prefill = r.steps[r.steps["replica"] == 0]
    ttft_s = np.sort(r.requests["ttft_ms"].to_numpy()) / 1e3
    assert len(prefill) >= 4      # 36,000 prompt tokens in steps of at most 8,192 (no decode there)
    assert (prefill["decode_tokens"] == 0).all()
    assert ttft_s[0] > prefill["step_s"].iloc[0]
    assert ttft_s[-1] > prefill["step_s"].sum() + r.summary["disaggregation"]["link_ms"]["p50"] / 1e3


def test_bad_layouts_are_refused_naming_the_field():
    with pytest.raises(InputError, match="all mixed"):
        Runner(*_first(disaggregated([{"role": "mixed"}, {"role": "prefill"}, {"role": "decode"}])))
    with pytest.raises(InputError, match="needs a decode pool"):
        Runner(*_first(disaggregated([{"role": "prefill"}])))
    with pytest.raises(InputError, match="same model"):
        Runner(*_first(disaggregated([{"role": "prefill"}, {"role": "decode", "model": "qwen2.5-7b"}])))
    with pytest.raises(CannotRun, match="tgi has no decode role.*engines that do: sglang, trtllm, vllm"):
        Runner(*_first(disaggregated([{"role": "prefill"}, {"role": "decode", "engine": "tgi"}])))
    # two 8-device replicas of L40S sit in two servers, and the L40S YAML describes no network between them
    with pytest.raises(InputError, match="l40s describes no network") as e:
        Runner(*_first(disaggregated([{"role": "prefill", "tp": 8}, {"role": "decode", "tp": 8}],
                                     deployment__hardware="l40s")))
    assert e.value.field.startswith("pools[")


def _first(sc):
    return sc, sc.engines[0]


def test_mixed_pools_of_two_devices_share_one_router():
    pools = [{"name": "h100", "hardware": "h100_sxm", "replicas": 1}, {"name": "a100", "hardware": "a100_80g_sxm",
                                                                       "replicas": 2}]
    sc = make_scenario(horizon_s=15.0, workload__arrival__rate=10.0, pools=pools, deployment__router="round_robin")
    s = compare(sc)["vllm"].summary
    assert [p["hardware"] for p in s["pools"]] == ["h100_sxm", "a100_80g_sxm", ]
    assert [x["pool"] for x in s["replicas"]] == ["h100", "a100", "a100"]
    decisions = [x["router_decisions"] for x in s["replicas"]]
    assert max(decisions) - min(decisions) <= 1 and sum(decisions) == s["num_requests"]


def test_sglang_and_trtllm_decode_from_the_prefill_sides_first_token():
    """SGLang's and TRT-LLM's decode servers take the first token with the KV (no recompute): it comes when the KV
    is in place, before vLLM's decode side has run its one-token step; the rest decode as usual."""
    wl = {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 12,
          "input_tokens": {"dist": "constant", "value": 3000}, "output_tokens": {"dist": "constant", "value": 40}}
    ttft = {}
    for decode in ("vllm", "sglang", "trtllm"):
        sc = disaggregated([{"role": "prefill", "engine": "vllm"}, {"role": "decode", "engine": decode}], workload=wl)
        r = run_engine(sc, sc.engines[0], check_invariants=True)
        assert r.summary["completed"] == 12 and (r.requests["num_output_tokens"] == 40).all()
        ttft[decode] = r.requests["ttft_ms"].to_numpy()
    assert (ttft["sglang"] < ttft["vllm"]).all() and (ttft["trtllm"] < ttft["vllm"]).all()


def test_prefill_on_trtllm_decode_on_vllm():
    pools = [{"role": "prefill", "engine": "trtllm"}, {"role": "decode", "engine": "vllm"}]
    sc = disaggregated(pools, horizon_s=10.0)
    s = run_engine(sc, EngineEntry(engine="vllm", label="hybrid"), check_invariants=True).summary
    assert [p["engine"] for p in s["pools"]] == ["trtllm", "vllm"]
    assert s["completed"] == s["num_requests"] == s["disaggregation"]["transfers"]


def test_disagg_long_prompts_decode_pool_has_a_lower_p99_tpot_than_colocated():
    sc = load_scenario("disagg_long_prompts", ["horizon_s=40"])
    res = compare(sc)
    colocated, split = res["colocated"].summary, res["disaggregated"].summary
    assert split["p99_tpot_ms"] < 0.8 * colocated["p99_tpot_ms"]
    assert split["completed"] + split["unfinished"] + split["failed"] == split["num_requests"]


def test_busy_fraction_of_a_link_per_time_bin():
    from simengine.report.plots import busy_fraction

    starts, ends = np.array([0.5, 2.0]), np.array([1.5, 4.0])
    np.testing.assert_allclose(busy_fraction(starts, ends, np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])),
                               [0.5, 0.5, 1.0, 1.0, 0.0])
    assert busy_fraction(np.array([]), np.array([]), np.array([0.0, 1.0])).tolist() == [0.0]


def test_replicas_fill_nodes_without_straddling_them():
    from simengine.sim.links import place

    pools = [type("P", (), {"dep": type("D", (), {"hardware": type("H", (), {"name": "h", "node_size": 8})(),
                                                   "num_devices": n})(), "count": c})() for n, c in ((3, 2), (4, 2))]
    # 3+3 fill node 0 to 6; a 4-device replica does not fit the 2 left: node 1, and the next one node 1 too
    assert place(pools) == [("h", 0), ("h", 0), ("h", 1), ("h", 1)]


def test_a_disaggregated_run_draws_its_cluster_timeline(tmp_path):
    from simengine.api import write_plots

    sc = disaggregated(horizon_s=5.0)
    res = compare(sc)
    paths = write_plots(sc, res, tmp_path)
    assert any(p.name == "vllm_cluster_timeline.png" and p.stat().st_size > 10_000 for p in paths)
