"""Multi-LoRA serving (engines/lora.py) in vLLM and SGLang: the workload names adapters with a Zipf popularity; the
adapter slots' memory comes out of the KV pool; a step whose adapter is not active waits for its load (from disk the
first time, then from the host cache; SGLang's preloaded adapters from host memory only); at most max_loras adapters
run at once, a waiting request of a further adapter is passed by others; KV computed under different adapters is
never shared; requests are conserved."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simengine.api import run_engine
from simengine.config.loader import from_dict
from simengine.config.scenario import EngineEntry
from simengine.core.request import Status
from simengine.cost.work import ADAPTER_DISK_BYTES_S, ADAPTER_DISK_LATENCY_S
from simengine.engines.lora import ADAPTER_BYTES_PER_PARAM, lora_params_per_rank
from simengine.errors import CannotRun, InputError
from simengine.sim.build import build_engine, cost_model, plan_pools
from simengine.workload.config import WorkloadConfig
from simengine.workload.generator import RequestFactory
from tests.conftest import make_dep, make_request, make_scenario

LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 64}
SGLANG_LORA = {"enable_lora": True, "max_loras_per_batch": 2, "max_lora_rank": 64}


def vllm(**params):
    return build_engine(EngineEntry(engine="vllm", params=LORA | params), make_dep())


def sglang(**params):
    return build_engine(EngineEntry(engine="sglang", params=SGLANG_LORA | params), make_dep())


def drive(eng, reqs, dt: float = 0.01):
    for r in reqs:
        assert eng.add_request(r, 0.0)
    outs, now = [], 0.0
    while eng.has_work():
        out = eng.schedule(now)
        assert len({r.lora_id for r, _ in out.scheduled if r.lora_id >= 0}) <= eng.adapters.max_loras
        now += dt
        eng.update(out, now)
        eng.check_invariants()
        outs.append(out)
    assert all(r.status is Status.FINISHED and r.num_output_tokens == r.output_len for r in reqs)
    return outs


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_adapter_slots_come_out_of_the_kv_pool(engine):
    plain = build_engine(EngineEntry(engine=engine, params={}), make_dep())
    eng = vllm(max_loras=8) if engine == "vllm" else sglang(max_loras_per_batch=8)
    dep = eng.dep
    slot_bytes = 8 * 64 * lora_params_per_rank(dep.model) * ADAPTER_BYTES_PER_PARAM
    assert dep.adapter_weight_bytes_per_device == slot_bytes
    lost_tokens = plain.kv_capacity_tokens() - eng.kv_capacity_tokens()
    assert lost_tokens == pytest.approx(slot_bytes / dep.kv_bytes_per_token_per_device, abs=16)


def test_a_step_waits_for_an_adapter_that_is_not_active():
    eng = vllm()
    cost = cost_model(eng)
    first = make_request(100, 3, lora_id=7, lora_rank=16)
    outs = drive(eng, [first])
    assert outs[0].shape.lora_disk_load_ranks == 16 and all(o.shape.lora_disk_load_ranks == 0 for o in outs[1:])
    loaded = cost.step(outs[0].shape).seconds
    again = cost.step(dataclasses.replace(outs[0].shape, lora_disk_load_ranks=0)).seconds
    per_rank = lora_params_per_rank(eng.dep.model) * ADAPTER_BYTES_PER_PARAM
    hw = eng.dep.hardware
    assert loaded - again == pytest.approx(16 * per_rank / ADAPTER_DISK_BYTES_S + ADAPTER_DISK_LATENCY_S
                                           + 16 * per_rank / hw.host_link_bandwidth_bytes_s + hw.host_link_latency_s)
    # two more adapters push 7 out of the 2 GPU slots (max_cpu_loras = max_loras = 2 keeps 2 on the host too)
    for a in (8, 9):
        drive(eng, [make_request(100, 3, lora_id=a, lora_rank=16)])
    outs = drive(eng, [make_request(100, 3, lora_id=7, lora_rank=16)])
    assert outs[0].shape.lora_disk_load_ranks == 16   # gone from the host cache too
    eng = vllm(max_cpu_loras=10)
    for a in (7, 8, 9):   # one after another: 9 replaces 7, the least recently used, in the 2 GPU slots
        drive(eng, [make_request(100, 3, lora_id=a, lora_rank=16)])
    outs = drive(eng, [make_request(100, 3, lora_id=7, lora_rank=16)])
    assert outs[0].shape.lora_host_load_ranks == 16 and outs[0].shape.lora_disk_load_ranks == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_at_most_max_loras_adapters_run_and_others_pass_a_waiting_one(engine):
    eng = vllm(max_loras=1) if engine == "vllm" else sglang(max_loras_per_batch=1)
    a = make_request(64, 30, lora_id=1, lora_rank=8)
    b = make_request(64, 5, lora_id=2, lora_rank=8)
    base = make_request(64, 5)
    outs = drive(eng, [a, b, base])
    first = {r.request_id for r, _ in outs[0].scheduled}
    assert first == {a.request_id, base.request_id}       # b's adapter would be the second: base passes it
    assert b.first_scheduled_s >= a.finish_s - 0.011       # b runs once a's adapter leaves the batch


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_kv_under_different_adapters_is_not_shared(engine):
    eng = vllm() if engine == "vllm" else sglang()
    tokens = np.arange(512)
    drive(eng, [make_request(512, 2, tokens=tokens, lora_id=1, lora_rank=8)])
    other = make_request(512, 2, tokens=tokens, lora_id=2, lora_rank=8)
    same = make_request(512, 2, tokens=tokens, lora_id=1, lora_rank=8)
    base = make_request(512, 2, tokens=tokens)
    drive(eng, [other])
    drive(eng, [base])
    drive(eng, [same])
    assert other.num_cached_tokens == base.num_cached_tokens == 0
    assert same.num_cached_tokens == (496 if engine == "vllm" else 511)   # full blocks / every token but the last


def test_sglang_adapters_preloaded_in_host_memory_never_come_from_disk():
    eng = sglang(max_loras_per_batch=1)
    outs = []
    for a in (1, 2, 1):
        outs += drive(eng, [make_request(64, 2, lora_id=a, lora_rank=16)])
    assert sum(o.shape.lora_host_load_ranks for o in outs) == 3 * 16
    assert not any(o.shape.lora_disk_load_ranks for o in outs)
    eng = sglang(max_loras_per_batch=1, max_loaded_loras=1)   # one adapter on the host: the others from disk
    outs = []
    for a in (1, 2, 1):
        outs += drive(eng, [make_request(64, 2, lora_id=a, lora_rank=16)])
    assert sum(o.shape.lora_disk_load_ranks for o in outs) == 3 * 16


def test_the_workload_draws_adapters_by_popularity_and_a_session_keeps_its_own():
    cfg = from_dict(WorkloadConfig, {"num_requests": 3000, "lora": {"adapters": 20, "zipf_s": 1.2, "ranks": [8, 32],
                                                                     "fraction": 0.75}}, source="test")
    reqs = list(RequestFactory(cfg, 5, 32000, 8192).open_loop(1e9))
    again = list(RequestFactory(cfg, 5, 32000, 8192).open_loop(1e9))
    assert [r.lora_id for r in reqs] == [r.lora_id for r in again]
    counts = Counter(r.lora_id for r in reqs)
    assert counts[-1] / len(reqs) == pytest.approx(0.25, abs=0.03)
    assert counts[0] > counts[1] > counts[5] and all(r.lora_rank == (8, 32)[r.lora_id % 2] for r in reqs
                                                     if r.lora_id >= 0)
    sessions = from_dict(WorkloadConfig, {"sessions": {"population": 4}, "lora": {"adapters": 50}}, source="test")
    factory = RequestFactory(sessions, 5, 32000, 8192)
    for i in range(6):
        plan = factory.session(i)
        first = factory.session_turn(plan, 0.0, None)
        plan.turn = 1
        second = factory.session_turn(plan, 1.0, first)
        assert first.lora_id == second.lora_id >= 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=st.sampled_from(["vllm", "sglang"]), max_loras=st.integers(1, 4), max_cpu=st.integers(0, 4),
       reqs=st.lists(st.tuples(st.integers(-1, 6), st.integers(1, 900), st.integers(1, 40)), min_size=1, max_size=14),
       small=st.booleans())
def test_requests_are_conserved_with_any_adapters(engine, max_loras, max_cpu, reqs, small):
    if engine == "vllm":
        params = {"max_loras": max_loras, "max_cpu_loras": max_loras + max_cpu}
        if small:
            params["kv_cache_memory_bytes"] = 1500 * 131072
        eng = vllm(**params)
    else:
        params = {"max_loras_per_batch": max_loras, "max_loaded_loras": max_loras + max_cpu}
        if small:
            params["max_total_tokens"] = 1500
        eng = sglang(**params)
    drive(eng, [make_request(p, o, lora_id=a, lora_rank=16 if a >= 0 else 0) for a, p, o in reqs])


def test_lora_settings_that_cannot_work_are_refused():
    wl = {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 5, "lora": {"adapters": 3}}
    for engine, params, match in (("tgi", {}, "engines that model multi-LoRA serving: sglang, vllm"),
                                  ("vllm", {}, "set enable_lora: true"), ("sglang", {}, "set enable_lora: true")):
        sc = make_scenario(workload=wl, engines=[{"engine": engine, "params": params}])
        with pytest.raises(CannotRun, match=match):
            plan_pools(sc, sc.engines[0])
    with pytest.raises(InputError) as exc:
        vllm(max_loras=4, max_cpu_loras=2)
    assert exc.value.field == "engines[vllm].params.max_cpu_loras"
    eng = vllm(max_lora_rank=16)
    req = make_request(10, 2, lora_id=1, lora_rank=64)
    assert not eng.add_request(req, 0.0) and "max_lora_rank" in req.fail_reason
    with pytest.raises(InputError) as exc:
        build_engine(EngineEntry(engine="sglang", params={"enable_lora": True}), make_dep())
    assert exc.value.field == "engines[sglang].params.max_lora_rank"


def test_more_adapter_slots_cut_ttft_in_the_tenants_scenario():
    from simengine.config.scenario import load_scenario
    sc = load_scenario("multi_lora_tenants", ["horizon_s=40"])
    ttft = {e.display: run_engine(sc, e).summary["median_ttft_ms"] for e in sc.engines}
    assert ttft["vllm-4-loras"] > ttft["vllm-16-loras"] > ttft["vllm-32-loras-cpu-100"]
