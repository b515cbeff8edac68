"""The workload section of a scenario: arrivals, lengths, sessions, request classes, structured output, traces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from simengine.config.loader import MAX_TOKENS, Checked, Range, Share, Tokens
from simengine.config.slo import SloConfig
from simengine.errors import InputError
from simengine.workload.arrivals import MAX_USERS, ArrivalConfig, Rate
from simengine.workload.distributions import Dist, TokenDist

MAX_REQUESTS = 100_000_000      # one run's requests; the simulator does ~1e5 req/s at best
Seconds = Annotated[float, Range(0, 1e9, unit="seconds")]


@dataclass(frozen=True, kw_only=True)
class SessionConfig(Checked):
    """Multi-turn chat or agent sessions: each turn's prompt is the whole conversation so far.

    Give `population` (that many sessions alive at once; a finished one is replaced until the horizon) or
    `arrival_rate` (new sessions per second, Poisson; each runs its turns then leaves).
    """

    population: Annotated[int, Range(1, MAX_USERS)] | None = None
    arrival_rate: Rate | None = None
    turns: Dist = field(default_factory=lambda: Dist(dist="uniform", low=3, high=8))
    think_time_s: Dist = field(default_factory=lambda: Dist(dist="lognormal", mean=4.0, sigma=0.6))
    user_tokens: TokenDist = field(default_factory=lambda: TokenDist(dist="lognormal", mean=180, sigma=0.7))
    start_spread_s: Seconds = 10.0        # population mode: first turns start uniformly over [0, start_spread_s]
    context_overflow: Literal["reject", "truncate"] = "reject"  # what the client does when context outgrows the model

    def __post_init__(self):
        super().__post_init__()
        if (self.population is None) == (self.arrival_rate is None):
            raise InputError("give exactly one of population or arrival_rate", field="workload.sessions")


@dataclass(frozen=True, kw_only=True)
class RequestClass(Checked):
    """A traffic class: its share of requests, its priority (lower is served first) and its own SLOs."""

    name: str
    weight: Annotated[float, Range(0, 1e6, above=True)] = 1.0
    priority: Annotated[int, Range(-1_000_000, 1_000_000)] = 0
    slo: SloConfig = field(default_factory=SloConfig)
    input_tokens: TokenDist | None = None      # overrides the workload's distributions for this class
    output_tokens: TokenDist | None = None


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
class StructuredOutputConfig(Checked):
    """A fraction of requests ask for JSON-schema constrained decoding through `backend`."""

    fraction: Share = 0.0
    backend: Literal["xgrammar", "outlines", "llguidance"] = "xgrammar"
    compile_ms: Annotated[float, Range(0, 1e7)] | None = None       # override the backend's compile time
    mask_us_per_token: Annotated[float, Range(0, 1e6)] | None = None  # override the backend's per-token mask cost

    @property
    def compile_s(self) -> float:
        return (self.compile_ms if self.compile_ms is not None else STRUCTURED_BACKENDS[self.backend][0]) / 1e3

    @property
    def mask_s(self) -> float:
        us = self.mask_us_per_token if self.mask_us_per_token is not None else STRUCTURED_BACKENDS[self.backend][1]
        return us / 1e6


@dataclass(frozen=True, kw_only=True)
class TraceConfig(Checked):
    """Replay a real trace (see docs/traces.md). `path` is relative to the repo root unless absolute."""

    kind: Literal["azure", "mooncake", "burstgpt", "sharegpt"]
    path: str
    start_s: Seconds = 0.0
    end_s: Annotated[float, Range(0, 1e9, above=True)] | None = None
    time_scale: Annotated[float, Range(0, 1e6, above=True)] = 1.0
    rate_scale: Annotated[float, Range(0, 1e6, above=True)] = 1.0
    max_requests: Annotated[int, Range(1, MAX_REQUESTS)] | None = None


@dataclass(frozen=True, kw_only=True)
class DocumentPool(Checked):
    """Shared long documents (RAG): each request's prompt is [shared prefix] + one document + its own question.
    Documents are picked with Zipf-like popularity: P(doc k) proportional to 1 / k**zipf_s (0 = uniform)."""

    count: Annotated[int, Range(1, 100_000)]
    tokens: TokenDist
    zipf_s: Annotated[float, Range(0, 100)] = 1.0


@dataclass(frozen=True, kw_only=True)
class PromptGroups(Checked):
    """A fixed pool of prompts in groups that share a system prompt, as inference-perf's shared_prefix data makes
    them (kubernetes-sigs/inference-perf datagen/shared_prefix_datagen.py): `groups` system prompts of
    `prefix_tokens` random tokens, each the head of `prompts_per_group` prompts whose question has input_tokens
    tokens; each prompt's question and output lengths are drawn once. The pool is shuffled once, and request k
    sends prompt k mod the pool's size (k counts from each stage's first request under staged arrivals, as
    inference-perf numbers a stage's requests from 0), so once the pool is used up whole prompts come again.
    `multi_turn`: inference-perf's multi-turn chat instead (below); its conversations go on across stages."""

    groups: Annotated[int, Range(1, 1_000_000)]
    prompts_per_group: Annotated[int, Range(1, 1_000_000)]
    prefix_tokens: Annotated[int, Range(0, MAX_TOKENS)]
    # enable_multi_turn_chat: one user a prompt, whose conversation starts as its group's system prompt; request k
    # asks question k mod the pool's size (questions in pool order) of user k mod the pool's size (users shuffled),
    # after that user's previous request has finished, with the whole conversation so far before the question
    # (apis/user_session.py: the prompt is context + question, the context after it prompt + response)
    multi_turn: bool = False


@dataclass(frozen=True, kw_only=True)
class LoraAdapters(Checked):
    """Multi-LoRA traffic: requests name one of `adapters` LoRA adapters of the served model, adapter k (from 0) with
    probability proportional to 1 / (k + 1)**zipf_s; adapter k has rank ranks[k % len(ranks)]. A share
    1 - `fraction` of requests uses the base model. A session keeps its adapter (one tenant) for every turn."""

    adapters: Annotated[int, Range(1, 1_000_000)]
    zipf_s: Annotated[float, Range(0, 100)] = 1.0
    ranks: list[Annotated[int, Range(1, 1024)]] = field(default_factory=lambda: [16])
    fraction: Annotated[float, Range(0, 1)] = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not self.ranks:
            raise InputError("give at least one adapter rank, e.g. ranks: [16]", field="workload.lora.ranks")


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig(Checked):
    """Requests: open-loop arrivals (or closed-loop users), length distributions, shared prefix, sessions,
    classes, structured output, or a trace."""

    arrival: ArrivalConfig = field(default_factory=lambda: ArrivalConfig(process="poisson", rate=1.0))
    num_requests: Annotated[int, Range(1, MAX_REQUESTS)] | None = None  # open loop: stop after this many
    input_tokens: TokenDist = field(default_factory=lambda: TokenDist(dist="lognormal", mean=1000, sigma=0.6,
                                                                      max=8000))
    output_tokens: TokenDist = field(default_factory=lambda: TokenDist(dist="lognormal", mean=250, sigma=0.7,
                                                                       max=2048))
    shared_prefix_tokens: Annotated[int, Range(0, MAX_TOKENS)] = 0  # identical system prompt at the head of prompts
    client_max_tokens: Tokens | None = None  # max_tokens the client sends; None = exactly the output length
    # the client sends token ids, not text (an engine API, or a benchmark that tokenises beforehand: trtllm-bench,
    # LMDeploy's profile scripts, MLPerf's LoadGen): the serving frontend has nothing to tokenise
    prompt_token_ids: bool = False
    sessions: SessionConfig | None = None
    documents: DocumentPool | None = None  # RAG: prompts = prefix + a shared document + input_tokens of question
    prompt_groups: PromptGroups | None = None  # a fixed pool of prompts sharing group system prompts, cycled
    classes: list[RequestClass] = field(default_factory=list)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    trace: TraceConfig | None = None
    lora: LoraAdapters | None = None  # multi-LoRA serving: which adapter each request names

    def __post_init__(self):
        super().__post_init__()
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise InputError("class names must be unique", field="workload.classes")
        if self.trace is not None and self.sessions is not None:
            raise InputError("a trace replay and sessions cannot be combined; remove one", field="workload.trace")
        if self.prompt_groups is not None:
            other = [k for k, v in (("trace", self.trace), ("sessions", self.sessions), ("documents", self.documents),
                                    ("classes", self.classes), ("lora", self.lora),
                                    ("shared_prefix_tokens", self.shared_prefix_tokens),
                                    ("structured_output", self.structured_output.fraction)) if v]
            if other:
                raise InputError(f"prompt_groups makes every prompt itself; remove {', '.join(other)} (or "
                                 "prompt_groups)", field="workload.prompt_groups")
            if self.prompt_groups.multi_turn and self.arrival.process == "closed_loop":
                raise InputError("multi_turn prompt groups run open-loop or staged arrivals, not closed_loop",
                                 field="workload.prompt_groups.multi_turn")
        if self.arrival.process == "stages" and self.num_requests is not None:
            raise InputError("the stages set the request count (int(rate x duration_s) each); remove "
                             "workload.num_requests", field="workload.num_requests")
        if self.arrival.process == "stages" and (self.sessions is not None or self.trace is not None):
            raise InputError("staged arrivals send plain requests; remove workload.sessions / workload.trace",
                             field="workload.arrival.process")


def shortest_prompt(cfg: WorkloadConfig) -> int | None:
    """Tokens no prompt falls below (the shared prefix counted): a plain stream's, a RAG stream's (prefix, the
    shortest document and question) or a session's first turn (prefix and user tokens; later turns only grow);
    None where prompts come from a trace or prompt groups (those are checked request by request at admission)."""
    if cfg.trace is not None or cfg.prompt_groups:
        return None

    def low(d: TokenDist) -> int:
        return max(round(max(d.lowest(), 0.0)), 1)   # sample_int: rounded, at least 1

    if cfg.sessions is not None:   # generator.session_turn: the first turn is the prefix and the user's tokens
        return cfg.shared_prefix_tokens + low(cfg.sessions.user_tokens)
    question = min(low(c.input_tokens or cfg.input_tokens) for c in cfg.classes) if cfg.classes else \
        low(cfg.input_tokens)
    if cfg.documents is not None:   # generator.py: prefix + document + a question of input_tokens
        return cfg.shared_prefix_tokens + low(cfg.documents.tokens) + question
    return max(cfg.shared_prefix_tokens + 1, question)   # generator.py: the prefix heads the input tokens
