"""KV offload to host memory (kvcache/host_tier.py): vLLM's CPU tier (write-through, asynchronous loads) and
TensorRT-LLM's secondary pool (offload on eviction, onboarding in the step). A prefix found in host memory costs its
bytes over the host link plus the link's latency, raises the share of prompt tokens not recomputed and lowers TTFT
when the GPU pool is too small; requests are conserved and the tier never exceeds its capacity; the settings that
cannot work are refused naming the knob."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry, load_scenario
from simengine.core.request import Status
from simengine.errors import InputError
from simengine.sim.build import build_engine, cost_model
from simengine.sim.runner import Runner
from tests.conftest import make_dep, make_request, make_scenario

GIB = 2**30
OFFLOAD = {"vllm": {"kv_cache_memory_bytes": 2000 * 131072, "kv_offloading_size": 4.0},
           "trtllm": {"kv_cache_max_tokens": 2048, "host_cache_size": 4 * GIB},
           "sglang": {"max_total_tokens": 2048, "enable_hierarchical_cache": True, "hicache_size": 4}}
POOL_KEYS = ("kv_cache_memory_bytes", "kv_cache_max_tokens", "max_total_tokens")


def engine_of(name: str, params: dict):
    return build_engine(EngineEntry(engine=name, params=params), make_dep())


def drive(eng, reqs, dt: float = 0.01):
    """Feed `reqs` one after another (each after the last finished, so earlier prompts fall out of a small GPU pool),
    loading offloaded KV at once; returns the steps' outputs."""
    outs, now = [], 0.0
    for req in reqs:
        assert eng.add_request(req, now)
        while eng.has_work():
            out = eng.schedule(now)
            for r in out.kv_loads:
                eng.remote_kv_arrived(r, now)
            now += dt
            if out.scheduled:
                eng.update(out, now)
            eng.check_invariants()
            outs.append(out)
    assert all(r.status is Status.FINISHED and r.num_output_tokens == r.output_len for r in reqs)
    return outs


def shared_prompts(n: int, length: int, seed: int = 0) -> list:
    """`n` pairs of requests: a prompt, then an unrelated one, ..., then each first prompt again."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32000, length) for _ in range(n)]
    first = [make_request(length, 4, tokens=p, request_id=i) for i, p in enumerate(prompts)]
    again = [make_request(length, 4, tokens=p, request_id=100 + i) for i, p in enumerate(prompts)]
    return first + again


@pytest.mark.parametrize("engine", ["vllm", "trtllm", "sglang"])
def test_prompts_evicted_from_a_small_gpu_pool_come_back_from_host_memory(engine):
    reqs = shared_prompts(4, 1500)
    plain = {k: v for k, v in OFFLOAD[engine].items() if k in POOL_KEYS}
    eng = engine_of(engine, plain)
    drive(eng, reqs)
    assert all(r.num_cached_tokens == 0 for r in reqs[4:])     # the GPU pool held one prompt at a time
    reqs = shared_prompts(4, 1500)
    eng = engine_of(engine, OFFLOAD[engine])
    outs = drive(eng, reqs)
    loaded = eng.host_tier_stats()["hit_tokens"]
    if engine == "sglang":   # its cached-token count is the device hit; the rest came back from the host
        assert all(r.num_cached_tokens < 100 for r in reqs[4:]) and loaded >= 4 * 1400
    else:
        assert all(r.num_cached_tokens >= 1400 for r in reqs[4:])  # whole blocks of each prompt, from the host
        assert loaded == sum(r.num_cached_tokens for r in reqs[4:])
    if engine == "vllm":
        assert sum(len(o.kv_loads) for o in outs) == 4
    else:
        assert sum(o.shape.host_load_tokens for o in outs) == loaded
        assert all(o.shape.host_load_overlapped == (engine == "sglang") for o in outs if o.shape.host_load_tokens)


def test_an_offloaded_prefix_loads_in_bytes_over_the_host_link_plus_its_latency():
    """vLLM: one request, a second with the same prompt after the first was evicted: one load, on an idle link."""
    wl = {"arrival": {"process": "constant", "rate": 0.2}, "num_requests": 3,
          "input_tokens": {"dist": "constant", "value": 1}, "output_tokens": {"dist": "constant", "value": 2},
          "shared_prefix_tokens": 1600}   # every prompt: the same 1,600 tokens and one of its own
    sc = make_scenario(workload=wl, engines=[{"engine": "vllm", "params": {"kv_cache_memory_bytes": 2000 * 131072,
                                                                            "kv_offloading_size": 1.0}}])
    runner = Runner(sc, sc.engines[0])
    eng = runner.engines[0]
    pool = eng.kv.pool
    hits = []
    original = eng.kv.get_computed_blocks

    def evict_first(req):   # the pool forgets everything before each lookup: only the host tier can serve it
        for b in list(pool.cached.values()):
            if pool.ref_cnt[b] == 0:
                pool.uncache(b)
        hit = original(req)
        hits.append(hit.num_tokens)
        return hit

    eng.kv.get_computed_blocks = evict_first
    runner.run()
    loads = runner.replicas[0].host_loads
    assert len(loads) == 2 and hits == [0, 0, 0]
    hw, dep = eng.dep.hardware, eng.dep
    for tokens, queued_s, link_s in loads:
        assert tokens == 1600 and queued_s == 0      # the 100 full blocks of the shared tokens
        assert link_s == pytest.approx(tokens * dep.kv_bytes_per_token_per_device / hw.host_link_bandwidth_bytes_s
                                       + hw.host_link_latency_s, rel=1e-12)


def test_a_third_tier_on_disk_serves_what_host_memory_evicted_at_the_disk_s_cost():
    """vLLM with LMCache: a host tier of about one prompt, a local disk behind it; the prompts evicted from host memory
    come back from disk, each load read from disk first, then over the host link."""
    params = {"kv_cache_memory_bytes": 2000 * 131072, "kv_offloading_size": 0.25, "kv_offloading_backend": "lmcache",
              "lmcache_max_local_disk_size": 4.0}
    eng = engine_of("vllm", params)
    reqs = shared_prompts(4, 1500)
    seconds = []   # (tokens loaded, of them from disk, load seconds), priced before each load lands
    arrived = eng.remote_kv_arrived

    def priced_then_arrived(req, now):
        disk = eng.disk_loads.get(req.request_id, 0)
        seconds.append((req.remote_kv_tokens, disk, eng.host_load_seconds(req)))
        arrived(req, now)

    eng.remote_kv_arrived = priced_then_arrived
    drive(eng, reqs)
    stats = eng.host_tier_stats()
    assert stats["disk_loaded_blocks"] > 0 and all(r.num_cached_tokens >= 1400 for r in reqs[4:])
    hw, per = eng.dep.hardware, eng.dep.kv_bytes_per_token_per_device
    from simengine.kvcache.host_tier import DISK_READ_BYTES_S, DISK_READ_LATENCY_S
    assert any(disk for _, disk, _ in seconds)
    for tokens, disk, s in seconds:
        want = tokens * per / hw.host_link_bandwidth_bytes_s + hw.host_link_latency_s
        if disk:
            want += disk * per / DISK_READ_BYTES_S + DISK_READ_LATENCY_S
        assert s == pytest.approx(want)
    with pytest.raises(InputError) as exc:
        engine_of("vllm", {"kv_offloading_size": 1.0, "lmcache_max_local_disk_size": 4.0})
    assert exc.value.field == "engines[vllm].params.lmcache_max_local_disk_size"


def test_trtllm_onboarding_adds_its_copy_to_the_step():
    eng = engine_of("trtllm", OFFLOAD["trtllm"])
    outs = drive(eng, shared_prompts(2, 1500))
    step = next(o for o in outs if o.shape.host_load_tokens)
    cost = cost_model(eng)
    with_copy = cost.step(step.shape).seconds
    without = cost.step(dataclasses.replace(step.shape, host_load_tokens=0)).seconds
    hw, work = eng.dep.hardware, cost.work
    assert with_copy - without == pytest.approx(step.shape.host_load_tokens * work.kv_write_bytes_per_token
                                                / hw.host_link_bandwidth_bytes_s + hw.host_link_latency_s)


def test_offload_wins_back_hits_and_ttft_when_the_gpu_pool_is_the_bottleneck():
    sc = load_scenario("kv_offload_agents", ["horizon_s=60", "workload.sessions.population=24"])
    res = {e.display: run_engine(sc, e).summary for e in sc.engines}
    for plain, offload in (("vllm", "vllm-offload-64g"), ("trtllm", "trtllm-host-64g"),
                           ("sglang", "sglang-hicache-64g")):
        assert res[offload]["kv_offload"]["host_hit_tokens"] > 0
        assert res[offload]["mean_ttft_ms"] < res[plain]["mean_ttft_ms"]
        assert res[offload]["total_input_tokens"] >= res[plain]["total_input_tokens"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=st.sampled_from(["vllm", "trtllm", "sglang"]), host_gib=st.sampled_from([0.01, 0.05, 1.0]),
       prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 1800), st.integers(1, 30)), min_size=1,
                        max_size=12))
def test_requests_are_conserved_and_the_host_tier_stays_within_capacity(engine, host_gib, prompts):
    params = dict(OFFLOAD[engine])
    size = {"vllm": ("kv_offloading_size", host_gib), "trtllm": ("host_cache_size", int(host_gib * GIB)),
            "sglang": ("hicache_size", max(1, int(host_gib)))}[engine]
    params[size[0]] = size[1]
    eng = engine_of(engine, params)
    rng = np.random.default_rng(1)
    bases = [rng.integers(0, 32000, 1800) for _ in range(4)]
    reqs = [make_request(n, out, tokens=bases[b], request_id=i) for i, (b, n, out) in enumerate(prompts)]
    drive(eng, reqs)
    stats = eng.host_tier_stats()
    assert stats["blocks"] <= stats["capacity_blocks"]


def test_offload_settings_that_cannot_work_name_the_knob():
    with pytest.raises(InputError, match="host_link") as exc:   # the H20 YAML describes no host link
        build_engine(EngineEntry(engine="vllm", params={"kv_offloading_size": 4.0}),
                     make_dep(hardware="h20"))
    assert exc.value.field == "engines[vllm].params.kv_offloading_size"
    with pytest.raises(InputError, match="prefix cache") as exc:
        engine_of("vllm", {"kv_offloading_size": 4.0, "enable_prefix_caching": False})
    assert exc.value.field == "engines[vllm].params.kv_offloading_size"
    with pytest.raises(InputError) as exc:
        engine_of("trtllm", {"host_cache_size": 1000})
    assert exc.value.field == "engines[trtllm].params.host_cache_size"
    with pytest.raises(InputError, match="not modelled") as exc:
        engine_of("sglang", {"enable_hierarchical_cache": True, "hicache_write_policy": "write_back"})
    assert exc.value.field == "engines[sglang].params.hicache_write_policy"
