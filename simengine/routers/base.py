"""The router interface: a pure policy that picks a replica for each request from their current state (no SimPy, no
wall clock; an injected RNG where it samples)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simengine.config.loader import Checked, from_dict
from simengine.core.request import Request
from simengine.registry import Registry


class ReplicaState:
    """What a router may read of one replica that is up, at decision time: a load report's figures, or (`live`) the
    replica's engine now, whose KV figures are read only if the router asks for them."""

    __slots__ = ("index", "num_running", "num_waiting", "waiting_published", "_kv_usage", "_kv_capacity_tokens",
                 "_engine", "_events")

    def __init__(self, index: int, num_running: int, num_waiting: int, kv_usage: float, kv_capacity_tokens: int,
                 events=None, waiting_published: int | None = None):
        self.index, self.num_running, self.num_waiting = index, num_running, num_waiting
        # the queue the engine's metrics publish: what its last scheduling pass left waiting (sim/replica.py)
        self.waiting_published = num_waiting if waiting_published is None else waiting_published
        self._kv_usage, self._kv_capacity_tokens, self._engine = kv_usage, kv_capacity_tokens, None
        self._events = events   # the engine whose KV events the router hears (None: it hears none)

    @classmethod
    def live(cls, index: int, engine, waiting_published: int | None = None,
             num_waiting: int | None = None) -> ReplicaState:
        """The engine's state now (`num_waiting`: the replica's queue where it holds requests the engine has not
        seen yet, sim/replica.py; the engine's own otherwise)."""
        state = cls(index, engine.num_running(), engine.num_waiting() if num_waiting is None else num_waiting, 0.0, 0,
                    events=engine, waiting_published=waiting_published)
        state._engine = engine
        return state

    def cached_prefix_tokens(self, req: Request) -> int:
        """Leading prompt tokens of `req` the replica's prefix cache holds, as its KV events (vLLM's
        --kv-events-config, published as blocks are stored and evicted) tell a router now, whatever the age of the
        load report; 0 where the router hears no events."""
        return 0 if self._events is None else self._events.cached_prefix_tokens(req)

    @property
    def kv_usage(self) -> float:
        """Fraction of the replica's KV pool in use."""
        return self._kv_usage if self._engine is None else self._engine.kv_usage()

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_capacity_tokens if self._engine is None else self._engine.kv_capacity_tokens()

    @property
    def load(self) -> int:
        """Requests on the replica: running and queued."""
        return self.num_running + self.num_waiting

    def __repr__(self) -> str:
        return (f"ReplicaState({self.index}, running={self.num_running}, waiting={self.num_waiting}, "
                f"kv_usage={self.kv_usage:.3f})")


@dataclass(frozen=True, kw_only=True)
class NoParams(Checked):
    """A router without knobs."""


class Router(ABC):
    """Picks a replica for each request. `choose` gets the replicas that are up (never empty); `finished` is called
    when a request this router placed leaves its replica (completed, failed or lost)."""

    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    source: ClassVar[str] = ""   # the real router this follows

    def __init__(self, params, num_replicas: int, rng: np.random.Generator):
        self.params, self.num_replicas, self.rng = params, num_replicas, rng

    @abstractmethod
    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        """The index (ReplicaState.index) of the replica to send `req` to."""

    def one_of(self, indices: list[int]) -> int:
        """One of equally good replicas, drawn at random (no draw when there is one)."""
        return indices[int(self.rng.integers(len(indices)))] if len(indices) > 1 else indices[0]

    def finished(self, req: Request, replica: int) -> None:  # noqa: B027  (optional hook)
        """`req`, placed on `replica`, left it."""


ROUTERS: Registry[Router] = Registry("router")


def router_and_params(name: str, params: dict, *, at: str) -> tuple[type[Router], object]:
    """The registered router `name` and its knobs parsed; a bad name or knob is an InputError naming
    `<at>router` or `<at>router_params` (`at`: 'deployment.', 'pools[1].', or '' inside a pool's own section)."""
    cls = ROUTERS.get(name, field=f"{at}router")
    return cls, from_dict(cls.Params, params, source=None, field=f"{at}router_params")   # the file: its loader


def least_loaded_of(replicas: list[ReplicaState]) -> int:
    """The replica with the fewest running and queued requests (the first of equals)."""
    return min(replicas, key=lambda r: r.load).index
