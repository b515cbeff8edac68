"""Static batching (HF generate): batch formation, padding, lockstep, held responses, contiguous reservations."""

from __future__ import annotations

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.request import Request, Status
from simengine.engines.static import StaticEngine, StaticParams
from simengine.engines.vllm import VllmEngine, VllmParams
from simengine.errors import InputError
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import drive


def req(rid: int, prompt: int, out: int, *, arrival: float = 0.0, max_tokens: int | None = None) -> Request:
    return make_request(prompt, out, arrival_s=arrival, request_id=rid, max_tokens=max_tokens)


def engine(**params) -> StaticEngine:
    return StaticEngine(StaticParams(**params), make_dep())


def mixed_requests(n: int, seed: int = 0, max_tokens: int | None = None) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(50, 3000, n)
    outs = np.minimum(rng.lognormal(np.log(150), 0.9, n).astype(int) + 1, max_tokens or 4096)
    return [req(i, int(prompts[i]), int(outs[i]), arrival=0.05 * i, max_tokens=max_tokens) for i in range(n)]


# ---- mechanism -------------------------------------------------------------------------------------------
def test_batch_forms_when_idle_and_prefills_padded_prompts():
    eng = engine(batch_size=4)
    reqs = [req(i, p, 5) for i, p in enumerate([100, 700, 300, 50, 900, 10])]
    for r in reqs:
        eng.add_request(r, 0.0)
    out = eng.schedule(0.0)
    assert [r.request_id for r, _ in out.scheduled] == [0, 1, 2, 3]            # FCFS, batch_size rows
    assert [n for _, n in out.scheduled] == [100, 700, 300, 50]                # real prompts advance
    assert out.shape.prefill_chunks == [(700, 0)] * 4                          # priced padded to the longest
    assert out.shape.num_logits == 4 and not out.shape.cuda_graph
    assert eng.num_waiting() == 2


def test_no_joins_lockstep_and_responses_held_to_batch_end():
    eng = engine(batch_size=3)
    a, b, c = req(0, 100, 2), req(1, 200, 6), req(2, 150, 4)
    for r in (a, b, c):
        eng.add_request(r, 0.0)
    out = eng.schedule(0.0)
    res = eng.update(out, 1.0)
    assert res.num_first_tokens == 3 and a.first_token_s == 1.0                # TTFT at the first step
    late = req(3, 10, 1, arrival=1.0)
    eng.add_request(late, 1.0)
    t = 1.0
    while eng.num_running():
        out = eng.schedule(t)
        assert late not in [r for r, _ in out.scheduled]                       # no joins while a batch runs
        assert out.shape.padded_decode == 3                                     # finished rows still computed
        assert out.shape.decode_context_tokens == 3 * (200 + b.num_output_tokens)
        t += 1.0
        res = eng.update(out, t)
        if eng.num_running():
            assert res.finished == []                                           # a finished early: held
    assert {r.request_id for r in res.finished} == {0, 1, 2}
    assert a.finish_s == b.finish_s == c.finish_s == t                         # returned together
    assert a.last_token_s < t                                                   # although a was done earlier
    assert eng.schedule(t).scheduled[0][0] is late                              # the next batch starts


def test_contiguous_reservation_limits_the_batch():
    # max_model_len rows: Llama-3.1-8B reserves 131072 x 128 KiB = 16 GiB per row; an H100 holds 3 of them
    eng = engine(batch_size=8, preallocate="max_model_len")
    reqs = [req(i, 100, 10) for i in range(8)]
    for r in reqs:
        eng.add_request(r, 0.0)
    out = eng.schedule(0.0)
    assert len(out.scheduled) == 3 and eng.num_waiting() == 5                  # the rest waits for memory
    assert eng.kv_usage() == pytest.approx(3 * 131072 / eng.kv_capacity_tokens())


def test_request_that_can_never_get_its_row_is_rejected():
    eng = StaticEngine(StaticParams(preallocate="max_model_len"), make_dep("rtx_4090"))
    r = req(0, 100, 10)
    eng.add_request(r, 0.0)
    out = eng.schedule(0.0)
    assert out.rejected == [r] and r.status is Status.FAILED and out.is_empty and not eng.has_work()


def test_max_model_len_static_cache_rejects_an_overrunning_request():
    eng = engine(preallocate="max_model_len")
    r = req(0, 131000, 100)
    assert not eng.add_request(r, 0.0) and "overruns" in r.fail_reason


def test_contiguous_preallocation_wastes_over_half_where_paged_uses_85_percent():
    reqs = mixed_requests(64, seed=3, max_tokens=1024)  # clients send max_tokens=1024, generate far fewer
    static = engine(batch_size=8)
    drive(static, reqs)
    reserved, used = static.kv_reserved_vs_used()
    assert used / reserved < 0.5                   # padding, rows of finished members, unused max_tokens
    classic = engine(batch_size=8, preallocate="max_model_len")
    drive(classic, mixed_requests(64, seed=3, max_tokens=1024))
    reserved, used = classic.kv_reserved_vs_used()
    assert used / reserved < 0.05                  # 131072-token rows for ~1-3k-token sequences

    paged = VllmEngine(VllmParams(enable_prefix_caching=False), make_dep())
    held = [0, 0]

    def account(eng):
        held[0] += sum(eng.kv.num_blocks_of(r) for r in eng.running) * eng.kv.block_size
        held[1] += sum(r.num_computed_tokens for r in eng.running)

    drive(paged, mixed_requests(64, seed=3, max_tokens=1024), on_step=account)
    assert held[1] / held[0] > 0.85


def test_eager_synchronous_timing():
    t = engine().timing
    assert t.cuda_graph_sizes == () and not t.overlap
    assert t.kernels_per_layer * t.kernel_launch_s > 12 * 4e-6  # eager HF dispatch dwarfs fused engines'


def test_params_validate():
    with pytest.raises(InputError, match="batch_size"):
        StaticParams(batch_size=0)


# ---- shared invariants and end to end ---------------------------------------------------------------------
@pytest.mark.parametrize("preallocate", ["max_tokens", "max_model_len"])
def test_shared_invariants_on_mixed_workload(preallocate):
    done, failed = drive(engine(batch_size=8, preallocate=preallocate), mixed_requests(40, seed=1))
    assert done and not failed


def test_end_to_end_smoke():
    scenario = make_scenario(engines=["static"], workload__num_requests=30,
                             workload__arrival={"process": "poisson", "rate": 2.0},
                             workload__output_tokens={"dist": "lognormal", "mean": 80, "sigma": 0.7, "max": 500})
    res = run_engine(scenario, EngineEntry(engine="static"), check_invariants=True)
    s = res.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == 30
    assert s["completed"] == 30
