"""The engine-policy contract and the mechanics every policy shares (token progress, finishing, shapes).

A policy is pure: `schedule(now)` decides one step, `update(output, now)` applies its results. No SimPy,
no wall clock, randomness only from an injected numpy Generator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from itertools import islice
from typing import ClassVar

import numpy as np

from simengine.config.hardware import Hardware
from simengine.core.batch import BatchShape, SchedulerOutput, StepResult
from simengine.core.request import Request, Status
from simengine.cost.timing import EngineTiming
from simengine.cost.work import UnfusedAttention
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.lora import AdapterSlots
from simengine.engines.memory import Deployment
from simengine.engines.remote_kv import RemoteKV
from simengine.engines.speculative import Speculation, with_proposer
from simengine.registry import Registry


class EnginePolicy(RemoteKV, ABC):
    """One serving engine's scheduler and KV rules.

    Subclasses set `Params` (a frozen dataclass with the engine's real knob names and defaults), `vendors`
    (where it runs), and implement `add_request`, `schedule` and the queue views. `update` is shared.
    """

    name: ClassVar[str]
    Params: ClassVar[type]
    vendors: ClassVar[frozenset[str]]        # hardware vendors the engine supports
    device_classes: ClassVar[frozenset[str]] = frozenset({"datacenter", "workstation", "consumer"})
    gaudi_backend: ClassVar[bool] = True     # False: no Intel Gaudi (HPU) backend although it runs on Intel GPUs
    support_source: ClassVar[str] = ""
    supports_expert_parallel: ClassVar[bool] = False
    supports_attention_dp: ClassVar[bool] = False   # deployment.attention_dp: one scheduler per rank of a group
    last_repeat_by_update: ClassVar[bool] = False   # repeat_steps may count the step a request finishes in (below)
    # an arrival during proved repeats only queues, add_request reads nothing they change, and nothing but arrivals
    # reaches the engine (no KV loads): on a replica alone the repeats run on through arrivals (sim/replica.py)
    repeats_outlast_arrivals: ClassVar[bool] = False

    @classmethod
    def runs_on(cls, hw: Hardware) -> bool:
        """Whether the engine has a backend for the device: its vendors and classes (and Gaudi's HPU runtime)."""
        gaudi = hw.name.startswith("gaudi")
        return hw.vendor in cls.vendors and hw.device_class in cls.device_classes and (cls.gaudi_backend or not gaudi)
    research_baseline: ClassVar[bool] = False  # a scheduling policy from a paper, not a product one deploys
    # an overlapped loop (timing.overlap) that schedules step k+1 before step k runs, after receiving new requests
    # (`schedules_ahead`); False where overlap only hides host work
    overlap_schedules_ahead: ClassVar[bool] = False
    # pp micro-batches in flight (sim/replica.py PipelinedReplica holds their requests in `in_flight`: not scheduled)
    supports_pipeline_microbatches: ClassVar[bool] = False
    # whose measured kernel tables price the engine's GPU work (cost/measured.py): its own backend, or the nearest
    # one whose kernels it shares; None for engines with kernels of their own no table measured (the roofline)
    kernel_backend: ClassVar[str | None] = None
    # the prefill/decode disaggregation roles ("prefill", "decode") the engine takes here (docs/cluster.md): a
    # prefill role keeps a finished `hold_kv` request's KV until `free_held`; a decode role reserves blocks for
    # `remote_kv_tokens` (SchedulerOutput.kv_reserved) and schedules the request after `remote_kv_arrived`
    disaggregation_roles: ClassVar[frozenset[str]] = frozenset()
    # speed device (docs/performance.md): the engine advances its steady decodes in a DecodeCohort (`cohort`, which
    # the engine creates where its configuration allows; `update`, `make_shape`, `sync` and `exact_mode` use it)
    lazy_decode: ClassVar[bool] = False
    cohort: DecodeCohort | None = None

    # Limits the shared invariant tests check on every step (None = the engine has no such cap).
    step_token_limit: int | None = None       # tokens computed per step (vLLM max_num_batched_tokens, ...)
    batch_size_limit: int | None = None       # requests per step / running at once (max_num_seqs, ...)

    def __init__(self, params, dep: Deployment):
        self.params = params
        self.in_flight: set[int] = set()   # requests of micro-batches still in the pipeline (above)
        self.max_model_len = dep.model.max_model_len
        self.num_preemptions = 0
        self.held: dict[int, Request] = {}   # P/D prefill side: finished requests whose KV waits to be pulled
        self.loading: dict[int, Request] = {}  # P/D decode side: blocks reserved, the remote KV on its way
        self.disk_loads: dict[int, int] = {}   # KV offload: request id -> tokens of its load read from disk first
        self.adapters: AdapterSlots | None = None   # multi-LoRA serving where the engine's params turn it on
        # speculative decoding where the engine's params switch it on (engines/speculative.py): a decoding request
        # is scheduled with 1 + drafts tokens, and update keeps the accepted ones
        self.speculation: Speculation | None = self.speculation_of(params, dep)
        self.dep = with_proposer(dep, self.speculation)   # the proposer's weights and KV share the devices
        self.timing: EngineTiming = self.make_timing()

    @classmethod
    def speculation_of(cls, params, dep: Deployment) -> Speculation | None:
        """The speculative decoding the engine's params ask for (None: off, or an engine without it)."""
        return None

    def drafts(self, req: Request, batch: int) -> int:
        """Drafts to verify for decoding `req` in a step of `batch` decodes (0 without speculation)."""
        spec = self.speculation
        return spec.proposals(req, batch, self.max_model_len) if spec is not None else 0

    def engine_gemm_flops_s(self) -> float | None:
        """FLOP/s the engine reaches on its deployment's layer GEMMs where its own kernels, or its own way of calling
        the vendor library, set the rate (cost/work.py StepWork.engine_gemm_flops_s); None: the device's GEMM at its
        gemm_fraction."""
        return None

    def engine_attention_flops_s(self) -> float | None:
        """FLOP/s the engine's own attention kernel reaches where it is not a vendor library's (cost/work.py
        StepWork.engine_attention_flops_s); None: the device's attention peak at its gemm_fraction."""
        return None

    def unfused_attention(self) -> UnfusedAttention | None:
        """Attention as separate kernels with the scores in memory (cost/work.py UnfusedAttention); None: a fused
        kernel."""
        return None

    def layer_kernels(self) -> int | None:
        """Kernels one layer's token-count ops (GEMMs, norms, activation, RoPE, cache writes; not attention) take where
        the engine's graph runs them unfused, each paying the device's kernel floor (cost/work.py StepWork.
        token_kernels); None: the fused layer's four GEMMs and four elementwise kernels."""
        return None

    def dequantize_above_tokens(self) -> int | None:
        """Token count above which every step first dequantizes the quantized layer weights to 16 bit for a vendor
        GEMM (cost/work.py StepWork.dequantize_above_tokens); None: GEMMs read the stored weights."""
        return None

    def decode_kv_reads(self) -> float:
        """Times the engine's decode attention kernel reads each KV head's cache in a step (cost/work.py
        StepWork.decode_kv_reads): 1 where one thread block computes all the query heads that share a KV head."""
        return 1.0

    def expert_tile_columns(self) -> int | None:
        """The widest token tile of the engine's grouped expert GEMM where each expert computes its tokens in whole
        tiles (cost/work.py StepWork.padded_expert_tokens); None: experts compute their tokens exactly."""
        return None

    # ---- contract ---------------------------------------------------------------------------------
    @abstractmethod
    def make_timing(self) -> EngineTiming:
        """The engine's named overhead terms for this deployment."""

    @abstractmethod
    def add_request(self, req: Request, now: float) -> bool:
        """Queue a new request. Returns False (and marks it FAILED with a reason) if the engine rejects it."""

    @abstractmethod
    def schedule(self, now: float) -> SchedulerOutput:
        """Decide the next step. Mutates queues and KV allocations; never advances token counts."""

    @abstractmethod
    def num_running(self) -> int: ...

    @abstractmethod
    def num_waiting(self) -> int: ...

    @abstractmethod
    def kv_usage(self) -> float:
        """Fraction of KV capacity in use (0..1)."""

    @abstractmethod
    def release(self, req: Request) -> None:
        """Free a finished request's KV (a policy may cache it first)."""

    def prefix_cache_tokens(self) -> tuple[int, int]:
        """Prefix-cache (queried, hit) prompt tokens so far (vLLM's prefix_cache_queries and _hits)."""
        return 0, 0

    def cached_prefix_tokens(self, req: Request) -> int:
        """Leading prompt tokens of `req` this replica's prefix cache holds now, read without touching it (what a
        router learns from the engine's KV events); 0 for an engine without a prefix cache."""
        return 0

    def host_tier_stats(self) -> dict | None:
        """KV offload to host memory (kvcache/host_tier.py): None for an engine without it."""
        return None

    def serves_lora(self) -> bool:
        """Whether this engine, as configured, serves LoRA adapters (engines/lora.py)."""
        return self.adapters is not None

    def lora_stats(self) -> dict | None:
        """Multi-LoRA figures (None without adapters): slots, their memory per device, adapter loads."""
        a = self.adapters
        return None if a is None else a.stats(self.dep.adapter_weight_bytes_per_device)

    def check_adapter(self, req: Request, switch: str) -> bool:
        """Refuse a request naming a LoRA adapter the engine does not serve (`switch`: the knob that turns adapters
        on); the API server answers it before the engine sees it."""
        if req.lora_id < 0:
            return True
        if self.adapters is None:
            return self.reject(req, f"names LoRA adapter {req.lora_id} but {switch} is off")
        why = self.adapters.refusal(req)
        return self.reject(req, why) if why else True

    def prefix_hit_rate(self) -> float:
        queries, hits = self.prefix_cache_tokens()
        return hits / queries if queries else 0.0

    def has_work(self) -> bool:
        return self.num_running() > 0 or self.num_waiting() > 0

    def num_running_reported(self) -> int:   # its statistics after a step (a finished request released later: out)
        return self.num_running()

    def check_invariants(self) -> None:  # noqa: B027  (optional hook: engines without extra state skip it)
        """Raise AssertionError on broken bookkeeping (tests/fuzzing)."""

    def kv_capacity_tokens(self) -> int:
        return 0

    @property
    def schedules_ahead(self) -> bool:
        """Whether the loop forms the next batch while the running one computes (`overlap_schedules_ahead` and the
        timing overlapped): the decision for step k+1 is taken as step k starts, from the requests received by then,
        so a request that arrives during step k first joins step k+2 (sim/replica.py holds it until the decision
        after its arrival's step). False: a decision sees every request that arrived before it."""
        return self.overlap_schedules_ahead and self.timing.overlap

    def repeat_steps(self, out: SchedulerOutput) -> int:
        """After `out` was applied: how many next steps are certainly `out` again (the same requests, one decode
        token each, none finishing, no scheduling decision an arrival could change). The replica then prices them
        (`context_growth`), applies them with `apply_repeats` and skips `schedule`. 0 unless an engine proves more.
        With `last_repeat_by_update`, requests may finish in the last of them, which the replica applies by `update`
        (where the engine's schedule call for that step would change nothing `update` does not)."""
        return 0

    def context_growth(self, shape: BatchShape) -> int:
        """Context tokens a repeat of this decode step reads more than the step before: one per decode."""
        return shape.num_decode

    def apply_repeats(self, out: SchedulerOutput, ends: list[float]) -> list[float] | np.ndarray:
        """Apply `len(ends)` repeats of `out` (proved by `repeat_steps`) ending at `ends`, as that many `update`
        calls would, and return kv_usage() after each (a list or an array). Each repeat gives every scheduled
        request one token and finishes none. This default makes the calls; an engine with a closed form for its
        state overrides it."""
        usages = []
        for end in ends:
            self.update(out, end)
            usages.append(self.kv_usage())
        return usages

    @staticmethod
    def advance_decodes(out: SchedulerOutput, ends: list[float]) -> None:
        """`update`'s effect on the requests of repeated decode steps ending at `ends`."""
        steps, last_end = len(ends), ends[-1]
        for req, _ in out.scheduled:
            req.num_computed_tokens += steps
            req.num_output_tokens += steps
            req.last_token_s = last_end
            if req.token_times is not None:
                req.token_times.extend(ends)

    def exact_mode(self) -> None:
        """Switch the engine's speed devices off (Scenario.exact): the reference path alone. The base engine's one
        is the closed-form repeat of proven-identical steps (`repeat_steps`); an engine with more extends this."""
        self.repeat_steps = lambda out: 0   # type: ignore[method-assign]
        self.sync()
        self.cohort = None

    def sync(self) -> None:
        """Bring every request's counters up to date (the decode cohort's members are advanced lazily); call before
        reading a running request's progress from outside the engine."""
        if self.cohort is not None:
            self.cohort.sync()

    def check_cohort(self, running: list[Request]) -> None:
        """Bring the decode cohort's members up to date and check it against `running`, the engine's running set
        (the first thing an engine with a cohort does in check_invariants)."""
        self.sync()
        if self.cohort is not None:
            self.cohort.check_invariants(running)

    # ---- shared mechanics ---------------------------------------------------------------------------
    def reject(self, req: Request, reason: str) -> bool:
        req.status = Status.FAILED
        req.fail_reason = reason
        return False

    def refusal(self, req: Request) -> str | None:
        """Why the engine refuses `req` whatever its state (its lengths against the engine's limits: HTTP 400), or
        None. Pure: a run checks its shortest prompt with it before simulating (sim/build.py)."""
        if req.prompt_len + 1 > self.max_model_len:   # no room to generate within max_model_len
            return f"prompt of {req.prompt_len} tokens exceeds max_model_len {self.max_model_len}"
        return None

    def admit_length(self, req: Request) -> bool:
        """Reject `req` (False) where `refusal` gives a reason."""
        return (reason := self.refusal(req)) is None or self.reject(req, reason)

    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        """Advance computed tokens; a request that caught up samples one token; finished ones are released."""
        res = StepResult()
        itl = res.itl_groups
        finished = res.finished
        run_prev, run_count = -1.0, 0  # decodes whose previous token came at run_prev (mostly all of them)
        for req, n in islice(out.scheduled, out.num_lazy, None) if out.num_lazy else out.scheduled:
            computed = req.num_computed_tokens + n
            produced = req.num_output_tokens
            ahead = computed - req.prompt_len - produced
            if ahead:
                if ahead < 0:  # a prefill chunk that did not reach the end of the prompt
                    req.num_computed_tokens = computed
                    continue
                # a decode that verified `ahead` drafts: keep the accepted ones, roll the rest's KV back
                assert self.speculation is not None, "a decode ahead of its tokens without speculation"
                accepted = self.speculation.accepted(req, ahead)
                computed -= ahead - accepted
                produced += accepted
                res.num_accepted += accepted
                if req.token_times is not None:
                    req.token_times.extend([now] * accepted)
            req.num_computed_tokens = computed
            produced += 1
            req.num_output_tokens = produced
            if produced == 1:
                req.first_token_s = now
                res.num_first_tokens += 1
            elif req.last_token_s == run_prev:
                run_count += 1
            else:
                if run_count:
                    itl[run_prev] = itl.get(run_prev, 0) + run_count
                run_prev, run_count = req.last_token_s, 1
            req.last_token_s = now
            if req.token_times is not None:
                req.token_times.append(now)
            if produced >= req.output_len:
                req.status = Status.FINISHED
                req.finish_s = now
                finished.append(req)
        if run_count:
            itl[run_prev] = itl.get(run_prev, 0) + run_count
        if finished:
            self.on_finished(res.finished, now)
        if self.cohort is not None:
            self.cohort.stepped(out, itl, now)
        return res

    def stop_at_length(self, out: SchedulerOutput, res: StepResult, now: float, limit: int, reason: str) -> int:
        """Finish the step's requests whose sequence reached `limit` tokens before their own end (an engine's length
        stop); `reason` goes into fail_reason. Returns how many stopped."""
        stopped = 0
        for req, _ in out.scheduled:
            if req.prompt_len + req.num_output_tokens >= limit and req.num_output_tokens and \
                    req.status is Status.RUNNING:
                req.status, req.finish_s = Status.FINISHED, now
                req.fail_reason = f"{reason} after {req.num_output_tokens} of {req.output_len} tokens"
                res.finished.append(req)
                self.on_finished([req], now)
                stopped += 1
        return stopped

    def on_finished(self, finished: list[Request], now: float) -> None:
        """Remove finished requests from the running set and free their KV."""
        for req in finished:
            self.release(req)

    def make_shape(self, scheduled: Sequence[tuple[Request, int]], num_lazy: int = 0) -> BatchShape:
        """The batch shape of a step, with CUDA-graph coverage decided by the engine's timing terms. The first
        `num_lazy` entries are the decode cohort's members (their counters may be stale)."""
        shape = BatchShape()
        chunks = shape.prefill_chunks
        num_decode = logits = num_lazy
        ctx = self.cohort.context_tokens(num_lazy) if num_lazy and self.cohort is not None else 0
        structured = spec = drafts = 0
        for req, n in islice(scheduled, num_lazy, None) if num_lazy else scheduled:
            if req.structured:
                structured += 1
            computed = req.num_computed_tokens
            total = req.prompt_len + req.num_output_tokens
            if n == 1 and computed == total - 1 and req.num_output_tokens:
                num_decode += 1
                ctx += total
            elif computed + n > total:  # a decode verifying n - 1 speculative drafts
                num_decode += 1
                ctx += total
                spec += 1
                drafts += n - 1
                logits += n
                continue
            else:
                chunks.append((n, computed))
                if computed + n < total:
                    continue
            logits += 1
        shape.num_decode, shape.decode_context_tokens, shape.num_logits = num_decode, ctx, logits
        shape.num_structured = structured
        shape.num_spec, shape.spec_tokens = spec, drafts
        shape.cuda_graph, shape.padded_decode = self.timing.graph_for(num_decode, not chunks)
        return shape

    def mark_scheduled(self, req: Request, now: float) -> None:
        if req.first_scheduled_s < 0:
            req.first_scheduled_s = now
        req.status = Status.RUNNING


ENGINES: Registry[EnginePolicy] = Registry("engine")
