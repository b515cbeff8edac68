"""vllm_bench_serve.json: every key `vllm bench serve --save-result --save-detailed` writes (docs/metrics.md),
per-request lists that add up as vLLM's own timeline plotter assumes, statistics equal to the
summary's, and recording token times changes no simulated result."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from simengine.api import compare, write_results
from simengine.report.vllm_bench import bench_result
from tests.conftest import make_scenario

METRICS_MD = Path(__file__).resolve().parents[2] / "shared" / "reference" / "metrics.md"
# the key list of metrics.md's "Result JSON keys (`--save-result`)", with defaults: percentile 99, and e2el asked
KEYS_FALLBACK = ("date endpoint_type backend label model_id tokenizer_id num_prompts request_rate burstiness "
                 "max_concurrency duration completed failed total_input_tokens total_output_tokens request_throughput "
                 "request_goodput output_throughput total_token_throughput max_output_tokens_per_s "
                 "max_concurrent_requests rtfx latencies queue_times input_lens output_lens start_times ttfts itls "
                 "generated_texts errors").split()


def listed_keys() -> list[str]:
    """The keys metrics.md lists (setup, results and --save-detailed lists), or the same list kept here."""
    if not METRICS_MD.exists():
        return list(KEYS_FALLBACK)
    text = METRICS_MD.read_text()
    block = text[text.index("Result JSON keys"):text.index("* File name")]
    keys = [k for k in re.findall(r"`([a-z_0-9{}]+)`", block) if "{" not in k and not k.endswith("_")]
    optional = {"ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps", "rps_change_events", "ttft", "tpot",
                "itl", "e2el"}   # ramp-up and probe keys only with those options; the metric names, not keys
    return [k for k in keys if k not in optional]


@pytest.fixture(scope="module")
def run():
    sc = make_scenario(horizon_s=20.0, workload__arrival__rate=10.0, workload__shared_prefix_tokens=200,
                       deployment__replicas=2, engines=["vllm", "sglang"], slo={"ttft_ms": 500.0},
                       output={"detailed_requests": 120})
    return sc, compare(sc)


def test_the_file_has_every_key_vllm_writes(run, tmp_path):
    sc, results = run
    folder = write_results(sc, results, tmp_path)
    for label in results:
        d = json.loads((folder / label / "vllm_bench_serve.json").read_text())
        missing = [k for k in listed_keys() if k not in d]
        assert not missing, (label, missing)
        for m in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p99"):
                assert f"{stat}_{m}_ms" in d
        assert re.fullmatch(r"\d{8}-\d{6}", d["date"]) and d["request_rate"] == 10.0 and d["burstiness"] == 1.0


@pytest.mark.parametrize("label", ["vllm", "sglang"])
def test_per_request_lists_add_up(run, label):
    sc, results = run
    r = results[label]
    d = bench_result(r.recorder, r.summary, sc, label, "20261201-000000")
    n = d["simengine_detailed_requests"]["listed"]
    assert n == min(120, r.summary["num_requests"]) > 50
    assert all(len(d[k]) == n for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                                        "queue_times", "generated_texts", "errors"))
    req = r.requests.sort_values("request_id").head(n)
    assert d["input_lens"] == req["prompt_len"].tolist()
    assert d["start_times"] == pytest.approx(req["arrival_s"].tolist())
    for ttft, itls, latency, out, err in zip(d["ttfts"], d["itls"], d["latencies"], d["output_lens"], d["errors"]):
        if err:
            assert (ttft, itls, latency, out) == (0.0, [], 0.0, 0)
            continue
        assert len(itls) == out - 1 and min(itls, default=1.0) > 0
        assert ttft + sum(itls) == pytest.approx(latency, abs=1e-9)   # vLLM's timeline plot rebuilds latency so
    done = req[req["status"] == "completed"]
    assert np.array(d["ttfts"])[req["status"].to_numpy() == "completed"] * 1e3 == \
        pytest.approx(done["ttft_ms"].to_numpy())
    for k in ("completed", "duration", "total_output_tokens", "request_throughput", "mean_ttft_ms", "p99_itl_ms",
              "median_tpot_ms", "std_e2el_ms"):
        assert d[k] == r.summary[k]
    assert d["request_goodput"] == r.summary["request_goodput"] is not None


def test_peaks_follow_vllms_definitions(run):
    sc, results = run
    r = results["vllm"]
    d = bench_result(r.recorder, r.summary, sc, "vllm", "20261201-000000")
    steps, req = r.steps, r.requests
    assert steps["output_tokens"].sum() == r.summary["total_output_tokens"]   # every sampled token in a step row
    done = req[req["status"] == "completed"]
    t0 = done["arrival_s"].min()
    per_second = np.bincount(np.floor(steps["end_s"] - t0).astype(int), weights=steps["output_tokens"])
    assert d["max_output_tokens_per_s"] == per_second.max()
    # vllm/benchmarks/serve.py: each completed request counts in every one-second bucket from its send's to its end's
    first, last = (done["arrival_s"] - t0).astype(int), (done["finish_s"] - t0).astype(int)
    per_bucket = [((first <= k) & (last >= k)).sum() for k in range(last.max() + 1)]
    assert d["max_concurrent_requests"] == max(per_bucket)
    at = np.sort(np.concatenate([done["arrival_s"], done["finish_s"]]))   # at least the instantaneous peak
    assert d["max_concurrent_requests"] >= max(((done["arrival_s"] <= t) & (done["finish_s"] > t)).sum() for t in at)


def test_recording_token_times_changes_no_result():
    """Recording every token's time (cohort members get theirs when they leave it) changes no figure."""
    base = dict(horizon_s=15.0, workload__arrival__rate=12.0, engines=["vllm", "static", "llamacpp"])
    none = compare(make_scenario(**base, output={"detailed_requests": 0}))
    every = compare(make_scenario(**base, output={"detailed_requests": 10_000}))
    for label in none:
        a, b = none[label].summary, every[label].summary
        assert a == b, label
        assert none[label].recorder.token_times == {} and len(every[label].recorder.token_times) == a["num_requests"]


def test_failed_and_unfinished_requests_carry_their_error(tmp_path):
    sc = make_scenario(horizon_s=5.0, drain_s=0.5, workload__arrival__rate=40.0,
                       workload__input_tokens={"dist": "uniform", "low": 1000, "high": 3000},
                       engines=[{"engine": "vllm", "params": {"max_model_len": 2048}}])
    r = compare(sc)["vllm"]
    d = bench_result(r.recorder, r.summary, sc, "vllm", "20261201-000000")
    assert d["failed"] == r.summary["failed"] + r.summary["unfinished"] > 0 and r.summary["failed"] > 0
    errors = [(n, e) for n, e in zip(d["input_lens"], d["errors"]) if e]
    assert errors and all(("max_model_len" in e) == (n >= 2048) for n, e in errors)   # the rest: unfinished
