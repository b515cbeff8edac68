"""Step time: the kernels' GPU time for a batch shape, then CUDA-graph replay or eager launches, then host time.

`CostModel.step(shape)` is what a replica waits for each step. The GPU part comes from a kernel model
(`RooflineKernels`, or `MeasuredKernels` where tables exist); everything that depends only on the step's token
count (GEMMs, elementwise kernels, communication) is priced for whole ranges of token counts at once and looked
up, so a step costs a few table reads plus its attention. The engine's mechanisms follow (cost/timing.py): a
captured CUDA graph replays the step in one launch, an eager step lasts at least as long as the host needs to
enqueue its kernels, and host work (scheduling, output processing, per-sequence sampling, grammar masks) adds to
the step unless the engine overlaps it with the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simengine.core.batch import BatchShape
from simengine.cost.roofline import RooflineKernels, bound
from simengine.cost.timing import EngineTiming
from simengine.cost.work import (
    ADAPTER_BYTES_PER_PARAM,
    ADAPTER_DISK_BYTES_S,
    ADAPTER_DISK_LATENCY_S,
    LORA_KERNELS_PER_MODULE,
    TARGET_MODULES,
    lora_params_per_rank,
)


class StepCost(NamedTuple):
    """Seconds of one step and where they went: compute-bound, memory-bound and communication GPU time, the rest
    (kernel floors, launches, exposed host time) as overhead; `measured_s` of them came from measured kernels."""

    seconds: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    measured_s: float = 0.0


def step_seconds(gpu, cuda_graph, host_extra, t: EngineTiming, launch_s, maximum=max):
    """Step seconds from GPU seconds: a captured CUDA graph replays in one launch; an eager step lasts at least as
    long as the host takes to enqueue its kernels; then the host work the engine does not overlap with the GPU.
    Floats or arrays (`cuda_graph` a bool, or a bool array: then a blend by 0/1, which gives the same floats)."""
    if cuda_graph is True:
        total = gpu + t.graph_replay_s
    elif cuda_graph is False:
        total = maximum(gpu, launch_s)
    else:
        total = cuda_graph * (gpu + t.graph_replay_s) + (1 - cuda_graph) * maximum(gpu, launch_s)
    return total + t.exposed_host_s(total, host_extra)


def pipeline_stage(seconds, cpu, stages, overlap, maximum=max):
    """One pipeline rank's seconds per micro-batch of a step of `seconds` with `cpu` seconds of host work
    (sim/replica.py PipelinedReplica): the GPU work divided among the stages, the host work not (every rank
    schedules, prepares and hands on every micro-batch), hidden behind the stage's share of the GPU only where the
    engine's loop overlaps the two. Floats or arrays (`overlap` a bool or a bool array)."""
    return overlap * maximum(seconds / stages, cpu) + (1 - overlap) * ((seconds - cpu) / stages + cpu)


class Proposer:
    """What drafting a step's speculative tokens costs (engines/speculative.py): a draft network's forward passes
    (`draft`: the step-time model of a draft model or a one-layer draft head, without host terms of its own), one
    per draft position for the drafting requests, plus one over the step's prompt tokens, whose hidden states or KV
    the draft needs; or, for prompt lookup (ngram), host time per drafting request. The proposer runs between the
    target's forwards, so its time adds to the step."""

    def __init__(self, draft: CostModel | None, host_s_per_request: float = 0.0, *, batched: bool = True):
        self.draft, self.host_s_per_request = draft, host_s_per_request
        self.batched = batched   # False: each request drafts alone (llama.cpp's slots), a batch of one per pass

    def seconds(self, shape: BatchShape) -> float:
        n = shape.num_spec
        if self.draft is None:
            return n * self.host_s_per_request
        ctx = shape.decode_context_tokens * n // max(shape.num_decode, 1)
        if self.batched:
            passes, batch = -(-shape.spec_tokens // n), n   # draft positions (the deepest request's)
        else:
            passes, batch, ctx = shape.spec_tokens, 1, ctx // n
        cuda_graph, padded = self.draft.timing.graph_for(batch, True)
        one = self.draft.step(BatchShape(num_decode=batch, decode_context_tokens=ctx, num_logits=batch,
                                         padded_decode=padded, cuda_graph=cuda_graph)).seconds
        total = passes * one
        if shape.prefill_chunks:
            total += self.draft.step(BatchShape(prefill_chunks=shape.prefill_chunks)).seconds
        return total


# Repeats of one decode shape (llama.cpp's busy slots, a static batch between finishes) read contexts that later runs
# of the same shape read again: `decode_run` keeps each shape's `decode_steps` rows for every context below a bound,
# computed by `decode_steps` itself (elementwise operations: the same floats whatever else the array holds).
DECODE_TABLE_CONTEXTS = 1 << 16   # contexts one shape's table may cover (3 MiB of rows)
DECODE_TABLES = 8                 # shapes that get a table; others are priced run by run


class CostModel:
    """Step time of one replica: `kernels` for the GPU, `timing` for the engine's launch and host mechanisms, and
    the speculative `proposer` where the engine drafts tokens."""

    def __init__(self, kernels: RooflineKernels, timing: EngineTiming, *, grammar_mask_s: float = 0.0,
                 proposer: Proposer | None = None):
        self.kernels, self.timing, self.proposer = kernels, timing, proposer
        self.work = kernels.work
        self.model, self.tp, self.pp = self.work.model, self.work.tp, self.work.pp
        self.grammar_mask_s = grammar_mask_s  # host time per structured-output token (the backend's mask cost)
        self.launch_s = timing.kernel_launch_s * timing.kernels_per_layer * self.model.num_layers
        self._tok: list[tuple[float, ...]] = []   # per token count: (gpu, compute, memory, comm, measured)
        self._lm: list[tuple[float, ...]] = []    # per logits count: (gpu, compute, memory, measured)
        self._decode_tables: dict[tuple, np.ndarray] = {}   # decode shape -> its decode_steps rows by context

    def describe(self) -> str:
        return self.kernels.describe()

    # ---- cached per token / logits count --------------------------------------------------------------
    def _grow(self, cache: list, need: int, price) -> None:
        n = 1 << max(need, 255).bit_length()
        cols = price(np.arange(n, dtype=float))
        rows = np.broadcast_arrays(*[np.asarray(c, dtype=float) for c in cols])
        cache[:] = list(zip(*(r.tolist() for r in rows), strict=True))

    def token_parts(self, tokens: int) -> tuple[float, ...]:
        if tokens >= len(self._tok):
            self._grow(self._tok, tokens, self.kernels.tokens)
        return self._tok[tokens]

    def logit_parts(self, logits: int) -> tuple[float, ...]:
        if logits >= len(self._lm):
            self._grow(self._lm, logits, self.kernels.logits)
        return self._lm[logits]

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self, shape: BatchShape) -> StepCost:
        """Price one forward pass."""
        chunks = shape.prefill_chunks
        num_decode = shape.num_decode
        prefill = 0
        for c, _ in chunks:
            prefill += c
        tok = self.token_parts(prefill + (shape.padded_decode if shape.padded_decode > num_decode else num_decode)
                               + shape.spec_tokens)
        lm = self.logit_parts(shape.num_logits)
        gpu, compute, memory, measured = tok[0] + lm[0], tok[1] + lm[1], tok[2] + lm[2], tok[4] + lm[3]
        if chunks:
            a = self.kernels.prefill(chunks)
            gpu, compute, memory, measured = gpu + a[0], compute + a[1], memory + a[2], measured + a[3]
        if num_decode:
            a = self.kernels.decode(num_decode, shape.decode_context_tokens)
            gpu, compute, memory, measured = gpu + a[0], compute + a[1], memory + a[2], measured + a[3]
        t = self.timing
        comm = tok[3]
        if t.compiled_max_bs:
            f = t.gpu_factor(num_decode, not chunks and not shape.spec_tokens, shape.cuda_graph)
            gpu, compute, memory, comm, measured = gpu * f, compute * f, memory * f, comm * f, measured * f
        host = t.seq_cpu_s * (num_decode + len(chunks)) + shape.num_structured * self.grammar_mask_s
        seconds = step_seconds(gpu, shape.cuda_graph, host, t, self.launch_s)
        if shape.num_spec and self.proposer is not None:
            seconds += self.proposer.seconds(shape)
        if shape.lora_adapters:
            seconds += self.lora_seconds(shape)
        if shape.host_load_tokens:   # offloaded KV copied in over the host link
            hw = self.work.hw
            load = (shape.host_load_tokens * self.work.kv_write_bytes_per_token / hw.host_link_bandwidth_bytes_s
                    + hw.host_link_latency_s)
            if shape.host_load_overlapped:   # layer by layer: layer i computes once its KV is in, so the step ends
                seconds = max(seconds, load + seconds / self.model.num_layers)  # at the load plus one layer's work
            else:                            # before the forward
                seconds += load
        if shape.pipelined and self.pp > 1:   # one more forward through a filled pipeline: its last stage's share
            f = 1.0 / self.pp
            seconds, compute, memory, comm, measured = (seconds * f, compute * f, memory * f, comm * f,
                                                         measured * f)
        return StepCost(seconds, compute, memory, comm, seconds - compute - memory - comm, measured)

    def stage_seconds(self, shape: BatchShape, seconds: float, stages: int) -> float:
        """One pipeline rank's seconds per micro-batch for a step of `seconds` (`pipeline_stage`)."""
        t = self.timing
        cpu = (t.step_cpu_s + t.seq_cpu_s * (shape.num_decode + len(shape.prefill_chunks))
               + shape.num_structured * self.grammar_mask_s)
        return pipeline_stage(seconds, cpu, stages, t.overlap)

    def lora_seconds(self, shape: BatchShape) -> float:
        """Multi-LoRA (engines/lora.py): adapters loaded before the forward (from host memory over the host link,
        from disk first), then the batched LoRA kernels: each distinct adapter's weights read once, every LoRA
        token's shrink and expand computed, at the padded rank, two kernels per target module and layer."""
        w, t, hw = self.work, self.kernels.terms, self.work.hw
        params = lora_params_per_rank(w.model) / w.attention_tp   # per rank, on each device
        per_rank = params * ADAPTER_BYTES_PER_PARAM      # bytes
        s = 0.0
        if shape.lora_host_load_ranks:
            s += shape.lora_host_load_ranks * per_rank / hw.host_link_bandwidth_bytes_s + hw.host_link_latency_s
        if shape.lora_disk_load_ranks:
            disk = shape.lora_disk_load_ranks * per_rank * w.attention_tp
            s += disk / ADAPTER_DISK_BYTES_S + ADAPTER_DISK_LATENCY_S
            s += shape.lora_disk_load_ranks * per_rank / hw.host_link_bandwidth_bytes_s + hw.host_link_latency_s
        flops = 2.0 * shape.lora_tokens * shape.lora_rank * params
        nbytes = shape.lora_adapters * shape.lora_rank * per_rank
        gpu, _, _ = bound(flops / self.kernels.attn_peak, nbytes / self.kernels.bandwidth, t.g_attn,
                          t.memory_fraction)
        kernels = LORA_KERNELS_PER_MODULE * TARGET_MODULES * w.model.num_layers
        return s + gpu + kernels * t.kernel_floor_s

    def decode_run(self, shape: BatchShape, growth: int, steps: int) -> np.ndarray:
        """`decode_steps` of `steps` repeats of `shape`, each reading `growth` more context tokens than the one before
        (the first `growth` more than `shape`), read from the shape's table where its contexts fit one (a view)."""
        first = shape.decode_context_tokens + growth
        last = first + growth * (steps - 1)
        key = (shape.num_decode, shape.padded_decode, shape.num_logits, shape.cuda_graph, shape.num_structured)
        table = self._decode_tables.get(key)
        if table is None or last >= len(table):
            if last >= DECODE_TABLE_CONTEXTS or (table is None and len(self._decode_tables) >= DECODE_TABLES):
                return self.decode_steps(shape, first + growth * np.arange(float(steps)))
            size = 1 << max(last, 1023).bit_length()
            table = self._decode_tables[key] = self.decode_steps(shape, np.arange(float(size)))
        return table[first:last + 1:growth]

    def decode_steps(self, shape: BatchShape, contexts: np.ndarray) -> np.ndarray:
        """`step` of decode-only copies of `shape` whose decodes read `contexts[i]` tokens in all (the repeats of a
        decode step), in one numpy pass: one row of StepCost fields per context, bit for bit `step`'s (the same
        operations in the same order; tests/test_cost_model.py)."""
        if shape.prefill_chunks or shape.num_spec or shape.host_load_tokens or shape.lora_adapters:
            raise ValueError("decode_steps prices decode-only shapes without drafts")
        num_decode = shape.num_decode
        tok = self.token_parts(shape.padded_decode if shape.padded_decode > num_decode else num_decode)
        lm = self.logit_parts(shape.num_logits)
        a = self.kernels.decode(num_decode, np.asarray(contexts, dtype=np.float64), np.maximum)
        out = np.empty((len(contexts), len(StepCost._fields)))
        gpu = (tok[0] + lm[0]) + a[0]
        out[:, 1] = (tok[1] + lm[1]) + a[1]
        out[:, 2] = (tok[2] + lm[2]) + a[2]
        out[:, 3] = tok[3]
        out[:, 5] = (tok[4] + lm[3]) + a[3]
        t = self.timing
        if t.compiled_max_bs:
            f = t.gpu_factor(num_decode, True, shape.cuda_graph)
            gpu = gpu * f
            out[:, 1:4] *= f
            out[:, 5] *= f
        host = t.seq_cpu_s * num_decode + shape.num_structured * self.grammar_mask_s
        seconds = out[:, 0] = step_seconds(gpu, shape.cuda_graph, host, t, self.launch_s, np.maximum)
        out[:, 4] = seconds - out[:, 1] - out[:, 2] - out[:, 3]
        return out
