"""LMDeploy TurboMind scheduler driven by hand: one FCFS pass over all sequences per forward."""

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.request import Status
from simengine.engines.lmdeploy import LmdeployEngine
from simengine.engines.lmdeploy_config import LmdeployParams, turbomind_max_batch_size
from simengine.engines.memory import NON_TORCH_BYTES
from simengine.errors import InputError
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import drive, run_step


def engine(dep=None, **params) -> LmdeployEngine:
    return LmdeployEngine(LmdeployParams(**params), dep or make_dep())


def drain(eng, now=0.0, steps=2000):
    for i in range(steps):
        if not eng.has_work():
            return now + i * 0.01
        run_step(eng, now + i * 0.01)
        eng.check_invariants()
    raise AssertionError("did not drain")


def test_defaults_memory_rule_and_timing():
    assert [turbomind_max_batch_size(make_dep(h)) for h in ("h100_sxm", "h200_sxm", "a100_80g_sxm", "l40s")] == \
        [1024, 1024, 384, 128]
    eng = engine()
    dep = eng.dep
    assert (eng.step_token_limit, eng.batch_size_limit) == (8192 + 1024, 1024)
    free = dep.hardware.memory_bytes - dep.weight_bytes_per_device - NON_TORCH_BYTES
    tokens = int(0.8 * free // dep.kv_bytes_per_token_per_device)      # 0.8 of FREE memory after weights
    assert eng.kv_capacity_tokens() == tokens // 64 * 64 and eng.kv.block_size == 64
    assert not eng.kv.enable_prefix_caching
    assert eng.timing.cuda_graph_sizes == () and eng.timing.graph_for(8, True) == (False, 8)
    assert eng.timing.overlap and not engine(async_=0).timing.overlap


def test_the_decode_kernel_before_0_3_rereads_a_gqa_groups_kv_cache():
    """TurboMind's decoder_multihead_attention (v0.1-v0.2) computes at most 4 query heads a thread block (one with a
    quantised KV cache), so the blocks of a KV head's group each read its cache: Llama-2-70B (groups of 8) twice, a
    multi-head model once; today's decoding kernel takes a group of 4-8 in one block. The step prices the reads."""
    from simengine.sim.build import cost_model
    old = "decoder_multihead_attention"
    l70 = make_dep("a100_80g_sxm", "llama-2-70b", "fp16", "fp16", tp=4)
    assert engine(l70, decode_attention_kernel=old).decode_kv_reads() == 2.0
    assert engine(l70).decode_kv_reads() == 1.0
    l7 = make_dep("a100_80g_sxm", "llama-2-7b", "fp16", "fp16")   # multi-head: a group of one
    assert engine(l7, decode_attention_kernel=old).decode_kv_reads() == 1.0
    l3 = make_dep("a100_80g_sxm", "llama-3.1-8b")                      # 32 query heads over 8: groups of 4
    assert engine(l3, decode_attention_kernel=old).decode_kv_reads() == 1.0
    assert engine(l3, decode_attention_kernel=old, quant_policy=8).decode_kv_reads() == 4.0
    eng = engine(l70, decode_attention_kernel=old)
    assert cost_model(eng).work.decode_kv_reads == 2.0


def test_separate_passes_compute_the_iterations_contexts_then_one_decode_pass():
    """v0.1.0a1's loop (prefill_passes separate): the iteration's new sequences compute their contexts but the last
    token in prefill-only passes (whole sequences, within max_context_token_num tokens and longest context x
    sequences), then one decode pass gives every sequence one token (the new ones their last prompt token, hence
    their first output token); a request that arrives meanwhile waits for the next iteration."""
    eng = engine(prefill_passes="separate", max_context_token_num=1000)
    assert eng.cohort is None and eng.step_token_limit == 8192 + 1024
    a, b, c = make_request(400, 3, arrival_s=0.0), make_request(300, 3, arrival_s=0.0), make_request(500, 3)
    for r in (a, b, c):
        eng.add_request(r, 0.0)
    out, res = run_step(eng, 0.0)
    assert out.scheduled == [(a, 399), (b, 299)]      # c would make the padded mini-batch 3 x 499 > 1000
    assert res.num_first_tokens == 0
    late = make_request(50, 3, arrival_s=0.005)
    eng.add_request(late, 0.005)
    out, _ = run_step(eng, 0.01)
    assert out.scheduled == [(c, 499)]                  # the late arrival waits: the iteration admitted a, b, c
    out, res = run_step(eng, 0.02)
    assert out.scheduled == [(a, 1), (b, 1), (c, 1)]    # the decode pass: three first tokens
    assert res.num_first_tokens == 3 and a.first_token_s == b.first_token_s == c.first_token_s == 0.03
    out, _ = run_step(eng, 0.03)
    assert out.scheduled == [(late, 49)]                # the next iteration admits it, prefills it, then decodes
    out, _ = run_step(eng, 0.04)
    assert out.scheduled == [(a, 1), (b, 1), (c, 1), (late, 1)]
    drain(eng, 0.05)
    reqs = [make_request(200 + 37 * i, 4 + i % 5, arrival_s=0.01 * i) for i in range(40)]
    done, failed = drive(engine(prefill_passes="separate", max_batch_size=8, cache_max_entry_count=40), reqs)
    assert len(done) == 40 and not failed


def test_quant_policy_sets_kv_bytes_and_fp8_kv_is_rejected():
    base = engine().kv_capacity_tokens()
    int8, int4 = engine(quant_policy=8), engine(quant_policy=4)
    assert int8.dep.kv_dtype == "int8" and int4.dep.kv_dtype == "int4"
    assert int8.kv_capacity_tokens() == pytest.approx(2 * base, rel=1e-3)
    assert int4.kv_capacity_tokens() == pytest.approx(4 * base, rel=1e-3)
    assert engine(make_dep(kv_dtype="int8")).dep.kv_elem_bytes == 1.0     # kv_dtype int8 implies quant_policy 8
    with pytest.raises(InputError, match="FP8"):
        engine(make_dep(kv_dtype="fp8"))
    with pytest.raises(InputError, match="contradicts"):
        engine(make_dep(kv_dtype="int8"), quant_policy=4)
    w4 = engine(make_dep(weight_dtype="int4"))                           # W4A16 weights: more room for KV
    assert w4.kv_capacity_tokens() > base
    with pytest.raises(InputError, match="max_prefill_token_num"):
        LmdeployParams(max_prefill_token_num=0)


def test_strict_fcfs_over_all_sequences_and_block_aligned_chunks():
    eng = engine(max_prefill_token_num=100, max_batch_size=4)     # forward budget 104
    a = make_request(1000, 5, arrival_s=0.0)
    b = make_request(10, 5, arrival_s=0.1)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.1)
    out, _ = run_step(eng, 0.1)
    assert out.scheduled == [(a, 64), (b, 10)]       # a's 104-token chunk is cut back to a 64-token block
    eng2 = engine(max_prefill_token_num=60, max_batch_size=4)     # budget 64: the older prefill takes it all
    a, b = make_request(1000, 5, arrival_s=0.0), make_request(10, 5, arrival_s=0.1)
    eng2.add_request(a, 0.0)
    eng2.add_request(b, 0.1)
    for i in range(10):                                 # no decode-first rule: b waits behind a's prefill
        out, _ = run_step(eng2, 0.1 + i * 0.01)
        assert out.scheduled == [(a, 64)]
    # a sequence whose chunk would be shorter than a block sits out; later ones still run
    eng3 = engine(max_prefill_token_num=100, max_batch_size=4)
    x, y, z = make_request(50, 5), make_request(1000, 5), make_request(10, 5)
    for r in (x, y, z):
        eng3.add_request(r, 0.0)
    out, _ = run_step(eng3)
    assert out.scheduled == [(x, 50), (z, 10)]


def test_earlier_sequence_evicts_tail_blocks_of_later_ones():
    eng = engine(cache_max_entry_count=6)     # > 1: a block count, 6 x 64 tokens
    a = make_request(128, 300, arrival_s=0.0)
    b = make_request(190, 300, arrival_s=0.1)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.1)
    now, preempted = 0.1, []
    for _ in range(500):
        out, _ = run_step(eng, now)
        now += 0.01
        preempted = out.preempted
        eng.check_invariants()
        if preempted:
            break
    assert preempted == [b] and a.num_preemptions == 0 and b.num_preemptions == 1
    assert b.status is Status.PREEMPTED and 0 < b.num_computed_tokens < b.num_tokens
    kept = b.num_computed_tokens
    assert kept % 64 == 0 and eng.kv.num_blocks_of(b) == kept // 64   # the valid head of b survives
    assert [r for r, _ in out.scheduled] == [a]
    resumed = []
    for _ in range(1000):
        out, _ = run_step(eng, now)
        now += 0.01
        resumed = [n for r, n in out.scheduled if r is b]
        if resumed:
            break
    assert a.status is Status.FINISHED     # b is not resumed while the older a still needs the pool
    assert b.status is Status.RUNNING and resumed[0] >= 1 and b.num_computed_tokens >= kept


def test_interactive_session_resumes_from_kept_kv():
    def second_turn(**params):
        eng = engine(**params)
        turn1 = make_request(300, 20, session_id=3, turn=0)
        eng.add_request(turn1, 0.0)
        now = drain(eng)
        history = turn1.token_ids[:320]                       # prompt + the whole first answer
        turn2 = make_request(370, 5, tokens=np.concatenate([history, np.arange(50, dtype=np.int32) + 7000]),
                             session_id=3, turn=1)
        eng.add_request(turn2, now)
        out, _ = run_step(eng, now)
        return turn2, out.scheduled[0][1]

    t2, n = second_turn(interactive_sessions=True)
    assert n == 370 - 319 and t2.num_cached_tokens == 319     # only the new tokens (+ the last sampled one)
    t2, n = second_turn()
    assert n == 370 and t2.num_cached_tokens == 0             # sessions and prefix caching off: all of it
    t2, n = second_turn(enable_prefix_caching=True)
    assert n == 370 - 256                                     # the trie shares full 64-token blocks only


def test_session_kv_is_evicted_first_under_pressure():
    eng = engine(cache_max_entry_count=8, interactive_sessions=True)   # 8 blocks
    t1 = make_request(300, 20, session_id=1, turn=0)
    eng.add_request(t1, 0.0)
    now = drain(eng)
    assert eng.sessions[1][1] == 319 and eng.kv.num_blocks_of(t1) == 5
    other = make_request(400, 2)            # needs 7 blocks: takes 4 from the idle session, no preemption
    eng.add_request(other, now)
    out, _ = run_step(eng, now)
    assert out.scheduled == [(other, 400)] and not out.preempted
    assert eng.sessions[1][1] == 64 and eng.kv.num_blocks_of(t1) == 1
    now = drain(eng, now + 0.01)
    t2 = make_request(370, 3, tokens=np.concatenate([t1.token_ids[:320], np.arange(50, dtype=np.int32)]),
                      session_id=1, turn=1)
    eng.add_request(t2, now)
    out, _ = run_step(eng, now)
    assert out.scheduled == [(t2, 370 - 64)]                  # resumes from the prefix that survived


def test_requests_that_can_never_fit_are_rejected():
    eng = engine(cache_max_entry_count=4)   # 256 tokens: session_len is capped to the pool
    assert eng.max_model_len == 256
    long = make_request(300, 2)
    assert not eng.add_request(long, 0.0) and "max_model_len" in long.fail_reason
    ok = make_request(200, 500)
    assert eng.add_request(ok, 0.0) and ok.output_len == 56        # generation stops at session_len
    drain(eng)
    assert ok.status is Status.FINISHED


def test_end_to_end_conservation_and_invariants():
    sessions = {"population": 12, "turns": {"dist": "uniform", "low": 2, "high": 4},
                "think_time_s": {"dist": "constant", "value": 0.5}, "start_spread_s": 2.0}
    sc = make_scenario(horizon_s=10.0, workload__sessions=sessions, workload__shared_prefix_tokens=500)
    for params in ({}, {"interactive_sessions": True, "enable_prefix_caching": True, "cache_max_entry_count": 150}):
        r = run_engine(sc, EngineEntry(engine="lmdeploy", params=params), check_invariants=True)
        s = r.summary
        assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 20
        assert s["completed"] > 0 and s["failed"] == 0
