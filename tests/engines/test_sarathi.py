"""Sarathi-Serve: chunk_size token budget, decodes first, chunked prefills, watermark admission, recompute."""

from __future__ import annotations

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.core.request import Request, Status
from simengine.engines.memory import activation_reserve_bytes
from simengine.engines.sarathi import SarathiEngine, SarathiParams
from simengine.errors import InputError
from tests.conftest import make_dep, make_request, make_scenario
from tests.engines.harness import drive
from tests.engines.harness import run_step as step


def req(rid: int, prompt: int, out: int, *, arrival: float = 0.0) -> Request:
    return make_request(prompt, out, arrival_s=arrival, request_id=rid)


def engine(**params) -> SarathiEngine:
    return SarathiEngine(SarathiParams(**params), make_dep())


def mixed_requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(20, 3000, n)
    outs = rng.lognormal(np.log(80), 0.9, n).astype(int) + 1
    return [req(i, int(prompts[i]), int(outs[i]), arrival=0.02 * i) for i in range(n)]


# ---- mechanism -------------------------------------------------------------------------------------------
def test_decodes_first_then_a_chunk_fills_the_budget_without_stalling_them():
    eng = engine(chunk_size=512)
    small = [req(i, 10, 50) for i in range(3)]
    for r in small:
        eng.add_request(r, 0.0)
    step(eng)
    long = req(3, 2000, 5, arrival=0.01)
    eng.add_request(long, 0.01)
    chunks = []
    for i in range(4):
        out, _ = step(eng, 0.01 * (i + 1))
        assert out.scheduled[:3] == [(r, 1) for r in small]      # every decode, every iteration
        assert out.num_tokens <= 512
        chunks.append(out.scheduled[3][1])
    assert chunks == [509, 509, 509, 473]
    assert long.num_output_tokens == 1


def test_ongoing_prefill_before_new_requests():
    eng = engine(chunk_size=512)
    a, b = req(0, 800, 5), req(1, 300, 5, arrival=0.001)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    out, _ = step(eng)
    assert out.scheduled == [(a, 512)] and eng.num_waiting() == 1  # no budget left: b waits
    out, _ = step(eng, 0.01)
    assert out.scheduled == [(a, 288), (b, 224)]
    out, _ = step(eng, 0.02)
    assert out.scheduled == [(a, 1), (b, 76)]


def test_admission_holds_the_whole_prompt_above_the_watermark():
    eng = engine(chunk_size=512, num_gpu_blocks=100, watermark_blocks_fraction=0.1)  # watermark: 10 blocks
    big = req(0, 1500, 5)                                          # 94 blocks > 90: can never be admitted
    assert not eng.add_request(big, 0.0) and big.status is Status.FAILED
    a, b = req(1, 1400, 5), req(2, 100, 5)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    out, _ = step(eng)
    assert out.scheduled == [(a, 512)] and eng.kv.num_blocks_of(a) == 88   # blocks for the whole prompt
    step(eng, 0.01)
    out, _ = step(eng, 0.02)
    assert out.scheduled == [(a, 376)]                             # budget left, but 88 + 7 > 100 - 10
    assert eng.num_waiting() == 1


def test_decode_short_of_a_block_preempts_the_latest_arrival_by_recompute():
    eng = engine(num_gpu_blocks=6, watermark_blocks_fraction=0.0)
    a, b = req(0, 47, 30), req(1, 47, 30, arrival=0.1)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.1)
    step(eng)
    step(eng, 0.01)                                                # 48 tokens each: 3 blocks each, pool full
    out, _ = step(eng, 0.02)                                       # a needs a 4th block
    assert out.preempted == [b] and out.scheduled == [(a, 1)]
    assert b.status is Status.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert eng.waiting[0] is b and eng.num_preemptions == 1 and eng.kv.num_blocks_of(b) == 0


def test_a_request_outgrowing_the_pool_preempts_itself_and_is_rejected():
    eng = engine(num_gpu_blocks=3, watermark_blocks_fraction=0.0)
    a = req(0, 47, 10)
    eng.add_request(a, 0.0)
    step(eng)
    step(eng, 0.01)
    out = eng.schedule(0.02)
    assert out.preempted == [a] and out.rejected == [a] and a.status is Status.FAILED
    assert not eng.has_work()


def test_max_num_seqs_caps_running():
    eng = engine(max_num_seqs=2)
    for i in range(4):
        eng.add_request(req(i, 20, 5), 0.0)
    out, _ = step(eng)
    assert len(out.scheduled) == 2 and eng.num_running() == 2 and eng.num_waiting() == 2


def test_memory_rule_and_timing():
    eng = engine()
    dep = make_dep()
    kv_bytes = 0.8 * dep.hardware.memory_bytes - dep.weight_bytes_per_device - activation_reserve_bytes(dep, 512, 1)
    assert eng.kv_capacity_tokens() == pytest.approx(kv_bytes / dep.kv_bytes_per_token_per_device, rel=1e-3)
    assert eng.timing.cuda_graph_sizes == () and not eng.timing.overlap
    assert eng.kv.enable_prefix_caching is False


def test_params_validate():
    with pytest.raises(InputError, match="chunk_size"):
        SarathiParams(chunk_size=0)
    with pytest.raises(InputError, match="watermark_blocks_fraction"):
        SarathiParams(watermark_blocks_fraction=1.0)


# ---- shared invariants and end to end ---------------------------------------------------------------------
@pytest.mark.parametrize("blocks", [None, 400])
def test_shared_invariants_on_mixed_workload(blocks):
    eng = engine(num_gpu_blocks=blocks, max_num_seqs=32)
    done, failed = drive(eng, mixed_requests(60, seed=1))
    assert done and not failed
    if blocks:
        assert eng.num_preemptions > 0                             # the tight pool exercises recompute


def test_end_to_end_smoke():
    scenario = make_scenario(engines=["sarathi"], workload__num_requests=60)
    res = run_engine(scenario, EngineEntry(engine="sarathi"), check_invariants=True)
    s = res.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == 60
    assert s["completed"] == 60
