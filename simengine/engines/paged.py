"""Queue and KV views shared by engines: a paged KV manager with running and waiting lists (vLLM, Sarathi-Serve,
TensorRT-LLM, Orca, the generic engine), or a token radix cache (SGLang, TGI)."""

from __future__ import annotations

from typing import Any

from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.engines.base import EnginePolicy
from simengine.kvcache.manager import KVCacheManager
from simengine.kvcache.radix import RadixCache


class PagedEngine(EnginePolicy):
    """Queue views shared by engines that keep a `running` list, a `waiting` queue and a paged `kv`
    (KVCacheManager). Subclasses create those three in __init__."""

    running: list[Request]
    waiting: Any   # a deque, list or heap, as the engine keeps its queue
    kv: KVCacheManager

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return self.kv.usage()

    def kv_capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def prefix_cache_tokens(self) -> tuple[int, int]:
        return self.kv.query_tokens, self.kv.hit_tokens

    def cached_prefix_tokens(self, req: Request) -> int:
        return self.kv.cached_prefix_tokens(req)

    def host_tier_stats(self) -> dict | None:
        """The KV offload tier's figures (None without one): capacity and blocks held, stored and loaded back,
        and the prompt tokens found there."""
        host = self.kv.host
        return None if host is None else host.stats(self.kv.host_hit_tokens,
                                                    self.kv.block_size * self.dep.kv_bytes_per_token_per_device)

    def release(self, req: Request) -> None:
        self.running.remove(req)
        if req.hold_kv:   # P/D prefill side: the blocks stay until the decode replica has pulled them
            self.held[req.request_id] = req
        else:
            self.kv.free(req)

    def free_kv(self, req: Request) -> None:
        self.kv.free(req)

    def admit_head(self, n: int, now: float, out: SchedulerOutput) -> Request:
        """Move the head of a deque `waiting` (blocks already allocated, no prefix hit) to running with `n` tokens
        this step (Orca, Sarathi, generic)."""
        req = self.waiting.popleft()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = 0
        self.mark_scheduled(req, now)
        self.running.append(req)
        out.scheduled.append((req, n))
        return req

    def drop_for_recompute(self, req: Request, out: SchedulerOutput, cached_tokens: int | None = None) -> None:
        """Recompute preemption: free the request's KV and progress (the full blocks of its first `cached_tokens`,
        default all computed, may stay in the prefix cache); the caller requeues it where its engine does."""
        self.kv.free(req, cached_tokens)
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)

    def check_invariants(self) -> None:
        self.kv.pool.check_invariants()
        if self.kv.host is not None:
            self.kv.host.check_invariants()
        held = {b for reqs in (self.running, self.held.values()) for r in reqs
                for b in self.kv.req_blocks.get(r.request_id, ())}
        assert len(held) <= self.kv.pool.num_used  # prefix-shared blocks count once
        for r in self.running:  # the manager's fast path never lets tokens past the blocks a request holds
            assert r.kv_settled_tokens <= self.kv.num_blocks_of(r) * self.kv.block_size, "settled past blocks"
        if self.batch_size_limit is not None:
            assert len(self.running) <= self.batch_size_limit


class RadixCacheViews:
    """KV views of engines whose KV is a token radix cache in `self.cache` (SGLang, TGI)."""

    cache: RadixCache

    def kv_usage(self) -> float:
        return self.cache.usage()

    def kv_capacity_tokens(self) -> int:
        return self.cache.capacity

    def prefix_cache_tokens(self) -> tuple[int, int]:
        return self.cache.query_tokens, self.cache.hit_tokens

    def cached_prefix_tokens(self, req: Request) -> int:
        return self.cache.peek_prefix(req.token_ids[:req.prompt_len])
