"""TGI v3 policy driven by hand: worst-case reservation, FCFS, mixed chunked forwards, re-queue, radix at finish."""

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.request import Status
from simengine.engines.tgi import TgiEngine, TgiParams, tgi_compute_optimal_prefill
from simengine.errors import InputError
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import run_step
from tests.engines.harness import run_steps as drive


def engine(**params) -> TgiEngine:
    return TgiEngine(TgiParams(**params), make_dep())


def test_defaults_follow_the_launcher():
    dep = make_dep()
    mbpt = tgi_compute_optimal_prefill(dep)
    assert 50_000 < mbpt < 80_000                      # ~990 TFLOP/s / ~15 GFLOP per Llama-3.1-8B token
    eng = engine()
    assert eng.mbpt == mbpt and eng.block == 1 and eng.cache.page == 1 and eng.cache.partial_evict
    assert eng.cache.capacity > 300_000 and eng.max_total_tokens == 131_072
    assert eng.max_input_tokens == 131_071
    assert eng.timing.cuda_graph_sizes == (1, 2, 4, 8, 16, 32) and not eng.timing.overlap
    assert not eng.timing.graph_mixed_steps
    assert engine(attention="paged").cache.enabled is False and engine(attention="paged").block == 16


def test_worst_case_reservation_at_admission_capped_at_1024_new_tokens():
    eng = engine()
    small, large = make_request(100, 5, max_tokens=50), make_request(100, 5, max_tokens=3000)
    eng.add_request(small, 0.0)
    eng.add_request(large, 0.0)
    run_step(eng)
    assert eng.visits[small.request_id].hold.private == 100 + 50 - 1
    assert eng.visits[large.request_id].hold.private == 100 + 1024 - 1


def test_strict_fcfs_with_head_of_line_blocking():
    eng = engine(max_batch_total_tokens=2000)
    a = make_request(100, 20, max_tokens=1024)         # reserves 1123
    b = make_request(100, 5, max_tokens=1000)          # 1099 more would exceed 2000
    c = make_request(10, 2)                            # would fit, but never skips ahead of b
    for r in (a, b, c):
        eng.add_request(r, 0.0)
    outs = drive(eng, 20)
    assert outs[0].scheduled == [(a, 100)]
    assert all(r is a for o in outs[:20] for r, _ in o.scheduled)
    assert a.status is Status.FINISHED
    out, _ = run_step(eng, 1.0)
    assert [r for r, _ in out.scheduled] == [b, c]


def test_no_preemption_ever_under_memory_pressure():
    eng = engine(max_batch_total_tokens=3000)
    reqs = [make_request(300, 200) for _ in range(12)]
    for r in reqs:
        eng.add_request(r, 0.0)
    now = 0.0
    while eng.has_work():
        out, _ = run_step(eng, now)
        assert not out.preempted
        now += 0.01
    assert all(r.status is Status.FINISHED for r in reqs) and eng.num_preemptions == 0


def test_new_entries_join_the_running_batch_in_one_forward_then_a_decode_follows():
    eng = engine()
    a = make_request(50, 20)
    eng.add_request(a, 0.0)
    assert drive(eng, 2)[1].scheduled == [(a, 1)]      # prefill alone, then decode
    b = make_request(300, 5)
    eng.add_request(b, 0.02)
    out, _ = run_step(eng, 0.02)
    assert out.scheduled == [(a, 1), (b, 300)]         # concatenated: one mixed forward
    assert out.shape.num_decode == 1 and out.shape.prefill_chunks == [(300, 0)]
    c = make_request(30, 5)
    eng.add_request(c, 0.03)
    out, _ = run_step(eng, 0.03)
    assert out.scheduled == [(a, 1), (b, 1)]           # the decode call: no admission although c waits
    out, _ = run_step(eng, 0.04)
    assert (c, 30) in out.scheduled


def test_prefill_budget_is_max_batch_prefill_tokens_minus_current_tokens():
    eng = engine(max_batch_prefill_tokens=512)
    a = make_request(50, 20)
    eng.add_request(a, 0.0)
    drive(eng, 2)
    b = make_request(1300, 3)
    eng.add_request(b, 0.02)
    outs = drive(eng, 3, 0.02)
    assert [dict((r.request_id, n) for r, n in o.scheduled)[b.request_id] for o in outs] == [511, 511, 278]
    assert all(o.num_tokens <= 512 for o in outs)
    assert all((a, 1) in o.scheduled for o in outs)    # decodes never pause for the chunks


def test_long_generations_are_requeued_every_1024_tokens_with_the_text_appended():
    eng = engine()
    r = make_request(100, 1500, max_tokens=1500)
    eng.add_request(r, 0.0)
    drive(eng, 1024)
    assert r.num_output_tokens == 1024 and r.status is Status.WAITING and eng.queue[-1] is r
    assert r.request_id not in eng.visits and eng.cache.req_tokens == 0
    assert eng.cache.tree_tokens == 100                # the visit's prompt entered the trie when freed
    out, _ = run_step(eng, 20.0)
    assert out.scheduled == [(r, 1024)]                # prompt hit; the generated text is re-prefilled
    assert eng.visits[r.request_id].hold.private == 1124 + (1500 - 1024) - 1 - 100
    drive(eng, 475, 21.0)
    assert r.status is Status.FINISHED and r.num_preemptions == 0 and eng.num_preemptions == 0


def test_radix_trie_is_filled_only_when_a_request_finishes():
    eng = engine()
    shared = np.arange(1000, dtype=np.int32)
    a = make_request(1000, 10, tokens=shared)
    eng.add_request(a, 0.0)
    run_step(eng)
    b = make_request(1000, 2, tokens=shared)
    eng.add_request(b, 0.01)
    drive(eng, 2, 0.01)
    assert b.num_cached_tokens == 0                    # a is still running: nothing to share yet
    drive(eng, 10, 0.1)
    assert a.status is Status.FINISHED
    c = make_request(1000, 2, tokens=shared)
    eng.add_request(c, 1.0)
    out, _ = run_step(eng, 1.0)
    assert c.num_cached_tokens == 999 and out.scheduled == [(c, 1)]   # whole prompt hit, minus one


def test_max_concurrent_requests_rejects_with_429():
    eng = engine(max_concurrent_requests=3)
    assert all(eng.add_request(make_request(10, 2), 0.0) for _ in range(3))
    r = make_request(10, 2)
    assert not eng.add_request(r, 0.0) and r.status is Status.FAILED and "429" in r.fail_reason


def test_without_chunking_a_new_batch_is_prefilled_alone():
    eng = engine(prefill_chunking=False)
    a = make_request(50, 20)
    eng.add_request(a, 0.0)
    drive(eng, 2)
    b, c = make_request(200, 5), make_request(100, 5)
    eng.add_request(b, 0.02)
    eng.add_request(c, 0.02)
    out, _ = run_step(eng, 0.02)
    assert out.scheduled == [(b, 200), (c, 100)]       # decode of a pauses
    out, _ = run_step(eng, 0.03)
    assert out.scheduled == [(a, 1), (b, 1), (c, 1)]


def test_cuda_graphs_cover_small_pure_decode_batches_only():
    eng = engine()
    for _ in range(40):
        eng.add_request(make_request(20, 5), 0.0)
    run_step(eng)
    out, _ = run_step(eng, 0.01)
    assert out.shape.num_decode == 40 and not out.shape.cuda_graph       # above 32: eager
    eng = engine()
    for _ in range(3):
        eng.add_request(make_request(20, 5), 0.0)
    run_step(eng)
    out, _ = run_step(eng, 0.01)
    assert out.shape.cuda_graph and out.shape.padded_decode == 4


def test_validation_rejects_and_bad_params_raise():
    eng = engine(max_batch_total_tokens=2000)
    r = make_request(1990, 2, max_tokens=20)
    assert not eng.add_request(r, 0.0) and "max_total_tokens" in r.fail_reason
    with pytest.raises(InputError, match="cuda_memory_fraction"):
        TgiParams(cuda_memory_fraction=0.0)
    with pytest.raises(InputError, match="max_concurrent_requests"):
        TgiParams(max_concurrent_requests=0)


def test_end_to_end_conserves_requests_and_never_preempts():
    sc = make_scenario(engines=["tgi"], workload__shared_prefix_tokens=500)
    r = run_engine(sc, EngineEntry(engine="tgi", params={"max_batch_total_tokens": 20_000}), check_invariants=True)
    s = r.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 50
    assert s["preemptions"] == 0 and s["prefix_cache_hit_rate"] > 0.2


def test_the_prefill_budget_comes_from_the_launchers_own_card_table():
    """launcher/src/main.rs @db931fc: an H100 counts 900 TFLOP/s (not its 989 datasheet figure), and a card its table
    does not name (B200, H100 PCIe, every AMD device) falls back to 4096."""
    from simengine.engines.tgi import tgi_compute_optimal_prefill
    h100 = make_dep("h100_sxm")
    flop = 2 * h100.model.active_linear_params + 2 * h100.model.num_layers * h100.model.num_heads * \
        h100.model.head_dim * h100.model.hidden_size
    assert tgi_compute_optimal_prefill(h100) == int(900e12 / flop)
    for card in ("b200", "h100_pcie", "mi300x"):
        assert tgi_compute_optimal_prefill(make_dep(card)) == 4096, card
