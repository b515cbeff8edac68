"""A request's token content and lifecycle state (plain data; engines mutate the counters)."""

from __future__ import annotations

from array import array
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from simengine.kvcache.hashing import HashBatch


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    FAILED = 4


class Request:
    """One request. `token_ids` holds prompt + the output the simulator will produce (known in advance).

    vLLM's rule drives every engine: `num_computed_tokens` catches up with `num_tokens` (prompt + outputs
    so far); when it has, the next token is sampled. Prefill, chunking, prefix hits and decode are one
    mechanism.
    """

    __slots__ = (
        "request_id", "arrival_s", "prompt_len", "output_len", "max_tokens", "token_ids", "priority",
        "session_id", "turn", "num_computed_tokens", "num_output_tokens", "status", "first_scheduled_s",
        "first_token_s", "last_token_s", "finish_s", "num_preemptions", "num_cached_tokens",
        "block_hashes", "block_hash_size", "fail_reason", "slo_class", "structured", "kv_settled_tokens",
        "hash_batch", "unique_outputs", "private_from", "token_times", "hold_kv", "remote_kv_tokens",
        "lora_id", "lora_rank",
    )

    def __init__(self, request_id: int, arrival_s: float, token_ids: np.ndarray, prompt_len: int,
                 output_len: int, *, max_tokens: int | None = None, priority: int = 0,
                 session_id: int = -1, turn: int = 0, slo_class: str = "", structured: bool = False,
                 unique_outputs: bool = False, private_from: int | None = None, lora_id: int = -1,
                 lora_rank: int = 0):
        if output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {output_len}")
        if len(token_ids) < prompt_len + output_len - 1:
            raise ValueError("token_ids must hold the prompt and all but the last output token")
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.token_ids = token_ids
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.max_tokens = max(max_tokens or output_len, output_len)
        self.priority = priority
        self.session_id = session_id
        self.turn = turn
        self.slo_class = slo_class
        self.structured = structured
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.status = Status.WAITING
        self.first_scheduled_s = -1.0
        self.first_token_s = -1.0
        self.last_token_s = -1.0
        self.finish_s = -1.0
        self.num_preemptions = 0
        self.num_cached_tokens = -1   # prefix-cache hit at first admission (-1 = not admitted yet)
        self.block_hashes: list[int] | None = None  # kvcache.hashing.block_hashes, on first need
        self.block_hash_size = 0                    # the block size those hashes are of
        self.hash_batch: tuple[HashBatch, int] | None = None  # hashed in one pass with its batch (batch, index)
        self.unique_outputs = unique_outputs  # its output tokens are its own (fresh random draws): no other request
                                              # holds a block containing one while it runs (a later turn may, after)
        # tokens from this index on are in no other request, ever (fresh draws of a request without later turns):
        # a block holding one can only be found by this request itself, after giving its blocks up unfinished
        self.private_from = len(token_ids) if private_from is None else min(private_from, len(token_ids))
        self.fail_reason = ""
        self.kv_settled_tokens = 0    # KVCacheManager: computed tokens its blocks take with no allocation or
                                      # prefix publish (its per-step fast path); 0 = ask the manager
        self.token_times: array | None = None  # when set (the runner's detailed requests): each output token's time
        # prefill/decode disaggregation (docs/cluster.md): a prefill replica keeps the KV of a `hold_kv` request
        # after it finishes, until its decode replica has pulled it (EnginePolicy.free_held); a decode replica
        # reserves blocks for a request with remote_kv_tokens > 0, sets it to the tokens it will pull, and
        # schedules the request once they arrived (EnginePolicy.remote_kv_arrived), when it is 0 again
        self.hold_kv = False
        self.remote_kv_tokens = 0
        self.lora_id = lora_id        # the LoRA adapter it names (-1: the base model) and that adapter's rank
        self.lora_rank = lora_rank

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs generated so far: what the KV cache must eventually hold."""
        return self.prompt_len + self.num_output_tokens

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.prompt_len + self.num_output_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_output_tokens > 0 and self.num_new_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status >= Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, prompt={self.prompt_len}, out={self.num_output_tokens}/"
                f"{self.output_len}, computed={self.num_computed_tokens}, {self.status.name})")
