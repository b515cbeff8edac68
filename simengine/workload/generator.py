"""Turn a workload description into Requests with token-id prompts (so prefix caching works by content).

Every random stream is a child of the scenario seed with a fixed role, so each engine sees the identical
request stream; a session's content depends only on its index, never on timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simengine.config.hardware import REPO_ROOT
from simengine.core.request import Request
from simengine.errors import InputError
from simengine.kvcache.hashing import HashBatch
from simengine.workload.arrivals import arrival_times
from simengine.workload.config import RequestClass, TraceConfig, WorkloadConfig

STREAM_ARRIVALS, STREAM_LENGTHS, STREAM_TOKENS, STREAM_PREFIX, STREAM_SESSIONS, STREAM_TRACE = range(6)
HASH_BATCH = 512  # open-loop requests made and hashed together: the per-pass overhead is spread, memory stays small
TOKEN_BLOCK = 1 << 20   # token ids drawn ahead at most (4 MiB)
LENGTH_BLOCK = 512  # plain requests whose lengths are drawn in one numpy call (the values one call each would draw)


@dataclass
class SessionPlan:
    """A session's deterministic random stream and progress."""

    index: int
    rng: np.random.Generator
    turns: int
    start_offset_s: float
    klass: RequestClass | None
    turn: int = 0
    lora: tuple[int, int] = (-1, 0)   # the session's LoRA adapter and its rank (every turn names it)



def zipf_p(n: int, s: float) -> np.ndarray:
    """P(item k) proportional to 1 / k**s, k = 1..n (a steep s sends the far tail to 0, quietly)."""
    with np.errstate(over="ignore"):
        w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()

class RequestFactory:
    """Builds Requests with deterministic token content from the scenario seed."""

    # Simulation speed, not workload: mark the fresh draws of requests without a next turn private, so the paged KV
    # manager never hashes or publishes blocks nobody else can look up. Same results either way
    # (tests/engines/test_fast_paths.py).
    mark_private: bool = True

    def __init__(self, cfg: WorkloadConfig, seed: int, vocab_size: int, max_model_len: int, *, exact: bool = False):
        self.cfg = cfg
        if exact:   # Scenario.exact: no speed devices, private tokens included
            self.mark_private = False
        self.vocab = vocab_size
        self.max_model_len = max_model_len
        children = np.random.SeedSequence(seed).spawn(6)
        self.rng_arrivals = np.random.default_rng(children[STREAM_ARRIVALS])
        self.rng_lengths = np.random.default_rng(children[STREAM_LENGTHS])
        self.rng_tokens = np.random.default_rng(children[STREAM_TOKENS])
        # `tokens`: rng_tokens' ids drawn ahead, unless a structured-output coin draws from the same stream
        self._draw_ahead = not cfg.structured_output.fraction
        self._token_pool, self._token_at, self._token_block = np.zeros(0, dtype=np.int32), 0, 1 << 12
        self.prefix = np.random.default_rng(children[STREAM_PREFIX]).integers(
            0, vocab_size, cfg.shared_prefix_tokens, dtype=np.int32)
        self._session_entropy = children[STREAM_SESSIONS].entropy
        self._trace_rng = np.random.default_rng(children[STREAM_TRACE])
        self.documents: list[np.ndarray] = []
        self._doc_p = None
        if cfg.documents is not None:
            drng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(99,)))
            d = cfg.documents
            self.documents = [self.tokens(drng, int(d.tokens.sample_int(drng))) for _ in range(d.count)]
            self._doc_p = zipf_p(d.count, d.zipf_s)
        # prompt_groups: the prompts (group, question, output length) in pool order and shuffled, each group's
        # system prompt; multi_turn: the user of slot k (shuffled) and each user's conversation so far
        self._questions: list[tuple[int, np.ndarray, int]] = []
        self._pool: list[tuple[int, np.ndarray, int]] = []
        self._pool_prefixes: list[np.ndarray] = []
        self._users: list[int] = []
        self._contexts: list[np.ndarray] = []
        self.pool_next = 0   # the next request's index into the pool (the runner sets 0 at each stage's start)
        if cfg.prompt_groups is not None:
            self._make_pool(np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(97,))))
        self._lora_p = None
        if cfg.lora is not None:   # a stream of its own: the other draws are those of the same workload without it
            self.rng_lora = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(98,)))
            self._lora_p = zipf_p(cfg.lora.adapters, cfg.lora.zipf_s)
        weights = np.array([c.weight for c in cfg.classes], dtype=float)
        self._class_p = weights / weights.sum() if len(weights) else None
        self.next_id = 0
        # plain requests' (input, output) lengths drawn ahead, next last; drawn LENGTH_BLOCK at a time where the
        # lengths are rng_lengths' only draws for a plain request (no classes, no documents) and both come from
        # one numpy method (or a constant): `_draw_lengths`
        self._lengths: list[tuple[int, int]] = []
        families = [cfg.input_tokens.draw_family(), cfg.output_tokens.draw_family()]
        methods = {f[0] for f in families if f is not None} - {"constant"}
        self._block_lengths = (self._class_p is None and cfg.documents is None and None not in families
                               and len(methods) <= 1)

    # ---- pieces ---------------------------------------------------------------------------------------
    def new_id(self) -> int:
        rid = self.next_id
        self.next_id += 1
        return rid

    def tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n token ids drawn from `rng`. From `rng_tokens`, where nothing else draws from it (no structured-output
        coin), they are copied out of blocks drawn ahead: a stream's consecutive integer draws are the values one
        draw of their total gives (tests/workload/test_generator.py), and one numpy call a request costs more than
        its tokens. A copy, not a view: prompt caches keep slices of token arrays, which must not hold a block."""
        if rng is not self.rng_tokens or not self._draw_ahead:
            return rng.integers(0, self.vocab, n, dtype=np.int32)
        pool, at = self._token_pool, self._token_at
        if at + n > len(pool):   # the rest of the block, then a new one (each twice the last, up to TOKEN_BLOCK)
            self._token_block = min(2 * self._token_block, TOKEN_BLOCK)
            more = rng.integers(0, self.vocab, max(self._token_block, n - (len(pool) - at)), dtype=np.int32)
            pool, at = np.concatenate([pool[at:], more]), 0
            self._token_pool = pool
        self._token_at = at + n
        return pool[at:at + n].copy()

    def _make_pool(self, rng: np.random.Generator) -> None:
        """prompt_groups' prompts: each group's system prompt, then its prompts' questions and output lengths drawn
        once (shared_prefix_datagen.py draws each group's lengths, then its tokens), the whole pool shuffled."""
        pg = self.cfg.prompt_groups
        assert pg is not None
        pool = []
        for g in range(pg.groups):
            self._pool_prefixes.append(self.tokens(rng, pg.prefix_tokens))
            for _ in range(pg.prompts_per_group):
                n_in, n_out, _ = self.lengths(rng, None)
                pool.append((g, self.tokens(rng, n_in), n_out))
        order = rng.permutation(len(pool)).tolist()
        self._questions, self._pool = pool, [pool[i] for i in order]
        self._users = order   # multi_turn: questions in pool order, users shuffled (user u starts as group u's prompt)
        self._contexts = [self._pool_prefixes[g] for g, _, _ in pool]

    def pool_request(self, now: float) -> Request:
        """The next prompt of the prompt_groups pool (its index counts on from `pool_next`, modulo the pool)."""
        group, question, n_out = self._pool[self.pool_next % len(self._pool)]
        self.pool_next += 1
        head = np.concatenate([self._pool_prefixes[group], question])
        return self.make(now, head, len(head), n_out, self.cfg.client_max_tokens, self.rng_tokens, None,
                         private=False)   # whole prompts come again: nothing is private

    @property
    def pool_multi_turn(self) -> bool:
        return bool(self._pool) and bool(self.cfg.prompt_groups and self.cfg.prompt_groups.multi_turn)

    def pool_turn_slot(self) -> tuple[int, int]:
        """(user, question) of the next multi-turn request: both its index modulo the pool (users in the shuffled
        order, questions in pool order, as shared_prefix_datagen.py shuffles only the user sessions)."""
        k = self.pool_next % len(self._pool)
        self.pool_next += 1
        return self._users[k], k

    def pool_turn(self, now: float, user: int, question: int) -> Request:
        """A multi-turn request: the user's conversation so far, then the question (and its output length)."""
        _, tokens, n_out = self._questions[question]
        head = np.concatenate([self._contexts[user], tokens])
        return self.make(now, head, len(head), n_out, self.cfg.client_max_tokens, self.rng_tokens, None,
                         private=False)

    def pool_turn_done(self, user: int, req: Request) -> None:
        """The user's conversation after `req`: its prompt and the output it got (unchanged if it failed)."""
        if req.num_output_tokens:
            self._contexts[user] = req.token_ids[:req.prompt_len + req.num_output_tokens]

    def pick_adapter(self, rng: np.random.Generator) -> tuple[int, int]:
        """(LoRA adapter, its rank) for a request or session; (-1, 0) for the base model."""
        lora = self.cfg.lora
        if lora is None or (lora.fraction < 1.0 and rng.uniform() >= lora.fraction):
            return -1, 0
        k = int(rng.choice(lora.adapters, p=self._lora_p))
        return k, lora.ranks[k % len(lora.ranks)]

    def pick_class(self, rng: np.random.Generator) -> RequestClass | None:
        if self._class_p is None:
            return None
        return self.cfg.classes[int(rng.choice(len(self._class_p), p=self._class_p))]

    def lengths(self, rng: np.random.Generator, klass: RequestClass | None) -> tuple[int, int, int | None]:
        """(input tokens, output tokens, client max_tokens) for one request."""
        ins = (klass.input_tokens if klass and klass.input_tokens else self.cfg.input_tokens)
        outs = (klass.output_tokens if klass and klass.output_tokens else self.cfg.output_tokens)
        n_in = int(ins.sample_int(rng))
        n_out = int(outs.sample_int(rng))
        cap = self.cfg.client_max_tokens
        return n_in, (min(n_out, cap) if cap else n_out), cap

    def make(self, arrival_s: float, head: np.ndarray, prompt_len: int, output_len: int, max_tokens: int | None,
             rng: np.random.Generator, klass: RequestClass | None, *, private: bool, **kw) -> Request:
        """A request whose prompt is `head` and then fresh tokens up to `prompt_len`; its output is fresh too (one
        draw from `rng` for both). `private`: no later request will contain its fresh tokens (it has no next turn),
        so they are marked private (Request.private_from) when `mark_private` is on."""
        fresh = self.tokens(rng, prompt_len - len(head) + output_len)
        token_ids = np.concatenate([head, fresh]) if len(head) else fresh
        structured = bool(self.cfg.structured_output.fraction
                          and rng.uniform() < self.cfg.structured_output.fraction)
        if self._lora_p is not None and "lora_id" not in kw:
            kw["lora_id"], kw["lora_rank"] = self.pick_adapter(self.rng_lora)
        return Request(self.new_id(), arrival_s, token_ids, prompt_len, output_len, max_tokens=max_tokens,
                       priority=klass.priority if klass else 0, slo_class=klass.name if klass else "",
                       structured=structured, unique_outputs=True,  # fresh draws; a next turn comes after
                       private_from=len(head) if private and self.mark_private else None, **kw)

    # ---- open loop ------------------------------------------------------------------------------------
    def open_loop(self, horizon_s: float, chunk: int = 4096) -> Iterator[Request]:
        """Requests in arrival order until the horizon or num_requests (generated lazily, in chunks)."""
        if self.cfg.trace is not None:
            yield from self._trace_requests(horizon_s)
            return
        cfg = self.cfg
        limit = cfg.num_requests if cfg.num_requests is not None else float("inf")
        t, made = 0.0, 0
        while made < limit:
            n = int(min(chunk, limit - made))
            times = arrival_times(cfg.arrival, self.rng_arrivals, n, t)
            within = n if times[-1] <= horizon_s else int(np.searchsorted(times, horizon_s, side="right"))
            arrivals = times[:within].tolist()
            for lo in range(0, within, HASH_BATCH):  # made together, hashed in one pass on first need
                group = [self.plain_request(a) for a in arrivals[lo:lo + HASH_BATCH]]
                hashing = HashBatch([req.token_ids for req in group])
                for index, req in enumerate(group):
                    req.hash_batch = (hashing, index)
                yield from group
            if within < n:
                return
            made += n
            t = float(times[-1])

    def _draw_lengths(self, n: int) -> list[tuple[int, int]]:
        """The next n plain requests' (input, output) lengths, last first: one numpy call whose parameters alternate
        input, output, so it draws what `lengths` would, request by request (tests/workload/test_generator.py)."""
        ins, outs = self.cfg.input_tokens, self.cfg.output_tokens
        (f_in, p_in), (f_out, p_out) = ins.draw_family(), outs.draw_family()  # type: ignore[misc]
        rng = self.rng_lengths
        if f_in == f_out == "constant":
            x_in, x_out = np.full(n, float(ins.value)), np.full(n, float(outs.value))  # type: ignore[arg-type]
        elif f_out == "constant":
            x_in, x_out = getattr(rng, f_in)(*p_in, n), np.full(n, float(outs.value))  # type: ignore[arg-type]
        elif f_in == "constant":
            x_in, x_out = np.full(n, float(ins.value)), getattr(rng, f_out)(*p_out, n)  # type: ignore[arg-type]
        else:
            x = getattr(rng, f_in)(*(np.tile((a, b), n) for a, b in zip(p_in, p_out, strict=True)))
            x_in, x_out = x[0::2], x[1::2]
        drawn = zip(ins.to_int(ins.clip(x_in), n).tolist(), outs.to_int(outs.clip(x_out), n).tolist(), strict=True)
        return list(drawn)[::-1]

    def plain_request(self, now: float) -> Request:
        """One request of the plain (non-session) workload arriving at `now`."""
        if self._pool:
            return self.pool_request(now)
        rng = self.rng_lengths
        if self._block_lengths:
            if not self._lengths:
                self._lengths = self._draw_lengths(LENGTH_BLOCK)
            klass, (n_in, n_out), cap = None, self._lengths.pop(), self.cfg.client_max_tokens
            if cap:
                n_out = min(n_out, cap)
        else:
            klass = self.pick_class(rng)
            n_in, n_out, cap = self.lengths(rng, klass)
        if self.documents:  # RAG: the question's length is input_tokens; the document comes on top
            doc = self.documents[int(rng.choice(len(self.documents), p=self._doc_p))]
            head = np.concatenate([self.prefix, doc])
            return self.make(now, head, len(head) + n_in, n_out, cap, self.rng_tokens, klass, private=True)
        return self.make(now, self.prefix, len(self.prefix) + max(1, n_in - len(self.prefix)), n_out, cap,
                         self.rng_tokens, klass, private=True)

    # ---- traces ---------------------------------------------------------------------------------------
    def _trace_requests(self, horizon_s: float) -> Iterator[Request]:
        from simengine.workload.traces import ReplayOptions, prompt_token_ids_from_hash_ids, read_trace

        tc = self.cfg.trace
        assert tc is not None, "a trace workload without its trace"
        path = resolve_trace_path(tc)
        opts = ReplayOptions(start_s=tc.start_s, end_s=tc.end_s, time_scale=tc.time_scale, rate_scale=tc.rate_scale,
                             max_requests=tc.max_requests or self.cfg.num_requests)
        trace = read_trace(tc.kind, path, opts, rng=self._trace_rng)
        arrivals = trace.arrival_s
        if tc.kind == "sharegpt":  # no timestamps in ShareGPT: the workload's arrival process assigns them
            arrivals = arrival_times(self.cfg.arrival, self.rng_arrivals, len(trace), 0.0)
        rng = self.rng_tokens
        for i in range(len(trace)):
            t = float(arrivals[i])
            if t > horizon_s:
                return
            n_in, n_out = int(trace.input_tokens[i]), int(trace.output_tokens[i])
            if trace.block_hash_ids is not None:
                prompt = prompt_token_ids_from_hash_ids(trace.block_hash_ids[i], n_in, trace.hash_block_tokens)
                prompt = prompt.astype(np.int32, copy=False)
            else:
                prompt = self.tokens(rng, n_in)
            klass = self.pick_class(self.rng_lengths)
            yield self.make(t, prompt, len(prompt), n_out, self.cfg.client_max_tokens, rng, klass, private=True)

    # ---- sessions ---------------------------------------------------------------------------------------
    def session(self, index: int) -> SessionPlan:
        """A session's deterministic plan: its own random stream, turn count, start offset and class."""
        s = self.cfg.sessions
        assert s is not None, "a session plan without sessions"
        rng = np.random.default_rng(np.random.SeedSequence(self._session_entropy, spawn_key=(index,)))
        turns = int(s.turns.sample_int(rng))
        offset = float(rng.uniform(0, s.start_spread_s)) if s.start_spread_s else 0.0
        plan = SessionPlan(index=index, rng=rng, turns=turns, start_offset_s=offset, klass=self.pick_class(rng))
        if self._lora_p is not None:
            plan.lora = self.pick_adapter(rng)
        return plan

    def session_turn(self, plan: SessionPlan, now: float, previous: Request | None) -> Request:
        """The next turn: previous prompt + previous output + new user/tool tokens."""
        s = self.cfg.sessions
        assert s is not None, "a session turn without sessions"
        rng = plan.rng
        user = self.tokens(rng, int(s.user_tokens.sample_int(rng)))
        _, n_out, cap = self.lengths(rng, plan.klass)
        if previous is None:
            prompt = np.concatenate([self.prefix, user])
        else:
            context = previous.token_ids[:previous.prompt_len + previous.output_len]
            prompt = np.concatenate([context, user])
            if s.context_overflow == "truncate":
                prompt = self._truncate(prompt, n_out)
        return self.make(now, prompt, len(prompt), n_out, cap, rng, plan.klass, private=False,
                         session_id=plan.index, turn=plan.turn, lora_id=plan.lora[0], lora_rank=plan.lora[1])

    def _truncate(self, prompt: np.ndarray, n_out: int) -> np.ndarray:
        """Drop the oldest conversation tokens after the shared prefix so prompt + output fit the context."""
        room = self.max_model_len - n_out
        if len(prompt) <= room:
            return prompt
        keep_head = min(len(self.prefix), max(room // 2, 0))
        tail = max(room - keep_head, 1)
        return np.concatenate([prompt[:keep_head], prompt[-tail:]])

    def think_time(self, plan: SessionPlan) -> float:
        assert self.cfg.sessions is not None
        return max(0.0, float(self.cfg.sessions.think_time_s.sample(plan.rng)))

    def session_start_times(self, horizon_s: float) -> Iterator[float]:
        """Open session arrivals (Poisson at sessions.arrival_rate) up to the horizon."""
        assert self.cfg.sessions is not None and self.cfg.sessions.arrival_rate is not None
        rate = self.cfg.sessions.arrival_rate
        t = 0.0
        while True:
            t += float(self.rng_arrivals.exponential(1.0 / rate))
            if t > horizon_s:
                return
            yield t


def resolve_trace_path(tc: TraceConfig) -> Path:
    p = Path(tc.path)
    if not p.is_absolute():
        p = (REPO_ROOT / p).resolve()
    if not p.exists():
        raise InputError(f"trace file not found: {p}; trace scenarios read ../shared/data/traces/ beside the repo "
                         f"by default: put the file there or set workload.trace.path", field="workload.trace.path")
    return p
