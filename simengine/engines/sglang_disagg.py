"""SGLang's P/D decode side (srt/disaggregation/decode.py, 0.5.23): the prealloc queue that reserves KV slots for a
request whose prompt was computed elsewhere, the transfer queue it waits in while the KV arrives, and the prebuilt
batch that joins the running batch without a forward. The scheduler that uses it is engines/sglang.py.
"""

from __future__ import annotations

from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request
from simengine.engines.base import EnginePolicy
from simengine.engines.sglang_policy import reserve_tokens
from simengine.kvcache.radix import RadixCache, RadixHold

NUM_RESERVED_DECODE_TOKENS = 512    # server_args.py num_reserved_decode_tokens: a P/D decode server keeps this many
                                    # tokens per active request free for their decoding (disaggregation/decode.py)


class SglangDecodeSide(EnginePolicy):
    """The decode-side queues of an SGLang engine (--disaggregation-mode decode)."""

    cache: RadixCache
    holds: dict[int, RadixHold]
    running: list[Request]
    prealloc: list[Request]    # waiting for KV slots (DecodePreallocQueue)
    prebuilt: list[Request]    # KV arrived: the batch the next schedule merges into running
    chunked: Request | None
    max_running_requests: int

    def running_outside_cohort(self) -> list[Request]:
        """The running requests outside the decode cohort, whose counters are current (every running request when
        the cohort has no members)."""
        cohort = self.cohort
        return self.running if cohort is None or not cohort.members else cohort.running_others()

    def _preallocate(self, out: SchedulerOutput) -> None:
        """DecodePreallocQueue.pop_preallocated, first come first served: slots for a request's whole prompt when the
        pool, less NUM_RESERVED_DECODE_TOKENS for every active request, holds them and its own reservation, and the
        request could finish with every running request retracted; the KV then loads into them."""
        active = len(self.running) + len(self.loading) + len(self.prebuilt)
        retractable = sum(r.prompt_len + r.num_output_tokens for r in self.running_outside_cohort())
        if self.cohort is not None:
            retractable += self.cohort.context_tokens(len(self.cohort.members))
        taken = 0
        for req in self.prealloc:
            if active >= self.max_running_requests:   # req_to_token_pool slots
                break
            allocatable = self.cache.available() - NUM_RESERVED_DECODE_TOKENS * active
            need = req.prompt_len + NUM_RESERVED_DECODE_TOKENS
            if max(need, req.prompt_len + reserve_tokens(req) - retractable) > allocatable:
                break
            hold = self.cache.acquire(req.token_ids, 0)
            if not self.cache.grow(hold, req.prompt_len):
                self.cache.release(hold)
                break
            self.holds[req.request_id] = hold
            self.reserved_for_remote(req, req.prompt_len, out)
            active += 1
            taken += 1
        del self.prealloc[:taken]

    def remote_kv_arrived(self, req: Request, now: float) -> None:
        """DecodeTransferQueue: the KV is in place; the prefill side's first token came with it. A request of one
        token is done; the others join the next prebuilt batch."""
        del self.loading[req.request_id]
        if self.take_remote_first_token(req, now):
            self.release(req)
            return
        self.prebuilt.append(req)

    def _merge_prebuilt(self, now: float) -> None:
        """get_new_prebuilt_batch + process_prebuilt: as many as the running batch has room for, no forward; their
        first token goes out and they join the running batch (and the cohort's running order), decoding from their
        second token."""
        room = self.max_running_requests - len(self.running) - (self.chunked is not None)
        if room <= 0:
            return
        merged = self.prebuilt[:room]
        for req in merged:
            req.first_token_s = req.last_token_s = now   # goes out with this batch (no forward)
            if req.token_times is not None:
                req.token_times[-1] = now
            self.mark_scheduled(req, now)
            self.running.append(req)
        del self.prebuilt[:room]
        if self.cohort is not None:
            self.cohort.order(merged, fresh=False)
