"""vLLM's /metrics series from a simulated run: metrics.csv over simulated time agrees with the summary, and
metrics.prom parses with prometheus_client's parser into vLLM's metric names and buckets."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simengine.api import compare
from simengine.report import prometheus
from tests.conftest import make_scenario


@pytest.fixture(scope="module")
def result():
    sc = make_scenario(horizon_s=30.0, workload__arrival__rate=8.0, workload__shared_prefix_tokens=300,
                       deployment__replicas=2, engines=["vllm"])
    return compare(sc)["vllm"]


def test_the_series_agrees_with_the_summary(result):
    s = result.summary
    df = prometheus.series(result.recorder, result.end_s)
    last = df.iloc[-1]
    assert df["time_s"].is_monotonic_increasing and len(df) <= prometheus.MAX_SAMPLES + 1
    for counter in [c for c in df.columns if c.endswith(("_total", "_count", "_sum"))]:
        assert df[counter].is_monotonic_increasing, counter
    assert last["vllm:request_success_total"] == s["completed"]
    assert last["vllm:generation_tokens_total"] == s["total_output_tokens"]
    assert last["vllm:prompt_tokens_total"] == s["total_input_tokens"]
    assert last["vllm:prefix_cache_hits_total"] / last["vllm:prefix_cache_queries_total"] == \
        pytest.approx(s["prefix_cache_hit_rate"], abs=0.02)
    mean_ttft_s = last["vllm:time_to_first_token_seconds_sum"] / last["vllm:time_to_first_token_seconds_count"]
    assert mean_ttft_s * 1e3 == pytest.approx(s["mean_ttft_ms"], rel=1e-6)
    assert df["vllm:num_requests_running"].max() > 0 and (df["vllm:kv_cache_usage_perc"] <= 1).all()


def test_the_snapshot_parses_as_prometheus_text(result):
    text = prometheus.exposition(result.recorder, result.end_s, "llama-3.1-8b", "vllm")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert name in families, name
    ttft = families["vllm:time_to_first_token_seconds"]
    buckets = [x for x in ttft.samples if x.name.endswith("_bucket")]
    assert [float(x.labels["le"]) for x in buckets[:-1]] == list(prometheus.TTFT_BUCKETS_S)
    counts = [x.value for x in buckets]
    assert counts == sorted(counts) and counts[-1] == result.summary["completed"]
    assert all(x.labels["model_name"] == "llama-3.1-8b" for x in ttft.samples)
    itl = families["vllm:inter_token_latency_seconds"]
    itl_count = next(x.value for x in itl.samples if x.name.endswith("_count"))
    assert itl_count == float(np.sum(result.itl_counts))
