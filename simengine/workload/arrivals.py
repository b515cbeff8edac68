"""Open-loop arrival times: Poisson, Gamma with vLLM's burstiness, constant, offline, and ramp / diurnal curves."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np

from simengine.config.loader import Checked, Range
from simengine.errors import InputError

MAX_RATE = 1e6                  # requests per second: beyond any real deployment
MAX_USERS = 1_000_000           # closed-loop users / sessions alive at once
Rate = Annotated[float, Range(0, MAX_RATE, above=True, unit="requests per second (process: offline sends all at t=0)")]
Period = Annotated[float, Range(0, 1e9, above=True, unit="seconds")]


@dataclass(frozen=True, kw_only=True)
class LoadStage(Checked):
    """One stage of a staged run: `int(rate * duration_s)` requests from the stage's start, at Poisson times or
    (`process: constant`, inference-perf's `type: constant`) every 1 / rate seconds."""

    rate: Rate
    duration_s: Period
    process: Literal["poisson", "constant"] = "poisson"


@dataclass(frozen=True, kw_only=True)
class ArrivalConfig(Checked):
    """How requests arrive.

    poisson: exponential gaps at `rate` req/s. gamma: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness))
    exactly as vLLM `bench serve --burstiness` (1 = Poisson, < 1 burstier, > 1 smoother). constant: 1/rate gaps.
    offline: every request at t=0. closed_loop: `concurrency` users, each sends its next request when the previous
    one finishes (vLLM --max-concurrency with --request-rate inf). ramp: a Poisson process whose rate moves
    linearly from `ramp_start_rate` to `rate` over `ramp_duration_s` (vLLM --ramp-up-strategy linear), then stays.
    diurnal: a Poisson process with rate(t) = rate * (1 + amplitude * sin(2 pi t / period_s)).
    stages: inference-perf's load stages (kubernetes-sigs/inference-perf loadgen/load_generator.py run_stage): stage
    j sends int(rate * duration_s) requests from its start, at Poisson times or evenly spaced (its `process:
    constant`), and the next stage starts when all of them have finished; a prompt pool (workload.prompt_groups)
    restarts at its first prompt each stage.
    """

    process: Literal["poisson", "gamma", "constant", "offline", "closed_loop", "ramp", "diurnal", "stages"] = "poisson"
    rate: Rate | None = None           # requests per second (the end rate of a ramp, the mean of a diurnal curve)
    burstiness: Annotated[float, Range(0, 1000, above=True)] = 1.0
    concurrency: Annotated[int, Range(1, MAX_USERS, unit="users")] | None = None     # closed_loop users
    ramp_start_rate: Annotated[float, Range(0, MAX_RATE)] = 0.0
    ramp_duration_s: Period = 60.0
    amplitude: Annotated[float, Range(0, 1)] = 0.5             # diurnal: relative swing
    period_s: Period = 86400.0
    stages: list[LoadStage] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        if (self.process == "stages") != bool(self.stages):
            raise InputError("list the stages (rate and duration_s each) with process: stages, and only with it",
                             field="workload.arrival.stages")
        if self.stages and self.rate is not None:
            raise InputError("process stages takes each stage's rate; remove workload.arrival.rate",
                             field="workload.arrival.rate")
        if self.stages and not any(int(s.rate * s.duration_s) for s in self.stages):
            raise InputError("every stage sends int(rate x duration_s) = 0 requests; raise a rate or a duration",
                             field="workload.arrival.stages")
        if self.process in ("poisson", "gamma", "constant", "ramp", "diurnal") and self.rate is None:
            raise InputError(f"{self.process} arrivals need rate > 0 (requests per second)",
                             field="workload.arrival.rate")
        if self.process == "closed_loop" and self.concurrency is None:
            raise InputError("closed_loop arrivals need concurrency >= 1", field="workload.arrival.concurrency")

    @property
    def rate_req_s(self) -> float:
        """`rate`, which __post_init__ requires of every process that has one (0 for offline and closed_loop)."""
        return self.rate or 0.0

    def rate_at(self, t: float) -> float:
        """Instantaneous rate (req/s) of the time-varying processes."""
        rate = self.rate_req_s
        if self.process == "ramp":
            if t >= self.ramp_duration_s:
                return rate
            return self.ramp_start_rate + (rate - self.ramp_start_rate) * t / self.ramp_duration_s
        if self.process == "diurnal":
            return rate * (1.0 + self.amplitude * math.sin(2 * math.pi * t / self.period_s))
        return rate


def stage_times(stage: LoadStage, rng: np.random.Generator, start_s: float) -> np.ndarray:
    """A stage's arrival times from `start_s`: its requests at its rate, Poisson or evenly spaced."""
    n = int(stage.rate * stage.duration_s)
    if stage.process == "constant":
        return start_s + np.arange(1, n + 1) / stage.rate
    return start_s + np.cumsum(rng.exponential(1.0 / stage.rate, n))


def arrival_times(cfg: ArrivalConfig, rng: np.random.Generator, n: int, start_s: float) -> np.ndarray:
    """The next n arrival times after `start_s` (non-decreasing). Not for process stages, whose stages the runner
    starts one after another (`stage_times`)."""
    if cfg.process in ("offline", "closed_loop"):
        return np.full(n, start_s)
    if cfg.process == "stages":
        raise ValueError("staged arrivals come from the runner's stages (stage_times)")
    if cfg.process == "constant":
        return start_s + np.arange(1, n + 1) / cfg.rate_req_s
    if cfg.process == "poisson":
        return start_s + np.cumsum(rng.exponential(1.0 / cfg.rate_req_s, n))
    if cfg.process == "gamma":
        b = cfg.burstiness
        return start_s + np.cumsum(rng.gamma(shape=b, scale=1.0 / (cfg.rate_req_s * b), size=n))
    return _thinned(cfg, rng, n, start_s)


def _thinned(cfg: ArrivalConfig, rng: np.random.Generator, n: int, start_s: float) -> np.ndarray:
    """Non-homogeneous Poisson by thinning (Lewis and Shedler 1979) against the curve's maximum rate."""
    peak = max(cfg.rate_req_s, cfg.ramp_start_rate) if cfg.process == "ramp" else cfg.rate_req_s * (1 + cfg.amplitude)
    out = np.empty(n)
    t, k = start_s, 0
    while k < n:
        cand = t + np.cumsum(rng.exponential(1.0 / peak, 2 * (n - k) + 16))
        keep = rng.uniform(0, peak, len(cand)) < np.fromiter((cfg.rate_at(x) for x in cand), float, len(cand))
        got = cand[keep][: n - k]
        out[k:k + len(got)] = got
        k += len(got)
        t = cand[-1]
    return out
