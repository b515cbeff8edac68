"""llm-d's inference scheduler (the Gateway API inference extension's endpoint picker, EPP): weighted scorers and a
max-score picker, with its prefix-cache scorer in either of its two modes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from simengine.config.loader import Checked, Range
from simengine.core.request import Request
from simengine.routers.base import ROUTERS, ReplicaState, Router
from simengine.routers.prefix import PrefixIndex


@dataclass(frozen=True, kw_only=True)
class LlmdParams(Checked):
    """The EPP's scorer weights and prefix-cache scorer settings. Defaults: every weight 1 and the approximate
    prefix scorer, the inference gateway's default profile (llm-d/llm-d-kv-cache benchmarking/73-capacity,
    'estimated-scheduling ... matching the default configuration in the IGW'), with the approximate scorer's own
    defaults (gateway-api-inference-extension pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go:
    hashBlockSize 64 characters, maxPrefixBlocksToMatch 256, lruCapacityPerServer 31250)."""

    prefix_cache_weight: Annotated[float, Range(0, 1000)] = 1.0
    kv_cache_weight: Annotated[float, Range(0, 1000)] = 1.0    # kv-cache-utilization-scorer
    queue_weight: Annotated[float, Range(0, 1000)] = 1.0       # queue-scorer
    # approximate: the scheduler's own index of the prompts it sent each pod. precise (`mode: cache_tracking`): the
    # pods' KV events, so it matches what each pod's cache holds now, evictions included
    prefix_mode: Literal["approximate", "precise"] = "approximate"
    # the approximate index hashes the prompt text in blocks of 64 characters, 16 tokens at the plugin's own guess
    # of 4 characters a token; it matches at most maxPrefixBlocksToMatch of them (the first 4,096 tokens)
    hash_block_tokens: Annotated[int, Range(1, 1 << 20, unit="tokens")] = 16
    max_prefix_blocks: Annotated[int, Range(1, 1 << 30)] = 256
    lru_capacity_per_server: Annotated[int, Range(1, 1 << 40)] = 31250   # hashed blocks a pod's index keeps


@ROUTERS.register("llm_d")
class Llmd(Router):
    """Each pod's score is the weighted sum of its scorers' scores, each in [0, 1]: queue-scorer
    (max - waiting) / (max - min) waiting requests over the pods (1 when all are equal; the queue the pod's metrics
    publish, what its last scheduling pass left waiting), kv-cache-utilization-scorer
    1 - KV usage, prefix-cache-scorer the share of the prompt's hashed blocks the pod holds (approximate), or the
    pod's cached leading blocks min-max normalised over the pods holding any, 1 when they hold alike and 0 for the
    others (precise). The highest score wins, equals at random (max-score-picker shuffles before its stable sort)."""

    Params = LlmdParams
    source = ("llm-d inference scheduler / Gateway API inference extension EPP: queue-scorer, "
              "kv-cache-utilization-scorer, prefix-cache-scorer (approximate or cache_tracking), max-score-picker")

    def __init__(self, *args):
        super().__init__(*args)
        self.index = PrefixIndex(self.num_replicas)

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        p = self.params
        waiting = [r.waiting_published for r in replicas]   # vLLM's num_requests_waiting, as the EPP scrapes it
        low, high = min(waiting), max(waiting)
        scores = [p.queue_weight * (1.0 if high == low else (high - w) / (high - low)) for w in waiting]
        if p.kv_cache_weight:
            scores = [s + p.kv_cache_weight * (1.0 - r.kv_usage) for s, r in zip(scores, replicas)]
        hashes = None
        if p.prefix_cache_weight:
            if p.prefix_mode == "precise":
                prefix = self._precise(req, replicas)
            else:
                hashes = self._hashes(req)
                prefix = self._approximate(hashes, replicas)
            scores = [s + p.prefix_cache_weight * x for s, x in zip(scores, prefix)]
        top = max(scores)
        best = [r.index for r, s in zip(replicas, scores) if s == top]
        pick = self.one_of(best)
        if hashes is not None:   # PreRequest: the approximate index learns where the prompt went
            self.index.insert(pick, hashes, p.lru_capacity_per_server)
        return pick

    def _hashes(self, req: Request) -> list[int]:
        p = self.params
        return PrefixIndex.hashes(req, p.hash_block_tokens)[:p.max_prefix_blocks]

    def _approximate(self, hashes: list[int], replicas: list[ReplicaState]) -> list[float]:
        if not hashes:   # a prompt shorter than one hashed block: no prefix score
            return [0.0] * len(replicas)
        return [self.index.matched_blocks(r.index, hashes) / len(hashes) for r in replicas]

    @staticmethod
    def _precise(req: Request, replicas: list[ReplicaState]) -> list[float]:
        held = [r.cached_prefix_tokens(req) for r in replicas]
        some = [h for h in held if h]
        if not some:
            return [0.0] * len(replicas)
        low, high = min(some), max(some)
        return [0.0 if not h else 1.0 if high == low else (h - low) / (high - low) for h in held]
