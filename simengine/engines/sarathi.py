"""Sarathi-Serve (Agrawal et al., OSDI'24) stall-free batching, after sarathi-serve's SarathiScheduler and Vidur.

Each iteration has a fixed token budget (`chunk_size`). Running decodes go first, one token each; prefills
already in progress continue with chunks of what is left of the budget; then new requests are admitted FCFS
with chunks of the rest, so a long prompt never stalls ongoing decodes. Admission needs free blocks for the
whole prompt plus a watermark; a decode that finds no free block preempts (recompute) the latest-arrived
request not yet scheduled this iteration, or itself. Paged KV, no prefix cache, no CUDA graphs, synchronous.

Simulation speed (not a Sarathi mechanism): steady decodes are advanced as one lazy cohort
(engines/decode_cohort.py, `schedule_decodes`); without a prefix cache the order in which decodes take their blocks
only labels the blocks, so the cohort's running order stands in for arrival order until a step could preempt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Annotated

from simengine.config.loader import (
    BlockTokens,
    Checked,
    MemoryFraction,
    PoolSize,
    Range,
    Sequences,
    Tokens,
)
from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.cost.timing import PYTHON_SEQ_CPU_S, EngineTiming
from simengine.engines.base import ENGINES
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.devices import ALL_CLASSES, ALL_VENDORS
from simengine.engines.memory import Deployment, activation_reserve_bytes, kv_tokens_or_refuse
from simengine.engines.paged import PagedEngine
from simengine.errors import InputError
from simengine.kvcache.manager import KVCacheManager

ARRIVAL_ORDER = attrgetter("arrival_s", "request_id")


@dataclass(frozen=True, kw_only=True)
class SarathiParams(Checked):
    """sarathi-serve knob names (sarathi/config/config.py) and defaults."""

    chunk_size: Tokens = 512                      # SarathiSchedulerConfig.chunk_size (Vidur SarathiSchedulerConfig 512)
    max_num_seqs: Sequences = 128                 # BaseSchedulerConfig.max_num_seqs (Vidur batch_size_cap 128)
    block_size: BlockTokens = 16                  # CacheConfig.block_size
    gpu_memory_utilization: MemoryFraction = 0.8  # WorkerConfig.gpu_memory_utilization, of total memory
    # BaseBlockSpaceManager watermark=0.01 (Vidur watermark_blocks_fraction)
    watermark_blocks_fraction: Annotated[float, Range(0, 1)] = 0.01
    max_model_len: Tokens | None = None           # ModelConfig.max_model_len; None: from the model config
    num_gpu_blocks: PoolSize | None = None        # CacheConfig.num_gpu_blocks; None: set by memory profiling

    def __post_init__(self):
        super().__post_init__()
        if self.watermark_blocks_fraction >= 1.0:
            raise InputError(f"must be < 1, got {self.watermark_blocks_fraction}", field="watermark_blocks_fraction")


@ENGINES.register("sarathi")
class SarathiEngine(PagedEngine):
    Params = SarathiParams
    vendors = ALL_VENDORS
    kernel_backend = "vllm"  # nearest measured backend: sarathi-serve is built on vLLM's kernels
    device_classes = ALL_CLASSES
    research_baseline = True
    support_source = ("research policy (OSDI'24, microsoft/sarathi-serve runs on NVIDIA CUDA only); modelled "
                      "as a scheduling policy on any accelerator, like its Vidur reimplementation")
    lazy_decode = True  # speed device (module docstring)

    def __init__(self, params: SarathiParams, dep: Deployment):
        # decodes are not capped by the chunk budget, only prefill chunks are (at most max_num_seqs decodes)
        self.step_token_limit = max(params.chunk_size, params.max_num_seqs)
        self.batch_size_limit = params.max_num_seqs
        super().__init__(params, dep)
        p = params
        # model_runner.profile_num_available_blocks: total x utilization - peak of a one-chunk profiling forward
        tokens = kv_tokens_or_refuse(dep, lambda d: p.gpu_memory_utilization * d.hardware.memory_bytes
                                     - d.weight_bytes_per_device - activation_reserve_bytes(d, p.chunk_size, 1),
                                     engine="sarathi",
                                     rule=f"gpu_memory_utilization={p.gpu_memory_utilization} of total memory")
        num_blocks = p.num_gpu_blocks or tokens // p.block_size
        self.kv = KVCacheManager(num_blocks, p.block_size, enable_prefix_caching=False)
        self.watermark = int(p.watermark_blocks_fraction * num_blocks)
        self.max_model_len = p.max_model_len or dep.model.max_model_len
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        # decodes are never capped (step_token_limit); pp > 1 keeps its per-request steps
        self.cohort = DecodeCohort(self.kv, self.step_token_limit) if self.lazy_decode and dep.pp == 1 else None

    def make_timing(self) -> EngineTiming:
        # ESTIMATE: sarathi-serve is a vLLM-0.2-era Python engine: scheduling + input preparation ~1 ms and
        # sampler + output processing ~1 ms per iteration, with no overlap (the base engine loop is synchronous)
        # and no CUDA graphs (model_runner.py captures none).
        return EngineTiming(scheduler_cpu_s=1.0e-3, output_cpu_s=1.0e-3, overlap=False, cuda_graph_sizes=(),
                            seq_cpu_s=PYTHON_SEQ_CPU_S)

    # ---- queues -------------------------------------------------------------------------------------
    def refusal(self, req: Request) -> str | None:
        if req.prompt_len > self.max_model_len:  # _check_request_prompt_length: prompt beyond max_model_len
            return f"prompt of {req.prompt_len} tokens exceeds max_model_len {self.max_model_len}"
        if self.kv.blocks_for(req.prompt_len) > self.kv.num_blocks - self.watermark:
            return "prompt needs more KV blocks than the pool holds above the watermark"
        return None

    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        self.waiting.append(req)
        return True

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: prefill tokens + decodes <= max(chunk_size, decodes); decodes are never delayed by a
        # prefill; len(running) <= max_num_seqs; preemption frees blocks only for decodes.
        out = SchedulerOutput()
        cohort = self.cohort
        prefills = cohort.schedule_decodes(out) if cohort is not None else None
        exact = prefills is None
        if prefills is None:
            pending = deque(sorted(self.running, key=ARRIVAL_ORDER))  # fcfs sort_by_priority
            kept, prefills, used = self._schedule_decodes(out, pending)
            self.running = kept + prefills
        else:  # the cohort took every decode; no block was short, so none preempted
            prefills.sort(key=ARRIVAL_ORDER)
            used = len(out.scheduled)
        used = self._schedule_prefills(out, prefills, used)
        num_running = len(self.running)
        self._schedule_waiting(out, used, now)
        if cohort is not None:  # the admitted join the others at the end of the running order (all of it if exact)
            cohort.order(self.running if exact else self.running[num_running:], fresh=exact)
        out.shape = self.make_shape(out.scheduled, out.num_lazy)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, pending: deque[Request]) -> tuple[list, list, int]:
        """Decodes in arrival order; a decode short of a block preempts from the back of the unscheduled rest."""
        kept: list[Request] = []
        prefills: list[Request] = []
        allocate, keep, take = self.kv.allocate_slots, kept.append, pending.popleft
        while pending:
            req = take()
            produced, computed = req.num_output_tokens, req.num_computed_tokens
            if not produced or req.prompt_len + produced - computed != 1:  # Request.is_decoding, inline
                prefills.append(req)  # a chunked prefill (or recompute) in progress: its blocks are held
                continue
            if computed >= req.kv_settled_tokens:   # held blocks do not take its token: allocate
                while not allocate(req, 1):
                    victim = pending.pop() if pending else req
                    self._preempt(victim, out)
                    if victim is req:
                        break
                if req.status is Status.PREEMPTED:
                    break
            keep(req)
        out.scheduled += [(req, 1) for req in kept]   # victims come from the unscheduled rest, never from kept
        return kept, prefills, len(kept)

    def _schedule_prefills(self, out: SchedulerOutput, prefills: list[Request], used: int) -> int:
        """Ongoing prefills take chunks of what the decodes left of the budget."""
        for req in prefills:
            n = min(req.num_new_tokens, self.params.chunk_size - used)
            if n <= 0:
                continue
            self.kv.allocate_slots(req, n)  # within the prompt blocks held since admission: never fails
            out.scheduled.append((req, n))
            used += n
        return used

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.drop_for_recompute(req, out)
        self.waiting.appendleft(req)  # BaseScheduler._preempt: waiting.insert(0, seq)

    def _schedule_waiting(self, out: SchedulerOutput, used: int, now: float) -> None:
        """FCFS admission: whole current sequence must fit above the watermark; first chunk fills the budget."""
        while self.waiting and len(self.running) < self.params.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens, self.params.chunk_size - used)
            if n <= 0:
                break
            if not self.kv.allocate_slots(req, n, reserve_tokens=req.num_tokens, watermark_blocks=self.watermark):
                if not self.running:  # nothing will ever free blocks for it
                    self.waiting.popleft()
                    self.reject(req, "its sequence needs more KV blocks than the pool holds above the watermark")
                    out.rejected.append(req)
                    continue
                break
            self.admit_head(n, now, out)
            used += n

    def check_invariants(self) -> None:
        self.check_cohort(self.running)
        self.kv.pool.check_invariants()
        assert len(self.running) <= self.params.max_num_seqs
        assert sum(self.kv.num_blocks_of(r) for r in self.running) == self.kv.pool.num_used
        for r in self.running:
            held = self.kv.num_blocks_of(r)
            assert held >= self.kv.blocks_for(r.num_computed_tokens if r.is_decoding else r.num_tokens)
