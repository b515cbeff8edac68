"""Orca: iteration-level scheduling, whole prefills mixed with decodes, max-length reservation, no preemption."""

from __future__ import annotations

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.request import Request, Status
from simengine.engines.orca import OrcaEngine, OrcaParams
from simengine.errors import InputError
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import drive
from tests.engines.harness import run_step as step


def req(rid: int, prompt: int, out: int, *, arrival: float = 0.0, max_tokens: int | None = None) -> Request:
    return make_request(prompt, out, arrival_s=arrival, request_id=rid, max_tokens=max_tokens)


def engine(**params) -> OrcaEngine:
    return OrcaEngine(OrcaParams(**params), make_dep())


def mixed_requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(20, 2000, n)
    outs = rng.lognormal(np.log(60), 0.9, n).astype(int) + 1
    return [req(i, int(prompts[i]), int(outs[i]), arrival=0.03 * i, max_tokens=int(outs[i]) + int(rng.integers(0, 200)))
            for i in range(n)]


# ---- mechanism -------------------------------------------------------------------------------------------
def test_whole_prefills_join_running_decodes_each_iteration():
    eng = engine()
    a = req(0, 100, 10)
    eng.add_request(a, 0.0)
    step(eng)
    b, c = req(1, 6000, 5), req(2, 3000, 5)
    eng.add_request(b, 0.01)
    eng.add_request(c, 0.01)
    out, res = step(eng, 0.01)
    assert out.scheduled == [(a, 1), (b, 6000), (c, 3000)]       # no chunking, no token budget
    assert out.shape.num_decode == 1 and out.shape.prefill_chunks == [(6000, 0), (3000, 0)]
    assert res.num_first_tokens == 2                               # both prompts done in one iteration


def test_finished_request_leaves_and_a_waiting_one_joins_next_iteration():
    eng = engine(max_num_seqs=2)
    a, b, c = req(0, 50, 2), req(1, 50, 5), req(2, 50, 3)
    for r in (a, b, c):
        eng.add_request(r, 0.0)
    out, _ = step(eng)
    assert [r for r, _ in out.scheduled] == [a, b] and eng.num_waiting() == 1
    out, res = step(eng, 0.01)
    assert res.finished == [a]                                     # a leaves at once (iteration-level)
    out, _ = step(eng, 0.02)
    assert out.scheduled == [(b, 1), (c, 50)]                      # c takes the freed slot


def test_admission_reserves_prompt_plus_max_tokens():
    eng = engine(num_blocks=100)                                   # 1600 tokens
    a = req(0, 100, 10, max_tokens=900)                            # reserves 1000 tokens = 63 blocks
    b = req(1, 100, 10, max_tokens=700)                            # needs 50 more: does not fit
    c = req(2, 10, 5)                                              # would fit, but FCFS head-of-line blocks it
    for r in (a, b, c):
        eng.add_request(r, 0.0)
    out, _ = step(eng)
    assert [r for r, _ in out.scheduled] == [a]
    assert eng.kv.num_blocks_of(a) == 63 and eng.num_waiting() == 2


def test_max_model_len_reservation_admits_fewer():
    eng = engine(num_blocks=1000, reserve="max_model_len", max_model_len=4096)   # 256 blocks per request
    reqs = [req(i, 100, 10) for i in range(6)]
    for r in reqs:
        eng.add_request(r, 0.0)
    out, _ = step(eng)
    assert len(out.scheduled) == 3


def test_never_preempts_even_when_the_pool_is_tight():
    eng = engine(num_blocks=300)
    done, failed = drive(eng, mixed_requests(60, seed=2))
    assert eng.num_preemptions == 0 and not failed
    assert all(r.num_preemptions == 0 for r in done)


def test_requests_that_can_never_fit_are_rejected_at_arrival():
    eng = engine(num_blocks=10, max_model_len=1000)
    too_long = req(0, 1000, 20)
    too_big = req(1, 100, 10, max_tokens=200)                       # 300 tokens > 160-token pool
    assert not eng.add_request(too_long, 0.0) and "max_model_len" in too_long.fail_reason
    assert not eng.add_request(too_big, 0.0) and too_big.status is Status.FAILED
    assert not eng.has_work()


def test_memory_rule_and_timing():
    eng = engine()
    dep = make_dep()
    kv_bytes = 0.8 * dep.hardware.memory_bytes - dep.weight_bytes_per_device
    assert eng.kv_capacity_tokens() == pytest.approx(kv_bytes / dep.kv_bytes_per_token_per_device, rel=1e-3)
    assert eng.timing.cuda_graph_sizes == () and not eng.timing.overlap


def test_params_validate():
    with pytest.raises(InputError, match="gpu_memory_utilization"):
        OrcaParams(gpu_memory_utilization=1.5)
    with pytest.raises(InputError, match="max_num_seqs"):
        OrcaParams(max_num_seqs=0)


# ---- shared invariants and end to end ---------------------------------------------------------------------
@pytest.mark.parametrize("reserve", ["max_tokens", "max_model_len"])
def test_shared_invariants_on_mixed_workload(reserve):
    done, failed = drive(engine(num_blocks=800, max_num_seqs=16, reserve=reserve, max_model_len=4096),
                         mixed_requests(50, seed=1))
    assert done and not failed


def test_end_to_end_smoke():
    scenario = make_scenario(engines=["orca"], workload__num_requests=60)
    res = run_engine(scenario, EngineEntry(engine="orca"), check_invariants=True)
    s = res.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == 60
    assert s["completed"] == 60 and s["preemptions"] == 0
