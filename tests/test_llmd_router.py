"""llm-d's endpoint picker (router `llm_d`) and its random picker (`random`): each scorer as the inference gateway
defines it, the max-score pick, the precise prefix scorer reading what the replicas' caches hold (without touching
them), and on shared-prefix stages the cache-aware picks raising the hit rate and cutting TTFT against random."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.api import compare
from simengine.config.loader import from_dict
from simengine.kvcache.manager import KVCacheManager
from simengine.kvcache.radix import RadixCache
from simengine.routers import ROUTERS, ReplicaState
from tests.conftest import make_request, make_scenario


def router(name: str, replicas: int, seed: int = 0, **params):
    cls = ROUTERS.get(name)
    return cls(from_dict(cls.Params, params, source="test"), replicas, np.random.default_rng(seed))


class Events:
    """A replica's KV events as a router hears them: the prompt tokens its cache holds for each request."""

    def __init__(self, held: int):
        self.held = held

    def cached_prefix_tokens(self, req) -> int:
        return self.held


def states(waiting=(0, 0, 0), kv=(0.5, 0.5, 0.5), held=None) -> list[ReplicaState]:
    return [ReplicaState(i, 1, w, u, 100_000, events=None if held is None else Events(held[i]))
            for i, (w, u) in enumerate(zip(waiting, kv, strict=True))]


def test_queue_scorer_prefers_the_shortest_wait_queue():
    r = router("llm_d", 3, prefix_cache_weight=0, kv_cache_weight=0)
    assert r.choose(make_request(64), states(waiting=(7, 2, 9))) == 1


def test_kv_cache_scorer_prefers_the_emptiest_cache():
    r = router("llm_d", 3, prefix_cache_weight=0, queue_weight=0)
    assert r.choose(make_request(64), states(kv=(0.9, 0.2, 0.4))) == 1


def test_weights_trade_the_scorers_against_each_other():
    """queue min-max normalised (1, 0.5, 0) plus 1 - KV usage (0.1, 0.6, 1): equal weights pick the middle one,
    a heavier queue weight the emptiest queue."""
    args = {"waiting": (0, 5, 10), "kv": (0.9, 0.4, 0.0)}
    assert router("llm_d", 3, prefix_cache_weight=0).choose(make_request(64), states(**args)) == 1
    assert router("llm_d", 3, prefix_cache_weight=0, queue_weight=3).choose(make_request(64), states(**args)) == 0


def test_precise_prefix_scores_min_max_over_the_replicas_holding_any():
    r = router("llm_d", 3, prefix_mode="precise", kv_cache_weight=0, queue_weight=0)
    req = make_request(1024)
    assert r.choose(req, states(held=(0, 256, 640))) == 2
    # the two holding alike both score 1: one of them, at random; one holding nothing never wins
    picks = {router("llm_d", 3, seed=s, prefix_mode="precise").choose(req, states(held=(0, 640, 640)))
             for s in range(30)}
    assert picks == {1, 2}


def test_approximate_prefix_follows_the_prompts_it_sent():
    r = router("llm_d", 4, kv_cache_weight=0, queue_weight=0)
    head = np.random.default_rng(5).integers(0, 32000, 2048, dtype=np.int32)
    first = r.choose(make_request(2048, tokens=head), states((0,) * 4, (0.5,) * 4))
    again = [r.choose(make_request(2048, tokens=head), states((0,) * 4, (0.5,) * 4)) for _ in range(5)]
    assert again == [first] * 5


@settings(max_examples=50, deadline=None)
@given(waiting=st.lists(st.integers(0, 50), min_size=1, max_size=8), seed=st.integers(0, 1000))
def test_the_pick_has_the_top_score(waiting, seed):
    """max-score-picker: whatever the state, the pick is one of the replicas with the highest weighted score."""
    rng = np.random.default_rng(seed)
    kv = rng.uniform(0, 1, len(waiting)).round(2)
    held = rng.integers(0, 4, len(waiting)) * 64
    r = router("llm_d", len(waiting), seed=seed, prefix_mode="precise", prefix_cache_weight=2.0)
    pick = r.choose(make_request(512), states(tuple(waiting), tuple(kv), tuple(held)))
    lo, hi = min(waiting), max(waiting)
    some = [h for h in held if h]
    score = [(1.0 if hi == lo else (hi - w) / (hi - lo)) + (1 - u)
             + 2.0 * (0.0 if not h else 1.0 if min(some) == max(some) else (h - min(some)) / (max(some) - min(some)))
             for w, u, h in zip(waiting, kv, held, strict=True)]
    assert score[pick] == pytest.approx(max(score))


def test_random_picks_every_replica_about_as_often():
    r = router("random", 4, seed=3)
    counts = np.bincount([r.choose(make_request(16), states((0,) * 4, (0.5,) * 4)) for _ in range(4000)],
                         minlength=4)
    assert counts.min() > 900 and counts.max() < 1100


def test_cached_prefix_tokens_reads_the_paged_cache_without_touching_it():
    kv = KVCacheManager(64, 16, enable_prefix_caching=True)
    head = np.arange(100, dtype=np.int32)
    a = make_request(100, tokens=head)
    assert kv.allocate_slots(a, 100)
    kv.publish_through(a, 100)
    kv.free(a)
    b = make_request(100, tokens=head)
    before = (kv.query_tokens, kv.hit_tokens, list(kv.pool.free_queue))
    assert kv.cached_prefix_tokens(b) == 96          # six full blocks of 16
    assert (kv.query_tokens, kv.hit_tokens, list(kv.pool.free_queue)) == before
    assert kv.get_computed_blocks(b).num_tokens == 96
    assert KVCacheManager(64, 16, enable_prefix_caching=False).cached_prefix_tokens(b) == 0


def test_peek_prefix_matches_like_match_prefix_and_changes_nothing():
    c = RadixCache(1000, page_size=4)
    for tokens in (np.arange(40), np.r_[np.arange(20), np.arange(500, 530)]):
        h = c.acquire(tokens.astype(np.int32))
        assert c.grow(h, len(tokens) - h.cached)
        c.commit(h, tokens.astype(np.int32))
        c.release(h)
    query = np.r_[np.arange(30), [7, 7, 7]].astype(np.int32)
    state = (c.clock, c.num_nodes, c.tree_tokens)
    assert c.peek_prefix(query) == 28                # whole pages of the 30 shared tokens
    assert (c.clock, c.num_nodes, c.tree_tokens) == state
    assert c.match_prefix(query)[0] == 28


def test_a_router_hashing_first_leaves_the_engine_its_own_block_size():
    """A precise router asking replicas of two block sizes: each engine still finds the request's blocks."""
    from simengine.kvcache.hashing import block_hashes, hash_blocks
    req = make_request(128)
    assert block_hashes(req, 64) == hash_blocks(req.token_ids, 64)
    assert block_hashes(req, 16) == hash_blocks(req.token_ids, 16)


STAGES = [{"rate": 4.0, "duration_s": 10.0}, {"rate": 4.0, "duration_s": 10.0, "process": "constant"}]


@pytest.fixture(scope="module")
def fleet():
    """Shared-prefix stages on four replicas, per router: (summary, requests)."""
    out = {}
    for label, name, params in (("random", "random", {}), ("approximate", "llm_d", {}),
                                ("precise", "llm_d", {"prefix_mode": "precise"})):
        sc = make_scenario(horizon_s=1e5, drain_s=1e5, deployment__replicas=4, deployment__router=name,
                           deployment__router_params=params,
                           workload__arrival={"process": "stages", "stages": STAGES},
                           workload__prompt_groups={"groups": 8, "prompts_per_group": 5, "prefix_tokens": 2048},
                           workload__input_tokens={"dist": "constant", "value": 128},
                           workload__output_tokens={"dist": "constant", "value": 64})
        r = compare(sc, ["vllm"])["vllm"]
        out[label] = (r.summary, r.requests)
    return out


def test_no_request_is_lost_under_any_pick(fleet):
    for s, req in fleet.values():
        assert s["completed"] == s["num_requests"] == 80 and req["replica"].nunique() > 1


def test_cache_aware_picks_hit_more_and_answer_sooner_than_random(fleet):
    rand = fleet["random"][0]
    for mode in ("approximate", "precise"):
        s = fleet[mode][0]
        assert s["prefix_cache_hit_rate"] > rand["prefix_cache_hit_rate"] + 0.1
        assert s["mean_ttft_ms"] < rand["mean_ttft_ms"]


def test_a_constant_stage_spaces_its_requests_evenly(fleet):
    req = fleet["random"][1].sort_values("request_id").iloc[40:]
    gaps = np.diff(req["arrival_s"].to_numpy())
    assert gaps == pytest.approx(np.full(39, 0.25))


def test_the_published_queue_is_what_the_last_scheduling_pass_left(monkeypatch):
    """vLLM sets num_requests_waiting from the scheduler's stats at the end of each step, before the requests that
    arrived during the step join the scheduler: the published queue changes only at a scheduling pass, while
    arrivals in between lengthen the live one."""
    from simengine.sim.replica import Replica
    from simengine.sim.runner import Runner
    seen = {"after_pass": 0, "ahead": 0}
    scheduled, submit = Replica.scheduled, Replica.submit

    def after_pass(self, out):
        scheduled(self, out)
        assert self.waiting_published == self.engine.num_waiting()
        seen["after_pass"] += 1

    def arrival(self, req):
        before = self.waiting_published
        submit(self, req)
        assert self.waiting_published == before
        seen["ahead"] += self.engine.num_waiting() > before

    monkeypatch.setattr(Replica, "scheduled", after_pass)
    monkeypatch.setattr(Replica, "submit", arrival)
    sc = make_scenario(horizon_s=10.0, workload__arrival__rate=40.0, deployment__replicas=2,
                       deployment__router="llm_d")
    Runner(sc, sc.engines[0]).run()
    assert seen["after_pass"] > 100 and seen["ahead"] > 10
