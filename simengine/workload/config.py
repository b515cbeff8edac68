"""The workload section of a scenario: arrivals, lengths, sessions, request classes, structured output, traces."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from simengine.config.slo import SloConfig
from simengine.errors import InputError
from simengine.workload.arrivals import ArrivalConfig
from simengine.workload.distributions import Dist


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """Multi-turn chat or agent sessions: each turn's prompt is the whole conversation so far.

    Give `population` (that many sessions alive at once; a finished one is replaced until the horizon) or
    `arrival_rate` (new sessions per second, Poisson; each runs its turns then leaves).
    """

    population: int | None = None
    arrival_rate: float | None = None
    turns: Dist = field(default_factory=lambda: Dist(dist="uniform", low=3, high=8))
    think_time_s: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=4.0, sigma=0.6))
    user_tokens: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=180, sigma=0.7))
    start_spread_s: float = 10.0          # population mode: first turns start uniformly over [0, start_spread_s]
    context_overflow: Literal["reject", "truncate"] = "reject"  # what the client does when context outgrows the model

    def __post_init__(self):
        if (self.population is None) == (self.arrival_rate is None):
            raise InputError("give exactly one of population or arrival_rate", field="workload.sessions")
        if self.population is not None and not 1 <= self.population <= 1_000_000:
            raise InputError(f"must be in 1..1000000, got {self.population}", field="workload.sessions.population")
        if self.arrival_rate is not None and not (math.isfinite(self.arrival_rate) and self.arrival_rate > 0):
            raise InputError(f"must be > 0, got {self.arrival_rate}", field="workload.sessions.arrival_rate")
        if self.start_spread_s < 0:
            raise InputError(f"must be >= 0, got {self.start_spread_s}", field="workload.sessions.start_spread_s")


@dataclass(frozen=True, kw_only=True)
class RequestClass:
    """A traffic class: its share of requests, its priority (lower is served first) and its own SLOs."""

    name: str
    weight: float = 1.0
    priority: int = 0
    slo: SloConfig = field(default_factory=SloConfig)
    input_tokens: Dist | None = None      # overrides the workload's distributions for this class
    output_tokens: Dist | None = None

    def __post_init__(self):
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise InputError(f"must be > 0, got {self.weight}", field=f"workload.classes[{self.name}].weight")


# Per-backend costs of JSON-schema constrained decoding. compile_ms: grammar compilation before the request
# can be scheduled (engines hold it in a grammar queue); mask_us: CPU time per generated token to build the mask.
STRUCTURED_BACKENDS: dict[str, tuple[float, float, str]] = {
    # XGrammar paper (Dong et al., arXiv:2411.15100, 2024): per-token mask generation under 40 us for JSON
    # grammars thanks to context-independent token caching; JSON-schema compilation in the tens of ms (ESTIMATE 25).
    "xgrammar": (25.0, 40.0, "XGrammar paper arXiv:2411.15100"),
    # Outlines builds a regex FSM index over the whole vocabulary up front: seconds for non-trivial schemas
    # (ESTIMATE 2000 ms; outlines issues report 1-60 s), then cheap per-token lookups (ESTIMATE 100 us with the
    # Python logits processor).
    "outlines": (2000.0, 100.0, "Outlines (Willard & Louf, arXiv:2307.09702); compile time from user reports"),
    # llguidance README: ~50 us CPU per token for a 128k tokenizer and negligible startup (lazy lexer).
    "llguidance": (1.0, 50.0, "guidance-ai/llguidance README performance section"),
}


@dataclass(frozen=True, kw_only=True)
class StructuredOutputConfig:
    """A fraction of requests ask for JSON-schema constrained decoding through `backend`."""

    fraction: float = 0.0
    backend: Literal["xgrammar", "outlines", "llguidance"] = "xgrammar"
    compile_ms: float | None = None       # override the backend's compile time
    mask_us_per_token: float | None = None  # override the backend's per-token mask cost

    def __post_init__(self):
        if not 0 <= self.fraction <= 1:
            raise InputError(f"must be in [0, 1], got {self.fraction}", field="workload.structured_output.fraction")

    @property
    def compile_s(self) -> float:
        return (self.compile_ms if self.compile_ms is not None else STRUCTURED_BACKENDS[self.backend][0]) / 1e3

    @property
    def mask_s(self) -> float:
        us = self.mask_us_per_token if self.mask_us_per_token is not None else STRUCTURED_BACKENDS[self.backend][1]
        return us / 1e6


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """Replay a real trace (see docs/traces.md). `path` is relative to the repo root unless absolute."""

    kind: Literal["azure", "mooncake", "burstgpt", "sharegpt"]
    path: str
    start_s: float = 0.0
    end_s: float | None = None
    time_scale: float = 1.0
    rate_scale: float = 1.0
    max_requests: int | None = None


@dataclass(frozen=True, kw_only=True)
class DocumentPool:
    """Shared long documents (RAG): each request's prompt is [shared prefix] + one document + its own question.
    Documents are picked with Zipf-like popularity: P(doc k) proportional to 1 / k**zipf_s (0 = uniform)."""

    count: int
    tokens: Dist
    zipf_s: float = 1.0

    def __post_init__(self):
        if not 1 <= self.count <= 100_000:
            raise InputError(f"must be in 1..100000, got {self.count}", field="workload.documents.count")
        if not (math.isfinite(self.zipf_s) and self.zipf_s >= 0):
            raise InputError(f"must be >= 0, got {self.zipf_s}", field="workload.documents.zipf_s")


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """Requests: open-loop arrivals (or closed-loop users), length distributions, shared prefix, sessions,
    classes, structured output, or a trace."""

    arrival: ArrivalConfig = field(default_factory=lambda: ArrivalConfig(process="poisson", rate=1.0))
    num_requests: int | None = None       # open loop: stop after this many (else at the horizon)
    input_tokens: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=1000, sigma=0.6, max=8000))
    output_tokens: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=250, sigma=0.7, max=2048))
    shared_prefix_tokens: int = 0         # identical system prompt (+ tool definitions) at the head of prompts
    client_max_tokens: int | None = None  # max_tokens the client sends; None = exactly the output length
    sessions: SessionConfig | None = None
    documents: DocumentPool | None = None  # RAG: prompts = prefix + a shared document + input_tokens of question
    classes: list[RequestClass] = field(default_factory=list)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    trace: TraceConfig | None = None

    def __post_init__(self):
        if self.num_requests is not None and not 1 <= self.num_requests <= 100_000_000:
            raise InputError(f"must be in 1..1e8, got {self.num_requests}", field="workload.num_requests")
        if not 0 <= self.shared_prefix_tokens <= 10_000_000:
            raise InputError(f"must be >= 0, got {self.shared_prefix_tokens}", field="workload.shared_prefix_tokens")
        if self.client_max_tokens is not None and self.client_max_tokens < 1:
            raise InputError(f"must be >= 1, got {self.client_max_tokens}", field="workload.client_max_tokens")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise InputError("class names must be unique", field="workload.classes")
        if self.trace is not None and self.sessions is not None:
            raise InputError("a trace replay and sessions cannot be combined; remove one", field="workload.trace")
