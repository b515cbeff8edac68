"""vLLM V1 scheduler (vllm-project/vllm vllm/v1/core/sched/scheduler.py, tag v0.33.0).

Running requests first in admission order, then waiting ones into the leftover token budget; decodes and
prefill chunks share one budget (chunked prefill always on); admission needs blocks for the whole prompt;
recompute preemption of the last-admitted (or lowest-priority) request; full-block hashed prefix cache.

Simulation speed (not vLLM mechanisms): steady decodes are kept as one lazy cohort and blocks of a request's own
outputs are published at its next allocation, see `VllmEngine`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from simengine.config.loader import MAX_TOKENS, Checked, MemoryFraction, Range, Sequences, Tokens
from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.cost.timing import PYTHON_FRONTEND_S, PYTHON_SEQ_CPU_S, EngineTiming
from simengine.engines.base import ENGINES, PagedEngine
from simengine.engines.lora import AdapterSlots
from simengine.engines.memory import NON_TORCH_BYTES, Deployment, activation_reserve_bytes, kv_tokens_or_refuse
from simengine.engines.speculative import AcceptanceKnobs, Speculation, resolve
from simengine.errors import InputError
from simengine.kvcache.host_tier import host_tier
from simengine.kvcache.manager import NO_HIT, KVCacheManager, PrefixHit

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class VllmSpeculativeConfig(AcceptanceKnobs):
    """--speculative-config (vllm/config/speculative.py SpeculativeConfig; the simulator's acceptance beside it)."""

    method: Literal["ngram", "eagle", "eagle3", "mtp", "draft_model"]
    # drafts per step; None: the draft's n_predict where it has one (an MTP model's MTP layers: 1), else required
    num_speculative_tokens: Annotated[int, Range(1, 64)] | None = None
    model: str | None = None   # the draft model of method draft_model (a catalog name here)


@dataclass(frozen=True, kw_only=True)
class VllmParams(Checked):
    """vLLM engine arguments (CLI flag names with dashes as underscores). Defaults from vLLM 0.33.0."""

    max_num_seqs: Sequences | None = None  # None: 1024 on >=70 GB non-A100, else 256 (arg_utils get_batch_defaults)
    max_num_batched_tokens: Tokens | None = None   # None: 16384 on >=160 GB, 8192 on >=70 GB non-A100, else 2048 (same)
    gpu_memory_utilization: MemoryFraction = 0.92  # config/cache.py (0.9 before 0.33)
    block_size: Literal[1, 8, 16, 32, 64, 128, 256] = 16  # CacheConfig.DEFAULT_BLOCK_SIZE (config/cache.py BlockSize)
    enable_prefix_caching: bool = True             # config/cache.py
    long_prefill_token_threshold: Annotated[int, Range(0, MAX_TOKENS)] = 0  # config/scheduler.py (0 = off)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # config/scheduler.py `policy`
    max_model_len: Tokens | None = None  # None: the model's max_position_embeddings, capped to fit the KV pool
    enforce_eager: bool = False                    # disables CUDA graphs
    async_scheduling: bool = True  # None->auto-on in config/vllm.py; overlaps host scheduling with the GPU and
    # schedules step k+1 before step k's output is applied (v1/core/sched/async_scheduler.py)
    kv_cache_memory_bytes: Annotated[int, Range(1, 2**50)] | None = None  # overrides the gpu_memory_utilization rule
    # vLLM V0 (0.5.4-0.7) --num-scheduler-steps: the scheduler runs once per this many steps, so a run of decode
    # steps admits nobody new until it ends (vllm/engine/arg_utils.py of 0.6.0; removed with V0, where 1 is all)
    num_scheduler_steps: Annotated[int, Range(1, 1024)] = 1
    # speculative decoding (engines/speculative.py); V1 keeps no disable_by_batch_size (unused since V0 was removed
    # in 0.10 and deleted by PR #35060), so drafts run at every batch size
    speculative_config: VllmSpeculativeConfig | None = None
    # KV offload to CPU memory (config/cache.py CacheConfig, since 0.11.1; vllm/config/vllm.py maps it to a KV
    # connector): GiB in all, summed over the TP x PP ranks; None: off. native (the default from 0.14): the
    # OffloadingConnector's CPU tier, LRU, storing every computed full block; lmcache: LMCacheConnectorV1, storing
    # prompt blocks. A prompt continuing a GPU hit in the CPU tier loads those blocks back asynchronously
    # (WAITING_FOR_REMOTE_KVS) before it runs (docs/engines.md 'KV offload')
    kv_offloading_size: Annotated[float, Range(0, 1 << 20, above=True)] | None = None
    kv_offloading_backend: Literal["native", "lmcache"] = "native"
    # LMCache's local disk tier (lmcache/v1/config.py max_local_disk_size, env LMCACHE_MAX_LOCAL_DISK_SIZE, GiB per
    # worker; local_disk set): what the CPU tier evicts goes to disk, and is read back from there
    lmcache_max_local_disk_size: Annotated[float, Range(0, 1 << 30)] = 0.0
    # multi-LoRA serving (config/lora.py LoRAConfig; engines/lora.py): adapters active at once, the rank their slots
    # are sized for, and adapters cached in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: Annotated[int, Range(1, 1024)] = 1
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    max_cpu_loras: Annotated[int, Range(1, 1 << 20)] | None = None


def vllm_batch_defaults(dep: Deployment) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM's OpenAI server picks for this device."""
    mem_gib = dep.hardware.memory_bytes / GIB
    is_a100 = dep.hardware.name.startswith("a100")
    if mem_gib >= 160:
        return 1024, 16384
    if mem_gib >= 70 and not is_a100:
        return 1024, 8192
    return 256, 2048


def vllm_capture_sizes(max_num_seqs: int, max_batched: int) -> tuple[int, ...]:
    """CUDA-graph capture sizes: 1,2,4, 8..248 step 8, 256.. step 16, up to min(2*max_num_seqs, 512)."""
    limit = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, limit + 1, 16))
    out = sorted({s for s in sizes if s <= limit} | ({max_batched} if max_batched <= limit else set()))
    return tuple(out)


@ENGINES.register("vllm")
class VllmEngine(PagedEngine):
    Params = VllmParams
    vendors = frozenset({"nvidia", "amd", "intel", "huawei"})
    kernel_backend = "vllm"  # vLLM's own kernels (aiconfigurator-core's vllm tables)
    support_source = "vLLM docs 'GPU installation' (CUDA, ROCm, XPU) and the vllm-ascend plugin; Gaudi via vllm-gaudi"
    supports_expert_parallel = True  # vLLM --enable-expert-parallel (docs: expert parallel deployment)
    supports_pipeline_microbatches = True  # v1/engine/core.py step_with_batch_queue: pp batches in flight
    # KV connectors (NixlConnector, P2pNcclConnector, Mooncake): kv_role kv_producer / kv_consumer
    # (vllm/distributed/kv_transfer/, docs/features/disagg_prefill.md)
    disaggregation_roles = frozenset({"prefill", "decode"})
    # A steady decode (one token a step, no KV event and not its last token in sight) joins a cohort whose counters
    # advance lazily: a step walks only the other running requests and prices the cohort from two sums. When the
    # step's tokens or blocks might not fit (a cap could bind, an allocation could fail) the cohort is dissolved and
    # the exact per-request loop runs. Same results either way (tests/engines/test_fast_paths.py); off with pp > 1.
    # A request whose token times are recorded (Request.token_times: the detailed requests) never joins: the exact
    # loop writes each token's time.
    lazy_decode: ClassVar[bool] = True
    # Blocks of a request's own outputs are published at its next allocation or release, not the step that fills
    # them (KVCacheManager.defer_output_publish), so a member's only KV event is taking a block: the cohort counts
    # those instead of handling them one by one (see phase_members). No result changes (same tests).
    defer_output_publish: ClassVar[bool] = True

    def __init__(self, params: VllmParams, dep: Deployment):
        seqs, batched = vllm_batch_defaults(dep)
        self.max_num_seqs = params.max_num_seqs or seqs
        self.max_num_batched_tokens = params.max_num_batched_tokens or batched
        self.step_token_limit, self.batch_size_limit = self.max_num_batched_tokens, self.max_num_seqs
        super().__init__(params, dep)
        dep = self.dep   # with a speculative proposer's weights and KV
        p = params
        if p.enable_lora:   # the stacked LoRA weights of max_loras slots at max_lora_rank come out of the KV pool
            if p.max_cpu_loras is not None and p.max_cpu_loras < p.max_loras:
                raise InputError(f"must be >= max_loras ({p.max_loras}), got {p.max_cpu_loras}",
                                 field="max_cpu_loras")
            self.adapters = AdapterSlots(p.max_loras, p.max_cpu_loras or p.max_loras, p.max_lora_rank)
            dep = self.dep = dataclasses.replace(
                dep, adapter_weight_bytes_per_device=self.adapters.slot_bytes_per_device(dep.model, dep.tp))
        if p.kv_cache_memory_bytes:
            kv_bytes = float(p.kv_cache_memory_bytes)
            rule = "kv_cache_memory_bytes"
        else:
            kv_bytes = (p.gpu_memory_utilization * dep.hardware.memory_bytes - dep.weight_bytes_per_device
                        - activation_reserve_bytes(dep, self.max_num_batched_tokens, self.max_num_seqs)
                        - NON_TORCH_BYTES)
            rule = f"gpu_memory_utilization={p.gpu_memory_utilization} of total memory"
        tokens = kv_tokens_or_refuse(dep, kv_bytes, engine="vllm", rule=rule)
        num_blocks = tokens // p.block_size
        if num_blocks > 50_000_000:  # more than any device holds (a B200 has ~13M 16-token blocks of Llama-8B)
            raise InputError(f"a KV pool of {kv_bytes / 2**30:.0f} GiB is beyond any device; give "
                             "kv_cache_memory_bytes in bytes of one device's KV cache", field="kv_cache_memory_bytes")
        if p.max_model_len and p.max_model_len > dep.model.max_model_len:
            raise InputError(f"max_model_len {p.max_model_len} exceeds {dep.model.name}'s context of "
                             f"{dep.model.max_model_len} tokens (vLLM refuses it without "
                             f"VLLM_ALLOW_LONG_MAX_MODEL_LEN); use <= {dep.model.max_model_len}", field="max_model_len")
        self.kv = KVCacheManager(num_blocks, p.block_size, enable_prefix_caching=p.enable_prefix_caching)
        self.kv.defer_output_publish = self.defer_output_publish
        if p.kv_offloading_size:
            # native: cpu_bytes_to_use, the whole size over the TP x PP ranks, every computed block stored;
            # lmcache: max_local_cpu_size = size / (TP x PP) per worker, prompt blocks only (save_decode_cache off)
            self.kv.attach_host(host_tier(dep, p.kv_offloading_size * GIB / dep.num_devices, p.block_size,
                                          write_through=True, field="kv_offloading_size",
                                          caching=p.enable_prefix_caching,
                                          prompt_only=p.kv_offloading_backend == "lmcache"))
        if p.lmcache_max_local_disk_size:
            if p.kv_offloading_backend != "lmcache" or self.kv.host is None:
                raise InputError("a local disk tier is LMCache's: set kv_offloading_backend: lmcache and "
                                 "kv_offloading_size", field="lmcache_max_local_disk_size")
            self.kv.host.spill = host_tier(dep, p.lmcache_max_local_disk_size * GIB, p.block_size,
                                           write_through=False, field="lmcache_max_local_disk_size")
        self.max_model_len = min(p.max_model_len or dep.model.max_model_len, num_blocks * p.block_size)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.waiting_heap: list[tuple[int, float, int, Request]] = []
        self.priority = p.scheduling_policy == "priority"
        self.in_flight: set[int] = set()  # requests of batches still in the pipeline (pp > 1) are not rescheduled
        # drafts and adapters: per-request steps
        self.lazy = self.lazy_decode and dep.pp == 1 and self.speculation is None and self.adapters is None
        # KV slots a decode holds past its verified tokens for the drafter (Scheduler.num_lookahead_tokens: the
        # drafts for eagle and draft models, 0 for ngram)
        self.lookahead = self.speculation.lookahead_tokens if self.speculation is not None else 0
        self.steps_done = 0                # updates applied: the cohort's clock
        self.last_step_end_s = -1.0
        self.last_out = SchedulerOutput()  # the last step applied
        self.cohort: dict[int, tuple[Request, int]] = {}  # request_id -> (req, 1); engine_state = steps_done at joining
        self.cohort_context = 0            # sum of (prompt + outputs - steps_done) at joining; context = this + n*steps
        self.cohort_events: dict[int, list[tuple[int, Request]]] = {}  # step -> (order, req) of members whose
        # blocks change or whose last token is due at that step (a calendar: every step's list is taken whole)
        self.others: list[tuple[int, Request]] = []  # (running order, req): running requests outside the cohort
        self.num_ordered = 0               # running-order numbers handed out
        # Counted members: those whose only KV event is taking a block when their tokens fill the last one (their
        # own outputs' blocks are published at release, KVCacheManager.defer_output_publish, or never, being
        # private, Request.private_from; or caching is off).
        # A member that takes a block at step s takes one every block_size steps, so the step's takers are the
        # members of phase s % block_size. Their blocks leave the pool on that step, in running order, but go to
        # `spare` and reach the member's table when it leaves the cohort (block ids are labels: nothing can tell).
        self.phase_members: list[list[tuple[int, Request]]] = [[] for _ in range(p.block_size)]
        self.phase_of: dict[int, int] = {}  # request_id -> phase, for counted members
        self.spare: list[int] = []          # blocks taken for counted members, not yet in their tables
        self.cohort_in_flight = 0           # 1 between a step that carried the cohort and its update
        self.multi_step_left = 0            # num_scheduler_steps > 1: decode steps left in the current run
        # async_scheduling (vLLM's AsyncScheduler, EngineCore.step_with_batch_queue): step k+1 is scheduled before
        # step k's output is applied, so a request that finishes in step k still sits in `running` with its blocks
        # for one more decision (skipped: its last token is in flight) and is freed after it. Every other decision
        # is the synchronous one: computed tokens advance at scheduling and decodes hold an output placeholder.
        self.async_finish = p.async_scheduling
        self.finishing: list[Request] = []  # finished in the last update, released at the end of the next schedule

    def exact_mode(self) -> None:
        """No decode cohort and no deferred publishing: every request walked and every block published each step."""
        super().exact_mode()
        self.sync()
        self.lazy = False
        self.kv.defer_output_publish = False

    @classmethod
    def speculation_of(cls, params: VllmParams, dep: Deployment) -> Speculation | None:
        c = params.speculative_config
        if c is None:
            return None
        k = c.num_speculative_tokens
        if k is None:
            if c.method != "mtp":
                raise InputError(f"give num_speculative_tokens for method {c.method}",
                                 field="speculative_config.num_speculative_tokens")
            k = 1   # the model's num_nextn_predict_layers (DeepSeek-V3: 1)
        return resolve(c.method, k, c, target=dep.model, at="speculative_config", draft_model=c.model,
                       lookahead=True)

    def make_timing(self) -> EngineTiming:
        p = self.params
        return EngineTiming(
            # ESTIMATE: V1 EngineCore schedule + input prep ~1 ms and output processing ~0.5 ms per step at
            # moderate batch (vLLM V1 blog, Jan 2025: CPU overheads hidden by async scheduling/busy loop); a
            # multi-step run schedules once for all its steps.
            scheduler_cpu_s=1.0e-3 / p.num_scheduler_steps, output_cpu_s=0.5e-3, overlap=p.async_scheduling,
            seq_cpu_s=PYTHON_SEQ_CPU_S, frontend_s=PYTHON_FRONTEND_S,
            cuda_graph_sizes=() if p.enforce_eager else vllm_capture_sizes(self.max_num_seqs,
                                                                           self.max_num_batched_tokens),
            graph_padding=True, graph_mixed_steps=not p.enforce_eager,  # FULL_AND_PIECEWISE
            custom_allreduce=True)  # ParallelConfig.disable_custom_all_reduce defaults to False (config/parallel.py)

    # ---- queues -------------------------------------------------------------------------------------
    def num_waiting(self) -> int:   # waiting, and those whose KV is on its way (WAITING_FOR_REMOTE_KVS)
        return (len(self.waiting_heap) if self.priority else len(self.waiting)) + len(self.loading)

    def _push_waiting(self, req: Request, front: bool = False) -> None:
        if self.priority:
            heapq.heappush(self.waiting_heap, (req.priority, req.arrival_s, req.request_id, req))
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _peek_waiting(self) -> Request:
        return self.waiting_heap[0][3] if self.priority else self.waiting[0]

    def _pop_waiting(self) -> Request:
        return heapq.heappop(self.waiting_heap)[3] if self.priority else self.waiting.popleft()

    def add_request(self, req: Request, now: float) -> bool:
        if not self.check_length(req):
            return False
        if not self.check_adapter(req, "enable_lora"):
            return False
        self._push_waiting(req)
        return True

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: sum of scheduled tokens <= max_num_batched_tokens; len(running) <= max_num_seqs;
        # waiting requests are admitted only if this step preempted nothing.
        out = SchedulerOutput()
        budget = self._schedule_cohort(out) if self.lazy else None
        exact = budget is None
        if exact:
            budget = self._schedule_running(out, now)
        num_running = len(self.running)
        in_run = self.multi_step_left > 0   # a multi-step run admits nobody until it ends
        if not out.preempted and not in_run:
            self._schedule_waiting(out, budget, now)
        if self.lazy:  # the admitted join the others at the end of the running order (all of running after the loop)
            self._order(self.running if exact else self.running[num_running:], fresh=exact)
            out.shape = self.make_shape(out.scheduled, out.num_lazy,
                                        self.cohort_context + out.num_lazy * self.steps_done)
            self.cohort_in_flight = 1 if out.num_lazy else 0  # until update: members hold this step's blocks
        else:
            out.shape = self.make_shape(out.scheduled)
        if self.adapters is not None:
            self.adapters.shape_step(out.scheduled, out.shape)
        if self.params.num_scheduler_steps > 1:   # a decode-only step starts a run of num_scheduler_steps
            self.multi_step_left = (self.multi_step_left - 1 if in_run else
                                    0 if out.shape.prefill_chunks else self.params.num_scheduler_steps - 1)
        if self.dep.pp > 1:
            self.in_flight.update(r.request_id for r, _ in out.scheduled)
        if self.finishing:
            out.released = len(self.finishing)
            for req in self.finishing:
                self.release(req)
            self.finishing = []
        return out

    def on_finished(self, finished: list[Request], now: float) -> None:
        if self.async_finish:
            self.finishing += finished
        else:
            super().on_finished(finished, now)

    def update(self, out: SchedulerOutput, now: float):
        if self.in_flight:
            self.in_flight.difference_update(r.request_id for r, _ in out.scheduled)
        res = super().update(out, now)
        if out.num_lazy:  # every cohort member's previous token came at the end of the previous step
            itl, prev = res.itl_groups, self.last_step_end_s
            itl[prev] = itl.get(prev, 0) + out.num_lazy
        self.last_step_end_s = now
        self.last_out = out
        self.steps_done += 1
        self.cohort_in_flight = 0
        return res

    # ---- the decode cohort ----------------------------------------------------------------------------
    def _order(self, reqs: list[Request], *, fresh: bool) -> None:
        """Number `reqs` in running order after every request numbered so far; `fresh` replaces the others."""
        if not reqs and not fresh:
            return
        start = self.num_ordered
        self.num_ordered += len(reqs)
        numbered = list(zip(range(start, self.num_ordered), reqs))
        if fresh:
            self.others = numbered
        else:
            self.others += numbered

    def _schedule_cohort(self, out: SchedulerOutput) -> int | None:
        """The running-request part of a step with the cohort advanced as a whole: steady others join it, members
        whose blocks change this step allocate (in running order, with the others), members due their last token
        leave it and the others go through the exact per-request rules. Returns the budget left, or None after
        dissolving the cohort when the exact loop must decide (a cap could bind or an allocation fail)."""
        step, cohort, events = self.steps_done, self.cohort, self.cohort_events
        others, prev = [], self.last_step_end_s
        kv = self.kv
        bs = kv.block_size
        phase_members, phase_of = self.phase_members, self.phase_of
        uncached, defer = not kv.enable_prefix_caching, kv.defer_output_publish
        for entry in self.others:
            req = entry[1]
            if req.status is not Status.RUNNING:
                continue  # finished since
            out_tokens, computed = req.num_output_tokens, req.num_computed_tokens
            if (out_tokens and computed == req.prompt_len + out_tokens - 1 and req.last_token_s == prev
                    and out_tokens + 1 < req.output_len and not req.structured and req.token_times is None):
                cohort[req.request_id] = (req, 1)
                req.engine_state = step
                self.cohort_context += req.prompt_len + out_tokens - step
                kv_in = req.kv_settled_tokens - computed  # tokens its blocks take before it needs another
                last_in = req.output_len - 1 - out_tokens  # steps to its last token
                if 0 <= kv_in < bs and (uncached or defer and req.unique_outputs or req.private_from <= computed):
                    phase = (step + kv_in) % bs  # counted: its blocks fill at steps step + kv_in + k * bs
                    phase_members[phase].append(entry)
                    phase_of[req.request_id] = phase
                    when = step + last_in
                else:  # its first event: blocks change, or last token due
                    when = step + (kv_in if kv_in < last_in else last_in) if kv_in > 0 else step
                events.setdefault(when, []).append(entry)
                continue
            others.append(entry)
        # members whose event is this step, popped in running order: their blocks change, or their last token is due
        due: list[tuple[int, Request, int]] = []  # (running order, req, 1)
        now_due = events.pop(step, None)
        if now_due:
            if len(now_due) > 1:
                now_due.sort()  # running order
            leavers = False
            for order, req in now_due:
                steps = step - req.engine_state  # _materialise's counters, inline
                if steps:
                    req.num_computed_tokens += steps
                    req.num_output_tokens += steps
                    req.last_token_s = prev
                req.engine_state = step
                if req.num_output_tokens + 1 < req.output_len:
                    due.append((order, req, 1))
                    continue
                req.engine_state = None  # its last token: the exact rules finish it
                rid = req.request_id
                del cohort[rid]
                self.cohort_context -= req.prompt_len + req.num_output_tokens - step
                phase = phase_of.pop(rid, None)
                if phase is not None:
                    phase_members[phase].remove((order, req))
                    self._claim(req)
                others.append((order, req))
                leavers = True
            if leavers:
                others.sort()
        self.others = others
        # the step fits (no cap binds, no allocation fails) when every request's tokens and new blocks do
        budget = self.max_num_batched_tokens - len(cohort)
        threshold = self.params.long_prefill_token_threshold
        alone = threshold and self._alone()
        takers = phase_members[step % bs]  # counted members whose blocks fill: one new block each
        needed = len(due) + len(takers)  # an evented member needs at most one block
        scheduled, allocating = [], []
        for order, req in others:
            computed = req.num_computed_tokens
            n = req.prompt_len + req.num_output_tokens - computed
            if 0 < threshold < n and not alone:
                n = threshold
            budget -= n
            if computed + n > req.kv_settled_tokens:
                needed += kv.blocks_needed(req, n)
                allocating.append((order, req, n))
            scheduled.append((req, n))
        pool = kv.pool
        free = pool.num_free
        if needed > free and due:
            needed += sum(kv.blocks_needed(r, 1) for _, r, _ in due) - len(due)
        if budget < 0 or needed > free:
            self._dissolve()
            return None
        out.scheduled = [*cohort.values(), *scheduled]
        out.num_lazy = len(cohort)
        if allocating or (due and takers):  # blocks leave the pool in running order
            allocating += due
            allocating += [(order, req, 0) for order, req in takers]
            allocating.sort()
        else:
            allocating = due
            if takers:
                self.spare += pool.allocate(len(takers))
        allocate, append, spare = kv.allocate_slots, kv.append_slot, self.spare
        for order, req, n in allocating:
            if not n:  # a counted member's block
                spare.append(pool.allocate_one())
                continue
            computed = req.num_computed_tokens
            if computed + n > req.kv_settled_tokens and not (append(req) if n == 1 else allocate(req, n)):
                raise RuntimeError(f"vLLM cohort step: allocation for request {req.request_id} failed after the "
                                   "block check")
            if req.engine_state is not None:  # a member: queue its next event (kv_in, last_in >= 1 after allocating)
                kv_in = req.kv_settled_tokens - computed
                last_in = req.output_len - 1 - req.num_output_tokens
                events.setdefault(step + (kv_in if kv_in < last_in else last_in), []).append((order, req))
        return budget

    def _materialise(self, req: Request) -> None:
        """Write a cohort member's counters as of now, and put a counted member's blocks in its table."""
        steps = self.steps_done - req.engine_state
        if steps:
            req.num_computed_tokens += steps
            req.num_output_tokens += steps
            req.last_token_s = self.last_step_end_s
        if req.request_id in self.phase_of:
            self._claim(req)

    def _claim(self, req: Request) -> None:
        """A counted member's blocks taken since it joined (or last claimed), from `spare` into its table; its
        counters are current (and with a step in flight, its blocks also hold the token that step computes)."""
        kv = self.kv
        k = kv.blocks_for(req.num_computed_tokens + self.cohort_in_flight) - kv.num_blocks_of(req)
        if k:
            spare = self.spare
            kv.adopt(req, spare[-k:])
            del spare[-k:]

    def _dissolve(self) -> None:
        """Every member back to exact per-request scheduling (a step the cohort cannot take as a whole)."""
        for req, _ in self.cohort.values():
            self._materialise(req)
            req.engine_state = None
        self.cohort.clear()
        self.cohort_events.clear()
        self.cohort_context = 0
        self.phase_of.clear()
        for members in self.phase_members:
            members.clear()

    def sync(self) -> None:
        for req, _ in self.cohort.values():
            self._materialise(req)
            req.engine_state = self.steps_done

    def check_invariants(self) -> None:
        self.sync()
        super().check_invariants()
        if not self.lazy:
            return
        members = [r for r, _ in self.cohort.values()]
        others = [r for _, r in self.others if r.status is Status.RUNNING]
        running = [r.request_id for r in self.running if r.status is not Status.FINISHED]  # async: finishing
        assert sorted(r.request_id for r in members + others) == sorted(running), \
            "cohort and others are not the running set"
        assert sum(map(len, self.cohort_events.values())) == len(members), "a member without its leave event"
        assert not self.spare, "blocks taken for counted members and in no table"
        counted = sorted(r.request_id for m in self.phase_members for _, r in m)
        assert counted == sorted(self.phase_of), "phase lists and phase_of disagree"
        bs = self.kv.block_size
        for phase, m in enumerate(self.phase_members):
            for _, r in m:
                assert r.kv_settled_tokens == self.kv.num_blocks_of(r) * bs, "a counted member with an event"
                assert (self.steps_done + r.kv_settled_tokens - r.num_computed_tokens) % bs == phase, "phase drift"
        assert all(step >= self.steps_done for step in self.cohort_events), "a member stayed past its event"
        assert all(r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens < r.output_len
                   for r in members), "a member that is not a steady decode"
        assert self.cohort_context + len(members) * self.steps_done == sum(r.num_tokens for r in members)

    def _cap(self, n: int, budget: int, alone: bool) -> int:
        t = self.params.long_prefill_token_threshold
        if 0 < t < n and not alone:
            n = t
        return min(n, budget)

    def _alone(self) -> bool:
        return len(self.running) + self.num_waiting() == 1

    def _schedule_running(self, out: SchedulerOutput, now: float) -> int:
        budget = self.max_num_batched_tokens
        running = self.running
        alone = self._alone()
        threshold = self.params.long_prefill_token_threshold
        allocate = self.kv.allocate_slots
        in_flight = self.in_flight
        schedule = out.scheduled.append
        speculating = self.speculation is not None
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.status is Status.FINISHED:  # async: its last token is in flight (vLLM skips it)
                i += 1
                continue
            computed = req.num_computed_tokens
            n = req.prompt_len + req.num_output_tokens - computed
            reserve = 0
            if speculating and n == 1 and req.num_output_tokens:  # 1 + drafts (num_tokens_with_spec)
                n += self.drafts(req, len(running))
                reserve = computed + n + self.lookahead
            if threshold or n > budget:
                n = self._cap(n, budget, alone)   # drafts that do not fit the budget are dropped
            if n <= 0 or (in_flight and req.request_id in in_flight):
                i += 1
                continue
            if computed + n <= req.kv_settled_tokens and reserve <= req.kv_settled_tokens:  # held blocks take
                # the tokens (allocate_slots' fast path)
                schedule((req, n))
                budget -= n
                i += 1
                continue
            blocked = False
            while not allocate(req, n, reserve_tokens=reserve):
                victim = self._victim()
                alone = False
                if victim is None:  # every other request is in flight: wait for a batch to come back
                    blocked = True
                    break
                before = self.priority and running.index(victim) < i  # vLLM: `if victim_index < req_index`
                budget += self._preempt(victim, out)  # priority mode may take one scheduled before req: tokens back
                if before:
                    i -= 1
                if victim is req:
                    break
            if blocked:
                break
            if req.status is Status.PREEMPTED:
                if self.priority:
                    continue  # running shrank; the same index now holds the next request
                break
            schedule((req, n))
            budget -= n
            i += 1
        return budget

    def _victim(self) -> Request | None:
        idle = [r for r in self.running if r.request_id not in self.in_flight] if self.in_flight else self.running
        if not idle:
            return None
        if self.priority:
            return max(idle, key=lambda r: (r.priority, r.arrival_s))
        return idle[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Preempt `req` by recompute; return the tokens it had been scheduled this step (priority mode can pick a
        request scheduled earlier in the loop: vLLM unschedules it, v1/core/sched/scheduler.py `schedule`)."""
        if req.status is Status.FINISHED:   # async: finished, last token in flight; its blocks go now
            self.finishing.remove(req)
            self.release(req)
            self.num_preemptions += 1
            out.preempted.append(req)
            return 0
        scheduled = 0
        if self.priority:
            for k, (r, n) in enumerate(out.scheduled):
                if r is req:
                    scheduled = n
                    del out.scheduled[k]
                    break
        if self.kv.defer_output_publish:  # the blocks its scheduled tokens fill were cached when they were allocated
            self.kv.publish_through(req, req.num_computed_tokens + scheduled)
        self.running.remove(req)
        cached = None
        if self.async_finish and req.last_token_s == self.last_step_end_s and req.num_output_tokens >= 2 and \
                (req, 1) in self.last_out.scheduled:
            # a decode in the last step (its input the token the step before sampled): vLLM caches blocks through
            # the tokens whose output was applied, so the block that decode filled is not in the prefix cache yet
            # (it would be at that step's update_from_output, cache_blocks)
            cached = req.num_computed_tokens - 1
        self.drop_for_recompute(req, out, cached)
        self._push_waiting(req, front=True)
        return scheduled

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        queue = self.waiting_heap if self.priority else self.waiting
        # max_loras: a waiting request whose adapter would be one too many this step is skipped (it keeps its place;
        # later ones may pass it: scheduler.py skipped_waiting_requests)
        loras = {r.lora_id for r, _ in out.scheduled if r.lora_id >= 0} if self.adapters is not None else None
        skipped: list[Request] = []
        while budget > 0 and queue and len(self.running) < self.max_num_seqs:
            req = self._peek_waiting()
            if loras is not None and not self.adapters.admits(loras, req):
                skipped.append(self._pop_waiting())   # (an admission that fails below stops the loop: a set that
                continue                              # took its adapter is not used again)
            hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else NO_HIT
            if req.remote_kv_tokens:
                if not self._reserve_remote(req, hit, out):
                    break
                continue
            if self.kv.host is not None and not req.num_computed_tokens:
                host, disk = self.kv.host_hit(req, hit)
                if host + disk:
                    if not self._load_from_host(req, hit, host + disk, disk, out):
                        break
                    continue
            num_new = req.num_tokens - req.num_computed_tokens - hit.num_tokens
            n = self._cap(num_new, budget, self._alone())
            # scheduler_reserve_full_isl: blocks for the whole current sequence must be free at admission (a check:
            # only this step's tokens get blocks; max_model_len is capped to the pool, so an empty engine admits)
            if not self.kv.allocate_slots(req, n, hit, fits_tokens=req.num_tokens):
                break  # strict FCFS: head-of-line blocking, no preemption for waiting requests
            self._pop_waiting()
            req.num_computed_tokens += hit.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            self.mark_scheduled(req, now)
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        for req in reversed(skipped):
            self._push_waiting(req, front=True)

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
