"""TensorRT-LLM's scheduling bookkeeping (batch_manager/capacityScheduler.cpp, microBatchScheduler.cpp): the order it
keeps requests in, a step's micro-batch budget, and the blocks every started request still needs to its completion
(GUARANTEED_NO_EVICT's reservation). The scheduler that uses them is engines/trtllm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from simengine.core.request import Request
from simengine.kvcache.manager import KVCacheManager


def arrival_order(req: Request) -> tuple[float, int]:
    return req.arrival_s, req.request_id   # PyExecutor keeps active_requests in arrival order


@dataclass(slots=True)
class MicroBatchBudget:
    """The micro-batch scheduler's per-step caps: max_num_tokens and max_batch_size."""

    tokens: int
    slots: int

    def take(self, charge: int) -> bool:
        if self.slots <= 0 or charge > self.tokens:
            return False
        self.tokens -= charge
        self.slots -= 1
        return True


class CompletionReservations:
    """Every started request's horizon (getRemainingBlocksToCompletion: prompt + max_tokens within max_seq_len) in
    blocks, and the blocks they still need to reach it."""

    def __init__(self, kv: KVCacheManager, max_seq_len: int):
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.horizon_blocks: dict[int, int] = {}   # request id of a started request -> its horizon's blocks

    def horizon(self, req: Request) -> int:
        return self.kv.blocks_for(min(req.prompt_len + req.max_tokens, self.max_seq_len))

    def start(self, req: Request) -> None:
        self.horizon_blocks[req.request_id] = self.horizon(req)

    def end(self, req: Request) -> None:
        del self.horizon_blocks[req.request_id]

    def blocks_to_come(self) -> int:
        """Blocks the started requests still need to reach their horizons."""
        return self.kv.blocks_short_of(self.horizon_blocks)
