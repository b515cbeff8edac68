"""Static batching with HuggingFace transformers `generate`: the "traditional" serving baseline before vLLM.

A batch of up to `batch_size` waiting requests starts only when the engine is idle (no timeout: it takes what
is waiting). The prompts are left-padded to the longest and prefilled in one forward; the batch then decodes in
lockstep until its longest member is done. Rows of members that finished earlier keep computing pad tokens, and
every member's response is returned when the whole batch ends (`generate` returns the batch together), so their
finish time is the batch end; first tokens are still stamped at the first step, as a streamer would see them.
KV is one contiguous row per member preallocated for the whole generation (HF `StaticCache`), so admission
counts the reservation, not the tokens written. Eager PyTorch: no CUDA graphs, no prefix cache, one
synchronous Python loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from simengine.config.loader import Checked, Sequences
from simengine.core.batch import BatchShape, SchedulerOutput, StepResult
from simengine.core.request import Request, Status
from simengine.cost.timing import PYTHON_SEQ_CPU_S, EngineTiming
from simengine.engines.base import ENGINES, EnginePolicy
from simengine.engines.devices import ALL_CLASSES, ALL_VENDORS
from simengine.engines.memory import NON_TORCH_BYTES, Deployment, activation_reserve_bytes, kv_tokens_or_refuse


@dataclass(frozen=True, kw_only=True)
class StaticParams(Checked):
    """A server that calls `model.generate` on batches (HF `pipeline(..., batch_size=...)` semantics)."""

    # ESTIMATE: pipeline batch_size defaults to 1 (no batching; transformers pipelines/base.py);
    # 8 is the first batched size in the "Pipeline batching" section of HF's pipelines docs
    batch_size: Sequences = 8
    preallocate: Literal["max_tokens", "max_model_len"] = "max_tokens"
    # "max_tokens": generate(cache_implementation="static") sizes each row to generation_config.max_length - 1 =
    # padded prompt + max_new_tokens (transformers generation/utils.py); "max_model_len": a StaticCache built
    # without max_cache_len takes config.max_position_embeddings (cache_utils.py), the classic max-length buffer.


@ENGINES.register("static")
class StaticEngine(EnginePolicy):
    Params = StaticParams
    vendors = ALL_VENDORS
    # nearest measured backend: PyTorch/transformers GEMMs are cuBLAS, attention SDPA/flash-attention
    kernel_backend = "vllm"
    device_classes = ALL_CLASSES
    research_baseline = True
    support_source = ("research/baseline policy, not a product: PyTorch + transformers run on CUDA, ROCm, Ascend "
                      "(torch_npu), Apple MPS, Intel XPU/Gaudi and CPUs (transformers installation docs)")
    last_repeat_by_update = True   # a decode step of the formed batch only describes it
    repeats_outlast_arrivals = True   # a formed batch admits nobody until it is done

    def __init__(self, params: StaticParams, dep: Deployment):
        self.step_token_limit, self.batch_size_limit = None, params.batch_size
        super().__init__(params, dep)
        # No memory knob: the PyTorch caching allocator may take the whole device. What is left after weights,
        # non-torch memory and a batch's activations holds the StaticCache rows.
        self.free_bytes = dep.hardware.memory_bytes - dep.weight_bytes_per_device - NON_TORCH_BYTES
        self.kv_per_token = dep.kv_bytes_per_token_per_device
        self.capacity = kv_tokens_or_refuse(dep, lambda d: d.hardware.memory_bytes - d.weight_bytes_per_device
                                            - NON_TORCH_BYTES - activation_reserve_bytes(d, 1, 1),
                                            engine="static", rule="all device memory (no fraction knob)")
        self.waiting: deque[Request] = deque()
        self.batch: list[Request] = []          # the running batch, finished members included (they hold rows)
        self.done_in_batch: list[Request] = []  # finished members waiting for the batch end
        self.row_len = 0                        # tokens reserved per row
        self.pad_len = 0                        # prompts are left-padded to this length
        self.reserved_token_steps = 0           # sum over steps of reserved KV tokens
        self.used_token_steps = 0               # sum over steps of KV tokens actually written
        self.batch_written = 0                  # KV tokens the current batch has written (rows never pass row_len)

    def make_timing(self) -> EngineTiming:
        return EngineTiming(
            # ESTIMATE: generate's per-step Python (prepare_inputs_for_generation, mask/cache bookkeeping) ~1 ms
            # and logits processors + sampling + stopping criteria with a host sync ~1 ms.
            scheduler_cpu_s=1.0e-3, output_cpu_s=1.0e-3, overlap=False, seq_cpu_s=PYTHON_SEQ_CPU_S,
            # ESTIMATE: eager HF Llama layer ~40 ops (RMSNorm as 6 ops twice, 3 separate q/k/v GEMMs, rotate_half
            # RoPE ~10 ops, SDPA, o_proj, gate/up/act/mul/down, 2 residuals) at ~25 us of PyTorch dispatch each:
            # ~32 ms per Llama-7B step, matching the 25.5 tok/s PyTorch measured for a plain eager Llama-2-7B
            # on A100 (pytorch.org/blog/accelerating-generative-ai-2: "heavily CPU overhead bound").
            kernel_launch_s=25e-6, kernels_per_layer=40, cuda_graph_sizes=())

    # ---- queues -------------------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self.batch)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return len(self.batch) * self.row_len / self.capacity

    def kv_capacity_tokens(self) -> int:
        return self.capacity

    def kv_reserved_vs_used(self) -> tuple[int, int]:
        """(reserved, written) KV tokens summed over every step so far: how much of the reservation is used."""
        return self.reserved_token_steps, self.used_token_steps

    def refusal(self, req: Request) -> str | None:
        if (reason := super().refusal(req)) is not None:
            return reason
        if self.params.preallocate == "max_model_len" and req.prompt_len + req.max_tokens > self.max_model_len:
            return (f"prompt + max_tokens {req.prompt_len + req.max_tokens} overruns the static cache of "
                    f"max_model_len {self.max_model_len}")
        return None

    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        self.waiting.append(req)
        return True

    def release(self, req: Request) -> None:
        self.batch.remove(req)

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: a batch is formed only when none runs; once formed it is fixed (no joins) and every one of
        # its rows, finished or not, is computed and holds its full reservation until the last member is done.
        out = SchedulerOutput()
        if not self.batch:
            self._form_batch(out, now)
            if self.batch:
                self._prefill_step(out)
        else:
            self._decode_step(out)
        return out

    def _row_len(self, members: list[Request]) -> int:
        pad = max(r.prompt_len for r in members)
        if self.params.preallocate == "max_model_len":
            return self.max_model_len
        return pad + max(r.max_tokens for r in members) - 1  # max_length - 1: the last token is never cached

    def _fits(self, members: list[Request]) -> bool:
        rows = len(members)
        pad = max(r.prompt_len for r in members)
        kv = rows * self._row_len(members) * self.kv_per_token
        return kv + activation_reserve_bytes(self.dep, rows * pad, rows) <= self.free_bytes

    def _form_batch(self, out: SchedulerOutput, now: float) -> None:
        """FCFS: take waiting requests while the padded batch's rows and activations fit in memory."""
        members: list[Request] = []
        while self.waiting and len(members) < self.params.batch_size:
            req = self.waiting[0]
            if self._fits(members + [req]):
                members.append(self.waiting.popleft())
                continue
            if not members:  # alone it cannot get its row: it never will
                self.waiting.popleft()
                self.reject(req, "its preallocated KV row and prefill activations exceed device memory")
                out.rejected.append(req)
                continue
            break
        if not members:
            return
        for req in members:
            self.mark_scheduled(req, now)
            req.num_cached_tokens = 0
        self.batch = members
        self.row_len = self._row_len(members)
        self.pad_len = max(r.prompt_len for r in members)

    def _prefill_step(self, out: SchedulerOutput) -> None:
        """One forward over every prompt padded to the longest; only last-token logits (logits_to_keep=1)."""
        out.scheduled = [(r, r.prompt_len) for r in self.batch]
        rows = len(self.batch)
        out.shape = BatchShape(prefill_chunks=[(self.pad_len, 0)] * rows, num_logits=rows)

    def _decode_step(self, out: SchedulerOutput) -> None:
        """Every row decodes one token over the padded context; finished rows compute pads."""
        active = [r for r in self.batch if r.status is not Status.FINISHED]
        out.scheduled = [(r, 1) for r in active]
        rows = len(self.batch)
        context = self.pad_len + active[0].num_output_tokens  # lockstep: every active row has as many outputs
        out.shape = BatchShape(num_decode=len(active), padded_decode=rows, decode_context_tokens=rows * context,
                               num_logits=rows)

    def repeat_steps(self, out: SchedulerOutput) -> int:
        """A running batch decodes in lockstep: up to the step in which its next member finishes (applied by update),
        every step is the same."""
        if not self.batch or not out.shape.num_decode:
            return 0
        return max(0, min(r.output_len - r.num_output_tokens for r, _ in out.scheduled))

    def context_growth(self, shape: BatchShape) -> int:
        return shape.padded_decode  # every row, padding included, reads one more token

    def apply_repeats(self, out: SchedulerOutput, ends: list[float]) -> list[float]:
        """update's counters over `len(ends)` lockstep steps, in closed form (no member finishes meanwhile)."""
        m = len(ends)
        self.advance_decodes(out, ends)
        self.reserved_token_steps += m * len(self.batch) * self.row_len
        written, per_step = self.batch_written, sum(n for _, n in out.scheduled)
        self.used_token_steps += m * written + per_step * m * (m + 1) // 2  # written after each step, summed
        self.batch_written = written + m * per_step
        return [self.kv_usage()] * m

    # ---- update -------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        """Shared token progress; finished members are held until the whole batch is done, then all return."""
        res = super().update(out, now)
        self.reserved_token_steps += len(self.batch) * self.row_len
        self.batch_written += sum(n for _, n in out.scheduled)
        self.used_token_steps += self.batch_written
        if len(self.done_in_batch) < len(self.batch):
            res.finished = []
            return res
        for req in self.done_in_batch:
            req.finish_s = now  # generate() returns the batch together
        res.finished = self.done_in_batch
        self.batch, self.done_in_batch, self.row_len, self.pad_len, self.batch_written = [], [], 0, 0, 0
        return res

    def on_finished(self, finished: list[Request], now: float) -> None:
        self.done_in_batch.extend(finished)

    def check_invariants(self) -> None:
        assert len(self.batch) <= self.params.batch_size
        assert len(self.batch) * self.row_len <= self.capacity
        assert all(r in self.batch for r in self.done_in_batch)
        assert all(r.num_computed_tokens <= self.row_len for r in self.batch if r.status is not Status.FINISHED)
