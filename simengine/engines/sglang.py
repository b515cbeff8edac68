"""SGLang scheduler (srt/managers/scheduler.py, schedule_policy.py; 0.5.23); docs/engines/sglang.md.

Prefill first: whenever a prefill batch can be formed it runs instead of decode (decodes pause for every chunk of a
long prompt; mixed only with enable_mixed_chunk). The PrefillAdder admits in policy order while free + evictable
radix tokens minus the running requests' projected decode growth (new_token_ratio x min(max_new, 4096)) covers the
prompt and its own growth; at most one chunked request. new_token_ratio decays from 0.7 to 0.098 over 600 decode
steps and jumps back after a retraction; a decode that does not fit retracts the request with the fewest outputs
(tie: longest prompt), which recomputes later. Token-granular radix cache: prompts are inserted as prefill
progresses, whole sequences at finish; LRU eviction of unlocked leaves.
Speed device (docs/performance.md): steady decodes advance in a DecodeCohort on decode steps (`schedule_lockstep`)
unless speculation, mixed chunks, adapters, the host tier or pipeline stages are on (a retraction dissolves it).
"""

from __future__ import annotations

import dataclasses

from simengine.core.batch import SchedulerOutput, StepResult
from simengine.core.request import Request, Status
from simengine.cost.timing import PYTHON_FRONTEND_S, PYTHON_SEQ_CPU_S, TOKENIZE_S_PER_TOKEN, EngineTiming
from simengine.engines.base import ENGINES
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.memory import Deployment, kv_tokens_or_refuse
from simengine.engines.paged import RadixCacheViews
from simengine.engines.sglang_config import (
    SglangParams,
    sglang_adapter_slots,
    sglang_decode_graph_sizes,
    sglang_gpu_defaults,
    sglang_host_tier,
    sglang_kv_bytes,
    sglang_mem_fraction_static,
    sglang_speculation,
)
from simengine.engines.sglang_disagg import SglangDecodeSide
from simengine.engines.sglang_policy import CLIP_MAX_NEW_TOKENS, AddResult, PrefillAdder, order_waiting, reserved_tokens
from simengine.engines.speculative import Speculation
from simengine.kvcache.radix import RadixCache, RadixHold, radix_tokens

INIT_NEW_TOKEN_RATIO = 0.7          # environ.py SGLANG_INIT_NEW_TOKEN_RATIO (x schedule_conservativeness)
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14   # environ.py SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600   # environ.py SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20           # environ.py SGLANG_RETRACT_DECODE_STEPS


@ENGINES.register("sglang")
class SglangEngine(RadixCacheViews, SglangDecodeSide):
    Params = SglangParams
    lazy_decode = True  # speed device (module docstring)
    vendors = frozenset({"nvidia", "amd", "huawei"})
    kernel_backend = "sglang"  # SGLang's own kernels (aiconfigurator-core's sglang tables)
    overlap_schedules_ahead = True  # event_loop_overlap: recv, schedule, launch batch k+1, then batch k's result
    support_source = "SGLang docs 'Install' (CUDA), 'AMD GPUs' (ROCm MI300/MI325/MI355), 'Ascend NPUs' (sgl-kernel-npu)"
    supports_expert_parallel = True  # --ep-size / --enable-ep-moe (arg_groups/fields/parallel.py)
    supports_attention_dp = True  # --enable-dp-attention with --dp-size (server_args.py enable_dp_attention)
    # --disaggregation-mode prefill: a finished request's KV stays locked in the inflight queue until the
    # transfer backend (mooncake, nixl) has sent it (python/sglang/srt/disaggregation/prefill.py);
    # --disaggregation-mode decode: prealloc queue -> transfer queue -> prebuilt batch -> running batch
    # (disaggregation/decode.py), without the decode-side radix cache (--disaggregation-decode-enable-radix-cache off)
    disaggregation_roles = frozenset({"prefill", "decode"})

    def __init__(self, params: SglangParams, dep: Deployment):
        p = params
        cps, max_bs = sglang_gpu_defaults(dep)
        self.chunked_prefill_size = p.chunked_prefill_size or cps
        self.graph_max_bs = p.cuda_graph_max_bs_decode or max_bs
        act_tokens = self.chunked_prefill_size if self.chunked_prefill_size > 0 else p.max_prefill_tokens
        self.mem_fraction = p.mem_fraction_static or sglang_mem_fraction_static(dep, act_tokens, self.graph_max_bs)
        super().__init__(params, dep)
        dep = self.dep   # with a speculative proposer's weights and KV
        self.adapters = sglang_adapter_slots(p)
        if self.adapters is not None:   # the LoRA pool comes out of the KV pool
            dep = self.dep = dataclasses.replace(
                dep, adapter_weight_bytes_per_device=self.adapters.slot_bytes_per_device(dep.model, dep.attention_tp))
        tokens = kv_tokens_or_refuse(dep, lambda d: sglang_kv_bytes(d, self.mem_fraction), engine="sglang",
                                     rule=f"mem_fraction_static={self.mem_fraction} of the memory free before loading")
        if p.max_total_tokens:
            tokens = min(tokens, p.max_total_tokens)
        context = p.context_length or dep.model.max_model_len
        self.max_running_requests = p.max_running_requests or max(1, min(
            max(2048, min(4096, int(tokens / context * 512))), tokens // 2))
        # max_req_len: a request must fit the pool alone, with the adder's one-page margin
        self.max_model_len = min(context, tokens - p.page_size - 1)
        cps_on = self.chunked_prefill_size > 0
        slots = 1 + (self.speculation.num_tokens if self.speculation is not None else 0)  # a decode and its drafts
        self.step_token_limit = max(self.chunked_prefill_size, self.max_running_requests * slots) if cps_on else None
        self.batch_size_limit = self.max_running_requests
        self.cache = RadixCache(tokens, page_size=p.page_size, enabled=not p.disable_radix_cache)
        self.host = sglang_host_tier(p, dep, tokens)
        self.holds: dict[int, RadixHold] = {}   # request id -> its claim on the radix pool (locked prefix, slots)
        self.onboarded = 0                    # tokens this step loads back from the host tier
        cache_aware = p.schedule_policy in ("lpm", "dfs-weight")
        # without the tree, cache-aware policies fall back to fcfs (_validate_and_adjust_policy)
        self.policy = "fcfs" if cache_aware and p.disable_radix_cache else p.schedule_policy
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * p.schedule_conservativeness, 1.0)
        self.min_ratio = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.ratio_decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.chunked: Request | None = None
        self.batch_is_full = False
        self._entry: dict[int, int] = {}       # request id -> queue-entry sequence (priority tie-break)
        self._seq = 0
        self._prefilled: list[Request] = []
        # P/D decode side: requests waiting for KV slots (DecodePreallocQueue) and arrived (the prebuilt batch the
        # next schedule merges into running); those with slots and KV on its way (DecodeTransferQueue): self.loading
        self.prealloc: list[Request] = []
        self.prebuilt: list[Request] = []
        self.step_in_flight: SchedulerOutput | None = None   # scheduled, not yet updated
        lazy = (self.lazy_decode and dep.pp == 1 and self.speculation is None and not p.enable_mixed_chunk
                and self.adapters is None and self.host is None)
        # members: their reserved growth (max_tokens - outputs) is under the clip, so the adder's sum over them is
        # the cohort's closed form; their private slots are their computed tokens outside the tree
        self.cohort = DecodeCohort(None, 0, steady=lambda r: r.max_tokens - r.num_output_tokens <= CLIP_MAX_NEW_TOKENS,
                                   settle=self._settle) if lazy else None

    def _settle(self, req: Request) -> None:
        """A cohort member's private slots, its counters written: its computed tokens (and the slot of a step in
        flight) beyond those the tree holds for it."""
        assert self.cohort is not None
        hold = self.holds[req.request_id]
        hold.private = req.num_computed_tokens + self.cohort.in_flight - hold.cached

    @classmethod
    def speculation_of(cls, params: SglangParams, dep: Deployment) -> Speculation | None:
        return sglang_speculation(params, dep)

    def make_timing(self) -> EngineTiming:
        p = self.params
        return EngineTiming(
            # ESTIMATE: SGLang's Python scheduler spends ~1 ms building a batch and ~0.5 ms processing results per
            # step; with the overlap scheduler (on by default) it runs while the GPU computes the previous batch
            # ('zero-overhead batch scheduler', SGLang v0.4 blog, Dec 2024), so only the excess shows. Speculative
            # decoding turns it off (server_args.py: "Overlap scheduler is disabled because of using eagle ...")
            scheduler_cpu_s=1.0e-3, output_cpu_s=0.5e-3,
            overlap=not p.disable_overlap_schedule and self.speculation is None,
            seq_cpu_s=PYTHON_SEQ_CPU_S, frontend_s=PYTHON_FRONTEND_S, tokenize_s_per_token=TOKENIZE_S_PER_TOKEN,
            cuda_graph_sizes=() if p.disable_cuda_graph else sglang_decode_graph_sizes(self.graph_max_bs),
            # prefill CUDA graphs up to chunked_prefill_size tokens (memory_hook.py prefill max_bs)
            graph_padding=True, graph_mixed_steps=not p.disable_cuda_graph and self.chunked_prefill_size > 0,
            custom_allreduce=True,  # --disable-custom-all-reduce defaults to False (server_args.py)
            compiled_max_bs=p.torch_compile_max_bs * (p.enable_torch_compile and not p.disable_cuda_graph))

    # ---- queues -------------------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.prealloc) + len(self.prebuilt)

    def _enqueue(self, req: Request) -> None:
        self._seq += 1
        self._entry[req.request_id] = self._seq
        self.waiting.append(req)

    def refusal(self, req: Request) -> str | None:   # tokenizer_manager: input + max_new_tokens must fit (HTTP 400)
        fits = req.prompt_len + req.max_tokens <= self.max_model_len
        return None if fits else (f"prompt {req.prompt_len} + max_tokens {req.max_tokens} exceeds the max request "
                                  f"length {self.max_model_len} (context/KV pool)")

    def add_request(self, req: Request, now: float) -> bool:
        if not (self.admit_length(req) and self.check_adapter(req, "enable_lora")):
            return False
        (self.prealloc.append if req.remote_kv_tokens else self._enqueue)(req)   # P/D decode side: KV comes first
        return True

    def release(self, req: Request) -> None:
        hold = self.holds.get(req.request_id)
        if hold is not None:
            self.cache.commit(hold, radix_tokens(req)[:req.num_computed_tokens])   # cache_finished_req
            if self.host is not None:
                self.host.back_up(req, hold.cached, done=True)
            if req.hold_kv:   # P/D prefill side: locked until the decode side has pulled it
                self.held[req.request_id] = req
            else:
                self.cache.release(self.holds.pop(req.request_id))
        self._entry.pop(req.request_id, None)

    def free_kv(self, req: Request) -> None:
        self.cache.release(self.holds.pop(req.request_id))

    def on_finished(self, finished: list[Request], now: float) -> None:
        done = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in done]
        for req in finished:
            self.release(req)
        self.batch_is_full = False

    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        self.step_in_flight = None
        res = super().update(out, now)
        if self.speculation is not None:   # the verify step frees the slots of rejected drafts (page size 1)
            for req, n in out.scheduled:
                hold = self.holds.get(req.request_id)
                if n > 1 and hold is not None and req.num_output_tokens > 1:
                    extra = hold.cached + hold.private - req.num_computed_tokens
                    if extra > 0:
                        self.cache.shrink(hold, extra)
        for req in self._prefilled:   # cache_unfinished_req: the computed prompt becomes matchable at once
            hold = self.holds.get(req.request_id)
            if req.status is Status.RUNNING and hold is not None:
                self.cache.commit(hold, radix_tokens(req)[:req.num_computed_tokens])
                if self.host is not None:
                    self.host.back_up(req, hold.cached)
        self._prefilled = []
        return res

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: a step is a prefill batch (chunked request first, <= chunked_prefill_size tokens, admitted
        # only while free + evictable - reserved decode growth covers it) whenever one forms, else one decode
        # token for every running request; at most one chunked request; len(running) <= max_running_requests.
        out = SchedulerOutput()
        if self.prealloc:
            self._preallocate(out)
        if self.prebuilt:
            self._merge_prebuilt(now)
        if not self.running and self.chunked is None:
            self.batch_is_full = False     # update_running_batch resets it once the batch is empty
        num_running, exact = len(self.running), False
        if not self._schedule_prefill(out, now):
            exact = self._schedule_decode(out)
            if not out.scheduled:          # everything was retracted: prefill what is left
                self._schedule_prefill(out, now)
        if self.cohort is not None:   # the admitted join the cohort's running order (all of it after a retraction)
            self.cohort.order(self.running if exact else self.running[num_running:], fresh=exact)
        out.shape = self.make_shape(out.scheduled, out.num_lazy)
        if self.adapters is not None:
            self.adapters.shape_step(out.scheduled, out.shape)
        if self.onboarded:
            out.shape.host_load_tokens, out.shape.host_load_overlapped, self.onboarded = self.onboarded, True, 0
        self.step_in_flight = out
        return out

    def _schedule_prefill(self, out: SchedulerOutput, now: float) -> bool:
        if self.chunked is None and (self.batch_is_full or not self.waiting):
            return False
        if self.chunked is None and len(self.running) >= self.max_running_requests:
            self.batch_is_full = True
            return False
        p = self.params
        self._order_waiting()
        mixed = list(self.running) if p.enable_mixed_chunk else []
        cps = self.chunked_prefill_size
        adder = PrefillAdder(self.cache, self.host, self.holds, p.max_prefill_tokens - len(mixed),
                             cps - len(mixed) if cps > 0 else None,
                             self._reserved_decode_tokens() * self.new_token_ratio + len(mixed))
        if self.chunked is not None:
            adder.add_chunked(self.chunked)
        # max_loras_per_batch: a request whose adapter would be one too many is skipped (_can_schedule_lora_req)
        loras = ({r.lora_id for r in (*self.running, *([self.chunked] if self.chunked else ())) if r.lora_id >= 0}
                 if self.adapters is not None else None)
        for req in self.waiting:
            if len(self.running) + adder.count >= self.max_running_requests:
                self.batch_is_full = True
                break
            if loras is not None and self.adapters is not None and not self.adapters.admits(loras, req):
                continue
            res = adder.add_one(req)
            if res is not AddResult.CONTINUE:
                self.batch_is_full = self.batch_is_full or res is AddResult.NO_TOKEN
                break
        if not adder.admitted:
            return False
        self._commit_admissions(adder, mixed, out, now)
        return True

    def _reserved_decode_tokens(self) -> int:
        """The running batch's decode growth the adder reserves (`reserve_tokens` summed): the cohort's members, all
        under the clip, from its sum."""
        if self.cohort is None or not self.cohort.members:
            return reserved_tokens(self.running)
        return reserved_tokens(self.running_outside_cohort()) + self.cohort.max_tokens_left()

    def _order_waiting(self) -> None:
        key = self._priority_key if self.params.enable_priority_scheduling else None
        self.waiting = order_waiting(self.policy, self.waiting, self.cache, key)

    def _priority_key(self, req: Request) -> tuple[int, int]:
        """enable_priority_scheduling: by priority (lower values first with schedule_low_priority_values_first),
        then queue entry."""
        sign = 1 if self.params.schedule_low_priority_values_first else -1
        return sign * req.priority, self._entry.get(req.request_id, 0)

    def host_tier_stats(self) -> dict | None:
        return None if self.host is None else self.host.stats(self.dep.kv_bytes_per_token_per_device)

    def _commit_admissions(self, adder: PrefillAdder, mixed: list[Request], out: SchedulerOutput, now: float) -> None:
        """prepare_for_extend: allocate the chunks, move requests between queues, append mixed decodes."""
        cache, taken = self.cache, set()
        for req, n in adder.admitted:
            hold = self.holds[req.request_id]
            host = adder.loading_back.get(req.request_id, 0)
            if not cache.grow(hold, n + host):     # cannot happen while the adder's accounting holds; be safe
                if req is not self.chunked:
                    cache.release(self.holds.pop(req.request_id))
                    req.num_computed_tokens = 0
                continue
            if host and self.host is not None:
                self.onboarded += host
                self.host.loaded(host)
            if req is not self.chunked:
                taken.add(id(req))
                cache.record_lookup(req.num_tokens, hold.cached)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hold.cached
                self.mark_scheduled(req, now)
            out.scheduled.append((req, n))
            self._prefilled.append(req)
            if n == req.num_new_tokens:
                self.running.append(req)
                if req is self.chunked:
                    self.chunked = None
            elif req is not self.chunked:
                self.chunked = req
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        if mixed and cache.available() >= len(mixed):   # enable_mixed_chunk: decodes ride along
            for r in mixed:
                cache.grow(self.holds[r.request_id], 1)
                out.scheduled.append((r, 1))

    def _schedule_decode(self, out: SchedulerOutput) -> bool:
        """One decode token for every running request (and its drafts), retracting until they fit. Returns whether
        the decode cohort was dissolved (a retraction reads every request's progress)."""
        if not self.running:
            return False
        drafts = self.speculation.num_tokens if self.speculation is not None else 0  # slots per decode: 1 + drafts
        cohort = self.cohort
        if self.cache.available() < len(self.running) * (1 + drafts):
            if cohort is not None:
                cohort.dissolve()
            self._retract(out, 1 + drafts)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
            if cohort is not None:   # members take their slots in the one allocation and settle them when they leave
                if not self.cache.alloc(len(self.running)):
                    raise RuntimeError("sglang decode allocation failed although the pool held it")
                holds = self.holds
                for req in cohort.schedule_lockstep(out):
                    holds[req.request_id].private += 1
                    out.scheduled.append((req, 1))
                return False
        batch = len(self.running)
        sizes = [1 + self.drafts(req, batch) for req in self.running] if drafts else [1] * batch
        # the slots taken at once (evictions follow the LRU order whatever the grouping)
        if not self.cache.alloc(sum(sizes)):
            raise RuntimeError("sglang decode allocation failed after retraction")
        holds = self.holds
        for req, n in zip(self.running, sizes):
            holds[req.request_id].private += n
        out.scheduled += zip(self.running, sizes)
        return cohort is not None

    def _retract(self, out: SchedulerOutput, slots: int = 1) -> None:
        """retract_decode: drop the fewest-output requests (tie: longest prompt) until one decode step fits (`slots`
        per request: its token and its drafts); one request is kept unless even it cannot fit (real SGLang would fail
        there)."""
        order = sorted(self.running, key=lambda r: (r.num_output_tokens, -r.prompt_len), reverse=True)
        gone: list[Request] = []
        while len(order) > 1 and (not gone or self.cache.available() < len(order) * slots):
            gone.append(order.pop())
            self._retract_one(gone[-1], out)
        if self.cache.available() < len(order):
            gone.append(order.pop())
            self._retract_one(gone[-1], out)
        out_ids = {id(r) for r in gone}
        self.running = [r for r in self.running if id(r) not in out_ids]
        if self.running:
            decoded = sum(r.num_output_tokens for r in self.running)
            max_new = sum(r.max_tokens for r in self.running)
            self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (max_new + 1))
        self.batch_is_full = False

    def _retract_one(self, req: Request, out: SchedulerOutput) -> None:
        self.cache.release(self.holds.pop(req.request_id))   # its inserted prompt stays in the tree, now evictable
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        self._enqueue(req)

    def check_invariants(self) -> None:
        self.check_cohort(self.running)
        if self.cohort is not None:   # slots taken at scheduling: with a step in flight (a run cut off), its tokens too
            step = self.step_in_flight
            ahead = {r.request_id: n for r, n in step.scheduled} if step is not None else {}
            assert all(h.cached + h.private == r.num_computed_tokens + ahead.get(r.request_id, 0) for r in self.running
                       for h in (self.holds[r.request_id],)), "a running request's slots are not its computed tokens"
        self.cache.check_invariants()
        if self.host is not None:
            self.host.tier.check_invariants()
        holders = (self.running + ([self.chunked] if self.chunked is not None else []) + list(self.held.values())
                   + list(self.loading.values()) + self.prebuilt)
        assert sorted(r.request_id for r in holders) == sorted(self.holds), "a hold without its request"
        assert sum(h.private for h in self.holds.values()) == self.cache.req_tokens, "private slot leak"
        assert len(self.running) <= self.max_running_requests
