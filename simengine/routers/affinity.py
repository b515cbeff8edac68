"""Session affinity: a consistent hash of the session id, so every turn of a conversation lands on one replica."""

from __future__ import annotations

import bisect
import hashlib

from simengine.core.request import Request
from simengine.routers.base import ROUTERS, ReplicaState, Router, least_loaded_of

VIRTUAL_NODES = 160   # points per replica on the ring (ketama's default, as uhashring uses)


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@ROUTERS.register("session_affinity")
class SessionAffinity(Router):
    """Each replica owns VIRTUAL_NODES points of a hash ring; a session goes to the owner of the first point at or
    after its own hash among the replicas that are up (a failed replica's sessions move, the others stay). Requests
    without a session go to the least loaded replica."""

    source = "vLLM production stack router `--routing-logic session` (a hash ring over the session key)"

    def __init__(self, *args):
        super().__init__(*args)
        ring = sorted((_point(f"replica-{i}-{v}"), i) for i in range(self.num_replicas) for v in range(VIRTUAL_NODES))
        self.points = [p for p, _ in ring]
        self.owners = [i for _, i in ring]

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        if req.session_id < 0:
            return least_loaded_of(replicas)
        up = {r.index for r in replicas}
        k = bisect.bisect_left(self.points, _point(f"session-{req.session_id}"))
        for step in range(len(self.points)):
            owner = self.owners[(k + step) % len(self.points)]
            if owner in up:
                return owner
        raise RuntimeError("no replica is up")   # the runner never asks then
