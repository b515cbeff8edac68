"""Attention data parallelism (deployment.attention_dp): each rank of a tp group schedules its own requests, holds
the attention whole and 1/tp of the experts; the step's work, the memory sizing, the pools, the refusals and a run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.cost.measured import MeasuredKernels, data_root, interp_hold
from simengine.cost.roofline import DeviceTerms
from simengine.cost.work import StepWork
from simengine.engines import ENGINES
from simengine.errors import CannotRun, InputError
from simengine.sim.build import build_engine, plan_pools
from tests.conftest import make_dep, make_scenario

QWEN = dict(hardware="h100_sxm", model="qwen3-235b-a22b", weight_dtype="fp8", kv_dtype="fp8")


def deps(tp: int = 8, **kw):
    tp_dep = make_dep(**{**QWEN, **kw}, tp=tp)
    return tp_dep, dataclasses.replace(tp_dep, attention_dp=True, expert_parallel=True)


def work(dep) -> StepWork:
    return StepWork(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=dep.kv_elem_bytes,
                    tp=dep.tp, pp=dep.pp, expert_parallel=dep.expert_parallel, attention_dp=dep.attention_dp)


def test_a_rank_holds_the_attention_whole_and_a_tp_share_of_the_experts():
    tp, adp = deps()
    m, fmt = tp.model, tp.weight_format
    experts = m.routed_expert_params_total * fmt.bytes_per_param
    # FP8: the embedding, LM head and norms stay 16-bit, every linear layer one byte
    rest = (m.embedding_params + m.lm_head_params + m.norm_params) * 2.0 + m.dense_linear_params * 1.0
    assert m.stored_bytes(fmt) == pytest.approx((rest, experts))
    assert adp.weight_bytes_per_device == pytest.approx(rest + experts / 8)
    assert tp.weight_bytes_per_device == pytest.approx((rest + experts) / 8)
    # every KV head on the rank that owns the request (Qwen3-235B's 4 KV heads are replicated under TP8)
    assert adp.kv_bytes_per_token_per_device == pytest.approx(m.kv_bytes_per_token(1.0))
    assert tp.kv_bytes_per_token_per_device == pytest.approx(m.kv_bytes_per_token(1.0) / 4)
    assert (adp.num_devices, adp.attention_tp) == (1, 1)
    assert (tp.num_devices, tp.attention_tp) == (8, 8)


def test_a_ranks_work_is_its_own_attention_and_the_groups_tokens_at_its_experts():
    tp, adp = deps()
    w_tp, w_adp = work(tp), work(adp)
    m = tp.model
    tokens = np.array([1.0, 16.0, 256.0])
    # the same FLOPs per device per token of the group (balanced ranks), but the attention weights read whole
    assert w_adp.linear_flops_per_token == pytest.approx(w_tp.linear_flops_per_token * 8)
    assert w_adp.dense_weight_bytes == pytest.approx(w_tp.dense_weight_bytes * 8)
    assert w_adp.expert_bytes == w_tp.expert_bytes
    np.testing.assert_allclose(w_adp.experts_touched(tokens), w_tp.experts_touched(8 * tokens))
    # one gather + scatter of the group's tokens per MoE layer, through the collective library
    assert w_adp.num_allreduce == m.num_moe_layers
    np.testing.assert_allclose(w_adp.allreduce_bytes(tokens), w_tp.allreduce_bytes(8 * tokens))
    # decode attention: the rank's own requests with every head, no replicated KV heads
    assert w_adp.kv_bytes_layer == pytest.approx(4 * w_tp.kv_bytes_layer)
    assert w_adp.attn_flops_per_pair == pytest.approx(8 * w_tp.attn_flops_per_pair)


@pytest.mark.skipif(data_root() is None, reason="aiconfigurator-core is not installed")
def test_measured_experts_are_looked_up_at_the_groups_tokens_with_ep_over_the_group():
    _, adp = deps()
    w = work(adp)
    k = MeasuredKernels(w, DeviceTerms.of(w, adp.hardware, custom_allreduce=False), system="h100_sxm",
                        backend="trtllm", custom_allreduce=False)
    assert "moe" not in k.fallbacks and "attn_decode" not in k.fallbacks
    tokens = np.array([4.0, 64.0])
    f = k.token_features(tokens)
    moe = adp.model.num_moe_layers * interp_hold(8 * tokens, *k.moe_curve, lambda x: x)
    assert np.all(f["meas_m"] + f["meas_c"] >= moe * (1 - 1e-9))


@pytest.mark.skipif(data_root() is None, reason="aiconfigurator-core is not installed")
def test_one_anomalous_routing_series_does_not_set_the_measured_expert_time():
    # the H200 trtllm table's fp8 power_law_1.2 series for Llama-4 Maverick's experts runs 5-8x its neighbours;
    # the same GPUs with more bandwidth must not price the experts slower than the H100 does
    curves = []
    for hw in ("h100_sxm", "h200_sxm"):
        dep = dataclasses.replace(make_dep(hw, "llama-4-maverick-17b-128e", weight_dtype="fp8", kv_dtype="fp8",
                                           tp=8), expert_parallel=True)
        w = work(dep)
        k = MeasuredKernels(w, DeviceTerms.of(w, dep.hardware, custom_allreduce=False), system=hw,
                            backend="trtllm", custom_allreduce=False)
        curves.append(interp_hold(np.array([512.0, 4096.0]), *k.moe_curve, lambda x: x))
    assert np.all(curves[1] <= curves[0] * 1.1)


def test_a_group_runs_one_replica_per_rank():
    sc = make_scenario(deployment__model="qwen3-235b-a22b", deployment__weight_dtype="fp8", deployment__tp=8,
                       deployment__replicas=2, deployment__attention_dp=True, engines=["trtllm"])
    (pool,) = plan_pools(sc, sc.engines[0])
    assert (pool.count, pool.dep.num_devices, pool.num_devices) == (16, 1, 16)


@given(st.sampled_from([("qwen3-235b-a22b", 8), ("qwen3-30b-a3b", 2), ("mixtral-8x7b", 4)]),
       st.sampled_from(["vllm", "sglang", "trtllm"]))
def test_with_fewer_kv_heads_than_tp_attention_dp_holds_more_kv_tokens(case, engine):
    model, tp = case
    base, adp = deps(tp=tp, model=model, hardware="h200_sxm")
    entry = EngineEntry(engine=engine)
    tp_tokens = build_engine(entry, base).kv_capacity_tokens()
    adp_tokens = tp * build_engine(entry, adp).kv_capacity_tokens()
    if base.model.num_kv_heads < tp:    # TP replicates heads that attention DP stores once
        assert adp_tokens > tp_tokens
    else:                               # the same heads stored, less room beside the whole attention weights
        assert adp_tokens < tp_tokens


@pytest.mark.parametrize("engine", [n for n in ENGINES.names() if ENGINES.get(n).supports_attention_dp])
def test_every_request_completes_under_attention_dp(engine):
    sc = make_scenario(deployment__model="qwen3-30b-a3b", deployment__tp=2, deployment__attention_dp=True,
                       workload__num_requests=40, engines=[engine])
    result = run_engine(sc, sc.engines[0], check_invariants=True)
    frame = result.requests
    assert len(frame) == 40 and (frame["status"] == "completed").all()
    assert frame["replica"].nunique() == 2   # the router spreads requests over both ranks


@pytest.mark.parametrize("overrides, field, text", [
    ({"deployment__model": "llama-3.1-70b", "deployment__tp": 4}, "deployment.attention_dp", "use replicas"),
    ({"deployment__model": "qwen3-30b-a3b", "deployment__tp": 1}, "deployment.tp", "tp to 2 or more"),
])
def test_impossible_attention_dp_layouts_are_refused_naming_the_field(overrides, field, text):
    sc = make_scenario(**overrides, deployment__attention_dp=True)
    with pytest.raises(InputError, match=text) as exc:
        plan_pools(sc, sc.engines[0])
    assert exc.value.field == field


def test_an_engine_without_attention_dp_is_refused_with_the_engines_that_have_it():
    sc = make_scenario(deployment__model="qwen3-30b-a3b", deployment__tp=2, deployment__attention_dp=True,
                       engines=["tgi"])
    with pytest.raises(CannotRun, match="engines that do: .*sglang") as exc:
        plan_pools(sc, sc.engines[0])
    assert exc.value.field == "deployment.attention_dp"


def test_failures_name_a_rank_of_the_group():
    def with_failure(replica: int):
        return make_scenario(deployment__model="qwen3-30b-a3b", deployment__tp=2, deployment__attention_dp=True,
                             deployment__failures={"at": [{"replica": replica, "time_s": 1.0}]}, engines=["vllm"])
    assert with_failure(1).deployment.failures.at[0].replica == 1   # the second rank of the one group
    with pytest.raises(InputError, match="the deployment has 2") as exc:
        with_failure(2)
    assert exc.value.field == "deployment.failures.at[0].replica"
