"""End to end: a throughput row through the simulator and step-latency rows through the engine's timing."""

import dataclasses

import numpy as np
import pytest

from simengine.api import run_engine
from simengine.core.batch import BatchShape
from simengine.cost import calibrated as terms
from simengine.sim.build import build_deployment, build_engine, cost_model
from simengine.validate import experiments
from simengine.validate.experiments import plan_row
from simengine.validate.measurements import Arrival, Measurement
from simengine.validate.run import Prediction, run_row


@pytest.fixture(autouse=True)
def no_calibrated_terms(tmp_path, monkeypatch):
    """Price with the engines' own timing only, whatever the repo's calibration YAML holds."""
    monkeypatch.setattr(terms, "ENGINE_TERMS_PATH", tmp_path / "none.yaml")


def row(**kw) -> Measurement:
    base = dict(id="r", source="s", engine="vllm", model="llama-3.1-8b", weight_dtype="bf16", kv_dtype="fp16",
                hardware="h100_sxm", num_gpus=1, tp=1, pp=1, input_len=256, output_len=128, num_requests=300,
                arrival=Arrival(kind="offline"), metric="output_throughput_tok_s", value=10000.0, notes="")
    base.update(kw)
    return Measurement(**base)


def test_throughput_row_equals_the_simulators_own_summary():
    r = row()
    pred = run_row(r)
    assert isinstance(pred, Prediction) and pred.info["simulated_requests"] == 300
    summary = run_engine(plan_row(r).scenario, plan_row(r).entry).summary
    assert pred.predicted == pytest.approx(summary["output_throughput"], rel=1e-6)
    assert pred.error_pct == pytest.approx(100 * (pred.predicted / 10000.0 - 1))
    total = run_row(dataclasses.replace(r, metric="total_throughput_tok_s"))
    assert total.predicted == pytest.approx(pred.predicted * (256 + 128) / 128, rel=1e-9)


def test_capped_offline_run_extrapolates_within_one_percent(monkeypatch):
    r = row(input_len=64, output_len=64, num_requests=6000)
    full = run_row(r)
    monkeypatch.setattr(experiments, "WAVES", 2)   # simulate 2 and 1 x concurrency requests, extrapolate
    capped = run_row(r)
    assert capped.info["simulated_requests"] < 3000 and capped.info.get("extrapolated")
    assert capped.predicted == pytest.approx(full.predicted, rel=0.01)



def test_a_bursts_latency_runs_every_request_measured():
    """Only a throughput is extrapolated from a capped run: the mean TTFT of requests all sent at once grows with how
    many queue, so a latency row runs the count the benchmark sent (a capped run had reported 0.4x of it)."""
    # Qwen3-32B in 16 bit leaves one A100 about 20k tokens of KV: 4 waves of 9 requests, so 200 would be simulated
    r = row(model="qwen3-32b", hardware="a100_80g_sxm", input_len=2000, output_len=16, num_requests=600,
            metric="mean_ttft_ms", value=1.0)
    pred = run_row(r)
    assert pred.info["simulated_requests"] == 600 and not pred.info.get("extrapolated")
    fewer = run_row(dataclasses.replace(r, num_requests=200))
    assert pred.predicted > 2 * fewer.predicted   # three times the queue: the mean wait about triples
    tput = run_row(dataclasses.replace(r, input_len=64, output_len=64, num_requests=6000,
                                       metric="output_throughput_tok_s"))
    assert tput.info["simulated_requests"] < 6000   # a throughput still runs its capped waves
def test_decode_step_row_is_one_engine_step_priced_by_the_cost_model():
    r = row(engine="unknown", model="llama-2-70b", weight_dtype="fp16", hardware="a100_80g_sxm", num_gpus=4, tp=4,
            input_len=512, output_len=128, num_requests=4, arrival=Arrival(kind="batch", value=4),
            metric="decode_step_ms", value=45.0)
    pred = run_row(r)
    exp = plan_row(r)
    dep = build_deployment(exp.scenario)
    eng = build_engine(exp.entry, dep)
    cost = cost_model(eng)   # the simulator's own step-time model for that engine and deployment
    ctx = 512 + 64   # the median iteration of 128: halfway through the generation
    shape = BatchShape(num_decode=4, decode_context_tokens=4 * ctx, num_logits=4, padded_decode=4)
    assert pred.predicted == pytest.approx(1e3 * cost.step(shape).seconds, rel=1e-9)
    prefill = run_row(dataclasses.replace(r, metric="prefill_ms"))
    shape = BatchShape(prefill_chunks=[(512, 0)] * 4, num_logits=4)
    assert prefill.predicted == pytest.approx(1e3 * cost.step(shape).seconds, rel=1e-9)


def test_llama_bench_rows_use_ubatches_and_context_depth():
    base = row(engine="llamacpp", model="llama-2-7b", weight_dtype="q4_0", hardware="apple_m2_ultra",
               arrival=Arrival(kind="single"), num_requests=None, output_len=0, input_len=2048,
               metric="prefill_tok_s", notes="pp2048 @ d4096; ctx_depth=4096")
    pp = run_row(base)
    assert pp.info["steps"] == 4   # 2048 prompt tokens in ubatches of 512
    f = pp.features[0]
    assert np.all(f.f["pre_c"][1:] > f.f["pre_c"][:-1])   # each ubatch attends to a deeper context
    tg = run_row(dataclasses.replace(base, input_len=0, output_len=128, metric="decode_tok_s", notes="tg128"))
    assert tg.info["steps"] == 128 and 5 < tg.predicted < 500


def test_llama_bench_prompts_pipeline_their_ubatches_over_layer_split_cards():
    """llama-bench decodes a prompt n_batch (2,048) tokens a call; on cards splitting the layers a call's ubatches
    pipeline (PR #6017): pp4096 on 4 RTX 4090s is 2 calls of 4 ubatches, each (4 + 3) / 4 ubatch times, so it runs
    4 x 4 / (2 x 7) = 2.29x the cards taking the ubatches in turn (published: 2.37x one 4090, XiongjieDai,
    Llama-3-8B Q4_K_M); pp512 (one ubatch) gains nothing."""
    from simengine.validate.run import step_plan
    base = row(engine="llamacpp", model="llama-3-8b", weight_dtype="q4_k_m", hardware="rtx_4090", num_gpus=4, pp=4,
               arrival=Arrival(kind="single"), num_requests=None, output_len=0, input_len=4096,
               metric="prefill_tok_s", notes="pp4096")
    exp = plan_row(base)
    eng = build_engine(exp.entry, build_deployment(exp.scenario))
    cost = cost_model(eng)
    shapes, _ = step_plan(exp, eng)
    assert [s.pipelined for s in shapes] == [False, True, True, True] * 2
    piped = sum(cost.step(s).seconds for s in shapes)
    in_turn = sum(cost.step(dataclasses.replace(s, pipelined=False)).seconds for s in shapes)
    assert in_turn / piped == pytest.approx(16 / 7, rel=0.05)
    assert run_row(base).predicted == pytest.approx(4096 / piped)
    one, _ = step_plan(plan_row(dataclasses.replace(base, input_len=512)), eng)
    assert [s.pipelined for s in one] == [False]


def test_parallel_validate_ends_without_worker_tracebacks(tmp_path):
    """The worker pool's shutdown (SIGTERM to idle workers) is quiet: the CLI's SIGTERM handler is the parent's."""
    import subprocess
    import sys

    from simengine.validate.measurements import COLUMNS
    lines = [",".join(COLUMNS)] + [
        f"w{b},src,unknown,llama-2-7b,fp16,fp16,a100_80g_sxm,1,1,1,512,128,{b},batch:{b},decode_step_ms,20,note"
        for b in (1, 2, 4, 8)]
    path = tmp_path / "m.csv"
    path.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "simengine", "validate", str(path), "--jobs", "2", "--quiet",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
