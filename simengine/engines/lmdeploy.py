"""LMDeploy TurboMind engine (src/turbomind/engine/scheduler.cc, engine.cc; v0.16.0); docs/engines/lmdeploy.md.

One pass per forward over ALL sequences in the engine (at most max_batch_size, the rest wait in the gateway),
strictly by arrival: decode and prefill are not separated. Each sequence takes min(its remaining input, the
forward budget max_prefill_token_num + max_batch_size); a partial chunk ends on a cache block. Memory admission
lets a sequence evict inactive KV (kept sessions, cached blocks) and then the blocks of sequences that arrived
AFTER it (the newest first, tail blocks first); those become inactive and later resume from whatever prefix is
still valid (recompute). The first sequence that cannot fit ends the pass. Pool = cache_max_entry_count of the
free memory after weights, in blocks of cache_block_seq_len; quant_policy 8/4 stores the KV in int8/int4.
Prefix caching (a trie of full blocks) is off by default. With `interactive_sessions`, a finished turn's KV is
kept for its session and the next turn resumes from it (lmdeploy's stateful session API). async_=1 overlaps
host work with the GPU; TurboMind captures no CUDA graphs (fused C++ kernels, launched eagerly).

Simulation speed (not a TurboMind mechanism): while the sequences that ran in the last pass are the first ones by
arrival, their steady decodes are advanced as one lazy cohort (engines/decode_cohort.py) and the pass walks only the
others; when a budget, the context limit or the pool could bind, the cohort is dissolved and the pass walks every
sequence. Off with prefix caching (producers and trie hits are per-sequence decisions).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from simengine.config.dtypes import GGML_FORMATS
from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.cost.timing import NATIVE_SEQ_CPU_S, PYTHON_FRONTEND_S, TOKENIZE_S_PER_TOKEN, EngineTiming
from simengine.engines.base import ENGINES, EnginePolicy
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.lmdeploy_before_0_1 import separate_pass
from simengine.engines.lmdeploy_config import (
    LmdeployParams,
    turbomind_decode_kv_reads,
    turbomind_kv,
    turbomind_max_batch_size,
)
from simengine.engines.memory import NON_TORCH_BYTES, Deployment, kv_tokens_or_refuse
from simengine.errors import CannotRun
from simengine.kvcache.hashing import block_hashes
from simengine.kvcache.manager import NO_HIT, KVCacheManager, PrefixHit


@ENGINES.register("lmdeploy")
class LmdeployEngine(EnginePolicy):
    Params = LmdeployParams
    vendors = frozenset({"nvidia"})
    lazy_decode = True  # speed device (module docstring)
    # nearest measured backend: TurboMind's C++ CUTLASS GEMMs and fused attention are of TensorRT-LLM's kind
    kernel_backend = "trtllm"
    support_source = ("LMDeploy docs 'Supported models' / README: TurboMind is CUDA-only (sm70+); Huawei Ascend, "
                      "Cambricon and MACA run the PyTorch engine via dlinfer, which this module does not model")

    def __init__(self, params: LmdeployParams, dep: Deployment):
        p = params
        if dep.weight_format.name in GGML_FORMATS:
            raise CannotRun(f"TurboMind does not load ggml {dep.weight_format.name} weights; use bf16/fp16, int4 "
                            "(AWQ/GPTQ W4A16) or fp8", field="deployment.weight_dtype")
        dep = turbomind_kv(dep, p.quant_policy)
        self.max_batch_size = p.max_batch_size or turbomind_max_batch_size(dep)
        self.max_forward_tokens = p.max_prefill_token_num + self.max_batch_size
        self.step_token_limit, self.batch_size_limit = self.max_forward_tokens, self.max_batch_size
        super().__init__(p, dep)
        bs = p.cache_block_seq_len
        if p.cache_max_entry_count > 1:
            tokens = int(p.cache_max_entry_count) * bs
        else:
            # ESTIMATE: TurboMind sizes the pool from cudaMemGetInfo after loading weights; activations and
            # workspaces come out of the remaining (1 - cache_max_entry_count) share.
            rule = f"cache_max_entry_count={p.cache_max_entry_count} of free memory after weights"
            tokens = kv_tokens_or_refuse(dep, lambda d: p.cache_max_entry_count * (
                d.hardware.memory_bytes - d.weight_bytes_per_device - NON_TORCH_BYTES), engine="lmdeploy", rule=rule)
        num_blocks = max(1, tokens // bs)
        self.kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=p.enable_prefix_caching)
        # capped to the pool so the oldest sequence can always run by evicting everything newer
        self.max_model_len = min(p.session_len or dep.model.max_model_len, num_blocks * bs)
        self.max_context_token_num = p.max_context_token_num or self.max_model_len
        if p.prefill_passes == "separate":   # a prefill-only pass takes up to max_context_token_num tokens
            self.step_token_limit = max(self.max_forward_tokens, self.max_context_token_num)
        self.queue: deque[Request] = deque()          # gateway: requests not yet in the engine
        self.seqs: list[Request] = []                 # sequences in the engine, arrival order
        self.sessions: dict[int, list] = {}           # session_id -> [finished turn holding KV, valid tokens]
        self._active: set[int] = set()                # request ids scheduled in the last pass
        self._stop = 0                                # index of the first sequence that lost blocks this pass
        self._produced: set[int] = set()              # prefix keys of blocks being written in this pass
        self._query_tokens = self._hit_tokens = 0
        # speed device (module docstring): the active sequences are seqs[:len(_active)] when no sequence sat out the
        # last pass, and then the cohort can carry them
        self._active_first = True
        self.cohort = (DecodeCohort(self.kv, self.max_forward_tokens) if self.lazy_decode and not
                       p.enable_prefix_caching and self.speculation is None and dep.pp == 1 and
                       p.prefill_passes == "unified" else None)
        self._in_iteration = False   # prefill_passes separate: admitted sequences' contexts are being computed

    def decode_kv_reads(self) -> float:
        return turbomind_decode_kv_reads(self.params, self.dep)

    def make_timing(self) -> EngineTiming:
        return EngineTiming(
            # ESTIMATE: the C++ scheduler pass (scheduler.cc) ~0.2 ms; output callbacks to the gateway ~0.3 ms;
            # detokenisation runs in Python (AsyncEngine) off the engine thread. async_=1 hides both.
            scheduler_cpu_s=0.2e-3, output_cpu_s=0.3e-3, overlap=self.params.async_ == 1,
            seq_cpu_s=NATIVE_SEQ_CPU_S, frontend_s=PYTHON_FRONTEND_S, tokenize_s_per_token=TOKENIZE_S_PER_TOKEN,
            # ESTIMATE: fused C++ kernels per decoder layer: norm+residual, QKV(+bias), RoPE+KV write, attention,
            # O, norm+residual, gate_up+SiLU, down = 8 launches at ~3 us from C++ (no Python in the loop).
            kernel_launch_s=3e-6, kernels_per_layer=8, cuda_graph_sizes=())

    # ---- queues -------------------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self._active)

    def num_waiting(self) -> int:
        return len(self.queue) + len(self.seqs) - len(self._active)

    def kv_usage(self) -> float:
        return self.kv.usage()

    def kv_capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def prefix_cache_tokens(self) -> tuple[int, int]:
        """Prompt tokens not recomputed at first admission (trie hits and resumed sessions)."""
        return self._query_tokens, self._hit_tokens

    def refusal(self, req: Request) -> str | None:
        if (reason := super().refusal(req)) is not None:
            return reason
        if req.prompt_len > self.max_context_token_num:
            return f"prompt of {req.prompt_len} tokens exceeds max_context_token_num {self.max_context_token_num}"
        return None

    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        req.output_len = min(req.output_len, self.max_model_len - req.prompt_len)  # generation stops at session_len
        self.queue.append(req)
        return True

    def release(self, req: Request) -> None:
        """Free a finished sequence's KV, or keep it for its session's next turn."""
        self._active.discard(req.request_id)
        if self.params.interactive_sessions and req.session_id >= 0:
            old = self.sessions.pop(req.session_id, None)
            if old is not None:
                self.kv.free(old[0])
            self.sessions[req.session_id] = [req, req.num_computed_tokens]
        else:
            self.kv.free(req)

    def on_finished(self, finished: list[Request], now: float) -> None:
        done = {id(r) for r in finished}
        self.seqs = [r for r in self.seqs if id(r) not in done]
        for req in finished:
            self.release(req)

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: sequences are visited strictly by arrival; each may evict only inactive KV and later
        # arrivals' blocks; the first that does not fit (tokens, context or memory) ends the pass.
        out = SchedulerOutput()
        if self.params.prefill_passes == "separate":
            separate_pass(self, out, now)
            return self._finish(out)
        self._admit()
        cohort = self.cohort
        left = self._cohort_pass(out) if cohort is not None else None
        if left is None:
            self._pass(out, now)
            self._active = {r.request_id for r, _ in out.scheduled}
            if cohort is not None:
                cohort.order([r for r, _ in out.scheduled], fresh=True)
        else:  # the active sequences went through the cohort: the pass goes on with the sequences after them
            carried = len(out.scheduled)
            self._pass(out, now, len(self._active), *left)
            admitted = [r for r, _ in out.scheduled[carried:]]
            self._active.update(r.request_id for r in admitted)
            cohort.order(admitted, fresh=False)  # type: ignore[union-attr]
        return self._finish(out)

    def _admit(self) -> None:
        """Gateway to engine, while the engine holds fewer than max_batch_size sequences."""
        while self.queue and len(self.seqs) < self.max_batch_size:
            req = self.queue.popleft()
            self._bind_session(req)
            self.seqs.append(req)

    def _finish(self, out: SchedulerOutput) -> SchedulerOutput:
        if not out.scheduled and self.seqs:
            out.idle_reason = "no sequence fits the forward budget or KV pool"
        out.shape = self.make_shape(out.scheduled, out.num_lazy)
        return out

    def _cohort_pass(self, out: SchedulerOutput) -> tuple[int, int] | None:
        """The pass over the active sequences with the cohort: (forward tokens, context tokens) left for the pass to
        go on from the first inactive sequence, or None after dissolving the cohort when the full pass must decide
        (a sequence sat out the last pass, or the context limit, forward budget or pool could bind)."""
        cohort = self.cohort
        assert cohort is not None
        ctx = self.max_context_token_num
        if self._active_first:
            for req in cohort.running_others():   # ContextTokenResource: an active prefill charges its context
                if req.num_tokens - req.num_computed_tokens > 1:
                    ctx -= req.num_tokens
            if ctx >= 0:
                tokens = cohort.schedule_running(out)
                return None if tokens is None else (tokens, ctx)
        cohort.dissolve()
        return None

    def _pass(self, out: SchedulerOutput, now: float, i: int = 0, tokens: int = -1, ctx: int = -1) -> None:
        """Visit the sequences from index `i` with `tokens` forward and `ctx` context tokens (-1: the limits)."""
        if tokens < 0:
            tokens, ctx = self.max_forward_tokens, self.max_context_token_num
        self._stop = len(self.seqs)
        self._produced.clear()
        self._active_first = True
        active, schedule, seqs = self._active, out.scheduled.append, self.seqs
        while True:
            end = min(self._stop, len(seqs))   # changes only on the full path below
            while i < end and tokens > 0:
                req = seqs[i]
                computed = req.num_computed_tokens
                if not (computed + 1 == req.prompt_len + req.num_output_tokens and computed < req.kv_settled_tokens
                        and req.request_id in active):
                    break
                # an active decode whose blocks take its token: no hit, no context charge, no alignment, no
                # producer conflict (it is past its prompt) and no block to publish, exactly as the full path
                schedule((req, 1))
                tokens -= 1
                i += 1
            if i >= end or tokens <= 0:
                return
            req = seqs[i]
            hit = self._resume_hit(req)
            begin = req.num_computed_tokens + hit.num_tokens
            charge = self._context_charge(req, begin)
            fits = charge <= ctx
            n = self._align(req, begin, min(req.num_tokens - begin, tokens)) if fits else 0
            if fits and (n <= 0 or self._producer_conflict(req, begin)):
                self._active_first = False
                i += 1
                continue  # a sub-block chunk, or blocks another sequence is writing: sits out the pass
            if not fits or not self._make_room(i, req, n, hit, out):
                if i == 0:  # the oldest sequence can never run: answer it rather than stall
                    self._drop(req, out)
                    continue
                break
            self._run(req, n, hit, now, out)
            tokens -= n
            ctx -= charge
            i += 1

    def _context_charge(self, req: Request, begin: int) -> int:
        """ContextTokenResource: a sequence that prefills charges its whole context; an active decode nothing."""
        decoding = req.num_tokens - begin <= 1 and req.request_id in self._active
        return 0 if decoding else req.num_tokens

    def _align(self, req: Request, begin: int, n: int) -> int:
        """ClampForwardEnd: a partial prefill chunk ends on a cache block boundary."""
        end = begin + n
        if end < req.num_tokens:
            end = end // self.kv.block_size * self.kv.block_size
        return end - begin

    def _resume_hit(self, req: Request) -> PrefixHit:
        """Prefix-trie match for a sequence holding no blocks, cut where blocks are still being written."""
        if req.num_computed_tokens or self.kv.num_blocks_of(req):
            return NO_HIT
        hit = self.kv.get_computed_blocks(req)
        if not hit.blocks:
            return hit
        for i, key in enumerate(block_hashes(req, self.kv.block_size)[:len(hit.blocks)]):
            if key in self._produced:
                return PrefixHit(hit.blocks[:i], i * self.kv.block_size)
        return hit

    def _producer_conflict(self, req: Request, begin: int) -> bool:
        """CheckProducers: the next block to compute is being written by an earlier sequence (defer)."""
        if not self._produced:
            return False
        bs = self.kv.block_size
        idx = begin // bs
        return idx < req.prompt_len // bs and block_hashes(req, bs)[idx] in self._produced

    def _run(self, req: Request, n: int, hit: PrefixHit, now: float, out: SchedulerOutput) -> None:
        if not self.kv.allocate_slots(req, n, hit):
            raise RuntimeError(f"lmdeploy: {req} has no blocks after admission made room")
        req.num_computed_tokens += hit.num_tokens
        if self.kv.enable_prefix_caching:
            bs, start, end = self.kv.block_size, req.num_computed_tokens, req.num_computed_tokens + n
            self._produced.update(block_hashes(req, bs)[start // bs:end // bs])
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
            self._query_tokens += req.prompt_len
            self._hit_tokens += req.num_computed_tokens
        self.mark_scheduled(req, now)
        out.scheduled.append((req, n))

    def _drop(self, req: Request, out: SchedulerOutput) -> None:
        self.seqs.remove(req)
        self._stop = max(0, self._stop - 1)   # indices after it shift down by one
        self.kv.free(req)
        self.reject(req, f"sequence of {req.num_tokens} tokens cannot fit the forward/context budget or KV pool")
        out.rejected.append(req)

    # ---- memory admission ---------------------------------------------------------------------------
    def _make_room(self, i: int, req: Request, n: int, hit: PrefixHit, out: SchedulerOutput) -> bool:
        """Evict oldest-first until `req` can allocate: inactive session KV, then later arrivals' tails.

        A request that cannot fit evicts nothing (RunRequiredAdmission replays only committed requests).
        """
        kv = self.kv
        if kv.can_allocate(req, n, hit):
            return True
        later = range(len(self.seqs) - 1, i, -1)
        if self._deficit(req, n, hit) > (sum(kv.num_blocks_of(h) for h, _ in self.sessions.values())
                                         + sum(kv.num_blocks_of(self.seqs[j]) for j in later)):
            return False
        while not kv.can_allocate(req, n, hit):
            deficit = self._deficit(req, n, hit)
            if self.sessions:
                self._shrink_session(next(iter(self.sessions)), deficit)
                continue
            j = next((j for j in later if kv.num_blocks_of(self.seqs[j])), None)
            if j is None:
                return False   # only blocks shared with earlier sequences were left
            self._stop = min(self._stop, j)   # the pass ends where memory was taken from a sequence
            self._shrink_seq(self.seqs[j], deficit, out)
        return True

    def _deficit(self, req: Request, n: int, hit: PrefixHit) -> int:
        kv = self.kv
        need = kv.blocks_for(req.num_computed_tokens + hit.num_tokens + n) - kv.num_blocks_of(req) - len(hit.blocks)
        return max(1, need - kv.pool.num_free_after_touch(hit.blocks))

    def _shrink_session(self, sid: int, k: int) -> None:
        holder, valid = self.sessions[sid]
        keep = max(0, self.kv.num_blocks_of(holder) - k)
        if keep == 0:
            self.kv.free(holder)
            del self.sessions[sid]
            return
        self.kv.free_tail(holder, keep * self.kv.block_size)
        self.sessions[sid][1] = min(valid, keep * self.kv.block_size)

    def _shrink_seq(self, victim: Request, k: int, out: SchedulerOutput) -> None:
        """Take `k` tail blocks from a later sequence; it keeps (and later resumes from) its valid prefix."""
        keep = max(0, self.kv.num_blocks_of(victim) - k)
        if keep == 0:
            self.kv.free(victim)
        else:
            self.kv.free_tail(victim, keep * self.kv.block_size)
        valid = min(victim.num_computed_tokens, keep * self.kv.block_size)
        if valid < victim.num_computed_tokens:
            victim.num_computed_tokens = valid
            if victim.status is Status.RUNNING:   # active -> inactive: its lost blocks are recomputed
                victim.status = Status.PREEMPTED
                victim.num_preemptions += 1
                self.num_preemptions += 1
                out.preempted.append(victim)

    # ---- stateful sessions --------------------------------------------------------------------------
    def _bind_session(self, req: Request) -> None:
        """Resume a session's next turn from the KV its previous turn left (interactive_sessions)."""
        if not self.params.interactive_sessions or req.session_id not in self.sessions:
            return
        holder, valid = self.sessions.pop(req.session_id)
        kv = self.kv
        if valid >= req.prompt_len or not np.array_equal(holder.token_ids[:valid], req.token_ids[:valid]):
            kv.free(holder)   # not a continuation of that history (sequence_start): start over
            return
        kv.free_tail(holder, valid)
        kv.transfer(holder, req)   # the new turn continues in the previous turn's blocks
        req.num_computed_tokens = valid

    def check_invariants(self) -> None:
        self.check_cohort([r for r in self.seqs if r.request_id in self._active])
        if self._active_first:
            assert {r.request_id for r in self.seqs[:len(self._active)]} == self._active, \
                "the active sequences are not the first ones"
        kv = self.kv
        kv.pool.check_invariants()
        assert len(self.seqs) <= self.max_batch_size
        assert len(self._active) <= self.max_batch_size
        for req in self.seqs:
            assert kv.num_blocks_of(req) >= kv.blocks_for(req.num_computed_tokens), "computed KV without blocks"
        for holder, valid in self.sessions.values():
            assert 0 < valid <= kv.num_blocks_of(holder) * kv.block_size
