"""KV that comes from elsewhere or waits to go there: prefill/decode disaggregation (a prefill replica holds a finished
request's KV until the decode side pulls it; a decode replica reserves blocks and schedules once the KV arrived) and
KV offload loads from host memory or disk. Mixed into every engine policy (engines/base.py EnginePolicy)."""

from __future__ import annotations

from typing import ClassVar

from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.engines.memory import Deployment
from simengine.kvcache.host_tier import DISK_READ_BYTES_S, DISK_READ_LATENCY_S


class RemoteKV:
    """The state lives on the engine (EnginePolicy.__init__): `held` (prefill side), `loading` (decode side and
    host loads) and `disk_loads`; `dep` is the engine's deployment."""

    name: ClassVar[str]
    dep: Deployment
    held: dict[int, Request]
    loading: dict[int, Request]
    disk_loads: dict[int, int]

    def free_held(self, req: Request) -> None:
        """P/D prefill side: the decode replica has pulled `req`'s KV; free what `release` kept. (Before the
        release, the request is simply released as usual when it comes.)"""
        held = self.held.pop(req.request_id, None)
        req.hold_kv = False
        if held is not None:
            self.free_kv(held)

    def free_kv(self, req: Request) -> None:
        """Free a released request's KV (the prefill role's deferred half of `release`)."""
        raise NotImplementedError(f"{self.name} has no prefill role")

    def reserved_for_remote(self, req: Request, remote_tokens: int, out: SchedulerOutput) -> None:
        """P/D decode side: blocks are reserved for `req`, and `remote_tokens` of its prompt (past a local prefix
        hit) will arrive from the prefill replica; the replica starts the transfer (SchedulerOutput.kv_reserved)."""
        req.remote_kv_tokens = remote_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.prompt_len - remote_tokens
        self.loading[req.request_id] = req
        out.kv_reserved.append(req)

    def load_from_host(self, req: Request, hit_tokens: int, host_tokens: int, out: SchedulerOutput,
                       disk_tokens: int = 0) -> None:
        """KV offload: blocks are reserved for `req`'s GPU prefix hit (`hit_tokens`, computed) and the `host_tokens`
        after it that the host tiers hold (`disk_tokens` of them on disk); the replica copies those over the host link
        (SchedulerOutput.kv_loads; `host_load_seconds`) and calls `remote_kv_arrived` when they are in place."""
        req.num_computed_tokens = hit_tokens
        req.remote_kv_tokens = host_tokens
        if disk_tokens:
            self.disk_loads[req.request_id] = disk_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit_tokens + host_tokens
        self.loading[req.request_id] = req
        out.kv_loads.append(req)

    def host_load_seconds(self, req: Request) -> float:
        """Time to load a request's offloaded KV (`load_from_host`) on an idle link: its disk part read first, then
        all of it over the host link (each device its own shard, in parallel)."""
        hw, per_token = self.dep.hardware, self.dep.kv_bytes_per_token_per_device
        seconds = req.remote_kv_tokens * per_token / hw.host_link_bandwidth_bytes_s + hw.host_link_latency_s
        disk = self.disk_loads.pop(req.request_id, 0)
        if disk:
            seconds += disk * per_token / DISK_READ_BYTES_S + DISK_READ_LATENCY_S
        return seconds

    @staticmethod
    def take_remote_first_token(req: Request, now: float) -> bool:
        """P/D decode side of engines whose prefill server sends its first token with the KV (SGLang, TRT-LLM):
        the prompt counts as computed and that token as produced at `now`. True when it was the request's last
        (the request is finished; the caller frees its KV)."""
        req.remote_kv_tokens = 0
        req.num_computed_tokens = req.prompt_len
        req.num_output_tokens = 1
        req.first_token_s = req.last_token_s = now
        if req.token_times is not None:
            req.token_times.append(now)
        if req.output_len > 1:
            return False
        req.status, req.finish_s = Status.FINISHED, now
        return True

    def remote_kv_arrived(self, req: Request, now: float) -> None:
        """P/D decode side: the KV of the request's reserved blocks has arrived at `now`; it may be scheduled (or,
        where the prefill's first token came with it and was its last, it is finished)."""
        raise NotImplementedError(f"{self.name} has no decode role")
