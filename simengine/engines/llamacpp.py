"""llama.cpp server (ggml-org/llama.cpp tools/server/server-context.cpp, master 001d906).

Fixed slots (-np; auto 4 with one unified KV of n_ctx cells). A task takes the idle slot whose cached tokens share
the longest prefix with its prompt (more than slot_prompt_similarity of it), else the least recently used one, else
it waits in a FIFO queue. An iteration decodes every generating slot first, then appends prompt tokens of slots
still prefilling, in slot order, up to n_batch; ggml runs it as ceil(T / n_ubatch) forwards, one simulator step
each (sampled tokens are placed in the last one, so they appear when the iteration ends); with layers split over
CUDA/HIP devices the forwards of an iteration pipeline through them, each after the first adding one stage's time
(pipeline parallelism, PR #6017). Per-slot prompt reuse
(cache_prompt) and the host-RAM prompt cache (--cache-ram: idle slots saved, the best match restored). No
preemption: a batch the cells cannot hold first purges idle slots, then fails every processing slot (the server's
"Context size has been exceeded"). Context shift off: a slot reaching n_ctx stops early (truncated). One
synchronous thread, CPU sampling, CUDA graphs only for single-token batches (ggml-cuda).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from simengine.core.batch import SchedulerOutput, StepResult
from simengine.core.request import Request, Status
from simengine.cost.timing import NATIVE_FRONTEND_S, TOKENIZE_S_PER_TOKEN, EngineTiming
from simengine.cost.work import UnfusedAttention
from simengine.engines import llamacpp_kernels
from simengine.engines.base import ENGINES, EnginePolicy
from simengine.engines.devices import ALL_CLASSES, launch_cost_s
from simengine.engines.llamacpp_config import (
    MIB,
    LlamaCppParams,
    gguf_tensor_types,
    llamacpp_check_deployment,
    llamacpp_fit_ctx,
    llamacpp_speculation,
)
from simengine.engines.llamacpp_prompt_cache import PromptRamCache, common_prefix
from simengine.engines.memory import Deployment
from simengine.engines.speculative import Speculation, with_proposer

EMPTY = np.zeros(0, dtype=np.int32)


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


@ENGINES.register("llamacpp")
class LlamaCppEngine(EnginePolicy):
    Params = LlamaCppParams
    vendors = frozenset({"nvidia", "amd", "apple", "intel", "qualcomm", "huawei"})
    device_classes = ALL_CLASSES
    gaudi_backend = False
    support_source = ("llama.cpp README 'Supported backends' + docs/build.md: CUDA (incl. Jetson), HIP (AMD), Metal "
                      "(Apple), SYCL/Vulkan (Intel GPUs), OpenCL (Qualcomm Adreno, docs/backend/OPENCL.md), CANN "
                      "(Ascend NPU); no Gaudi backend")
    last_repeat_by_update = True   # planning the iteration again reads the slots and changes none
    repeats_outlast_arrivals = True   # every slot busy: a queued task waits (add_request reads only n_ctx_slot)

    def __init__(self, params: LlamaCppParams, dep: Deployment):
        llamacpp_check_deployment(dep)
        dep = gguf_tensor_types(dep)
        p = params
        dep = with_proposer(dep, self.speculation_of(p, dep))   # the draft model's weights and KV fit first
        auto = p.n_parallel in (None, 1) and not p.kv_unified
        self.n_parallel: int = 4 if auto or p.n_parallel is None else p.n_parallel
        self.kv_unified = True if auto else bool(p.kv_unified)
        self.n_ctx = llamacpp_fit_ctx(p, dep)
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
        # pipeline parallelism (llama-context.cpp, PR #6017): with layers split over several devices whose backend
        # computes asynchronously with events (CUDA, HIP), the forwards of one llama_decode call follow each other
        # through the devices' layer ranges; ESTIMATE: off on the other backends
        self.pipelined = dep.pp > 1 and dep.hardware.vendor in ("nvidia", "amd")
        self.forwards_in_call = 0   # forwards of the current iteration scheduled so far
        state_bytes = dep.model.kv_bytes_per_token(dep.kv_elem_bytes)
        self.ram = PromptRamCache(0 if p.cache_ram == 0 else float("inf") if p.cache_ram < 0
                                  else p.cache_ram * MIB / state_bytes)   # --cache-ram in tokens
        self.clock = 0
        self.query_tokens = self.hit_tokens = 0
        self.num_truncated = 0
        self.num_may_truncate = 0   # busy slots whose task could reach n_ctx_slot before its end (update checks them)

    @classmethod
    def speculation_of(cls, params: LlamaCppParams, dep: Deployment) -> Speculation | None:
        return llamacpp_speculation(params, dep)

    def engine_gemm_flops_s(self) -> float | None:
        return llamacpp_kernels.gemm_flops_s(self.dep, self.params.cuda_force_cublas)

    def layer_kernels(self) -> int:
        return llamacpp_kernels.GGML_LAYER_KERNELS

    def dequantize_above_tokens(self) -> int | None:
        return llamacpp_kernels.dequantize_above_tokens(self.dep, self.params.cuda_force_cublas)

    def engine_attention_flops_s(self) -> float | None:
        return llamacpp_kernels.attention_flops_s(self.dep, self.params.flash_attn != "off")

    def unfused_attention(self) -> UnfusedAttention | None:
        return llamacpp_kernels.unfused_attention(self.dep) if self.params.flash_attn == "off" else None

    def expert_tile_columns(self) -> int | None:
        """MMQ's widest token tile (mmq_x_max 128 with tensor-core MMA, ggml-cuda/mmq.cuh) where MMQ multiplies the
        experts: each expert computes its tokens in whole tiles (cost/work.py padded_expert_tokens)."""
        mmq = llamacpp_kernels.mmq_flops_s(self.dep) and not self.dequantize_above_tokens()
        return llamacpp_kernels.MMQ_MAX_TILE_COLUMNS if mmq else None

    def make_timing(self) -> EngineTiming:
        hw = self.dep.hardware
        return EngineTiming(
            # ESTIMATE: one llama_decode ubatch on the host: batch split, graph reuse/alloc and input upload
            # ~0.3 ms (llama.cpp prints "graphs reused"; the graph is rebuilt only when its shape changes).
            scheduler_cpu_s=0.3e-3,
            # ESTIMATE: CPU sampling of one token: logits copy plus the default chain (penalties, top-k 40,
            # top-p, min-p, temp) builds a vocabulary-sized candidate array, ~2 ns per entry (0.26 ms at 128k),
            # once per sequence in the step; the slot and response bookkeeping of the server ~0.1 ms a step.
            output_cpu_s=0.1e-3, seq_cpu_s=2e-9 * self.dep.model.vocab_size,
            frontend_s=NATIVE_FRONTEND_S, tokenize_s_per_token=TOKENIZE_S_PER_TOKEN,
            overlap=False,                                  # one thread: schedule, decode, sample in sequence
            kernel_launch_s=launch_cost_s(hw),
            # the ggml graph's kernels a layer: the token-count ops' and attention's (one with FlashAttention)
            kernels_per_layer=self.layer_kernels() + (u.kernels_per_layer if (u := self.unfused_attention()) else 1),
            # ggml-cuda disables CUDA graphs for any batch above one token ("disabling CUDA graphs due to batch
            # size > 1", ggml-cuda.cu check_node_graph_compatibility); Metal/HIP/SYCL/Vulkan/OpenCL have none.
            cuda_graph_sizes=(1,) if hw.vendor == "nvidia" and self.params.cuda_graphs else (), graph_padding=False,
            graph_mixed_steps=False)

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

    def refusal(self, req: Request) -> str | None:
        if req.prompt_len >= self.n_ctx_slot:
            return (f"request ({req.prompt_len} tokens) exceeds the available context size ({self.n_ctx_slot} "
                    "tokens), try increasing it")
        return None

    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        self.queue.append(req)
        return True

    def _may_truncate(self, req: Request) -> bool:
        return req.prompt_len + req.output_len > self.n_ctx_slot

    def release(self, req: Request) -> None:
        for s in self.slots:
            if s.req is req:
                s.req, s.cache, s.last_used = None, req.token_ids[:req.num_computed_tokens], self._tick()
                self.num_busy -= 1
                self.num_may_truncate -= self._may_truncate(req)

    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        """Shared update, then the context limit: with context shift off a slot stops at n_ctx (STOP_TYPE_LIMIT)."""
        res = super().update(out, now)
        if self.num_may_truncate:
            why = f"truncated: reached n_ctx_slot {self.n_ctx_slot} with context shift off"
            self.num_truncated += self.stop_at_length(out, res, now, self.n_ctx_slot, why)
        return res

    def apply_repeats(self, out: SchedulerOutput, ends: list[float]) -> np.ndarray:
        """Every slot gains a cell a repeat; nothing else changes (no slot stops: repeat_steps stays short of it)."""
        used, busy = sum([s.cells for s in self.slots]), self.num_busy
        self.advance_decodes(out, ends)
        return (used + busy * np.arange(1, len(ends) + 1)) / self.n_ctx

    def repeat_steps(self, out: SchedulerOutput) -> int:
        """Every slot busy and decoding, the iteration one forward: up to the iteration in which a slot finishes or
        stops at n_ctx_slot (applied by update), or until the unified cells run short, each iteration is the same
        one-token-per-slot forward and no queued task can take a slot."""
        if (self.plan or self.num_busy < self.n_parallel or len(out.scheduled) != self.num_busy
                or out.shape.prefill_chunks):  # a prompt's last token was a prefill chunk, not yet a decode
            return 0
        steps = self.n_ctx  # any bound
        for req, n in out.scheduled:
            out_tokens = req.num_output_tokens
            if n != 1 or not out_tokens or req.status is not Status.RUNNING:
                return 0
            steps = min(steps, req.output_len - out_tokens, self.n_ctx_slot - req.prompt_len - out_tokens)
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
            if self.pipelined:
                out.shape.pipelined = self.forwards_in_call > 0
                self.forwards_in_call += 1
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
        best: _Slot | None = None
        best_sim, lcp_best = 0.0, 0
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
        assert best is not None   # idle is not empty
        if update_cache and self.ram.limit_tokens:
            self.ram.save(best.cache)
            self._ram_load(best, prompt)
            self.ram.evict()
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
        self.num_may_truncate += self._may_truncate(req)
        self.mark_scheduled(req, now)
        if self.params.cache_idle_slots and self.ram.limit_tokens:
            for s in self.slots:
                if s.req is None and len(s.cache):
                    self.ram.save(s.cache)
                    if self.kv_unified:
                        s.cache = EMPTY  # [TAG_IDLE_SLOT_CLEAR]: the cells go back to the shared pool
            self.ram.evict()

    def _plan_iteration(self, out: SchedulerOutput) -> None:
        entries = [(s.req, 1) for s in self.slots if s.req is not None and s.req.num_output_tokens]
        if self.speculation is not None:   # each generating slot verifies its drafts (server-context.cpp) in a ubatch
            entries = [(r, 1 + min(self.drafts(r, len(entries)), self.n_ubatch - 1)) for r, _ in entries]
        if self.params.cont_batching or not entries:
            room = self.n_batch - sum([n for _, n in entries])
            for s in self.slots:
                if s.req is not None and not s.req.num_output_tokens and room > 0:
                    n = min(s.req.num_new_tokens, room)
                    entries.append((s.req, n))
                    room -= n
        if not entries:
            return
        need = sum([n for _, n in entries])
        if need > self._free_cells():
            self._purge_idle(need)               # try_clear_idle_slots, one slot per failed decode
            if need > self._free_cells():
                self._fail_processing(out)       # decode() at n_batch == 1: "Context size has been exceeded."
                return
        self.plan.extend(self._split(entries, need))
        self.forwards_in_call = 0

    def _free_cells(self) -> int:
        if not self.kv_unified:
            return self.n_ctx  # per-slot streams: the n_ctx_slot limits already keep every slot in its cells
        return self.n_ctx - sum([s.cells for s in self.slots])

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
                self.num_may_truncate -= self._may_truncate(req)

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

    def _ram_load(self, slot: _Slot, prompt: np.ndarray) -> None:
        """load(): the RAM entry that beats the slot's cells moves in, if the cells can hold it (else the restore
        fails: prompt_clear(), and the entry stays cached)."""
        i = self.ram.best(slot.cache, prompt)
        if i is None:
            return
        room = self.n_ctx_slot if not self.kv_unified else min(self.n_ctx_slot, self._free_cells() + slot.cells)
        slot.cache = self.ram.take(i) if len(self.ram.entries[i]) <= room else EMPTY

    def check_invariants(self) -> None:
        cells = [s.cells for s in self.slots]
        assert sum(cells) <= self.n_ctx, "cells in use exceed n_ctx"
        assert all(c <= self.n_ctx_slot for c in cells), "a slot holds more than n_ctx_slot cells"
        assert self.num_busy == sum(1 for s in self.slots if s.req is not None) <= self.n_parallel
        assert self.num_may_truncate == sum(1 for s in self.slots if s.req is not None and self._may_truncate(s.req))
        assert all(n <= self.n_ubatch for piece in self.plan for _, n in piece)
        self.ram.check_invariants()
