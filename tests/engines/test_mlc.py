"""MLC-LLM serve policy driven by hand: modes, prefill priority, admission checks, preemption, recycling cache."""

import pytest

from simengine.api import run_engine
from simengine.config.loader import from_dict
from simengine.config.scenario import EngineEntry, Scenario
from simengine.core.request import Status
from simengine.engines.mlc import MlcEngine
from simengine.engines.mlc_config import MlcParams, mlc_engine_config, mlc_memory_tokens
from simengine.errors import CannotRun, InputError
from simengine.sim.build import build_engine
from tests.conftest import make_dep, make_request
from tests.engines.harness import run_step


def engine(dep=None, **params) -> MlcEngine:
    return MlcEngine(MlcParams(**params), dep or make_dep())


def run_until_done(eng, reqs, now=0.0):
    while not all(r.is_finished for r in reqs):
        run_step(eng, now)
        now += 0.01
    return now


def test_mode_decides_sequences_kv_and_chunk():
    dep = make_dep()
    local, inter, server = (mlc_engine_config(MlcParams(mode=m), dep) for m in ("local", "interactive", "server"))
    assert (local.max_num_sequence, local.max_total_sequence_length, local.prefill_chunk_size) == (4, 8192, 8192)
    assert (inter.max_num_sequence, inter.max_total_sequence_length) == (1, 131072)   # min(memory, context)
    assert server.max_num_sequence == 128 and server.max_total_sequence_length == server.memory_tokens > 131072
    apple = mlc_engine_config(MlcParams(mode="server"), make_dep("apple_m2_ultra", model="llama-2-7b",
                                                                  weight_dtype="q4_0"))
    assert apple.max_total_sequence_length == 32768 and apple.prefill_chunk_size == 4096  # Metal cap; ctx 4096


def test_memory_rule_is_a_fraction_of_total_memory():
    dep, seqs, chunk = make_dep(), 4, 8192
    hi = mlc_memory_tokens(MlcParams(gpu_memory_utilization=0.85), dep, seqs, chunk)
    lo = mlc_memory_tokens(MlcParams(gpu_memory_utilization=0.5), dep, seqs, chunk)
    per_token = dep.kv_bytes_per_token_per_device + 1.25
    assert (hi - lo) * per_token == pytest.approx(0.35 * dep.hardware.memory_bytes, rel=1e-3)


def test_runs_on_edge_and_mobile_but_not_ascend_or_gaudi():
    for hw in ("apple_m2_ultra", "snapdragon_8_elite", "jetson_agx_orin_64g", "mi300x", "arc_pro_b60"):
        build_engine(EngineEntry(engine="mlc"), make_dep(hw, model="llama-2-7b", weight_dtype="q4_0"))
    with pytest.raises(InputError, match="mlc does not run on ascend_910b3"):
        build_engine(EngineEntry(engine="mlc"), make_dep("ascend_910b3", model="llama-2-7b"))
    with pytest.raises(CannotRun, match="mlc does not run on gaudi3"):   # no Gaudi (HPU) backend
        build_engine(EngineEntry(engine="mlc"), make_dep("gaudi3", model="llama-2-7b"))
    assert {"edge", "mobile"} <= MlcEngine.device_classes and "OpenCL" in MlcEngine.support_source


def test_bad_params_are_input_errors():
    with pytest.raises(InputError, match="gpu_memory_utilization"):
        MlcParams(gpu_memory_utilization=0)
    with pytest.raises(InputError, match="prefix_cache_max_num_recycling_seqs"):
        MlcParams(prefix_cache_max_num_recycling_seqs=0)


def test_prefill_has_priority_and_hybrid_folds_running_decodes_in():
    for mode, expect in (("hybrid", 2), ("chunked", 1)):
        eng = engine(prefill_mode=mode)
        a = make_request(20, 10)
        eng.add_request(a, 0.0)
        run_step(eng)
        b = make_request(30, 5)
        eng.add_request(b, 0.01)
        out, _ = run_step(eng, 0.01)
        assert (b, 30) in out.scheduled and len(out.scheduled) == expect
        assert ((a, 1) in out.scheduled) == (mode == "hybrid")
        assert not out.shape.cuda_graph


def test_a_prompt_that_does_not_fit_whole_is_chunked_and_stops_admission():
    eng = engine(prefill_chunk_size=64)
    a = make_request(20, 10)
    eng.add_request(a, 0.0)
    run_step(eng)
    b, c = make_request(100, 3), make_request(10, 3)
    eng.add_request(b, 0.01)
    eng.add_request(c, 0.01)
    out, _ = run_step(eng, 0.01)
    assert out.scheduled == [(a, 1), (b, 63)] and eng.num_waiting() == 1   # chunk = 64 - a's decode token
    out, _ = run_step(eng, 0.02)
    assert out.scheduled == [(a, 1), (b, 37), (c, 10)] and out.num_tokens <= 64
    assert b.num_output_tokens == 1 and eng.num_waiting() == 0


def test_eight_step_decode_watermark_bounds_admission():
    for prompt, admitted in ((139, True), (140, False)):
        eng = engine(max_total_sequence_length=256, kv_cache_page_size=1)
        a = make_request(100, 50)
        eng.add_request(a, 0.0)
        run_step(eng)
        b = make_request(prompt, 2)
        eng.add_request(b, 0.01)
        out, _ = run_step(eng, 0.01)
        # 100 in the cache + (1 decode + prompt) + 8 x 2 sequences <= 256
        assert ((b, prompt) in out.scheduled) is admitted
        assert out.scheduled[0] == (a, 1)


def test_max_num_sequence_caps_running():
    eng = engine(max_num_sequence=2)
    for _ in range(4):
        eng.add_request(make_request(20, 5), 0.0)
    out, _ = run_step(eng)
    assert len(out.scheduled) == 2 and eng.num_running() == 2 and eng.num_waiting() == 2


def test_decode_preempts_the_last_running_request_after_freeing_recycling():
    eng = engine(max_total_sequence_length=128)          # 8 pages of 16
    a, b = make_request(40, 40), make_request(40, 40)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    out, _ = run_step(eng)
    assert [r for r, _ in out.scheduled] == [a, b]
    now, preempted = 0.01, []
    while not preempted:
        out, _ = run_step(eng, now)
        now += 0.01
        preempted = out.preempted
    assert preempted == [b] and out.scheduled == [(a, 1)]
    assert b.status is Status.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert eng.waiting[0] is b and eng.num_preemptions == 1
    now = run_until_done(eng, [a], now)
    assert list(eng.recycling.values()) == [a]            # a finished and is kept for reuse ...
    recompute = b.num_tokens                              # prompt + the outputs it had committed
    out, _ = run_step(eng, now)
    assert out.scheduled == [(b, recompute)] and not eng.recycling  # ... until b needs its pages
    run_until_done(eng, [b], now)
    assert b.num_output_tokens == 40
    eng.check_invariants()


def test_recycling_sequences_are_capped_lru_and_taken_over_by_a_match():
    eng = engine()                                        # local: max_num_sequence 4 -> 4 recycling sequences
    done = []
    now = 0.0
    for _ in range(5):
        r = make_request(64, 2)
        eng.add_request(r, now)
        now = run_until_done(eng, [r], now)
        done.append(r)
    assert list(eng.recycling.values()) == done[1:]       # the oldest left the radix tree
    first_again = make_request(64, 2, tokens=done[0].token_ids[:64])
    eng.add_request(first_again, now)
    run_step(eng, now)
    assert first_again.num_cached_tokens == 0             # its pages are free, no longer matchable
    last_again = make_request(64, 2, tokens=done[4].token_ids[:64])
    eng.add_request(last_again, now + 0.01)
    out, _ = run_step(eng, now + 0.01)
    assert last_again.num_cached_tokens == 48 and (last_again, 16) in out.scheduled  # whole pages, 1 token left
    assert done[4].request_id not in eng.recycling        # the recycling sequence was reused, not forked
    assert eng.prefix_hit_rate() > 0
    eng.check_invariants()


def test_active_sequences_are_forked_and_shared_pages_counted_once():
    eng = engine(max_num_sequence=2)
    a = make_request(160, 20)
    eng.add_request(a, 0.0)
    run_step(eng)
    b = make_request(170, 5, tokens=a.token_ids[:160].tolist() + list(range(10)))
    eng.add_request(b, 0.01)
    out, _ = run_step(eng, 0.01)
    assert b.num_cached_tokens == 160 and (b, 10) in out.scheduled
    assert eng.kv.pool.num_used == eng.kv.blocks_for(161) + 1   # b shares a's 10 full pages
    assert eng._total_seq_len() == 161 + 170               # ...but both whole lengths count for the watermark


def test_requests_that_can_never_fit_fail_instead_of_stalling():
    eng = engine()                                        # local mode: 8192 tokens, 512 pages
    edge, too_long = make_request(8176, 4), make_request(8177, 4)
    assert eng.add_request(edge, 0.0)                     # 511 pages + 1 per sequence: admitted
    assert not eng.add_request(too_long, 0.0) and "watermark" in too_long.fail_reason
    run_until_done(eng, [edge])
    # BatchDecode wants a free page per decode: with none left the lone sequence preempts itself, and MLC would
    # re-prefill it forever; the simulator fails it instead.
    assert edge.status is Status.FAILED and "outgrew" in edge.fail_reason and edge.num_output_tokens == 2
    ok = make_request(8000, 4)
    eng.add_request(ok, 1.0)
    run_until_done(eng, [ok], 1.0)
    assert ok.status is Status.FINISHED and ok.num_output_tokens == 4


def test_cuda_graph_for_every_decode_batch_without_padding():
    eng = engine()
    for _ in range(3):
        eng.add_request(make_request(20, 5), 0.0)
    run_step(eng)
    out, _ = run_step(eng, 0.01)
    assert out.shape.num_decode == 3 and out.shape.cuda_graph and out.shape.padded_decode == 3
    assert engine(opt="O1").timing.cuda_graph_sizes == ()
    assert engine(make_dep("apple_m2_ultra", model="llama-2-7b", weight_dtype="q4_0")).timing.cuda_graph_sizes == ()


def _scenario(**deployment) -> Scenario:
    return from_dict(Scenario, {
        "name": "mlc-edge", "seed": 5, "horizon_s": 60.0, "drain_s": 600.0,
        "deployment": {"hardware": "apple_m2_ultra", "model": "llama-2-7b", "weight_dtype": "q4_0", **deployment},
        "workload": {"arrival": {"process": "poisson", "rate": 0.3}, "shared_prefix_tokens": 200,
                     "input_tokens": {"dist": "lognormal", "mean": 500, "sigma": 0.5, "max": 2000},
                     "output_tokens": {"dist": "lognormal", "mean": 120, "sigma": 0.5, "max": 400}},
        "engines": [{"engine": "mlc", "params": {}}]}, source="test")


H100 = {"hardware": "h100_sxm", "model": "llama-3.1-8b", "weight_dtype": "bf16"}


@pytest.mark.parametrize("deployment, params", [
    ({}, {}),
    (H100, {"mode": "server", "max_total_sequence_length": 32768}),
    (H100, {"max_total_sequence_length": 2048}),
])
def test_end_to_end_conservation_and_invariants(deployment, params):
    sc = _scenario(**deployment)
    r = run_engine(sc, EngineEntry(engine="mlc", params=params), check_invariants=True)
    s = r.summary
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] > 5
    assert s["completed"] > 0 and s["prefix_cache_hit_rate"] > 0
    assert (r.steps["prefill_tokens"] + r.steps["decode_tokens"] <= 8192).all()


def test_a_refusal_mid_run_lets_the_waiting_requests_go_on():
    """Three long requests, one at a time in an 8k-token pool: each outgrows the pool while decoding and is
    refused. The refusal frees its pages, so the next waiting one starts at once instead of waiting for an
    arrival that never comes (before: two were left unfinished forever)."""
    from simengine.config.scenario import load_scenario
    sc = load_scenario("selector_high_throughput", [
        "engines=[mlc]", "workload.num_requests=3", "workload.arrival={process: offline}", "horizon_s=0",
        "drain_s=100000", "workload.input_tokens={dist: constant, value: 7000}",
        "workload.output_tokens={dist: constant, value: 2000}"])
    s = run_engine(sc, sc.engines[0]).summary
    assert s["failed"] == 3 and s["unfinished"] == 0
    assert all("outgrew max_total_sequence_length" in k for k in s["failure_reasons"])


def test_a_recycling_sequence_holding_the_last_page_stalls_the_head_as_mlc_does():
    """MLC's TryFreeMemory loop tests HasPrefillSpace with the batch before the head, CanPrefill with it
    (batch_prefill_base.cc): a head that needs every free page leaves the recycling sequence holding the page it lacks,
    and with nothing running no action processes anything. The engine says so."""
    eng = engine(max_total_sequence_length=128)          # 8 pages of 16
    a = make_request(20, 4)
    eng.add_request(a, 0.0)
    now = run_until_done(eng, [a])
    assert list(eng.recycling.values()) == [a] and eng.kv.pool.num_free == 6
    b = make_request(96, 4)                               # 6 pages: 6 + 1 > 6 free, 23 + 96 + 8 <= 128
    assert eng.add_request(b, now)
    out, _ = run_step(eng, now)
    assert out.is_empty and eng.has_work() and list(eng.recycling.values()) == [a]
    assert "TryFreeMemory" in out.idle_reason and "96 tokens in 6 pages" in out.idle_reason
    eng.check_invariants()


def test_a_stalled_replica_is_reported_with_its_reason(tmp_path):
    """The same stall in a run: the summary names the replica, since when, what it holds and why."""
    trace = tmp_path / "two.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0000000,20,4\n"
                     "2023-11-16 18:00:10.0000000,96,4\n")
    sc = from_dict(Scenario, {
        "name": "mlc-stall", "seed": 1, "horizon_s": 20.0, "drain_s": 100.0,
        "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b"},
        "workload": {"trace": {"kind": "azure", "path": str(trace)}},
        "engines": [{"engine": "mlc", "params": {"max_total_sequence_length": 128}}]}, source="test")
    s = run_engine(sc, sc.engines[0], check_invariants=True).summary
    assert s["completed"] == 1 and s["unfinished"] == 1
    [stall] = s["stalled"]
    assert stall["replica"] == 0 and stall["since_s"] == pytest.approx(10.0, abs=0.1) and stall["requests"] == 1
    assert "TryFreeMemory" in stall["reason"]
    ok = run_engine(sc, EngineEntry(engine="vllm", params={}), check_invariants=True).summary
    assert ok["completed"] == 2 and "stalled" not in ok
