"""Turn a workload description into Requests with token-id prompts (so prefix caching works by content).

Every random stream is a child of the scenario seed with a fixed role, so each engine sees the identical
request stream; a session's content depends only on its index, never on timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from simengine.core.request import Request
from simengine.errors import InputError
from simengine.workload.arrivals import ArrivalConfig, arrival_gaps
from simengine.workload.distributions import Dist

STREAM_ARRIVALS, STREAM_LENGTHS, STREAM_TOKENS, STREAM_PREFIX, STREAM_SESSIONS = range(5)


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """Closed-loop multi-turn sessions (chat or agent): each turn's prompt is the whole conversation so far."""

    population: int                       # sessions alive at once; a finished session is replaced until the horizon
    turns: Dist = field(default_factory=lambda: Dist(dist="uniform", low=3, high=8))
    think_time_s: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=4.0, sigma=0.6))
    user_tokens: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=180, sigma=0.7))
    start_spread_s: float = 10.0          # first turns start uniformly over [0, start_spread_s]

    def __post_init__(self):
        if self.population < 1:
            raise InputError(f"must be >= 1, got {self.population}", field="population")
        if self.start_spread_s < 0:
            raise InputError(f"must be >= 0, got {self.start_spread_s}", field="start_spread_s")


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """Requests: open-loop arrivals (or closed-loop users), length distributions, shared prefix, sessions."""

    arrival: ArrivalConfig = field(default_factory=lambda: ArrivalConfig(process="poisson", rate=1.0))
    num_requests: int | None = None       # open loop: stop after this many (else at the horizon)
    input_tokens: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=1000, sigma=0.6, max=8000))
    output_tokens: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=250, sigma=0.7, max=2048))
    shared_prefix_tokens: int = 0         # identical system prompt (+ tool definitions) at the head of prompts
    client_max_tokens: int | None = None  # max_tokens the client sends; None = exactly the output length
    sessions: SessionConfig | None = None

    def __post_init__(self):
        if self.num_requests is not None and self.num_requests < 1:
            raise InputError(f"must be >= 1, got {self.num_requests}", field="num_requests")
        if self.shared_prefix_tokens < 0:
            raise InputError(f"must be >= 0, got {self.shared_prefix_tokens}", field="shared_prefix_tokens")
        if self.client_max_tokens is not None and self.client_max_tokens < 1:
            raise InputError(f"must be >= 1, got {self.client_max_tokens}", field="client_max_tokens")


class RequestFactory:
    """Builds Requests with deterministic token content from the scenario seed."""

    def __init__(self, cfg: WorkloadConfig, seed: int, vocab_size: int):
        self.cfg = cfg
        self.seed = seed
        self.vocab = vocab_size
        root = np.random.SeedSequence(seed)
        children = root.spawn(5)
        self.rng_arrivals = np.random.default_rng(children[STREAM_ARRIVALS])
        self.rng_lengths = np.random.default_rng(children[STREAM_LENGTHS])
        self.rng_tokens = np.random.default_rng(children[STREAM_TOKENS])
        self.prefix = np.random.default_rng(children[STREAM_PREFIX]).integers(
            0, vocab_size, cfg.shared_prefix_tokens, dtype=np.int32)
        self._session_seq = children[STREAM_SESSIONS]
        self.next_id = 0

    def new_id(self) -> int:
        rid = self.next_id
        self.next_id += 1
        return rid

    def tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(0, self.vocab, n, dtype=np.int32)

    def output_len(self, rng: np.random.Generator) -> tuple[int, int | None]:
        out = int(self.cfg.output_tokens.sample_int(rng))
        cap = self.cfg.client_max_tokens
        return (min(out, cap), cap) if cap else (out, None)

    def make(self, arrival_s: float, prompt: np.ndarray, output_len: int, max_tokens: int | None,
             rng: np.random.Generator, **kw) -> Request:
        token_ids = np.concatenate([prompt, self.tokens(rng, output_len)])
        return Request(self.new_id(), arrival_s, token_ids, len(prompt), output_len, max_tokens=max_tokens, **kw)

    # ---- open loop ------------------------------------------------------------------------------------
    def open_loop(self, horizon_s: float, chunk: int = 4096) -> Iterator[Request]:
        """Requests in arrival order until the horizon or num_requests (generated lazily, in chunks)."""
        cfg = self.cfg
        limit = cfg.num_requests if cfg.num_requests is not None else float("inf")
        t, made = 0.0, 0
        while made < limit:
            n = int(min(chunk, limit - made))
            times = t + np.cumsum(arrival_gaps(cfg.arrival, self.rng_arrivals, n))
            ins = cfg.input_tokens.sample_int(self.rng_lengths, n)
            for i in range(n):
                if times[i] > horizon_s:
                    return
                yield self.closed_loop_request(float(times[i]), int(ins[i]))
                made += 1
            t = float(times[-1])

    def closed_loop_request(self, now: float, input_len: int | None = None) -> Request:
        """One request of the plain (non-session) workload arriving at `now`."""
        if input_len is None:
            input_len = int(self.cfg.input_tokens.sample_int(self.rng_lengths))
        rng = self.rng_tokens
        own = max(1, input_len - len(self.prefix))
        prompt = np.concatenate([self.prefix, self.tokens(rng, own)]) if len(self.prefix) else self.tokens(rng, own)
        out, cap = self.output_len(self.rng_lengths)
        return self.make(now, prompt, out, cap, rng)

    # ---- sessions ---------------------------------------------------------------------------------------
    def session(self, index: int) -> SessionPlan:
        """A session's deterministic plan: turn count, user-token and output lengths, think times."""
        s = self.cfg.sessions
        rng = np.random.default_rng(np.random.SeedSequence(self._session_seq.entropy,
                                                           spawn_key=(STREAM_SESSIONS, index)))
        turns = int(s.turns.sample_int(rng))
        return SessionPlan(index=index, rng=rng, turns=turns,
                           start_offset_s=float(rng.uniform(0, s.start_spread_s)) if s.start_spread_s else 0.0)

    def session_turn(self, plan: SessionPlan, now: float, previous: Request | None) -> Request:
        """The next turn: previous prompt + previous output + new user/tool tokens."""
        s = self.cfg.sessions
        rng = plan.rng
        user = self.tokens(rng, int(s.user_tokens.sample_int(rng)))
        if previous is None:
            prompt = np.concatenate([self.prefix, user])
        else:
            context = previous.token_ids[:previous.prompt_len + previous.output_len]
            prompt = np.concatenate([context, user])
        out, cap = self.output_len(rng)
        return self.make(now, prompt, out, cap, rng, session_id=plan.index, turn=plan.turn)

    def think_time(self, plan: SessionPlan) -> float:
        return float(max(0.0, self.cfg.sessions.think_time_s.sample(plan.rng)))


@dataclass
class SessionPlan:
    index: int
    rng: np.random.Generator
    turns: int
    start_offset_s: float
    turn: int = 0
