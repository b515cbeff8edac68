"""SGLang's schedule policy (srt/managers/schedule_policy.py, 0.5.23): the waiting queue's order and the PrefillAdder
that admits into one prefill batch. The scheduler that uses them is engines/sglang.py.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from simengine.core.request import Request
from simengine.kvcache.host_tier import TokenHostTier
from simengine.kvcache.radix import RadixCache, RadixHold, radix_tokens

CLIP_MAX_NEW_TOKENS = 4096          # schedule_policy.py SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
LPM_QUEUE_LIMIT = 128               # schedule_policy.py _determine_active_policy: lpm -> fcfs above this
IN_BATCH_PREFIX_THRESHOLD = 32      # schedule_policy.py IN_BATCH_PREFIX_CACHING_{CHECK,DEPRIORITIZE}_THRESHOLD


def reserve_tokens(req: Request) -> int:
    """The decode growth the adder reserves for a request: its outputs still to come, clipped."""
    return min(max(req.max_tokens - req.num_output_tokens, 0), CLIP_MAX_NEW_TOKENS)


def reserved_tokens(running: list[Request]) -> int:
    """`reserve_tokens` summed over the running batch (inline: it runs for every request at every prefill attempt)."""
    clip = CLIP_MAX_NEW_TOKENS
    return sum(min(max(r.max_tokens - r.num_output_tokens, 0), clip) for r in running)


class AddResult(Enum):
    CONTINUE = 0
    NO_TOKEN = 1
    OTHER = 2


class PrefillAdder:
    """PrefillAdder: the budgets of one prefill batch. `offset` holds the reserved tokens (the running decodes' growth
    x new_token_ratio, then this batch's admissions); a request is admitted while free + evictable - offset covers its
    prompt, its growth and a page. Admitted requests hold their radix prefix (in `holds`, by request id)."""

    def __init__(self, cache: RadixCache, host: TokenHostTier | None, holds: dict[int, RadixHold], rem_input: int,
                 rem_chunk: int | None, offset: float):
        self.cache, self.host, self.holds = cache, host, holds
        self.rem_input = rem_input
        self.rem_chunk = rem_chunk       # None: chunked prefill off
        self.offset = offset
        self.count = 0
        self.admitted: list[tuple[Request, int]] = []
        self.loading_back: dict[int, int] = {}   # request id -> host tokens its admission loads back

    def rem_total(self) -> float:   # free + evictable - reserved
        return self.cache.available() - self.offset

    def add_chunked(self, req: Request) -> None:
        """The request in the middle of a chunked prefill goes first, with what the budgets leave."""
        rem = int(self.rem_total())
        if self.rem_chunk is not None:
            rem = min(rem, self.rem_chunk)
        n = min(req.num_new_tokens, rem)
        if n <= 0:
            return
        whole = n == req.num_new_tokens
        self._charge(n, reserve_tokens(req) if whole else 0)
        self.admitted.append((req, n))

    def add_one(self, req: Request) -> AddResult:
        """add_one_req: lock its prefix, then admit it whole, or its first chunk, if the budgets hold it."""
        cache = self.cache
        hold = cache.acquire(radix_tokens(req), req.num_tokens - 1)   # locks the prefix (_lock_node)
        host = self.host.hit(req, hold.cached) if self.host is not None else 0
        extend = req.num_tokens - hold.cached - host
        page = cache.page
        if extend + host + reserve_tokens(req) + page >= self.rem_total():
            cache.release(hold)
            return AddResult.NO_TOKEN
        tokens = -(-extend // page) * page
        if tokens >= self.rem_input and self.count:
            cache.release(hold)
            return AddResult.OTHER
        if self.rem_chunk is None or tokens <= self.rem_chunk:
            n, reserve = extend, reserve_tokens(req)
        else:
            n, reserve = self.rem_chunk // page * page, 0
            if n <= 0:
                cache.release(hold)
                return AddResult.OTHER
        self.holds[req.request_id] = hold
        req.num_computed_tokens = hold.cached + host
        self._charge(n, reserve)
        if host:   # load_back: device slots for the host tokens, copied in layer by layer during the forward
            self.offset += host
            self.loading_back[req.request_id] = host
        self.admitted.append((req, n))
        return self._state()

    def _charge(self, n: int, reserve: int) -> None:
        self.offset += n + reserve
        self.rem_input -= n
        if self.rem_chunk is not None:
            self.rem_chunk -= n
        self.count += 1

    def _state(self) -> AddResult:
        if self.rem_total() <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE


def order_waiting(policy: str, q: list[Request], cache: RadixCache, priority_key: Callable[[Request], tuple] | None
                  ) -> list[Request]:
    """SchedulePolicy.calc_priority: the waiting queue in `policy` order (fcfs keeps arrival order, or sorts by
    `priority_key` with priority scheduling on); lpm falls back to fcfs on a long queue."""
    if policy == "fcfs":
        if priority_key is not None:
            q.sort(key=priority_key)
    elif policy == "lof":
        q.sort(key=lambda r: -r.max_tokens)
    elif policy == "lpm" and len(q) <= LPM_QUEUE_LIMIT:
        _sort_lpm(q, cache)
    elif policy == "dfs-weight":
        nodes = [cache.match_prefix(radix_tokens(r), r.num_tokens - 1)[1] for r in q]
        return [q[i] for i in cache.dfs_weight_order(nodes)]
    return q


def _sort_lpm(q: list[Request], cache: RadixCache) -> None:
    """Longest prefix match first; a request with a short tree match whose prompt already matches another waiting
    request is deferred, so one of a group sharing a new prefix goes first (in-batch caching)."""
    in_batch = RadixCache(1 << 62)
    matched: dict[int, float] = {}
    for r in q:
        key = radix_tokens(r)
        m = cache.match_prefix(key, r.num_tokens - 1)[0]
        matched[id(r)] = -m
        if m <= IN_BATCH_PREFIX_THRESHOLD:
            tokens = key[:r.num_tokens]
            if in_batch.match_prefix(tokens)[0] >= IN_BATCH_PREFIX_THRESHOLD:
                matched[id(r)] = float("inf")
            else:
                in_batch.alloc(len(tokens))
                in_batch.insert(tokens)
    q.sort(key=lambda r: matched[id(r)])
