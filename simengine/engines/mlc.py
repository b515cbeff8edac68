"""MLC-LLM serve engine (mlc-ai/mlc-llm cpp/serve, main), from the MLC sources named below.

Each step tries NewRequestPrefill, then BatchDecode, and runs the first that processes anything: prefill has
priority (engine_actions/action_commons.cc). Admission walks the waiting queue FCFS while the inputs fit
prefill_chunk_size, free pages (+1 per sequence) and an 8-decode-step watermark on the total sequence length
(batch_prefill_base.cc CanPrefill); a prompt that does not fit whole is chunked to the rest of the chunk and
admission stops. prefill_mode hybrid folds every running decode into the prefill forward. BatchDecode preempts the
last running request (recompute) after freeing recycling sequences. The radix prefix cache of sequences keeps
finished sequences as "recycling" (at most prefix_cache_max_num_recycling_seqs), freed LRU-first (prefix_cache.cc);
here it is the hashed-page KVCacheManager with only pages of live or recycling sequences matchable (docs/engines/
mlc.md: the equivalence). Synchronous loop; CUDA graphs (compile --opt O2) for decode steps on CUDA only.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from simengine.core.batch import SchedulerOutput, StepResult
from simengine.core.request import Request, Status
from simengine.cost.timing import NATIVE_SEQ_CPU_S, PYTHON_FRONTEND_S, TOKENIZE_S_PER_TOKEN, EngineTiming
from simengine.engines.base import ENGINES, EnginePolicy
from simengine.engines.devices import ALL_CLASSES, launch_cost_s
from simengine.engines.memory import Deployment
from simengine.engines.mlc_config import MlcParams, mlc_engine_config
from simengine.kvcache.hashing import block_hashes
from simengine.kvcache.manager import NO_HIT, KVCacheManager, PrefixHit

DECODE_WATERMARK = 8   # batch_prefill_base.cc HasPrefillSpace: room for 8 decode steps per sequence


@ENGINES.register("mlc")
class MlcEngine(EnginePolicy):
    Params = MlcParams
    vendors = frozenset({"nvidia", "amd", "apple", "intel", "qualcomm"})
    device_classes = ALL_CLASSES
    gaudi_backend = False
    support_source = ("MLC-LLM docs (install, deploy): CUDA incl. Jetson, ROCm, Vulkan (AMD/Intel/NVIDIA), Metal "
                      "(Apple), OpenCL on Android (Qualcomm Adreno), WebGPU; no Ascend or Gaudi backend")
    # repeat_steps proves no waiting request can prefill during the repeats (the batch is full, or the queue head
    # does not fit); an arrival queues behind the head, and add_request reads only the configuration
    repeats_outlast_arrivals = True

    def __init__(self, params: MlcParams, dep: Deployment):
        self.cfg = c = mlc_engine_config(params, dep)
        self.step_token_limit, self.batch_size_limit = c.prefill_chunk_size, c.max_num_sequence
        super().__init__(params, dep)
        self.max_model_len = c.max_single_sequence_length
        page = params.kv_cache_page_size
        self.kv = KVCacheManager(-(-c.max_total_sequence_length // page), page,
                                 enable_prefix_caching=params.prefix_cache_mode == "radix")
        self.running: list[Request] = []        # running_queue: admission order, incl. a request mid-prefill
        self.waiting: deque[Request] = deque()  # waiting_queue: a request mid-prefill stays in it
        self.prefilling: set[int] = set()       # running requests with input left (in both queues)
        self.recycling: OrderedDict[int, Request] = OrderedDict()  # finished sequences kept, least recent first
        self.recycle_cap = params.prefix_cache_max_num_recycling_seqs or c.max_num_sequence
        self.query_tokens = self.hit_tokens = 0

    def make_timing(self) -> EngineTiming:
        hw, c = self.dep.hardware, self.cfg
        graphs = hw.vendor == "nvidia" and self.params.opt in ("O2", "O3")
        return EngineTiming(
            # ESTIMATE: C++ action loop + TVM VM dispatch to prepare a step ~0.3 ms; GPU sampling, C++
            # detokenizer and stream callback ~0.3 ms. No overlap: each step is synchronous (docs/engines/mlc.md).
            scheduler_cpu_s=0.3e-3, output_cpu_s=0.3e-3, overlap=False, kernel_launch_s=launch_cost_s(hw),
            seq_cpu_s=NATIVE_SEQ_CPU_S, frontend_s=PYTHON_FRONTEND_S, tokenize_s_per_token=TOKENIZE_S_PER_TOKEN,
            # TVM's CUDA-graph rewrite captures the decode function lazily per batch shape: every decode size is
            # covered without padding; prefill and hybrid forwards run without graphs.
            cuda_graph_sizes=tuple(range(1, c.max_num_sequence + 1)) if graphs else (),
            graph_padding=False, graph_mixed_steps=False)

    # ---- queues -------------------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting) - len(self.prefilling)

    def _decodes(self) -> list[Request]:
        """GetRunningRequestStateEntries: running sequences whose input is all prefilled."""
        return [r for r in self.running if r.request_id not in self.prefilling]

    def kv_usage(self) -> float:
        return self.kv.usage()

    def kv_capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def prefix_cache_tokens(self) -> tuple[int, int]:
        return self.query_tokens, self.hit_tokens

    def _fits_ever(self, num_tokens: int) -> bool:
        """Whether a lone sequence of num_tokens passes the watermark and page checks (+1 page per sequence; a
        chunked input may round up one more page per chunk)."""
        c = self.cfg
        chunks = -(-num_tokens // c.prefill_chunk_size)
        pages = self.kv.blocks_for(num_tokens) + 1 + (chunks if chunks > 1 else 0)
        return num_tokens + DECODE_WATERMARK <= c.max_total_sequence_length and pages <= self.kv.num_blocks

    def refusal(self, req: Request) -> str | None:
        if (reason := super().refusal(req)) is not None:
            return reason
        if not self._fits_ever(req.prompt_len):
            return (f"prompt of {req.prompt_len} tokens plus the {DECODE_WATERMARK}-step decode watermark exceeds "
                    f"max_total_sequence_length {self.cfg.max_total_sequence_length} (mode={self.params.mode}); MLC "
                    "would keep it waiting forever")
        return None

    def add_request(self, req: Request, now: float) -> bool:
        if not self.admit_length(req):
            return False
        self.waiting.append(req)
        return True

    def release(self, req: Request) -> None:
        """RemoveRequestStateEntry: a finished sequence is recycled (kept for reuse) or removed."""
        self.running.remove(req)
        if self.params.prefix_cache_mode != "radix":
            self.kv.free(req)
            return
        if len(self.recycling) >= self.recycle_cap:
            self._try_free_memory()
        self.recycling[req.request_id] = req

    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        """Shared update, then MLC's "length" finish at max_single_sequence_length."""
        res = super().update(out, now)
        self.stop_at_length(out, res, now, self.max_model_len,
                            f"finish_reason=length at max_single_sequence_length {self.max_model_len}")
        return res

    def repeat_steps(self, out: SchedulerOutput) -> int:
        """Every running request decoding, and no waiting or arriving request able to prefill (the batch is full, or
        the queue head does not fit: decodes only tighten the space checks): until a decode finishes, reaches
        max_single_sequence_length or the pages run short, each step is the same BatchDecode. With recycling
        sequences kept, the head's space check must also hold throughout, or a schedule call would free one
        (TryFreeMemory) where a repeat would not."""
        c, n = self.cfg, len(out.scheduled)
        if self.prefilling or n != len(self.running) or out.shape.prefill_chunks:
            return 0
        steps = self.max_model_len
        for req, k in out.scheduled:
            outputs = req.num_output_tokens
            if k != 1 or not outputs or req.status is not Status.RUNNING:
                return 0
            steps = min(steps, req.output_len - 1 - outputs, self.max_model_len - 1 - req.prompt_len - outputs)
        full = n >= min(c.max_num_sequence, c.prefill_chunk_size)
        if not self.waiting and (self.recycling or not full):
            return 0   # an arrival could prefill, or its space check free a recycling sequence
        if not full and self._head_fits(out, 1):
            return 0
        lo, hi = 0, max(steps, 0)
        while lo < hi:   # the checks only tighten as decodes grow: the largest window where they hold
            mid = (lo + hi + 1) // 2
            if self._repeatable(out, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _state_at(self, out: SchedulerOutput, step: int) -> tuple[int, int]:
        """(free pages, total sequence length) at the schedule call of the `step`-th repeat of decode step `out`."""
        kv = self.kv
        taken = sum(max(0, kv.blocks_for(r.num_computed_tokens + step - 1) - kv.num_blocks_of(r))
                    for r, _ in out.scheduled)   # pages the earlier repeats took
        return kv.pool.num_free - taken, self._total_seq_len() + len(out.scheduled) * (step - 1)

    def _head_fits(self, out: SchedulerOutput, step: int) -> bool:
        """Whether _pick_prefills would pick the queue head (whole or a chunk) at the `step`-th repeat's call."""
        n, head = len(out.scheduled), self.waiting[0]
        return self._take(n, n, n, head.num_tokens - head.num_computed_tokens, self._state_at(out, step))[0] > 0

    def _repeatable(self, out: SchedulerOutput, step: int) -> bool:
        """Whether the `step`-th repeat's schedule call would decode everyone with no other effect: its decodes
        find a page each, and (recycling kept) the queue head passes _pick_prefills' space check."""
        n = len(out.scheduled)
        state = self._state_at(out, step)
        if n > state[0]:
            return False
        if not self.recycling:
            return True
        head = self.waiting[0]
        length = head.num_tokens - head.num_computed_tokens
        return self._has_space(n + self.kv.blocks_for(length), n, n + length, state)

    def apply_repeats(self, out: SchedulerOutput, ends: list[float]) -> list[float]:
        """The repeats as BatchDecode then update would make them (no request finishes or stops: repeat_steps stays
        short of it), request by request: a decode takes a page at the repeat whose token its pages cannot hold, as
        BatchDecode's allocate_slots would (which request takes which free page first is a label only)."""
        kv, steps = self.kv, len(ends)
        allocate, pool = kv.allocate_slots, kv.pool
        taken = [0] * steps     # pages taken at each repeat
        for r, _ in out.scheduled:
            c, o = r.num_computed_tokens, r.num_output_tokens
            while r.kv_settled_tokens < c + steps:   # the repeat j = settled - c + 1 needs a page
                j = r.kv_settled_tokens - c
                r.num_computed_tokens, r.num_output_tokens = c + j, o + j   # as at repeat j's schedule call
                used = pool.num_used
                allocate(r, 1)
                taken[j] += pool.num_used - used
            r.num_computed_tokens, r.num_output_tokens = c, o
        self.advance_decodes(out, ends)
        used, usages = pool.num_used - sum(taken), []
        for k in taken:
            used += k
            usages.append(used / pool.num_blocks)
        return usages

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: a step is NewRequestPrefill (+ every running decode when hybrid) whenever a waiting request
        # can be admitted, else BatchDecode of the running decodes; tokens <= prefill_chunk_size, running
        # sequences <= max_num_sequence, total sequence length + 8 per sequence <= max_total_sequence_length.
        out = SchedulerOutput()
        if not self._prefill(out, now):
            self._decode(out)
        while out.is_empty and self.running:
            # Only requests mid-prefill run and the queue head blocks them: MLC's BatchDecode would fail its check
            # "none of the prefill phase of the running requests is finished"; preempt the last one and retry.
            self._preempt(self.running[-1], out)
            self._prefill(out, now)
        if out.is_empty and self.waiting:
            out.idle_reason = self._head_blocked()
        out.shape = self.make_shape(out.scheduled)
        return out

    def _head_blocked(self) -> str:
        """Why the waiting head cannot prefill with nothing running (MLC then waits: no action processes anything)."""
        head = self.waiting[0]
        length = head.num_tokens - head.num_computed_tokens
        pages = self.kv.blocks_for(length)
        text = (f"the waiting head needs {length} tokens in {pages} pages + 1 and NewRequestPrefill finds "
                f"{self.kv.pool.num_free} free pages, total sequence length {self._total_seq_len()} of "
                f"{self.cfg.max_total_sequence_length}")
        if self.recycling and pages == self.kv.pool.num_free:
            text += (f"; {len(self.recycling)} recycling sequence(s) hold the page it lacks, and MLC's TryFreeMemory "
                     "loop checks the batch without the head (HasPrefillSpace) while CanPrefill counts it, so none is "
                     "freed (batch_prefill_base.cc)")
        return text

    def _total_seq_len(self) -> int:
        """GetCurrentTotalSequenceLength: every sequence in the KV cache at its full length (forks count whole)."""
        return (sum(r.num_computed_tokens for r in self.running)
                + sum(r.num_computed_tokens for r in self.recycling.values()))

    def _has_space(self, pages: int, batch: int, total_in: int, state: tuple[int, int] | None = None) -> bool:
        """HasPrefillSpace, now or at `state` (free pages, total sequence length)."""
        free, total = state if state is not None else (self.kv.pool.num_free, self._total_seq_len())
        limit = self.cfg.max_total_sequence_length
        return pages + batch <= free and total + total_in + DECODE_WATERMARK * batch <= limit

    def _can_prefill(self, batch: int, total_in: int, pages: int, state: tuple[int, int] | None = None) -> bool:
        c = self.cfg
        if batch > min(c.max_num_sequence, c.prefill_chunk_size):
            return False
        return total_in <= c.prefill_chunk_size and self._has_space(pages, batch, total_in, state)

    def _pick_prefills(self, n_dec: int) -> list[tuple[Request, int]]:
        """GetRequestStateEntriesToPrefill: whole inputs FCFS (attempt 1), else one chunk and stop (attempt 2)."""
        page = self.kv.block_size
        total_in = total_pages = n_dec
        picked: list[tuple[Request, int]] = []
        for req in self.waiting:
            length = req.num_tokens - req.num_computed_tokens
            pages = total_pages + -(-length // page)
            while not self._has_space(pages, n_dec + len(picked), total_in + length) and self._try_free_memory():
                pass
            n, stop = self._take(n_dec + len(picked), total_in, total_pages, length)
            if n:
                picked.append((req, n))
                total_in, total_pages = total_in + n, total_pages + -(-n // page)
            if stop:
                break
        return picked

    def _take(self, batch: int, total_in: int, pages: int, length: int, state: tuple[int, int] | None = None
              ) -> tuple[int, bool]:
        """The tokens the next waiting input of `length` gets after `batch` sequences, `total_in` tokens and `pages`
        pages are in the batch (all of them: attempt 1; the rest of the chunk: attempt 2; or 0), and whether admission
        stops after it (always after attempt 2). Pure: `state` as in _has_space."""
        chunk, page = self.cfg.prefill_chunk_size, self.kv.block_size
        if self._can_prefill(batch + 1, total_in + length, pages + -(-length // page), state):
            return length, False
        if chunk - total_in >= length or chunk == total_in:
            return 0, True   # not a chunk-size problem, or the chunk is full: chunking cannot help
        rest = chunk - total_in
        return (rest if self._can_prefill(batch + 1, total_in + rest, pages + -(-rest // page), state) else 0), True

    def _prefill(self, out: SchedulerOutput, now: float) -> bool:
        """NewRequestPrefill; False when it processes nothing (then BatchDecode runs)."""
        decodes = self._decodes()
        if len(decodes) > self.kv.pool.num_free or not self.waiting:
            return False  # even decode cannot run, or nothing to prefill
        picked = self._pick_prefills(len(decodes))
        if not picked:
            return False
        hits = [self._match(r) if not self.kv.num_blocks_of(r) else NO_HIT for r, _ in picked]  # before any insert
        if self.params.prefill_mode == "hybrid":
            for r in decodes:
                self.kv.allocate_slots(r, 1)
                out.scheduled.append((r, 1))
        for (req, length), hit in zip(picked, hits, strict=True):
            left = req.num_tokens - req.num_computed_tokens - hit.num_tokens
            n = min(length, left)
            if not self.kv.allocate_slots(req, n, hit):
                break  # unreachable under the conservative page check; stop admitting
            if hit.num_tokens:
                self._reuse_recycling(hit)
            req.num_computed_tokens += hit.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            if req.status is not Status.RUNNING:
                self.running.append(req)  # UpdateRequestToAlive: joins running_queue at its first chunk
                self.mark_scheduled(req, now)
            if n == left:
                self.waiting.popleft()    # RemoveProcessedRequests: picked requests are the queue's head
                self.prefilling.discard(req.request_id)
            else:
                self.prefilling.add(req.request_id)
            out.scheduled.append((req, n))
        return not out.is_empty

    def _match(self, req: Request) -> PrefixHit:
        """Longest prefix held by a live or recycling sequence, in whole pages, leaving one token to compute."""
        if self.params.prefix_cache_mode != "radix":
            return NO_HIT
        bs, pool = self.kv.block_size, self.kv.pool
        max_blocks = (req.num_tokens - 1) // bs
        blocks = []
        for h in block_hashes(req, bs)[:max_blocks]:
            b = pool.lookup(h)
            if b is None or not pool.ref_cnt[b]:   # a page no sequence holds left the radix tree
                break
            blocks.append(b)
        self.query_tokens += req.num_tokens
        self.hit_tokens += len(blocks) * bs
        return PrefixHit(blocks, len(blocks) * bs)

    def _reuse_recycling(self, hit: PrefixHit) -> None:
        """InsertSequence: a match ending in a recycling sequence takes the shortest one over (its tail rolls
        back); otherwise the request forked an active sequence (shared pages)."""
        k, best = len(hit.blocks), None
        for rid in self.recycling:
            blocks = self.kv.req_blocks.get(rid, [])
            if blocks[:k] == hit.blocks and (best is None or len(blocks) < len(self.kv.req_blocks[best])):
                best = rid
        if best is not None:
            self.kv.free(self.recycling.pop(best))

    def _try_free_memory(self) -> bool:
        """TryFreeMemory: remove the least recently used recycling sequence."""
        if not self.recycling:
            return False
        self.kv.free(self.recycling.popitem(last=False)[1])
        return True

    def _decode(self, out: SchedulerOutput) -> None:
        """BatchDecode: free recycling sequences, then preempt the last running request until every decode has a
        page; decode all of them (at most min(max_num_sequence, prefill_chunk_size))."""
        decodes = self._decodes()
        while len(decodes) > self.kv.pool.num_free:
            if self._try_free_memory():
                continue
            victim = self.running[-1]
            self._preempt(victim, out)
            if decodes and victim is decodes[-1]:
                decodes.pop()
        for r in decodes[:min(self.cfg.max_num_sequence, self.cfg.prefill_chunk_size)]:
            self.kv.allocate_slots(r, 1)
            out.scheduled.append((r, 1))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """PreemptLastRunningRequestStateEntry: drop its KV (not recycled), recompute from the front of waiting."""
        self.running.remove(req)
        self.kv.free(req)
        queued = req.request_id in self.prefilling  # mid-prefill: still queued, restarts its input there
        self.prefilling.discard(req.request_id)
        req.num_computed_tokens = 0
        if not self._fits_ever(req.num_tokens):
            if queued:
                self.waiting.remove(req)
            self.reject(req, f"sequence of {req.num_tokens} tokens outgrew max_total_sequence_length "
                             f"{self.cfg.max_total_sequence_length}; MLC would preempt and re-prefill it forever")
            out.rejected.append(req)
            return
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        if not queued:
            self.waiting.appendleft(req)

    def check_invariants(self) -> None:
        self.kv.pool.check_invariants()
        assert len(self.running) <= self.cfg.max_num_sequence
        assert len(self.recycling) <= self.recycle_cap
        assert all(r.status is Status.RUNNING for r in self.running)
        assert all(r.status is Status.FINISHED for r in self.recycling.values())
        assert self.num_waiting() >= 0 and len({id(r) for r in self.running}) == len(self.running)
