"""Open-loop arrival times: Poisson, Gamma with vLLM's burstiness, constant, offline (all at t=0)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from simengine.errors import InputError


@dataclass(frozen=True, kw_only=True)
class ArrivalConfig:
    """How requests arrive.

    poisson: exponential gaps at `rate` req/s. gamma: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness))
    exactly as vLLM `bench serve --burstiness` (1 = Poisson, < 1 burstier, > 1 smoother). constant: 1/rate
    gaps. offline: every request at t=0. closed_loop: `concurrency` users, each sends its next request when
    the previous one finishes (vLLM --max-concurrency with --request-rate inf).
    """

    process: Literal["poisson", "gamma", "constant", "offline", "closed_loop"] = "poisson"
    rate: float | None = None          # requests per second
    burstiness: float = 1.0
    concurrency: int | None = None     # closed_loop users

    def __post_init__(self):
        if self.process in ("poisson", "gamma", "constant"):
            if self.rate is None or not math.isfinite(self.rate) or self.rate <= 0:
                raise InputError(f"{self.process} arrivals need rate > 0 (requests per second), got {self.rate}",
                                 field="rate")
        if self.burstiness <= 0 or not math.isfinite(self.burstiness):
            raise InputError(f"must be > 0, got {self.burstiness}", field="burstiness")
        if self.process == "closed_loop" and (self.concurrency is None or self.concurrency < 1):
            raise InputError("closed_loop arrivals need concurrency >= 1", field="concurrency")


def arrival_gaps(cfg: ArrivalConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    """n inter-arrival gaps in seconds (the first request arrives after the first gap)."""
    if cfg.process == "offline" or cfg.process == "closed_loop":
        return np.zeros(n)
    if cfg.process == "constant":
        return np.full(n, 1.0 / cfg.rate)
    if cfg.process == "poisson":
        return rng.exponential(1.0 / cfg.rate, n)
    b = cfg.burstiness
    return rng.gamma(shape=b, scale=1.0 / (cfg.rate * b), size=n)
