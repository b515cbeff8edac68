"""vLLM V1 scheduler (vllm-project/vllm vllm/v1/core/sched/scheduler.py, tag v0.33.0).

Running requests first in admission order, then waiting ones into the leftover token budget; decodes and
prefill chunks share one budget (chunked prefill always on); admission needs blocks for the whole prompt;
recompute preemption of the last-admitted (or lowest-priority) request; full-block hashed prefix cache. With
`use_v1: false`, V0's (vllm/core/scheduler.py of 0.5-0.7, _schedule_default): unchunked, a step of new prompts alone
whenever one is admitted, decodes only when none is; no async scheduling; defaults in engines/vllm_config.py.

Simulation speed (not vLLM mechanisms): steady decodes are advanced as one lazy cohort (engines/decode_cohort.py)
and blocks of a request's own outputs are published at its next allocation (KVCacheManager.defer_output_publish);
`Scenario.exact` turns both off.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from typing import ClassVar

from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.cost.timing import PYTHON_FRONTEND_S, PYTHON_SEQ_CPU_S, TOKENIZE_S_PER_TOKEN, EngineTiming
from simengine.engines.base import ENGINES
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.lora import AdapterSlots
from simengine.engines.memory import Deployment
from simengine.engines.multi_step import MultiStepDelivery
from simengine.engines.speculative import Speculation
from simengine.engines.vllm_config import (
    V0_WATERMARK,
    VllmParams,
    fp8_weight_only,
    vllm_batch_defaults,
    vllm_capture_sizes,
    vllm_chunked_prefill,
    vllm_kv_cache,
    vllm_speculation,
)
from simengine.engines.vllm_connectors import VllmConnectors
from simengine.errors import InputError
from simengine.kvcache.manager import NO_HIT


@ENGINES.register("vllm")
class VllmEngine(VllmConnectors):
    Params = VllmParams
    vendors = frozenset({"nvidia", "amd", "intel", "huawei"})
    kernel_backend = "vllm"  # vLLM's own kernels (aiconfigurator-core's vllm tables)
    overlap_schedules_ahead = True  # async_scheduling: core.py step_with_batch_queue schedules k+1 while k runs
    support_source = "vLLM docs 'GPU installation' (CUDA, ROCm, XPU) and the vllm-ascend plugin; Gaudi via vllm-gaudi"
    supports_expert_parallel = True  # vLLM --enable-expert-parallel (docs: expert parallel deployment)
    supports_attention_dp = True  # --data-parallel-size with --enable-expert-parallel (docs: data parallel deployment)
    supports_pipeline_microbatches = True  # v1/engine/core.py step_with_batch_queue: pp batches in flight
    # KV connectors (NixlConnector, P2pNcclConnector, Mooncake): kv_role kv_producer / kv_consumer
    # (vllm/distributed/kv_transfer/, docs/features/disagg_prefill.md)
    disaggregation_roles = frozenset({"prefill", "decode"})
    # speed devices (module docstring): steady decodes in a DecodeCohort, off with pp > 1, speculation or LoRA
    # (per-request steps); own-output blocks published late, so a cohort member's only KV event is taking a block
    lazy_decode = True
    defer_output_publish: ClassVar[bool] = True

    def __init__(self, params: VllmParams, dep: Deployment):
        dep = fp8_weight_only(dep)
        seqs, batched = vllm_batch_defaults(params, dep)
        self.chunked_prefill = vllm_chunked_prefill(params, dep)
        # V0 without chunked prefill: steps of new prompts alone, decodes only when none is admitted
        self.prefill_first = not params.use_v1 and not self.chunked_prefill
        self.async_scheduling = params.async_scheduling and params.use_v1   # V0 never had it
        self.max_num_seqs = params.max_num_seqs or seqs
        self.max_num_batched_tokens = params.max_num_batched_tokens or batched
        model_len = params.max_model_len or dep.model.max_model_len
        if not self.chunked_prefill and self.max_num_batched_tokens < model_len:   # SchedulerConfig._verify_args
            raise InputError(f"{self.max_num_batched_tokens} is smaller than max_model_len ({model_len}) with chunked "
                             "prefill off, which vLLM refuses at startup; raise max_num_batched_tokens, lower "
                             "max_model_len or enable_chunked_prefill", field="max_num_batched_tokens")
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
                dep, adapter_weight_bytes_per_device=self.adapters.slot_bytes_per_device(dep.model, dep.attention_tp))
        self.kv = vllm_kv_cache(p, dep, self.max_num_batched_tokens, self.max_num_seqs)
        # late publishing is exact only where nothing keys on when a block is published: not with speculation (a
        # rollback past rejected drafts) or a host tier (write-through stores a block when it is published)
        self.kv.defer_output_publish = self.defer_output_publish and self.speculation is None and self.kv.host is None
        num_blocks = self.kv.num_blocks
        self.watermark_blocks = int(V0_WATERMARK * num_blocks) if not p.use_v1 else 0
        self.max_model_len = min(p.max_model_len or dep.model.max_model_len, num_blocks * p.block_size)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.waiting_heap: list[tuple[int, float, int, Request]] = []
        self.priority = p.scheduling_policy == "priority"
        # drafts and adapters: per-request steps
        lazy = self.lazy_decode and dep.pp == 1 and self.speculation is None and self.adapters is None and \
            p.num_scheduler_steps == 1   # a multi-step run streams at its end (engines/multi_step.py)
        self.cohort = DecodeCohort(self.kv, self.max_num_batched_tokens,
                                   self._cap_running if p.long_prefill_token_threshold else None) if lazy else None
        # KV slots a decode holds past its verified tokens for the drafter (Scheduler.num_lookahead_tokens: the
        # drafts for eagle and draft models, 0 for ngram)
        self.lookahead = self.speculation.lookahead_tokens if self.speculation is not None else 0
        self.last_step_end_s = -1.0
        self.last_out = SchedulerOutput()  # the last step applied
        self.multi_step_left = 0            # num_scheduler_steps > 1: decode steps left in the current run
        self.delivery = MultiStepDelivery() if p.num_scheduler_steps > 1 else None
        # async_scheduling (vLLM's AsyncScheduler, EngineCore.step_with_batch_queue): step k+1 is scheduled before
        # step k's output is applied, so a request that finishes in step k still sits in `running` with its blocks
        # for one more decision (skipped: its last token is in flight) and is freed after it. Every other decision
        # is the synchronous one: computed tokens advance at scheduling and decodes hold an output placeholder.
        self.finishing: list[Request] = []  # finished in the last update, released at the end of the next schedule

    def exact_mode(self) -> None:
        """No decode cohort and no deferred publishing: every request walked and every block published each step."""
        super().exact_mode()
        self.kv.defer_output_publish = False

    @classmethod
    def speculation_of(cls, params: VllmParams, dep: Deployment) -> Speculation | None:
        return vllm_speculation(params, dep)

    def make_timing(self) -> EngineTiming:
        p = self.params
        return EngineTiming(
            # ESTIMATE: V1 EngineCore schedule + input prep ~1 ms and output processing ~0.5 ms per step at
            # moderate batch (vLLM V1 blog, Jan 2025: CPU overheads hidden by async scheduling/busy loop); a
            # multi-step run schedules once for all its steps.
            scheduler_cpu_s=1.0e-3, steps_per_schedule=p.num_scheduler_steps, output_cpu_s=0.5e-3,
            overlap=self.async_scheduling,
            seq_cpu_s=PYTHON_SEQ_CPU_S, frontend_s=PYTHON_FRONTEND_S, tokenize_s_per_token=TOKENIZE_S_PER_TOKEN,
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
        if not self.admit_length(req):
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
        cohort = self.cohort
        in_run = self.multi_step_left > 0   # a multi-step run admits nobody until it ends
        num_running, exact = len(self.running), False
        if self.prefill_first and not in_run and self.num_waiting():   # V0 _schedule_default: prompts alone
            self._schedule_waiting(out, self.max_num_batched_tokens, now)
        if not out.scheduled:
            budget = cohort.schedule_running(out) if cohort is not None else None
            exact = budget is None
            if budget is None:
                budget = self._schedule_running(out, now)
            num_running = len(self.running)
            if not out.preempted and not in_run and not self.prefill_first:
                self._schedule_waiting(out, budget, now)
        if cohort is not None:  # the admitted join the others at the end of the running order (all of it if exact)
            cohort.order(self.running if exact else self.running[num_running:], fresh=exact)
        out.shape = self.make_shape(out.scheduled, out.num_lazy)
        if self.adapters is not None:
            self.adapters.shape_step(out.scheduled, out.shape)
        if self.params.num_scheduler_steps > 1:   # a decode-only step starts a run of num_scheduler_steps
            self.multi_step_left = (self.multi_step_left - 1 if in_run else
                                    0 if out.shape.prefill_chunks or not out.scheduled else
                                    self.params.num_scheduler_steps - 1)
        if self.finishing:
            out.released = len(self.finishing)
            for req in self.finishing:
                self.release(req)
            self.finishing = []
        return out

    def num_running_reported(self) -> int:   # make_stats runs after update_from_output has freed the finished
        return len(self.running) - len(self.finishing)

    def on_finished(self, finished: list[Request], now: float) -> None:
        if self.async_scheduling:
            self.finishing += finished
        else:
            super().on_finished(finished, now)

    def update(self, out: SchedulerOutput, now: float):
        if self.delivery is not None:   # V0 multi-step: the run streams at its end (engines/multi_step.py)
            self.delivery.before(out.scheduled)
        res = super().update(out, now)
        if self.delivery is not None:   # the run ends early when every request of it finished
            if all(r.status is Status.FINISHED for r in self.running):
                self.multi_step_left = 0
            res = self.delivery.after(res, now, run_over=not self.multi_step_left)
        self.last_step_end_s = now
        self.last_out = out
        return res

    def check_invariants(self) -> None:
        # async finishing: a finishing request is out of both the cohort and its others
        self.check_cohort([r for r in self.running if r.status is not Status.FINISHED])
        super().check_invariants()

    def _cap_running(self, req: Request, n: int) -> int:
        """long_prefill_token_threshold on a running request's tokens when the budget does not bind (the cohort's
        chunk)."""
        t = self.params.long_prefill_token_threshold
        return t if 0 < t < n and not self._alone() else n

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
        if self.async_scheduling and req.last_token_s == self.last_step_end_s and req.num_output_tokens >= 2 and \
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
            if loras is not None and self.adapters is not None and not self.adapters.admits(loras, req):
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
            if not self.chunked_prefill and num_new > budget:
                break   # a prompt is admitted whole or not at all
            n = self._cap(num_new, budget, self._alone())
            # scheduler_reserve_full_isl: blocks for the whole current sequence must be free at admission (a check:
            # only this step's tokens get blocks; max_model_len is capped to the pool, so an empty engine admits)
            if not self.kv.allocate_slots(req, n, hit, fits_tokens=req.num_tokens,
                                          watermark_blocks=self.watermark_blocks):
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
