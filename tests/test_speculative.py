"""Speculative decoding (engines/speculative.py) in every engine that has it: a decode step verifies k drafts and
keeps the accepted ones plus its own token; with acceptance 1 a step yields k + 1 tokens, with 0 one token at a higher
cost; TensorRT-LLM stops drafting above max_concurrency; the proposer's weights and KV come out of the pool; requests
are conserved and the KV released whatever the acceptance; the same request is accepted alike in every engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simengine.config.scenario import EngineEntry
from simengine.core.request import Status
from simengine.engines.speculative import ACCEPTANCE, Speculation
from simengine.errors import InputError
from simengine.sim.build import build_engine, cost_model
from tests.conftest import make_dep, make_request, make_scenario
from tests.speculation import SPEC_ENGINES, spec_params


def engine_of(name: str, params: dict, model: str = "llama-3.1-8b"):
    dep = make_dep(model=model, weight_dtype="q4_0" if name == "llamacpp" else "bf16")
    return build_engine(EngineEntry(engine=name, params=params), dep)


def method_of(engine: str) -> str:
    return {"llamacpp": "draft_model", "tgi": "ngram"}.get(engine, "eagle3")


def run(eng, reqs, on_step=None, dt: float = 0.01):
    """Drive `eng` until every request finished, checking caps and invariants each step; returns the steps' outputs
    and the decode steps' (request, tokens it gained) pairs."""
    for r in reqs:
        assert eng.add_request(r, 0.0)
    now, outs, gains = 0.0, [], []
    for _ in range(10_000):
        if not eng.has_work():
            break
        out = eng.schedule(now)
        assert not out.rejected
        if eng.step_token_limit is not None:
            assert out.num_tokens <= eng.step_token_limit
        if eng.batch_size_limit is not None:
            assert len(out.scheduled) <= eng.batch_size_limit
        before = {r.request_id: r.num_output_tokens for r, _ in out.scheduled}
        now += dt
        eng.update(out, now)
        eng.check_invariants()
        outs.append(out)
        gains += [(r, r.num_output_tokens - before[r.request_id]) for r, n in out.scheduled
                  if before[r.request_id] and r.num_output_tokens > before[r.request_id]]
        if on_step:
            on_step(out)
    assert not eng.has_work()
    assert all(r.status is Status.FINISHED and r.num_output_tokens == r.output_len for r in reqs)
    if eng.name != "llamacpp":   # llama.cpp's idle slots keep their cells as a prompt cache
        assert eng.kv_usage() == 0
    return outs, gains


@pytest.mark.parametrize("engine", SPEC_ENGINES)
def test_with_acceptance_one_a_decode_step_yields_k_plus_one_tokens(engine):
    k = 3
    eng = engine_of(engine, spec_params(engine, method_of(engine), k, [1.0]))
    req = make_request(64, 1 + 4 * (k + 1))
    _, gains = run(eng, [req])
    assert [g for _, g in gains] == [k + 1] * 4


@pytest.mark.parametrize("engine", SPEC_ENGINES)
def test_with_acceptance_zero_a_step_yields_one_token_and_costs_more_than_a_plain_step(engine):
    k = 3
    spec = engine_of(engine, spec_params(engine, method_of(engine), k, [0.0]))
    plain = engine_of(engine, {})
    reqs = [make_request(64, 12, request_id=i) for i in range(4)]
    outs, gains = run(spec, reqs)
    assert gains and all(g == 1 for _, g in gains)
    verify = next(o for o in outs if o.shape.num_spec == 4 and not o.shape.prefill_chunks)
    assert verify.shape.spec_tokens == 4 * k and verify.shape.num_decode == 4
    reqs = [make_request(64, 12, request_id=i) for i in range(4)]
    outs_plain, _ = run(plain, reqs)
    decode = next(o for o in outs_plain if o.shape.num_decode == 4 and not o.shape.prefill_chunks)
    spec_s = cost_model(spec).step(verify.shape).seconds
    plain_s = cost_model(plain).step(decode.shape).seconds
    assert spec_s > plain_s


def test_trtllm_drafts_only_up_to_max_concurrency():
    def steps(max_concurrency):
        params = spec_params("trtllm", "eagle3", 2)
        params["speculative_config"]["max_concurrency"] = max_concurrency
        eng = engine_of("trtllm", params)
        outs, _ = run(eng, [make_request(32, 20, request_id=i) for i in range(3)])
        return [o.shape for o in outs if o.shape.num_decode == 3]

    assert all(s.spec_tokens == 0 for s in steps(2))           # 3 generating requests > 2: no drafts
    assert any(s.spec_tokens == 6 for s in steps(3))


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_the_proposer_s_weights_and_kv_come_out_of_the_kv_pool(engine):
    def capacity(params):
        return engine_of(engine, params).kv_capacity_tokens()

    plain = capacity({})
    head = capacity(spec_params(engine, "eagle3", 3))
    draft = capacity(spec_params(engine, "draft_model", 3))
    assert draft < head < plain
    eng = engine_of(engine, spec_params(engine, "draft_model", 3))
    assert eng.dep.proposer_weight_bytes_per_device == pytest.approx(1_235_814_400 * 2)   # Llama-3.2-1B, bf16


def test_vllm_allocates_lookahead_slots_for_eagle_and_none_for_ngram():
    """Scheduler.num_lookahead_tokens: blocks for the verified tokens plus k more for an EAGLE drafter's KV."""
    for method, lookahead in (("eagle3", 4), ("ngram", 0)):
        eng = engine_of("vllm", spec_params("vllm", method, 4, [0.0]))
        req = make_request(16, 60)
        assert eng.add_request(req, 0.0)
        now = 0.0
        while eng.has_work():
            out = eng.schedule(now)
            for r, n in out.scheduled:
                if r.num_computed_tokens + n > r.num_tokens:   # a verify step
                    assert eng.kv.num_blocks_of(r) == eng.kv.blocks_for(r.num_computed_tokens + n + lookahead)
            now += 0.01
            eng.update(out, now)


def test_a_request_is_accepted_alike_in_every_engine():
    """Acceptance belongs to the text: the same request takes the same number of decode steps wherever it runs."""
    counts = {}
    for engine in ("vllm", "sglang", "trtllm"):
        eng = engine_of(engine, spec_params(engine, "eagle3", 3, [0.6]))
        _, gains = run(eng, [make_request(48, 60, request_id=7, seed=3)])
        counts[engine] = [g for _, g in gains]
    assert counts["vllm"] == counts["sglang"] == counts["trtllm"]
    assert len(set(counts["vllm"])) > 1     # some steps kept more drafts than others


def test_mean_tokens_a_step_matches_the_acceptance_model():
    spec = Speculation(method="eagle3", num_tokens=4, acceptance=ACCEPTANCE[("eagle3", "chat")])
    tokens = []
    for i in range(4000):
        req = make_request(8, 40, request_id=i)
        tokens.append(1 + spec.accepted(req, 4))
    assert np.mean(tokens) == pytest.approx(spec.expected_tokens(), rel=0.03)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=st.sampled_from(SPEC_ENGINES), k=st.integers(1, 6), rate=st.floats(0.0, 1.0),
       lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=8),
       small=st.booleans())
def test_requests_are_conserved_and_kv_released_under_any_acceptance(engine, k, rate, lengths, small):
    params = spec_params(engine, method_of(engine), k, [rate])
    if small:   # a pool that makes engines preempt, retract or wait
        params |= {"vllm": {"kv_cache_memory_bytes": 1200 * 131072}, "sglang": {"max_total_tokens": 1200},
                   "trtllm": {"kv_cache_max_tokens": 1200}, "llamacpp": {"ctx_size": 1200},
                   "tgi": {"max_batch_total_tokens": 1200}}[engine]
    eng = engine_of(engine, params)
    reqs = [make_request(p, o, request_id=i) for i, (p, o) in enumerate(lengths)]
    run(eng, reqs)


def test_bad_speculative_settings_name_the_field():
    cases = [
        ("vllm", {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}},
         "speculative_config.model"),
        ("vllm", {"speculative_config": {"method": "eagle3"}}, "speculative_config.num_speculative_tokens"),
        ("vllm", {"speculative_config": {"method": "mtp"}}, "speculative_config"),
        ("trtllm", {"speculative_config": {"decoding_type": "Eagle3"}}, "speculative_config.max_draft_len"),
        ("sglang", {"speculative_algorithm": "STANDALONE"}, "speculative_algorithm.speculative_draft_model_path"),
    ]
    for engine, params, field in cases:
        with pytest.raises(InputError) as exc:
            engine_of(engine, params)
        assert exc.value.field == f"engines[{engine}].params.{field}"
    with pytest.raises(InputError, match="tokenizer") as exc:   # Llama-2's 32k vocabulary against Llama-3.2's
        engine_of("vllm", spec_params("vllm", "draft_model", 3), model="llama-2-7b")
    with pytest.raises(InputError):
        engine_of("vllm", {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3,
                                                  "acceptance": [1.5]}})


def test_speculation_cuts_tpot_at_low_load_and_the_run_is_reproducible():
    from simengine.api import run_engine
    wl = {"arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 20}
    plain = make_scenario(workload=wl | {"output_tokens": {"dist": "constant", "value": 100}})
    spec = dataclasses.replace(plain, engines=[EngineEntry(engine="vllm", params=spec_params("vllm", "eagle3", 3))])
    tpot_plain = run_engine(plain, plain.engines[0]).summary["mean_tpot_ms"]
    first = run_engine(spec, spec.engines[0]).summary
    again = run_engine(spec, spec.engines[0]).summary
    assert first["mean_tpot_ms"] < 0.7 * tpot_plain
    assert first == again
