"""vLLM's KV connectors on the scheduler's side (vllm/v1/core/sched/scheduler.py, tag v0.33.0): a P/D decode replica
reserving blocks for a prompt computed elsewhere (e.g. NixlConnector) and the OffloadingConnector's CPU tier loading a
prompt's blocks back. Mixed into the scheduler of engines/vllm.py, whose queues and pool they use."""

from __future__ import annotations

from collections.abc import Callable

from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request
from simengine.engines.paged import PagedEngine
from simengine.kvcache.manager import PrefixHit


class VllmConnectors(PagedEngine):
    """Admission and arrival of KV that comes from elsewhere (`_schedule_waiting` calls the first two)."""

    _pop_waiting: Callable[[], Request]
    _push_waiting: Callable[..., None]

    # ---- P/D disaggregation, decode side (vLLM's KV connector, e.g. NixlConnector) ------------------------------
    def _reserve_remote(self, req: Request, hit: PrefixHit, out: SchedulerOutput) -> bool:
        """A request whose prompt was computed on a prefill replica: blocks for the whole prompt now (the local prefix
        hit and the rest), no tokens this step; the rest loads asynchronously (WAITING_FOR_REMOTE_KVS) and its blocks
        reach the prefix cache when it has arrived (vllm/v1/core/sched/scheduler.py schedule(): load_kv_async,
        allocate_slots(delay_cache_blocks=True); the connector's get_num_new_matched_tokens counts the prompt past the
        local hit). False, changing nothing, when the blocks are not free (head-of-line blocking, as any admission)."""
        if not self.kv.allocate_slots(req, 0, hit, reserve_tokens=req.num_tokens):
            return False
        self._pop_waiting()
        req.num_computed_tokens = hit.num_tokens
        self.reserved_for_remote(req, req.num_tokens - hit.num_tokens, out)
        return True

    def remote_kv_arrived(self, req: Request, now: float) -> None:
        """Its KV is in its blocks: the loaded tokens count as computed (when the whole prompt arrived, every token but
        the last: it is recomputed for the first token's logits), and the request waits at the head of the queue
        (scheduler.py _update_waiting_for_remote_kv: num_computed_tokens -= 1 when the whole prompt arrived,
        cache_blocks)."""
        del self.loading[req.request_id]
        req.num_computed_tokens = min(req.num_computed_tokens + req.remote_kv_tokens, req.num_tokens - 1)
        req.remote_kv_tokens = 0
        self.kv.publish_through(req, req.num_computed_tokens)
        self._push_waiting(req, front=True)

    # ---- KV offload to host memory (kv_offloading_size: the OffloadingConnector's CPU tier) ----------------------
    def _load_from_host(self, req: Request, hit: PrefixHit, host_tokens: int, disk_tokens: int,
                        out: SchedulerOutput) -> bool:
        """A new request whose prompt continues past the GPU hit in the CPU tier: blocks for the hit and the loaded
        tokens now, the load asynchronous (the connector's get_num_new_matched_tokens, load_kv_async; the request
        waits in WAITING_FOR_REMOTE_KVS while others run); the whole prompt must fit, as any admission. False,
        changing nothing, when the blocks are not free."""
        if not self.kv.allocate_slots(req, 0, hit, reserve_tokens=hit.num_tokens + host_tokens,
                                      fits_tokens=req.num_tokens):
            return False
        self._pop_waiting()
        self.kv.take_from_host(host_tokens, disk_tokens)
        self.load_from_host(req, hit.num_tokens, host_tokens, out, disk_tokens)
        return True
