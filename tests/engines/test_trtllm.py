"""TensorRT-LLM capacity + micro-batch scheduler driven by hand, like its capacityScheduler/microBatch tests."""

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.request import Status
from simengine.engines.memory import NON_TORCH_BYTES, activation_reserve_bytes
from simengine.engines.trtllm import TrtllmEngine, TrtllmParams, trtllm_capture_sizes
from simengine.errors import InputError
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import run_step


def engine(**params) -> TrtllmEngine:
    return TrtllmEngine(TrtllmParams(**params), make_dep())


def drain(eng, now=0.0, steps=400):
    done = []
    for i in range(steps):
        if not eng.has_work():
            break
        _, res = run_step(eng, now + i * 0.01)
        done += res.finished
    return done


def test_defaults_memory_rule_and_graph_sizes():
    eng = engine()
    dep = eng.dep
    p = eng.params
    assert (p.max_batch_size, p.max_num_tokens, p.tokens_per_block) == (2048, 8192, 32)
    assert not p.enable_chunked_prefill and p.capacity_scheduler_policy == "GUARANTEED_NO_EVICT"
    assert (eng.step_token_limit, eng.batch_size_limit) == (8192, 2048)
    free = (dep.hardware.memory_bytes - dep.weight_bytes_per_device
            - activation_reserve_bytes(dep, 8192, 2048) - NON_TORCH_BYTES)
    tokens = int(0.9 * free // dep.kv_bytes_per_token_per_device)   # 0.9 of FREE memory, not of total
    assert eng.kv_capacity_tokens() == tokens // 32 * 32
    assert trtllm_capture_sizes(128, False) == tuple(range(1, 32)) + (32, 64, 128)
    assert trtllm_capture_sizes(128, True)[:5] == (1, 2, 4, 8, 16)
    t = eng.timing
    assert t.overlap and not t.graph_mixed_steps and not t.graph_padding
    assert t.graph_for(31, True) == (True, 31) and t.graph_for(33, True) == (False, 33)  # no padding: eager
    assert t.graph_for(64, True) == (True, 64) and t.graph_for(200, True) == (False, 200)
    assert t.graph_for(4, False) == (False, 4)            # a context in the batch: no graph
    assert engine(cuda_graph_config=False).timing.cuda_graph_sizes == ()


def test_params_are_validated():
    with pytest.raises(InputError, match="free_gpu_memory_fraction"):
        TrtllmParams(free_gpu_memory_fraction=1.5)
    with pytest.raises(InputError, match="max_num_tokens"):
        TrtllmParams(max_num_tokens=0)
    with pytest.raises(InputError, match="deployment.weight_dtype"):
        TrtllmEngine(TrtllmParams(), make_dep(weight_dtype="q4_0"))


def test_guaranteed_no_evict_reserves_to_completion_and_blocks_head_of_line():
    eng = engine(kv_cache_max_tokens=320, disable_overlap_scheduler=True)   # 10 blocks of 32
    a = make_request(100, 100)   # reserves ceil(200/32) = 7 blocks to completion
    b = make_request(64, 64)     # needs 4 more: 11 > 10, although its prompt (2 blocks) fits now
    c = make_request(10, 10)     # 1 block would fit, but the first that does not fit stops admission
    for r in (a, b, c):
        eng.add_request(r, 0.0)
    out, _ = run_step(eng)
    assert [r for r, _ in out.scheduled] == [a]
    assert eng.waiting == [b, c] and eng.kv.num_blocks_of(a) == 4   # blocks come lazily; the reservation holds
    now = 0.01
    for _ in range(300):
        if a.status is Status.FINISHED:
            break
        out, _ = run_step(eng, now)
        now += 0.01
        assert [r for r, _ in out.scheduled] == [a]     # b and c wait although blocks sit free
        eng.check_invariants()
    drain(eng, now)
    assert eng.num_preemptions == 0 and all(r.status is Status.FINISHED for r in (a, b, c))
    assert b.first_scheduled_s >= a.finish_s and c.first_scheduled_s >= b.first_scheduled_s


def test_overlap_scheduler_runs_one_extra_decode_step():
    times = {}
    for overlap in (True, False):
        eng = engine(disable_overlap_scheduler=not overlap)
        req = make_request(50, 3)
        eng.add_request(req, 0.0)
        shapes = []
        for i in range(6):
            if not eng.has_work():
                break
            out, _ = run_step(eng, i * 0.01)
            shapes.append((out.shape.num_prefill_tokens, out.shape.num_decode))
        times[overlap] = (req.finish_s, shapes, req.num_output_tokens)
    fin_on, shapes_on, n_on = times[True]
    fin_off, shapes_off, n_off = times[False]
    assert shapes_off == [(50, 0), (0, 1), (0, 1)]
    assert shapes_on == [(50, 0), (0, 1), (0, 1), (0, 1)]     # the extra, dropped decode is computed
    assert fin_on == pytest.approx(fin_off + 0.01)             # and the completion is seen a step later
    assert n_on == n_off == 3


def test_no_chunking_prompt_must_fit_whole_and_long_prompts_are_rejected():
    eng = engine(disable_overlap_scheduler=True)
    long = make_request(9000, 2)
    assert not eng.add_request(long, 0.0) and "max_num_tokens" in long.fail_reason
    a, b = make_request(5000, 4), make_request(4000, 4)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    out, _ = run_step(eng)
    assert out.scheduled == [(a, 5000)]          # 5000 + 4000 > 8192: the walk breaks, no chunk of b
    out, _ = run_step(eng, 0.01)
    assert out.scheduled == [(a, 1), (b, 4000)]  # generation tokens first, then the whole prompt


def test_chunked_prefill_fills_budget_with_block_aligned_chunks():
    eng = engine(enable_chunked_prefill=True, disable_overlap_scheduler=True)
    a, b = make_request(5000, 4), make_request(9000, 4)
    eng.add_request(a, 0.0)
    assert eng.add_request(b, 0.0)               # longer than max_num_tokens is fine when chunking
    out, _ = run_step(eng)
    assert out.scheduled[0] == (a, 5000)
    n = out.scheduled[1][1]
    assert n == (8192 - 5000) // 32 * 32 and n % 32 == 0
    assert out.num_tokens <= 8192


def test_max_utilization_pauses_the_most_recently_started():
    eng = engine(kv_cache_max_tokens=320, capacity_scheduler_policy="MAX_UTILIZATION",
                 disable_overlap_scheduler=True, enable_block_reuse=False)
    a, b = make_request(150, 40), make_request(150, 40)   # 5 blocks each: the pool is full after prefill
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    out, _ = run_step(eng)
    assert {r.request_id for r, _ in out.scheduled} == {a.request_id, b.request_id}
    paused, now = [], 0.01
    for _ in range(300):
        out, _ = run_step(eng, now)
        now += 0.01
        paused = out.preempted
        eng.check_invariants()
        if paused:
            break
    assert paused == [b] and b.status is Status.PREEMPTED and b.num_computed_tokens == 0
    assert b in eng.waiting and eng.num_preemptions == 1 and b.num_preemptions == 1
    assert (a, 1) in out.scheduled and b not in [r for r, _ in out.scheduled]
    # the same pair under GUARANTEED_NO_EVICT never shares the pool: b waits for a to finish
    g = engine(kv_cache_max_tokens=320, disable_overlap_scheduler=True)
    a2, b2 = make_request(150, 40), make_request(150, 40)
    g.add_request(a2, 0.0)
    g.add_request(b2, 0.0)
    drain(g)
    assert g.num_preemptions == 0 and b2.first_scheduled_s >= a2.finish_s - 0.01


def test_block_reuse_and_beneficial_to_skip():
    prefix = np.arange(320, dtype=np.int32) + 7      # 10 full blocks shared
    for reuse in (True, False):
        eng = engine(enable_block_reuse=reuse, disable_overlap_scheduler=True)
        a = make_request(370, 3, tokens=np.concatenate([prefix, np.arange(50, dtype=np.int32) + 900]))
        b = make_request(370, 3, tokens=np.concatenate([prefix, np.arange(50, dtype=np.int32) + 1900]))
        eng.add_request(a, 0.0)
        eng.add_request(b, 0.0)
        out, _ = run_step(eng)
        if reuse:
            assert out.scheduled == [(a, 370)]           # b's first new block is being produced by a: skip
            out, _ = run_step(eng, 0.01)
            assert (b, 50) in out.scheduled and b.num_cached_tokens == 320
            assert eng.prefix_hit_rate() == pytest.approx(320 / 740)
        else:
            assert out.scheduled == [(a, 370), (b, 370)] and eng.prefix_hit_rate() == 0.0


def test_static_batch_admits_only_into_an_empty_engine():
    eng = engine(capacity_scheduler_policy="STATIC_BATCH", disable_overlap_scheduler=True)
    a = make_request(20, 5)
    eng.add_request(a, 0.0)
    run_step(eng)
    b = make_request(20, 5)
    eng.add_request(b, 0.01)
    out, _ = run_step(eng, 0.01)
    assert out.scheduled == [(a, 1)]
    drain(eng, 0.02)
    assert b.first_scheduled_s >= a.finish_s


def test_end_to_end_conservation_and_invariants():
    sc = make_scenario(horizon_s=15.0, workload__input_tokens={"dist": "lognormal", "mean": 3000, "sigma": 1.0,
                                                               "max": 12000})
    for params in ({}, {"capacity_scheduler_policy": "MAX_UTILIZATION", "kv_cache_max_tokens": 40000}):
        r = run_engine(sc, EngineEntry(engine="trtllm", params=params), check_invariants=True)
        s = r.summary
        assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 20
        assert s["completed"] > 0
        if not params:
            assert s["failed"] > 0   # prompts over max_num_tokens are refused without chunked prefill
            assert (r.requests.loc[r.requests.status == "failed", "prompt_len"] > 8192).all()
