"""One engine step: the scheduler's output, the batch shape the cost model prices, and what the step produced."""

from __future__ import annotations

from dataclasses import dataclass, field

from simengine.core.request import Request


@dataclass(slots=True)
class BatchShape:
    """Token-level shape of one forward pass (all the cost model needs)."""

    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (new tokens, cached context before)
    num_decode: int = 0                 # decoding requests: one new token each (plus spec_tokens drafts in all)
    decode_context_tokens: int = 0      # sum over decodes of the context their attention reads
    num_logits: int = 0                 # tokens that produce logits (decodes + prompts finishing this step)
    padded_decode: int = 0              # decode batch after CUDA-graph padding (>= num_decode)
    cuda_graph: bool = False            # whole step replayed from a captured graph
    num_structured: int = 0             # requests sampling under a grammar mask this step
    # speculative decoding (engines/speculative.py): decodes that verify drafts, and the drafts they verify in all
    # (query tokens beside each one's own: the GEMMs and the LM head take them, attention reads the context once)
    num_spec: int = 0
    spec_tokens: int = 0
    host_load_tokens: int = 0           # KV tokens copied in from host memory for this step's forward: before it
    host_load_overlapped: bool = False  # (TRT-LLM onboarding), or layer by layer alongside it (SGLang HiCache)
    # multi-LoRA (engines/lora.py): distinct adapters in the step and the tokens computed under one, their weights
    # padded to lora_rank; adapters loaded before the forward, as the sum of their ranks, from host memory or disk
    lora_adapters: int = 0
    lora_tokens: int = 0
    lora_rank: int = 0
    lora_host_load_ranks: int = 0
    lora_disk_load_ranks: int = 0
    # a forward entering the engine's pipeline of layer-split devices behind the previous forward of the same call
    # (llama.cpp's pipeline parallelism): it ends one stage, its own time / pp, after that one
    pipelined: bool = False

    @property
    def num_prefill_tokens(self) -> int:
        chunks = self.prefill_chunks
        return sum([c for c, _ in chunks]) if chunks else 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode + self.spec_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions. `scheduled` pairs a request with the tokens it computes this step."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)   # failed at admission this step
    shape: BatchShape = field(default_factory=BatchShape)
    idle_reason: str = ""           # why nothing was scheduled although work is waiting
    released: int = 0               # requests freed after this decision (vLLM async): a retry may admit more
    kv_reserved: list[Request] = field(default_factory=list)  # P/D decode side: blocks reserved for remote KV
    kv_loads: list[Request] = field(default_factory=list)     # blocks reserved for KV loaded from the host tier
    # the first `num_lazy` scheduled entries are steady decodes (one token each) whose counters the engine
    # advances itself (the decode cohort); the shared update and make_shape skip them
    num_lazy: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(slots=True)
class StepResult:
    """What a step produced: finished requests, and inter-token gaps grouped as {previous token time: count}."""

    finished: list[Request] = field(default_factory=list)
    itl_groups: dict[float, int] = field(default_factory=dict)
    num_first_tokens: int = 0
    num_accepted: int = 0       # speculative drafts accepted (tokens streamed beside each request's own one)
    # tokens the step computed where the client sees fewer now (a multi-step run streams at its end); None: as streamed
    num_tokens: int | None = None

    def tokens(self) -> int:
        """Tokens the step computed: `num_tokens` where set, else those it streamed."""
        if self.num_tokens is not None:
            return self.num_tokens
        return self.num_first_tokens + sum(self.itl_groups.values()) + self.num_accepted
