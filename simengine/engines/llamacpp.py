"""llama.cpp server (ggml-org/llama.cpp tools/server/server-context.cpp, master 001d906).

Fixed slots (-np; auto 4 with one unified KV of n_ctx cells). A task takes the idle slot whose cached tokens share
the longest prefix with its prompt (more than slot_prompt_similarity of it), else the least recently used one, else
it waits in a FIFO queue. An iteration decodes every generating slot first, then appends prompt tokens of slots
still prefilling, in slot order, up to n_batch; ggml runs it as ceil(T / n_ubatch) forwards, one simulator step
each (sampled tokens are placed in the last one, so they appear when the iteration ends). Per-slot prompt reuse
(cache_prompt) and the host-RAM prompt cache (--cache-ram: idle slots saved, the best match restored). No
preemption: a batch the cells cannot hold first purges idle slots, then fails every processing slot (the server's
"Context size has been exceeded"). Context shift off: a slot reaching n_ctx stops early (truncated). One
synchronous thread, CPU sampling, CUDA graphs only for single-token batches (ggml-cuda).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np

from simengine.config.loader import MAX_TOKENS, Checked, Range, Sequences, Share, Tokens
from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.cost.timing import NATIVE_FRONTEND_S, EngineTiming
from simengine.engines.base import ENGINES, EnginePolicy, StepResult
from simengine.engines.devices import ALL_CLASSES, gpu_visible_bytes, launch_cost_s, refuse_gaudi
from simengine.engines.memory import GIB, Deployment, activation_reserve_bytes
from simengine.engines.speculative import (
    AcceptanceDataset,
    AcceptanceKnobs,
    AcceptanceRates,
    Speculation,
    resolve,
    with_proposer,
)
from simengine.errors import CannotRun, InputError

MIB = 2**20
EMPTY = np.zeros(0, dtype=np.int32)
# ESTIMATE: driver context outside ggml's buffers (CUDA context 0.3-0.5 GiB; Metal/Vulkan/OpenCL similar).
DRIVER_CONTEXT_BYTES = 0.4 * GIB
GGUF_WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "q8_0", "q4_0", "mxfp4")  # ggml tensor types llama.cpp runs
# ggml-cuda multiplies quantized weights with its own MMQ kernels (mmq.cu: activations quantized to q8_1, int8
# tensor-core tiles, dequantised per block in registers) for batches over 8; 16/32-bit weights go to cuBLAS.
MMQ_WEIGHT_DTYPES = ("q8_0", "q4_0", "mxfp4")
# MMQ's throughput is a fixed amount of work per SM per cycle, not a share of the tensor peak: RTX 4090 (Ada, 128 SMs
# at 2.52 GHz) runs Llama-3-8B Q4_0 pp512 at 10358.75 tok/s with MMQ on tensor cores (ggml-org/llama.cpp PR #7676,
# ubatch 512), i.e. 2 x 6.98e9 layer weights x 10358.75 / (128 x 2.52e9) = 448 FLOP per SM per cycle (the step's
# attention, ~1%, included). That is 22% of Ada's and GA102's int8 tensor peak per SM but 11% of GA100's, whose
# SMs have twice the int8 rate: llama.cpp's published pp512 on A100 and RTX 3090 are equal within 2%, as SMs x clock
# predicts (docs/validation.md). Applies where the hardware YAML gives sm_count and boost_clock_mhz.
MMQ_FLOPS_PER_SM_CYCLE = 448.0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:  # most cached prompts differ at once: skip the array comparison
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True, kw_only=True)
class LlamaCppParams(Checked):
    """llama-server flags (long names, dashes as underscores). Defaults from common/common.h at 001d906."""

    n_parallel: Sequences | None = None  # -np; None (or 1 without -kvu): 4 slots, unified KV (server.cpp, #16736)
    kv_unified: bool | None = None       # -kvu; None: true when n_parallel was auto-set (same)
    # -c; 0: the model's training context, shrunk by --fit (common.h n_ctx)
    ctx_size: Annotated[int, Range(0, MAX_TOKENS)] = 0
    fit: bool = True                     # --fit (common.h fit_params)
    # --fit-target: MiB --fit leaves free per device (common.h fit_params_target)
    fit_target: Annotated[int, Range(0, 1 << 24)] = 1024
    fit_ctx: Tokens = 4096               # --fit-ctx: smallest n_ctx --fit shrinks to (common.h fit_params_min_ctx)
    batch_size: Tokens = 2048            # -b: logical batch n_batch (common.h)
    ubatch_size: Tokens = 512            # -ub: physical batch n_ubatch (common.h)
    cont_batching: bool = True           # -cb (common.h cont_batching)
    context_shift: bool = False          # --context-shift (common.h ctx_shift)
    cache_prompt: bool = True            # request field cache_prompt, on by default (common.h)
    # --cache-ram: MiB of host prompt cache, -1 no limit, 0 off (common.h)
    cache_ram: Annotated[int, Range(0, 1 << 30, also=(-1,))] = 8192
    cache_idle_slots: bool = True        # --cache-idle-slots: save idle slots to the RAM cache (common.h)
    slot_prompt_similarity: Share = 0.1  # -sps; 0 disables similarity-based slot choice (common.h)
    # speculative decoding with a draft model (-md / --spec-draft-model; a catalog name here): each generating slot
    # drafts up to spec_draft_n_max tokens with it, one slot at a time, and the iteration verifies them
    # (common.h common_params_speculative_draft n_max = 3 at 001d906; --draft-max, default 16, in older builds)
    model_draft: str | None = None
    spec_draft_n_max: Annotated[int, Range(1, 256)] = 3
    # the simulator's acceptance model (engines/speculative.py AcceptanceKnobs), not llama.cpp flags
    spec_acceptance: AcceptanceRates = None
    spec_acceptance_dataset: AcceptanceDataset = "chat"

    def __post_init__(self):
        super().__post_init__()
        if self.context_shift:
            raise InputError("true is not modelled (shifting discards KV mid-sequence, which the simulator's token "
                             "accounting cannot represent); leave the default false", field="context_shift")


@dataclass(slots=True, eq=False)
class _Slot:
    """One server slot: the task it processes, or (idle) the tokens still cached in its cells."""

    id: int
    req: Request | None = None
    cache: np.ndarray = field(default_factory=lambda: EMPTY)
    last_used: int = -1

    @property
    def cells(self) -> int:
        return self.req.num_computed_tokens if self.req is not None else len(self.cache)


def _check_deployment(dep: Deployment) -> None:
    refuse_gaudi(dep.hardware, "llama.cpp")
    if dep.weight_format.name not in GGUF_WEIGHT_DTYPES:
        raise InputError(f"llama.cpp runs GGUF weights; '{dep.weight_format.name}' has no ggml type; valid: "
                         f"{', '.join(GGUF_WEIGHT_DTYPES)} (q8_0/q4_0 are the 8- and 4-bit GGUF formats)",
                         field="deployment.weight_dtype")
    if dep.kv_dtype == "fp8":
        raise InputError("llama.cpp has no fp8 KV cache type (-ctk/-ctv: f16, bf16, q8_0, q4_0, ...); use bf16, "
                         "int8 (~q8_0) or int4 (~q4_0)", field="deployment.kv_dtype")
    if dep.tp > 1:
        raise InputError("llama.cpp splits layers across devices (--split-mode layer, the default), not tensors; "
                         "use deployment.pp instead of tp", field="deployment.tp")


@ENGINES.register("llamacpp")
class LlamaCppEngine(EnginePolicy):
    Params = LlamaCppParams
    vendors = frozenset({"nvidia", "amd", "apple", "intel", "qualcomm", "huawei"})
    device_classes = ALL_CLASSES
    support_source = ("llama.cpp README 'Supported backends' + docs/build.md: CUDA (incl. Jetson), HIP (AMD), Metal "
                      "(Apple), SYCL/Vulkan (Intel GPUs), OpenCL (Qualcomm Adreno, docs/backend/OPENCL.md), CANN "
                      "(Ascend NPU); no Gaudi backend")

    def __init__(self, params: LlamaCppParams, dep: Deployment):
        _check_deployment(dep)
        p = params
        dep = with_proposer(dep, self.speculation_of(p, dep))   # the draft model's weights and KV fit first
        auto = p.n_parallel in (None, 1) and not p.kv_unified
        self.n_parallel = 4 if auto else p.n_parallel
        self.kv_unified = True if auto else bool(p.kv_unified)
        self.n_ctx = self._fit_ctx(p, dep)
        per_slot = self.n_ctx if self.kv_unified else self.n_ctx // self.n_parallel
        self.n_ctx_slot = min(per_slot, dep.model.max_model_len)     # server-context.cpp n_ctx_slot()
        self.n_batch = min(p.batch_size, self.n_ctx)                  # llama_context: causal n_batch <= n_ctx
        self.n_ubatch = min(p.ubatch_size, self.n_batch)
        self.step_token_limit, self.batch_size_limit = self.n_ubatch, self.n_parallel
        super().__init__(params, dep)
        self.max_model_len = self.n_ctx_slot
        self.slots = [_Slot(i) for i in range(self.n_parallel)]
        self.num_busy = 0                                        # slots processing a task
        self.queue: deque[Request] = deque()
        self.plan: deque[list[tuple[Request, int]]] = deque()   # the current iteration's remaining forwards
        self.ram: list[np.ndarray] = []                          # host prompt cache, oldest first
        self.ram_heads: list[int] = []  # each entry's first token: only an entry sharing it can share a prefix
        state_bytes = dep.model.kv_bytes_per_token(dep.kv_elem_bytes)
        self.ram_limit = (0 if p.cache_ram == 0 else float("inf") if p.cache_ram < 0
                          else p.cache_ram * MIB / state_bytes)   # in tokens
        self.clock = 0
        self.query_tokens = self.hit_tokens = self.ram_restored_tokens = 0
        self.num_truncated = 0

    @classmethod
    def speculation_of(cls, params: LlamaCppParams, dep: Deployment) -> Speculation | None:
        p = params
        if p.model_draft is None:
            return None
        knobs = AcceptanceKnobs(acceptance=p.spec_acceptance, acceptance_dataset=p.spec_acceptance_dataset)
        return resolve("draft_model", p.spec_draft_n_max, knobs, target=dep.model, at="model_draft",
                       draft_model=p.model_draft, model_field="model_draft", batched_drafts=False)

    def _fit_ctx(self, p: LlamaCppParams, dep: Deployment) -> int:
        """n_ctx cells: the training context (or -c), shrunk by --fit to what device memory holds (>= fit_ctx)."""
        want = p.ctx_size or dep.model.max_model_len
        fixed = (dep.weight_bytes_per_device + DRIVER_CONTEXT_BYTES + p.fit_target * MIB * p.fit
                 + activation_reserve_bytes(dep, min(p.ubatch_size, p.batch_size), p.ubatch_size))  # compute buffer
        room = int((gpu_visible_bytes(dep.hardware) - fixed) // dep.kv_bytes_per_token_per_device)
        if want <= room:
            return want
        if p.fit and not p.ctx_size and room >= p.fit_ctx:
            return room
        hw = dep.hardware
        raise CannotRun(
            f"{dep.model.name} with n_ctx {want if p.ctx_size else p.fit_ctx} does not fit on {hw.name} with "
            f"llama.cpp: weights {dep.weight_bytes_per_device / GIB:.1f} GiB of "
            f"{gpu_visible_bytes(hw) / GIB:.1f} GiB usable leave room for {max(room, 0)} KV cells; --fit would move "
            f"layers to the CPU (not modelled): use a smaller weight_dtype (q4_0), a smaller ctx_size or more devices",
            field="deployment")

    def engine_gemm_flops_s(self) -> float | None:
        """ggml-cuda's MMQ rate for quantized weights on an NVIDIA device of known SMs and clock (else None)."""
        hw = self.dep.hardware
        if hw.vendor != "nvidia" or self.dep.weight_format.name not in MMQ_WEIGHT_DTYPES or not hw.sm_clocks_per_s:
            return None
        return MMQ_FLOPS_PER_SM_CYCLE * hw.sm_clocks_per_s

    def make_timing(self) -> EngineTiming:
        hw = self.dep.hardware
        return EngineTiming(
            # ESTIMATE: one llama_decode ubatch on the host: batch split, graph reuse/alloc and input upload
            # ~0.3 ms (llama.cpp prints "graphs reused"; the graph is rebuilt only when its shape changes).
            scheduler_cpu_s=0.3e-3,
            # ESTIMATE: CPU sampling of one token: logits copy plus the default chain (penalties, top-k 40,
            # top-p, min-p, temp) builds a vocabulary-sized candidate array, ~2 ns per entry (0.26 ms at 128k),
            # once per sequence in the step; the slot and response bookkeeping of the server ~0.1 ms a step.
            output_cpu_s=0.1e-3, seq_cpu_s=2e-9 * self.dep.model.vocab_size, frontend_s=NATIVE_FRONTEND_S,
            overlap=False,                                  # one thread: schedule, decode, sample in sequence
            kernel_launch_s=launch_cost_s(hw),
            kernels_per_layer=18,  # ESTIMATE: ggml llama graph, non-view nodes per layer with flash attention
            # ggml-cuda disables CUDA graphs for any batch above one token ("disabling CUDA graphs due to batch
            # size > 1", ggml-cuda.cu check_node_graph_compatibility); Metal/HIP/SYCL/Vulkan/OpenCL have none.
            cuda_graph_sizes=(1,) if hw.vendor == "nvidia" else (), graph_padding=False, graph_mixed_steps=False)

    # ---- queues -------------------------------------------------------------------------------------
    def num_running(self) -> int:
        return self.num_busy

    def num_waiting(self) -> int:
        return len(self.queue)

    def kv_usage(self) -> float:
        return sum([s.cells for s in self.slots]) / self.n_ctx

    def kv_capacity_tokens(self) -> int:
        return self.n_ctx

    def prefix_cache_tokens(self) -> tuple[int, int]:
        return self.query_tokens, self.hit_tokens

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def add_request(self, req: Request, now: float) -> bool:
        if req.prompt_len >= self.n_ctx_slot:
            return self.reject(req, f"request ({req.prompt_len} tokens) exceeds the available context size "
                                    f"({self.n_ctx_slot} tokens), try increasing it")
        self.queue.append(req)
        return True

    def release(self, req: Request) -> None:
        for s in self.slots:
            if s.req is req:
                s.req, s.cache, s.last_used = None, req.token_ids[:req.num_computed_tokens], self._tick()
                self.num_busy -= 1

    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        """Shared update, then the context limit: with context shift off a slot stops at n_ctx (STOP_TYPE_LIMIT)."""
        res = super().update(out, now)
        self.num_truncated += self.stop_at_length(
            out, res, now, self.n_ctx_slot, f"truncated: reached n_ctx_slot {self.n_ctx_slot} with context shift off")
        return res

    def apply_repeats(self, out: SchedulerOutput, ends: list[float]) -> list[float]:
        """Every slot gains a cell a repeat; nothing else changes (no slot stops: repeat_steps stays short of it)."""
        used, busy = sum([s.cells for s in self.slots]), self.num_busy
        self.advance_decodes(out, ends)
        return [(used + busy * i) / self.n_ctx for i in range(1, len(ends) + 1)]

    def repeat_steps(self, out: SchedulerOutput) -> int:
        """Every slot busy and decoding, the iteration one forward: until a slot finishes, stops at n_ctx_slot
        or the unified cells run short, each iteration is the same one-token-per-slot forward and no queued task
        can take a slot."""
        if (self.plan or self.num_busy < self.n_parallel or len(out.scheduled) != self.num_busy
                or out.shape.prefill_chunks):  # a prompt's last token was a prefill chunk, not yet a decode
            return 0
        steps = self.n_ctx  # any bound
        for req, n in out.scheduled:
            out_tokens = req.num_output_tokens
            if n != 1 or not out_tokens or req.status is not Status.RUNNING:
                return 0
            steps = min(steps, req.output_len - 1 - out_tokens, self.n_ctx_slot - 1 - req.prompt_len - out_tokens)
        if self.kv_unified:  # each iteration needs one free cell per slot
            steps = min(steps, self._free_cells() // self.num_busy)
        return max(steps, 0)

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: a step is one ggml forward of <= n_ubatch tokens; an iteration (one token per generating
        # slot, then prompt tokens in slot order, <= n_batch) is planned once, between iterations queued tasks
        # take idle slots; cells in use <= n_ctx and per slot <= n_ctx_slot.
        out = SchedulerOutput()
        tries = len(self.queue) + 2
        while not self.plan and tries and (self.queue or self.num_running()):
            self._assign_tasks(now)
            self._plan_iteration(out)
            tries -= 1
        if self.plan:
            out.scheduled = self.plan.popleft()
            out.shape = self.make_shape(out.scheduled)
        elif self.queue:
            out.idle_reason = "no idle slot"
        return out

    def _assign_tasks(self, now: float) -> None:
        while self.queue and self.num_busy < self.n_parallel:
            slot = self._pick_slot(self.queue[0])
            if slot is None:
                return
            self._launch(slot, self.queue.popleft(), now)

    def _pick_slot(self, req: Request) -> _Slot | None:
        """get_available_slot: best LCP similarity among idle slots, else LRU; refresh from the RAM cache."""
        idle = [s for s in self.slots if s.req is None]
        if not idle:
            return None
        prompt = req.token_ids[:req.prompt_len]
        best, best_sim, lcp_best = None, 0.0, 0
        if self.params.slot_prompt_similarity:
            for s in idle:
                lcp = common_prefix(s.cache, prompt)
                sim = lcp / req.prompt_len
                if len(s.cache) and sim > best_sim and sim > self.params.slot_prompt_similarity:
                    best, best_sim, lcp_best = s, sim, lcp
        update_cache = best is not None and lcp_best / len(best.cache) < 0.5  # about to lose most of its context
        if best is None:
            for s in idle:  # ties go to the later slot, as `slot.t_last_used <= t_last` does
                if best is None or s.last_used <= best.last_used:
                    best = s
            update_cache = True
        if update_cache and self.ram_limit:
            self._ram_save(best.cache)
            self._ram_load(best, prompt)
            self._ram_evict()
        return best

    def _launch(self, slot: _Slot, req: Request, now: float) -> None:
        """Keep the slot's common prefix (cache_prompt); at least one prompt token is recomputed for logits."""
        n_past = common_prefix(slot.cache, req.token_ids[:req.prompt_len]) if self.params.cache_prompt else 0
        n_past = min(n_past, req.prompt_len - 1)
        req.num_computed_tokens = n_past
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = n_past
        self.query_tokens += req.prompt_len
        self.hit_tokens += n_past
        slot.req, slot.cache = req, EMPTY
        self.num_busy += 1
        self.mark_scheduled(req, now)
        if self.params.cache_idle_slots and self.ram_limit:
            for s in self.slots:
                if s.req is None and len(s.cache):
                    self._ram_save(s.cache)
                    if self.kv_unified:
                        s.cache = EMPTY  # [TAG_IDLE_SLOT_CLEAR]: the cells go back to the shared pool
            self._ram_evict()

    def _plan_iteration(self, out: SchedulerOutput) -> None:
        entries = [(s.req, 1) for s in self.slots if s.req is not None and s.req.num_output_tokens]
        if self.speculation is not None:   # each generating slot verifies its drafts (server-context.cpp) in a ubatch
            entries = [(r, 1 + min(self.drafts(r, len(entries)), self.n_ubatch - 1)) for r, _ in entries]
        if self.params.cont_batching or not entries:
            room = self.n_batch - sum(n for _, n in entries)
            for s in self.slots:
                if s.req is not None and not s.req.num_output_tokens and room > 0:
                    n = min(s.req.num_new_tokens, room)
                    entries.append((s.req, n))
                    room -= n
        if not entries:
            return
        need = sum(n for _, n in entries)
        if need > self._free_cells():
            self._purge_idle(need)               # try_clear_idle_slots, one slot per failed decode
            if need > self._free_cells():
                self._fail_processing(out)       # decode() at n_batch == 1: "Context size has been exceeded."
                return
        self.plan.extend(self._split(entries, need))

    def _free_cells(self) -> int:
        if not self.kv_unified:
            return self.n_ctx  # per-slot streams: the n_ctx_slot limits already keep every slot in its cells
        return self.n_ctx - sum(s.cells for s in self.slots)

    def _purge_idle(self, need: int) -> None:
        for s in self.slots:
            if need <= self._free_cells():
                return
            if s.req is None and len(s.cache):
                s.cache = EMPTY

    def _fail_processing(self, out: SchedulerOutput) -> None:
        for s in self.slots:
            if s.req is not None:
                req = s.req
                self.reject(req, f"Context size has been exceeded: the unified KV of {self.n_ctx} cells cannot "
                                 f"hold this iteration and llama.cpp has no preemption")
                out.rejected.append(req)
                s.req, s.cache, s.last_used = None, EMPTY, self._tick()
                self.num_busy -= 1

    def _split(self, entries: list[tuple[Request, int]], need: int) -> list[list[tuple[Request, int]]]:
        """Cut the iteration (`need` tokens) into forwards of n_ubatch tokens; tokens that sample go last (logits
        come after the whole batch), and a request's pieces inside one forward are merged."""
        if need <= self.n_ubatch:
            return [entries]
        head, tail = [], []
        for req, n in entries:
            if req.num_computed_tokens + n > req.num_tokens:   # a decode and its drafts: one verify, never split
                tail.append((req, n))
            elif req.num_computed_tokens + n >= req.num_tokens:
                if n > 1:
                    head.append((req, n - 1))
                tail.append((req, 1))
            else:
                head.append((req, n))
        pieces: list[list[tuple[Request, int]]] = []
        cur: dict[Request, int] = {}
        room = self.n_ubatch
        for req, n in head + tail:
            if n > room and cur and req.num_computed_tokens + n > req.num_tokens:   # a verify starts a new forward
                pieces.append(list(cur.items()))
                cur, room = {}, self.n_ubatch
            while n:
                take = min(n, room)
                cur[req] = cur.get(req, 0) + take
                n -= take
                room -= take
                if not room:
                    pieces.append(list(cur.items()))
                    cur, room = {}, self.n_ubatch
        if cur:
            pieces.append(list(cur.items()))
        return pieces

    # ---- host-RAM prompt cache (server_prompt_cache) -----------------------------------------------------
    def _ram_save(self, tokens: np.ndarray) -> None:
        """alloc(): skip a state already contained in an entry, drop entries the new state contains."""
        if not len(tokens):
            return
        head = int(tokens[0])
        if head in self.ram_heads:  # else no entry shares a token with it: none contains it or is contained
            keep = []
            for e in self.ram:
                lcp = common_prefix(e, tokens)
                if lcp == len(tokens):
                    return
                if lcp < len(e):
                    keep.append(e)
            self.ram = keep
            self.ram_heads = [int(e[0]) for e in keep]
        self.ram.append(tokens)
        self.ram_heads.append(head)

    def _ram_load(self, slot: _Slot, prompt: np.ndarray) -> None:
        """load(): the entry beating the slot on both kept fraction and similarity (>= 25% kept) moves in."""
        lcp = common_prefix(slot.cache, prompt)
        f_keep = lcp / len(slot.cache) if len(slot.cache) else -1.0
        sim = lcp / len(prompt)
        best = None
        for i, e in enumerate(self.ram if int(prompt[0]) in self.ram_heads else ()):  # others share nothing
            lcp = common_prefix(e, prompt)
            fk, fs = lcp / len(e), lcp / len(prompt)
            if fk >= 0.25 and f_keep < fk and sim < fs:
                best, f_keep, sim = i, fk, fs
        if best is None:
            return
        entry = self.ram[best]
        room = self.n_ctx_slot if not self.kv_unified else min(self.n_ctx_slot, self._free_cells() + slot.cells)
        if len(entry) > room:
            slot.cache = EMPTY  # state restore failed: prompt_clear(); the entry stays cached
            return
        del self.ram[best], self.ram_heads[best]
        slot.cache = entry
        self.ram_restored_tokens += len(entry)

    def _ram_evict(self) -> None:
        """update(): drop the oldest entries beyond --cache-ram, always keeping one."""
        total = sum(len(e) for e in self.ram)
        while len(self.ram) > 1 and total > self.ram_limit:
            total -= len(self.ram.pop(0))
            self.ram_heads.pop(0)

    def check_invariants(self) -> None:
        cells = [s.cells for s in self.slots]
        assert sum(cells) <= self.n_ctx, "cells in use exceed n_ctx"
        assert all(c <= self.n_ctx_slot for c in cells), "a slot holds more than n_ctx_slot cells"
        assert self.num_busy == sum(1 for s in self.slots if s.req is not None) <= self.n_parallel
        assert all(n <= self.n_ubatch for piece in self.plan for _, n in piece)
        assert self.ram_heads == [int(e[0]) for e in self.ram], "RAM cache heads out of step"
        if len(self.ram) > 1:
            assert sum(len(e) for e in self.ram) <= self.ram_limit, "RAM prompt cache over --cache-ram"
