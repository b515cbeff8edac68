"""inference-perf's traffic: a shared-prefix prompt pool (workload.prompt_groups) and load stages (process: stages)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.api import run_engine
from simengine.errors import InputError
from simengine.metrics.frames import requests_frame
from simengine.sim.runner import Runner
from simengine.workload.generator import RequestFactory
from tests.conftest import make_scenario

POOL = {"groups": 3, "prompts_per_group": 4, "prefix_tokens": 64}
QUESTION = {"dist": "constant", "value": 40}


def factory(**pool) -> RequestFactory:
    sc = make_scenario(workload__prompt_groups={**POOL, **pool}, workload__input_tokens=QUESTION)
    return RequestFactory(sc.workload, sc.seed, 32000, 8192)


def test_pool_prompts_share_their_group_prefix_and_come_again_in_order():
    f = factory()
    reqs = [f.plain_request(0.0) for _ in range(2 * 12)]
    prompts = [tuple(r.token_ids[:r.prompt_len]) for r in reqs]
    assert all(r.prompt_len == 64 + 40 for r in reqs)
    assert prompts[:12] == prompts[12:]                      # request k sends prompt k mod the pool's size
    assert len(set(prompts[:12])) == 12                      # every prompt of the pool is its own
    heads = {p[:64] for p in prompts[:12]}
    assert len(heads) == 3                                   # three group prefixes ...
    assert all(sum(p[:64] == h for p in prompts[:12]) == 4 for h in heads)   # ... four prompts each
    assert all(r.private_from == len(r.token_ids) for r in reqs)   # whole prompts come again: nothing private


def test_pool_restarts_where_the_runner_sets_it():
    f = factory()
    first = [tuple(f.plain_request(0.0).token_ids[:104]) for _ in range(5)]
    f.pool_next = 0
    again = [tuple(f.plain_request(0.0).token_ids[:104]) for _ in range(5)]
    assert first == again


def run(**overrides):
    sc = make_scenario(horizon_s=1e5, drain_s=1e5, **overrides)
    return run_engine(sc, sc.engines[0])


def staged(stages, **kw):
    return run(workload__arrival={"process": "stages", "stages": stages}, workload__input_tokens=QUESTION,
               workload__output_tokens={"dist": "constant", "value": 30}, **kw)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 2.0, 7.0]), st.sampled_from([3.0, 10.0])), min_size=1, max_size=3))
def test_each_stage_sends_rate_x_duration_and_starts_when_the_last_drained(stages):
    """No request lost; stage j sends int(rate * duration_s); no request of a stage arrives before every request of
    the stage before has finished (inference-perf run_stage waits for them)."""
    if not any(int(r * d) for r, d in stages):
        return
    res = staged([{"rate": r, "duration_s": d} for r, d in stages])
    frame = res.requests.sort_values("request_id")
    sizes = [int(r * d) for r, d in stages]
    assert len(frame) == sum(sizes) and (frame["status"] == "completed").all()
    edges = np.cumsum([0, *sizes])
    for j in range(1, len(sizes)):
        before, this = frame.iloc[edges[j - 1]:edges[j]], frame.iloc[edges[j]:edges[j + 1]]
        if len(before) and len(this):
            assert this["arrival_s"].min() >= before["finish_s"].max()


def test_a_later_stage_hits_the_prompts_an_earlier_one_sent():
    res = staged([{"rate": 2.0, "duration_s": 10.0}, {"rate": 2.0, "duration_s": 10.0}],
                 workload__prompt_groups={"groups": 4, "prompts_per_group": 10, "prefix_tokens": 512})
    frame = res.requests.sort_values("request_id")
    first, second = frame.iloc[:20], frame.iloc[20:]
    # stage 1's prompts are new past their group prefix; stage 2 sends the same 20 prompts again
    assert (first["num_cached_tokens"] < 552 - 16).all()
    assert (second["num_cached_tokens"] >= 552 - 16).all()


@pytest.mark.parametrize("workload, field", [
    ({"arrival": {"process": "stages", "stages": []}}, "workload.arrival.stages"),
    ({"arrival": {"process": "poisson", "rate": 1, "stages": [{"rate": 1, "duration_s": 5}]}},
     "workload.arrival.stages"),
    ({"arrival": {"process": "stages", "stages": [{"rate": 0.1, "duration_s": 5}]}}, "workload.arrival.stages"),
    ({"arrival": {"process": "stages", "rate": 3, "stages": [{"rate": 1, "duration_s": 5}]}}, "workload.arrival.rate"),
    ({"arrival": {"process": "stages", "stages": [{"rate": -1, "duration_s": 5}]}}, "rate"),
    ({"arrival": {"process": "stages", "stages": [{"rate": 1, "duration_s": 5}]}, "num_requests": 10},
     "workload.num_requests"),
    ({"prompt_groups": {**POOL}, "shared_prefix_tokens": 100}, "workload.prompt_groups"),
    ({"prompt_groups": {**POOL}, "documents": {"count": 2, "tokens": QUESTION}}, "workload.prompt_groups"),
    ({"prompt_groups": {"groups": 0, "prompts_per_group": 1, "prefix_tokens": 8}}, "groups"),
])
def test_bad_stages_and_pools_name_the_field(workload, field):
    with pytest.raises(InputError) as e:
        make_scenario(**{f"workload__{k}": v for k, v in workload.items()})
    assert field in str(e.value)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([0.5, 3.0, 20.0]), st.sampled_from([1, 2, 3]), st.sampled_from([2, 6]))
def test_multi_turn_users_wait_for_their_last_turn_and_carry_the_conversation(rate, groups, per_group):
    """inference-perf's multi-turn chat: one user a prompt; a user's next request is sent only after its last one
    finished, and its prompt is the last prompt, the answer it got, then the question (across stages too)."""
    pool = {"groups": groups, "prompts_per_group": per_group, "prefix_tokens": 48, "multi_turn": True}
    sc = make_scenario(horizon_s=1e5, drain_s=1e5, workload__prompt_groups=pool, workload__input_tokens=QUESTION,
                       workload__output_tokens={"dist": "constant", "value": 12},
                       workload__arrival={"process": "stages", "stages": [{"rate": rate, "duration_s": 4.0},
                                                                          {"rate": 2 * rate, "duration_s": 4.0}]})
    runner = Runner(sc, sc.engines[0])
    prompts: dict[int, np.ndarray] = {}
    submit = runner.submit

    def keep(req):
        prompts[req.request_id] = req.token_ids[:req.prompt_len].copy()
        submit(req)
    runner.submit = keep
    frame = requests_frame(runner.run().recorder).set_index("request_id")
    assert len(frame) == int(rate * 4) + int(2 * rate * 4) and (frame["status"] == "completed").all()
    chains = 0
    for rid in sorted(prompts):
        p = prompts[rid]
        if len(p) == 88:
            chains += 1
            continue
        # a user's turn: the turn before (its prompt and 12 answer tokens), then a 40-token question
        prev = [q for q in prompts if len(prompts[q]) == len(p) - 52 and np.array_equal(prompts[q], p[:len(p) - 52])]
        assert len(prev) == 1, rid            # exactly one earlier turn of this user
        assert frame.loc[rid, "arrival_s"] >= frame.loc[prev[0], "finish_s"]
    # every user a stage reaches (slots restart at 0 each stage) starts once, from its group's system prompt
    assert chains == min(groups * per_group, int(2 * rate * 4))


def test_multi_turn_is_refused_with_closed_loop():
    with pytest.raises(InputError) as e:
        make_scenario(workload__prompt_groups={**POOL, "multi_turn": True},
                      workload__arrival={"process": "closed_loop", "concurrency": 2}, workload__num_requests=4)
    assert "workload.prompt_groups.multi_turn" in str(e.value)


def test_summary_reports_each_stage():
    res = staged([{"rate": 2.0, "duration_s": 5.0}, {"rate": 6.0, "duration_s": 5.0}])
    first, second = res.summary["stages"]
    assert (first["requests"], second["requests"]) == (10, 30) and first["completed"] == 10
    assert first["end_s"] == second["start_s"] and second["end_s"] == pytest.approx(res.requests["finish_s"].max())
    assert second["output_throughput_tok_s"] == pytest.approx(30 * 30 / (second["end_s"] - second["start_s"]))
    assert first["mean_ttft_ms"] > 0 and second["p99_e2el_ms"] >= second["median_e2el_ms"]
