"""Orca (Yu et al., OSDI'22): iteration-level scheduling with selective batching, as Vidur and Sarathi-Serve model it.

Every iteration runs one decode token for each running request plus the whole prompts of newly admitted ones
(selective batching: no chunking, prefills and decodes share the linear layers). Requests are admitted FCFS up
to `max_num_seqs` while the KV pool can hold their reservation: Orca reserves slots for the request's maximum
length at admission (Algorithm 1: n_rsrv += req.max_tokens), so a running request can never run out of KV and
nothing is ever preempted. Paged blocks hold the reservation (Vidur/Sarathi-Serve's Orca also count blocks).
No prefix cache, no CUDA graphs, a synchronous loop. Speed device (docs/performance.md): the running requests'
steady decodes advance in a DecodeCohort (`schedule_lockstep`; their KV is reserved, so a member's one event is its
last token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from simengine.config.loader import (
    BlockTokens,
    Checked,
    MemoryFraction,
    PoolSize,
    Sequences,
    Tokens,
)
from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request
from simengine.cost.timing import PYTHON_SEQ_CPU_S, EngineTiming
from simengine.engines.base import ENGINES
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.devices import ALL_CLASSES, ALL_VENDORS
from simengine.engines.memory import Deployment, kv_tokens_or_refuse
from simengine.engines.paged import PagedEngine
from simengine.kvcache.manager import KVCacheManager


@dataclass(frozen=True, kw_only=True)
class OrcaParams(Checked):
    """Orca's scheduler knobs under Sarathi-Serve's names (Orca itself was never released)."""

    max_num_seqs: Sequences = 128  # Orca's max_bs; sarathi-serve BaseSchedulerConfig.max_num_seqs and Vidur
                                         # BaseReplicaSchedulerConfig.batch_size_cap both default to 128
    block_size: BlockTokens = 16                  # sarathi-serve CacheConfig.block_size; Vidur block_size 16
    # of total memory: Vidur ReplicaConfig and sarathi-serve WorkerConfig 0.8
    gpu_memory_utilization: MemoryFraction = 0.8
    reserve: Literal["max_tokens", "max_model_len"] = "max_tokens"
    # "max_tokens": the paper's rule, prompt + the request's max_tokens (OSDI'22 Algorithm 1); "max_model_len":
    # sarathi-serve's OrcaBlockSpaceManager (ceil(max_model_len / block_size) blocks per request)
    max_model_len: Tokens | None = None           # None: the model's max_position_embeddings
    num_blocks: PoolSize | None = None  # Vidur BaseReplicaSchedulerConfig.num_blocks: None = sized from memory


@ENGINES.register("orca")
class OrcaEngine(PagedEngine):
    Params = OrcaParams
    lazy_decode = True  # speed device (module docstring)
    vendors = ALL_VENDORS
    # nearest measured backend: modelled on a PyTorch stack with cuBLAS GEMMs and flash-attention kernels
    kernel_backend = "vllm"
    device_classes = ALL_CLASSES
    research_baseline = True
    support_source = ("research policy (OSDI'22; the system was never released): modelled as a scheduling policy "
                      "on any accelerator, as Vidur and Sarathi-Serve reimplement it")

    def __init__(self, params: OrcaParams, dep: Deployment):
        self.step_token_limit, self.batch_size_limit = None, params.max_num_seqs  # whole prompts: no token cap
        super().__init__(params, dep)
        # Vidur MemoryPlanner.get_max_batch_size: total x gpu_memory_utilization - parameters, all of it for KV.
        tokens = kv_tokens_or_refuse(dep, lambda d: params.gpu_memory_utilization * d.hardware.memory_bytes
                                     - d.weight_bytes_per_device, engine="orca",
                                     rule=f"gpu_memory_utilization={params.gpu_memory_utilization} of total memory")
        num_blocks = params.num_blocks or tokens // params.block_size
        self.kv = KVCacheManager(num_blocks, params.block_size, enable_prefix_caching=False)
        self.max_model_len = params.max_model_len or dep.model.max_model_len
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.cohort = DecodeCohort(None, 0) if self.lazy_decode else None

    def make_timing(self) -> EngineTiming:
        # ESTIMATE: a Python scheduler and input preparation ~1 ms and sampling/output handling ~0.5 ms per
        # iteration, not overlapped (Orca's scheduler waits for each batch on a single worker; Sarathi-Serve's
        # engine loop is synchronous). No CUDA graphs (sarathi-serve model_runner.py captures none).
        return EngineTiming(scheduler_cpu_s=1.0e-3, output_cpu_s=0.5e-3, overlap=False, cuda_graph_sizes=(),
                            seq_cpu_s=PYTHON_SEQ_CPU_S)

    # ---- queues -------------------------------------------------------------------------------------
    def reservation(self, req: Request) -> int:
        """KV tokens reserved for the request's whole life at admission."""
        if self.params.reserve == "max_model_len":
            return self.max_model_len
        return req.prompt_len + req.max_tokens

    def refusal(self, req: Request) -> str | None:
        if (reason := super().refusal(req)) is not None:
            return reason
        need = self.reservation(req)
        if req.prompt_len + req.max_tokens > need:
            return (f"prompt + max_tokens {req.prompt_len + req.max_tokens} overruns the max_model_len reservation "
                    f"of {need}")
        if self.kv.blocks_for(need) > self.kv.num_blocks:
            return f"its reservation of {need} KV tokens exceeds the pool of {self.kv_capacity_tokens()}"
        return None

    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        self.waiting.append(req)
        return True

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: every running request holds blocks for its whole reservation, so every one decodes each
        # iteration and nothing is preempted; len(running) <= max_num_seqs; new prompts run whole.
        out = SchedulerOutput()
        num_running = len(self.running)
        running = self.cohort.schedule_lockstep(out) if self.cohort is not None else self.running
        out.scheduled += [(r, r.num_new_tokens) for r in running]
        self._admit(out, now)
        if self.cohort is not None:   # the admitted join the cohort's running order
            self.cohort.order(self.running[num_running:], fresh=False)
        out.shape = self.make_shape(out.scheduled, out.num_lazy)
        return out

    def _admit(self, out: SchedulerOutput, now: float) -> None:
        """FCFS head-of-line: stop at the first request whose reservation does not fit."""
        while self.waiting and len(self.running) < self.params.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.allocate_slots(req, req.prompt_len, reserve_tokens=self.reservation(req)):
                break
            self.admit_head(req.prompt_len, now, out)

    def check_invariants(self) -> None:
        self.check_cohort(self.running)
        self.kv.pool.check_invariants()
        assert len(self.running) <= self.params.max_num_seqs
        bs = self.kv.block_size
        for r in self.running:
            assert self.kv.num_blocks_of(r) * bs >= self.reservation(r), "a running request lost its reservation"
        assert sum(self.kv.num_blocks_of(r) for r in self.running) == self.kv.pool.num_used
