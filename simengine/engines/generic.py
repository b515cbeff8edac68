"""A documented generic continuous-batching engine, used where a measurement does not name its serving stack.

What is modelled: iteration-level (Orca-style) continuous batching as vLLM V0 ran it before chunked prefill
(vllm/core/scheduler.py, v0.2-v0.5): a step is either a prefill step (whole prompts of waiting requests, FCFS,
while the token budget, the sequence cap and the KV blocks allow; a prompt longer than the budget runs alone)
or, when no prompt can start, a decode step of every running request. Paged KV without a prefix cache; a decode
that finds no free block preempts the most recently admitted request by recompute. The loop is synchronous
(host work is never hidden) and eager (no CUDA graphs). Its mechanism terms (host CPU per step and per sequence,
the dispatch cost of an eager kernel) are the terms `simengine calibrate` fits for engine `generic` from rows whose
engine is `unknown` (docs/validation.md); see simengine/engines/calibration.yaml.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from simengine.config.loader import (
    BlockTokens,
    Checked,
    HostSeconds,
    MemoryFraction,
    Sequences,
    Tokens,
)
from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.cost.timing import PYTHON_SEQ_CPU_S, EngineTiming
from simengine.engines.base import ENGINES
from simengine.engines.devices import ALL_CLASSES, ALL_VENDORS
from simengine.engines.memory import NON_TORCH_BYTES, Deployment, activation_reserve_bytes, kv_tokens_or_refuse
from simengine.engines.paged import PagedEngine
from simengine.kvcache.manager import KVCacheManager


@dataclass(frozen=True, kw_only=True)
class GenericParams(Checked):
    """Knobs of the generic engine, named after their vLLM V0 counterparts (vllm/config.py, v0.4)."""

    max_num_seqs: Sequences = 256                 # vLLM V0 SchedulerConfig default (config.py / arg_utils.py)
    max_num_batched_tokens: Tokens = 8192  # ESTIMATE: V0 required >= max_model_len; 8192 is the common serving value
    gpu_memory_utilization: MemoryFraction = 0.9  # vLLM V0 CacheConfig default (arg_utils.py)
    block_size: BlockTokens = 16                  # vLLM V0 CacheConfig default
    scheduler_cpu_s: HostSeconds = 1.0e-3         # ESTIMATE: Python scheduling + input preparation per step
    output_cpu_s: HostSeconds = 0.5e-3            # ESTIMATE: sampling hand-off, stop checks, detokenisation per step


@ENGINES.register("generic")
class GenericEngine(PagedEngine):
    """Generic continuous batching: prefill-first whole-prompt steps, no prefix cache, synchronous, eager."""

    Params = GenericParams
    vendors = ALL_VENDORS
    kernel_backend = "vllm"  # nearest measured backend: a PyTorch stack with cuBLAS GEMMs and flash-attention kernels
    device_classes = ALL_CLASSES
    support_source = "an abstraction, not a product: stands for an unnamed stack on any device (docs/validation.md)"

    def __init__(self, params: GenericParams, dep: Deployment):
        self.step_token_limit = None  # a prompt longer than max_num_batched_tokens runs alone, whole
        self.batch_size_limit = params.max_num_seqs
        super().__init__(params, dep)
        p = params
        tokens = kv_tokens_or_refuse(dep, lambda d: (
            p.gpu_memory_utilization * d.hardware.memory_bytes - d.weight_bytes_per_device
            - activation_reserve_bytes(d, p.max_num_batched_tokens, p.max_num_seqs) - NON_TORCH_BYTES),
                                     engine="generic",
                                     rule=f"gpu_memory_utilization={p.gpu_memory_utilization} of total memory")
        num_blocks = tokens // p.block_size
        self.kv = KVCacheManager(num_blocks, p.block_size, enable_prefix_caching=False)
        self.max_model_len = min(dep.model.max_model_len, num_blocks * p.block_size)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()

    def make_timing(self) -> EngineTiming:
        p = self.params
        # Synchronous loop, eager kernels: every host second is exposed and no CUDA graph is replayed.
        return EngineTiming(scheduler_cpu_s=p.scheduler_cpu_s, output_cpu_s=p.output_cpu_s, overlap=False,
                            seq_cpu_s=PYTHON_SEQ_CPU_S,
                            cuda_graph_sizes=())

    # ---- queues -------------------------------------------------------------------------------------
    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        self.waiting.append(req)
        return True

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: a step is prefill-only (whole prompts) or decode-only; running requests hold KV for every
        # computed token; at most max_num_seqs run; nothing is scheduled twice.
        out = SchedulerOutput()
        self._schedule_prefills(out, now)
        if not out.scheduled:
            self._schedule_decodes(out)
        out.shape = self.make_shape(out.scheduled)
        return out

    def _schedule_prefills(self, out: SchedulerOutput, now: float) -> None:
        budget = self.params.max_num_batched_tokens
        while self.waiting and len(self.running) < self.params.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens   # the whole prompt (+ outputs after a recompute)
            if out.scheduled and n > budget:
                break
            if not self.kv.allocate_slots(req, n):
                break  # FCFS: the head waits for blocks; decodes free them as requests finish
            self.admit_head(n, now, out)
            budget -= n

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        i = 0
        while i < len(self.running):
            req = self.running[i]
            while not self.kv.allocate_slots(req, 1):
                victim = self.running[-1]   # the most recently admitted request is recomputed later
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is Status.PREEMPTED:
                break
            out.scheduled.append((req, 1))
            i += 1

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.drop_for_recompute(req, out)
        self.waiting.appendleft(req)

    def check_invariants(self) -> None:
        super().check_invariants()
        for r in self.running:
            assert self.kv.num_blocks_of(r) * self.kv.block_size >= r.num_computed_tokens
