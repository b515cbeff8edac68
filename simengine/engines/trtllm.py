"""TensorRT-LLM PyExecutor scheduler (capacity + micro-batch, C++ batch manager); docs/engines/trtllm.md.

Each iteration a capacity scheduler decides which requests may hold KV and a micro-batch scheduler packs them
under `max_num_tokens`. GUARANTEED_NO_EVICT (default) schedules every started request and reserves its blocks to
completion (prompt + max_tokens); pending requests are admitted in arrival order only while their whole
reservation fits, and the first that does not stops admission: no preemption, ever. MAX_UTILIZATION admits on
next-step blocks and pauses (recomputes) the most recently started request when short; STATIC_BATCH admits only
into an empty engine. Generation tokens fill the budget first, then whole prompts (or, with chunked prefill,
FCFS chunks rounded to tokens_per_block). Block reuse is a radix of full blocks; a context request whose first
new block another request is producing this step waits (beneficialToSkip). The overlap scheduler launches step
n+1 before step n's stop checks, so every request runs one extra decode step and is seen finished one step
later. CUDA graphs cover generation-only batches of captured sizes (1..31, 32, 64, 128; no padding). With pp > 1
the PP loop keeps pp micro-batches in flight and schedules none of their requests until their batch comes back.

Simulation speed (not a TensorRT-LLM mechanism): under GUARANTEED_NO_EVICT and STATIC_BATCH without speculation,
steady generation requests are advanced as one lazy cohort (engines/decode_cohort.py, `schedule_decodes`).
"""

from __future__ import annotations

from bisect import insort
from itertools import islice

from simengine.config.dtypes import GGML_FORMATS
from simengine.core.batch import SchedulerOutput, StepResult
from simengine.core.request import Request, Status
from simengine.cost.timing import PYTHON_FRONTEND_S, PYTHON_SEQ_CPU_S, TOKENIZE_S_PER_TOKEN, EngineTiming
from simengine.engines.base import ENGINES
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.memory import Deployment
from simengine.engines.paged import PagedEngine
from simengine.engines.speculative import Speculation
from simengine.engines.trtllm_capacity import CompletionReservations, MicroBatchBudget, arrival_order
from simengine.engines.trtllm_config import (
    TrtllmParams,
    trtllm_capture_sizes,
    trtllm_kv_cache,
    trtllm_speculation,
)
from simengine.engines.trtllm_reuse import ContextReuse
from simengine.errors import CannotRun
from simengine.kvcache.manager import NO_HIT, PrefixHit


@ENGINES.register("trtllm")
class TrtllmEngine(PagedEngine):
    Params = TrtllmParams
    vendors = frozenset({"nvidia"})
    kernel_backend = "trtllm"  # TensorRT-LLM's own kernels (aiconfigurator-core's trtllm tables)
    overlap_schedules_ahead = True  # _executor_loop_overlap: fetch, schedule, forward k+1, then update batch k
    # disaggregated serving (docs/source/advanced/disaggregated-service.md, `trtllm-serve disaggregated`): a
    # context-only request keeps its blocks until the kv_cache_transceiver has sent them; a generation-only request
    # (DISAGG_GENERATION_INIT) gets blocks from the capacity scheduler, receives the KV into them and decodes from
    # the context server's first token (py_executor.py _prepare_disagg_gen_init, _check_disagg_gen_transfer_status)
    disaggregation_roles = frozenset({"prefill", "decode"})
    device_classes = frozenset({"datacenter", "workstation", "consumer", "edge"})
    support_source = ("TensorRT-LLM docs 'Supported hardware' (NVIDIA GPUs only: Blackwell, Hopper, Ada, Ampere; "
                      "DGX Spark) and the v0.12.0-jetson branch for Jetson AGX Orin")
    supports_expert_parallel = True  # TensorRT-LLM moe_expert_parallel_size (llm_args.py)
    supports_attention_dp = True  # enable_attention_dp (llm_args.py; docs/source/features/parallel-strategy.md)
    lazy_decode = True  # speed device (module docstring)
    supports_pipeline_microbatches = True   # py_executor.py _executor_loop_pp: micro_batches, no overlap or drafts

    def __init__(self, params: TrtllmParams, dep: Deployment):
        p = params
        if dep.weight_format.name in GGML_FORMATS:
            raise CannotRun(f"TensorRT-LLM does not load ggml {dep.weight_format.name} weights; use bf16, fp8, "
                            "int4 (AWQ/GPTQ W4A16) or nvfp4", field="deployment.weight_dtype")
        self.max_num_tokens, self.max_batch_size = p.max_num_tokens, p.max_batch_size
        self.max_num_sequences = p.max_batch_size * dep.pp  # started: _util.py scheduler_capacity (per micro-batch)
        self.step_token_limit, self.batch_size_limit = p.max_num_tokens, self.max_num_sequences
        self.policy = p.capacity_scheduler_policy
        self.overlap = not p.disable_overlap_scheduler and dep.pp == 1   # the PP loop has no overlap
        super().__init__(params, dep)
        dep = self.dep   # with a speculative proposer's weights and KV
        self.kv = trtllm_kv_cache(p, dep)
        self.max_model_len = min(p.max_seq_len or dep.model.max_model_len, self.kv.num_blocks * p.tokens_per_block)
        self.reservations = CompletionReservations(self.kv, self.max_model_len)  # started: running and loading
        self.running: list[Request] = []   # started (holding KV), arrival order; includes overlap tails
        self.waiting: list[Request] = []   # context-init (new or paused), arrival order
        self.tails: set[int] = set()   # finished on the GPU, awaiting the overlap scheduler's extra step
        self.reuse = ContextReuse(self.kv)   # beneficialToSkip and the blocks contexts produce this step
        self.gen_init: list[Request] = []     # P/D decode side: generation-only requests waiting for blocks
        self.onboarded = 0                    # tokens this step copies in from the host pool
        lazy = self.lazy_decode and dep.pp == 1 and self.speculation is None and self.policy != "MAX_UTILIZATION"
        self.cohort = DecodeCohort(self.kv, self.max_num_tokens) if lazy else None
        self.renumber = False   # a request started out of arrival order since the cohort last numbered the running

    @classmethod
    def speculation_of(cls, params: TrtllmParams, dep: Deployment) -> Speculation | None:
        return trtllm_speculation(params, dep)

    def make_timing(self) -> EngineTiming:
        p = self.params
        return EngineTiming(
            # scheduler/design.md §5 (Llama-8B on B200, 411 iterations): 17.4 ms per iteration for the old Python
            # scheduler, 10.5 ms refactored, 2.89 ms mypyc-compiled. ESTIMATE: the default C++ SimpleScheduler
            # plus input preparation costs about the compiled figure; response handling (_process_previous_batch,
            # stop checks, hand-off to the serve process) ~1 ms. Hidden by the overlap scheduler when it is on.
            scheduler_cpu_s=2.89e-3, output_cpu_s=1.0e-3, overlap=self.overlap,
            seq_cpu_s=PYTHON_SEQ_CPU_S,  # responses in the 1.x Python PyExecutor
            frontend_s=PYTHON_FRONTEND_S, tokenize_s_per_token=TOKENIZE_S_PER_TOKEN,
            cuda_graph_sizes=trtllm_capture_sizes(p.cuda_graph_max_batch_size, p.cuda_graph_enable_padding)
            if p.cuda_graph_config else (),
            graph_padding=p.cuda_graph_enable_padding, graph_mixed_steps=False,  # generation-only batches
            custom_allreduce=True)  # allreduce_strategy AUTO picks its one-/two-shot NVLink kernels (llm_args.py)

    # ---- queues -------------------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.gen_init)

    def refusal(self, req: Request) -> str | None:
        unchunked = not self.params.enable_chunked_prefill and req.prompt_len > self.max_num_tokens
        return super().refusal(req) or (None if not unchunked else f"prompt of {req.prompt_len} tokens exceeds "
                                        f"max_num_tokens {self.max_num_tokens} and enable_chunked_prefill is False")

    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        # the LLM API clamps max_tokens to max_seq_len - prompt (finish reason 'length')
        req.output_len = min(req.output_len, self.max_model_len - req.prompt_len)
        if req.remote_kv_tokens:
            self.gen_init.append(req)
        else:
            insort(self.waiting, req, key=arrival_order)
        return True

    def release(self, req: Request) -> None:
        self.tails.discard(req.request_id)
        self.reservations.end(req)
        super().release(req)

    def on_finished(self, finished: list[Request], now: float) -> None:
        if self.overlap:
            return  # held for the overlap step; update() releases them one step later
        super().on_finished(finished, now)

    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        """Base progress; with overlap, a request seen finished only after its extra (dropped) decode step."""
        ending = self.tails   # empty without overlap; never cohort members (their last token is not in sight)
        tails = [r for r, _ in islice(out.scheduled, out.num_lazy, None) if r.request_id in ending] if ending else []
        live = SchedulerOutput(scheduled=[(r, n) for r, n in out.scheduled if r.request_id not in ending],
                               num_lazy=out.num_lazy) if tails else out
        res = super().update(live, now)
        if self.overlap:
            for req in res.finished:  # sampled its last token, but step n+1 was launched before the stop check
                req.status, req.finish_s = Status.RUNNING, -1.0
                ending.add(req.request_id)
            res.finished = []
        for req in tails:
            req.num_computed_tokens += 1
            req.status, req.finish_s = Status.FINISHED, now
            self.release(req)
            res.finished.append(req)
        return res

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: tokens <= max_num_tokens and requests <= max_batch_size per step; under GUARANTEED_NO_EVICT
        # and STATIC_BATCH free blocks always cover what every started request still needs to completion.
        out = SchedulerOutput()
        self.reuse.produced.clear()
        if self.gen_init:
            self._prepare_gen_init(out)
        if self.policy == "MAX_UTILIZATION":
            self._schedule_max_utilization(out, now)
        else:
            if self.renumber and self.cohort is not None:
                self.cohort.dissolve()
                self.cohort.order(self.running, fresh=True)
                self.renumber = False
            contexts = self.cohort.schedule_decodes(out) if self.cohort is not None else None
            budget = self._schedule_started(out, contexts)
            if self.policy == "GUARANTEED_NO_EVICT" or not self.running:
                self._schedule_pending(out, budget, now)
            if self.cohort is not None and contexts is None:  # the exact loop decided: a fresh running order
                self.cohort.order(self.running, fresh=True)
        if not out.scheduled and self.waiting:
            out.idle_reason = "head request's KV reservation or prompt does not fit yet"
        out.shape = self.make_shape(out.scheduled, out.num_lazy)
        out.shape.host_load_tokens, self.onboarded = self.onboarded, 0
        return out

    def _available_blocks(self) -> int:
        """Free blocks (reusable ones included) minus every started request's blocks still to come."""
        reserved = self.reservations.blocks_to_come()
        if self.cohort is not None:  # cohort members' blocks not yet in their tables (never past their reservation)
            reserved -= len(self.cohort.spare)
        return self.kv.pool.num_free - reserved

    def _context_tokens(self, req: Request, hit: PrefixHit, capacity: int) -> tuple[int, int]:
        """(tokens computed, tokens charged) for a context step: whole prompt, or an FCFS chunk."""
        remaining = req.num_tokens - req.num_computed_tokens - hit.num_tokens
        if not self.params.enable_chunked_prefill:
            return remaining, req.num_tokens - req.num_computed_tokens   # no reuse discount in the count
        if remaining <= capacity:
            return remaining, remaining
        n = capacity // self.kv.block_size * self.kv.block_size          # chunk ends on a block unless final
        return n, n

    def _prepare_gen_init(self, out: SchedulerOutput) -> None:
        """Generation-only requests in arrival order, while the batch has room and (GUARANTEED_NO_EVICT) the blocks
        to their completion fit beside every started request's: blocks for the prompt now, the KV on its way."""
        avail = self._available_blocks()
        taken = 0
        for req in self.gen_init:
            if len(self.running) + len(self.loading) >= self.max_num_sequences:
                break
            need = (self.kv.blocks_for(req.prompt_len) if self.policy == "MAX_UTILIZATION" else
                    self.reservations.horizon(req))
            if need > avail or not self.kv.allocate_slots(req, 0, reserve_tokens=req.prompt_len):
                break
            avail -= need
            self.reservations.start(req)
            self.reserved_for_remote(req, req.prompt_len, out)
            taken += 1
        del self.gen_init[:taken]

    def remote_kv_arrived(self, req: Request, now: float) -> None:
        """The KV is in its blocks: the context server's first token came with it; it decodes from the next step."""
        del self.loading[req.request_id]
        if self.take_remote_first_token(req, now):
            self.reservations.end(req)
            self.kv.free(req)
            return
        self.kv.publish_through(req, req.prompt_len)
        self.mark_scheduled(req, now)
        self._start(req)

    def _start(self, req: Request) -> None:
        insort(self.running, req, key=arrival_order)
        self.reservations.start(req)
        if self.cohort is not None:
            self.cohort.order([req], fresh=False)
            if self.running[-1] is not req:   # started before a later arrival (a P/D decode whose KV came first):
                self.renumber = True          # the cohort numbers the running list afresh before the next schedule

    def _schedule_started(self, out: SchedulerOutput, contexts: list[Request] | None) -> MicroBatchBudget:
        """Generation tokens first, then the next chunk of contexts already chunking (FCFS). `contexts`: the running
        contexts when the cohort took the generation tokens (None: every request walked here)."""
        budget = MicroBatchBudget(self.max_num_tokens, self.max_batch_size)
        if contexts is not None:  # no cap bound the cohort's generation tokens
            contexts.sort(key=arrival_order)
            budget.tokens -= len(out.scheduled)
            budget.slots -= len(out.scheduled)
        else:
            contexts = self._schedule_generation(out, budget)
        for req in contexts:
            n, charge = self._context_tokens(req, NO_HIT, budget.tokens)
            if n <= 0 or not budget.take(charge):
                break
            self.reuse.note_produced(req, n)
            if not self.kv.allocate_slots(req, n):
                raise RuntimeError(f"trtllm: started {req} lost its reserved KV blocks")
            out.scheduled.append((req, n))
        return budget

    def _schedule_generation(self, out: SchedulerOutput, budget: MicroBatchBudget) -> list[Request]:
        """Every generation request that fits, in arrival order; returns the running contexts."""
        decoding: list[Request] = []
        contexts: list[Request] = []
        flight = self.in_flight   # pp > 1: requests whose micro-batch is still in the pipeline wait for it
        for r in [r for r in self.running if r.request_id not in flight] if flight else self.running:
            (decoding if r.num_output_tokens and r.prompt_len + r.num_output_tokens - r.num_computed_tokens == 1
             else contexts).append(r)
        allocate = self.kv.allocate_slots
        if self.speculation is None:
            fit = max(0, min(len(decoding), budget.slots, budget.tokens))  # take(1) for each until it fails
            if fit < len(decoding):
                del decoding[fit:]
            budget.tokens -= fit
            budget.slots -= fit
            for req in decoding:  # within their reservation: blocks never short
                if req.num_computed_tokens + 1 > req.kv_settled_tokens and not allocate(req, 1):
                    raise RuntimeError(f"trtllm: started {req} lost its reserved KV blocks")
            out.scheduled += [(req, 1) for req in decoding]
        else:   # a generation request charges its token and its drafts
            batch = len(decoding)
            for req in decoding:
                n = 1 + self.drafts(req, batch)
                if not budget.take(n):
                    break
                if req.num_computed_tokens + n > req.kv_settled_tokens and not allocate(req, n):
                    raise RuntimeError(f"trtllm: started {req} lost its reserved KV blocks")
                out.scheduled.append((req, n))
        return contexts

    def _schedule_pending(self, out: SchedulerOutput, budget: MicroBatchBudget, now: float) -> None:
        """Admit context requests in arrival order while their reservation to completion and prompt fit."""
        if not self.waiting:
            return
        avail = self._available_blocks()
        keys = self.reuse.contributed_keys(self.running)
        i = 0
        while i < len(self.waiting) and budget.slots > 0 and len(self.running) < self.max_num_sequences:
            req = self.waiting[i]
            hit = self.reuse.lookup(req)
            # blocks of the prompt past the GPU hit that sit in the secondary (host) pool are onboarded: new blocks,
            # copied in before this step's forward, and reused as if they had stayed (kv_cache_config.host_cache_size)
            host = sum(self.kv.host_hit(req, hit)) if self.kv.host is not None and not req.num_computed_tokens else 0
            reused = PrefixHit(hit.blocks, hit.num_tokens + host) if host else hit
            key = self.reuse.first_new_block(req, reused)
            if key is not None and key in keys:   # beneficialToSkip: reuse that block next step instead
                self.reuse.unlookup(req, hit)
                i += 1
                continue
            need = self.reservations.horizon(req)
            n, charge = self._context_tokens(req, reused, budget.tokens)
            if need > avail or n <= 0 or not budget.take(charge):
                self.reuse.unlookup(req, hit)
                break  # the first request that does not fit stops admission
            if not self.kv.allocate_slots(req, n, reused):
                raise RuntimeError(f"trtllm: {req} passed the reservation check but got no blocks")
            if host:
                self.kv.take_from_host(host)
                self.onboarded += host
            self._admit(req, n, reused, key, keys, now, out)
            avail -= need

    def _admit(self, req: Request, n: int, hit: PrefixHit, key: int | None, keys: set[int], now: float,
               out: SchedulerOutput) -> None:
        """A context request whose blocks are allocated starts: waiting -> running."""
        self.waiting.remove(req)
        if key is not None:
            keys.add(key)
        req.num_computed_tokens += hit.num_tokens
        self.reuse.note_produced(req, n)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit.num_tokens
        self.mark_scheduled(req, now)
        self._start(req)
        out.scheduled.append((req, n))

    def _schedule_max_utilization(self, out: SchedulerOutput, now: float) -> None:
        """One fused pass in arrival order: admit on next-step blocks, pause the newest started when short."""
        budget = MicroBatchBudget(self.max_num_tokens, self.max_batch_size)
        flight = self.in_flight   # pp > 1: requests whose micro-batch is still in the pipeline wait for it
        order = sorted([r for r in self.running if r.request_id not in flight] + self.waiting, key=arrival_order)
        keys = self.reuse.contributed_keys(self.running)
        i, end = 0, len(order)
        while i < end:
            req = order[i]
            started = req.status is Status.RUNNING
            hit = NO_HIT if started else self.reuse.lookup(req)
            key = None if started else self.reuse.first_new_block(req, hit)
            if key is not None and key in keys:   # beneficialToSkip
                self.reuse.unlookup(req, hit)
                i += 1
                continue
            if req.is_decoding:
                n = charge = 1 + self.drafts(req, len(self.running)) if self.speculation is not None else 1
            else:
                n, charge = self._context_tokens(req, hit, budget.tokens)
            if not started and charge > self.max_num_tokens:   # a paused context grown past the budget
                self.reuse.unlookup(req, hit)
                self.waiting.remove(req)
                out.rejected.append(req)
                self.reject(req, "paused request's prompt + generated tokens exceed max_num_tokens and "
                                 "enable_chunked_prefill is False")
                i += 1
                continue
            full = not started and len(self.running) >= self.max_num_sequences
            if n <= 0 or full or charge > budget.tokens or budget.slots <= 0:
                self.reuse.unlookup(req, hit)
                break  # a token-budget failure ends the fused walk (scheduler/design.md §4.1.1)
            if self.kv.allocate_slots(req, n, hit):
                budget.take(charge)
                if started:
                    if not req.is_decoding:
                        self.reuse.note_produced(req, n)
                    out.scheduled.append((req, n))
                else:
                    self._admit(req, n, hit, key, keys, now, out)
                i += 1
                continue
            self.reuse.unlookup(req, hit)
            end = self._pause_last_started(order, i, end, out)
            if end < 0:
                break

    def _pause_last_started(self, order: list[Request], i: int, end: int, out: SchedulerOutput) -> int:
        """Pause the most recently started request in order[i:end] (recompute); return the new end or -1."""
        for j in range(end - 1, i - 1, -1):
            victim = order[j]
            if victim.status is Status.RUNNING and victim.request_id not in self.tails:
                self.running.remove(victim)
                self.reservations.end(victim)
                self.drop_for_recompute(victim, out)   # its full blocks stay reusable: a partial recompute
                insort(self.waiting, victim, key=arrival_order)
                return j
        return -1

    def check_invariants(self) -> None:
        self.check_cohort(self.running)
        super().check_invariants()   # the pools; started requests within max_num_sequences (batch_size_limit)
        assert self.reservations.horizon_blocks.keys() == {r.request_id for r in self.running} | self.loading.keys()
        if self.policy != "MAX_UTILIZATION":
            assert self._available_blocks() >= 0, "GUARANTEED_NO_EVICT reservation exceeds free blocks"
        for req in self.running:
            assert self.kv.num_blocks_of(req) >= self.kv.blocks_for(req.num_computed_tokens)
