"""Load-balancing routers: round robin, random, least loaded, least outstanding tokens, least KV usage, power of
two choices."""

from __future__ import annotations

from collections import defaultdict

from simengine.core.request import Request
from simengine.routers.base import ROUTERS, ReplicaState, Router, least_loaded_of


@ROUTERS.register("round_robin")
class RoundRobin(Router):
    source = "vLLM production stack router `--routing-logic roundrobin`; SGLang router `--policy round_robin`"

    def __init__(self, *args):
        super().__init__(*args)
        self.turn = 0

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        pick = replicas[self.turn % len(replicas)].index
        self.turn += 1
        return pick


@ROUTERS.register("random")
class Random(Router):
    source = "a replica drawn uniformly at random: llm-d's random-picker (the gateway's cache- and load-blind baseline)"

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        return replicas[int(self.rng.integers(len(replicas)))].index


@ROUTERS.register("least_loaded")
class LeastLoaded(Router):
    source = "fewest running + queued requests (the SGLang router's cache_aware fallback when load is imbalanced)"

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        return least_loaded_of(replicas)


@ROUTERS.register("least_outstanding_tokens")
class LeastOutstandingTokens(Router):
    """The replica with the fewest tokens still to process among the requests this router sent it: prompt plus
    max_tokens of each, counted from routing until the request leaves (what a router knows without engine state)."""

    source = "least_loaded weighted by tokens (prompt + max_tokens of each request in flight); no one router's name"

    def __init__(self, *args):
        super().__init__(*args)
        self.tokens: dict[int, int] = defaultdict(int)

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        pick = min(replicas, key=lambda r: (self.tokens[r.index], r.index)).index
        self.tokens[pick] += req.prompt_len + req.max_tokens
        return pick

    def finished(self, req: Request, replica: int) -> None:
        self.tokens[replica] -= req.prompt_len + req.max_tokens


@ROUTERS.register("least_kv_usage")
class LeastKvUsage(Router):
    source = ("the emptiest KV cache, as the Gateway API inference extension's KV-cache utilization scorer (ties: "
              "fewest requests)")

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        return min(replicas, key=lambda r: (r.kv_usage, r.load, r.index)).index


@ROUTERS.register("power_of_two")
class PowerOfTwo(Router):
    source = "power of two choices (Mitzenmacher 2001; SGLang router `--policy power_of_two`): the less loaded of two"

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        if len(replicas) == 1:
            return replicas[0].index
        a, b = self.rng.choice(len(replicas), 2, replace=False)
        return min(replicas[int(a)], replicas[int(b)], key=lambda r: r.load).index
