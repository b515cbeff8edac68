"""TGI v3 router + flash shard (backends/v3/src/{backend,queue,radix}.rs; HEAD db931fc); docs/engines/tgi.md.

Strict FCFS admission that reserves KV for the worst case up front (prompt + min(max_new, 1024) + speculate - 1,
minus the radix prefix hit) and never preempts. With prefill chunking (the default for flash models) newly
admitted prompts are concatenated with the running batch into one mixed forward under max_batch_prefill_tokens
minus the batch's current tokens, after which a decode forward always follows; without chunking a new batch is
prefilled on its own (decode pauses) when it is at least waiting_served_ratio of the running batch. Requests
wanting more than 1024 new tokens are re-queued at the tail after every 1024 with the text generated so far
appended (the re-prefill is mostly a prefix hit). The radix trie is filled only when a request's allocation is
freed (its prompt, block-aligned); LRU leaves are evicted, partially if that suffices. More than
max_concurrent_requests in flight are rejected (HTTP 429). The loop is synchronous: no CPU/GPU overlap.
Speed device (docs/performance.md): without speculation the running batch's steady decodes advance in a DecodeCohort
(`schedule_lockstep`); a new batch prefilled alone leaves them be, and a request leaving for its next visit
dissolves it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Annotated, Literal

from simengine.config.loader import Checked, MemoryFraction, PoolSize, Range, Sequences, Tokens
from simengine.core.batch import SchedulerOutput, StepResult
from simengine.core.request import Request, Status
from simengine.cost.timing import NATIVE_FRONTEND_S, PYTHON_SEQ_CPU_S, TOKENIZE_S_PER_TOKEN, EngineTiming
from simengine.engines.base import ENGINES, EnginePolicy
from simengine.engines.decode_cohort import DecodeCohort
from simengine.engines.memory import NON_TORCH_BYTES, Deployment, activation_reserve_bytes, kv_tokens_or_refuse
from simengine.engines.paged import RadixCacheViews
from simengine.engines.speculative import AcceptanceDataset, AcceptanceKnobs, AcceptanceRates, Speculation, resolve
from simengine.kvcache.radix import RadixCache, RadixHold

DEFAULT_GENERATION_LENGTH = 1024     # router/src/validation.rs: tokens reserved and generated per queue visit
BLOCK_SIZES = {"flashinfer": 1, "flashdecoding": 256, "paged": 16}   # server/.../models/globals.py BLOCK_SIZE


@dataclass(frozen=True, kw_only=True)
class TgiParams(Checked):
    """text-generation-launcher flags (and the shard's environment variables), dashes as underscores."""

    max_concurrent_requests: Sequences = 128        # launcher/src/main.rs; more in flight -> 429 "Model is overloaded"
    max_batch_prefill_tokens: Tokens | None = None  # None: compute-optimal = GPU fp16 FLOP/s / model FLOP per token
    max_batch_total_tokens: PoolSize | None = None  # None: inferred from free memory at warmup (flash_causal_lm.warmup)
    max_batch_size: Sequences | None = None         # launcher/src/main.rs (None = no cap)
    max_input_tokens: Tokens | None = None          # None: max_total_tokens - 1
    max_total_tokens: Tokens | None = None          # None: min(KV capacity, max_position_embeddings)
    waiting_served_ratio: Annotated[float, Range(0, 1000)] = 0.3  # launcher/src/main.rs (ignored with prefill chunking)
    max_waiting_tokens: Annotated[int, Range(1, 1_000_000)] = 20  # launcher/src/main.rs (ignored with prefill chunking)
    cuda_memory_fraction: MemoryFraction = 1.0      # launcher/src/main.rs
    # launcher/src/main.rs; (0,) disables
    cuda_graphs: tuple[Annotated[int, Range(0, 1_000_000)], ...] = (1, 2, 4, 8, 16, 32)
    # launcher/src/main.rs --speculate (None = 0): drafts per decode, n-gram speculation for a model without Medusa
    # or MLP-speculator heads (docs/source/conceptual/speculation.md)
    speculate: Annotated[int, Range(0, 64)] = 0
    # the simulator's acceptance model (engines/speculative.py AcceptanceKnobs), not TGI flags
    speculate_acceptance: AcceptanceRates = None
    speculate_acceptance_dataset: AcceptanceDataset = "chat"
    prefix_caching: bool = True                     # env PREFIX_CACHING (launcher resolve_attention; off on paged)
    prefill_chunking: bool = True                   # env PREFILL_CHUNKING (models/globals.py)
    attention: Literal["flashinfer", "flashdecoding", "paged"] = "flashinfer"  # env ATTENTION -> block size
    tgi_wiggle_room: MemoryFraction = 0.90          # env TGI_WIGGLE_ROOM (models/globals.py)


# launcher/src/main.rs @db931fc ComputeType::f16_flop: the launcher's own table, keyed by the card name nvidia-smi
# prints (lower case, spaces as dashes); any other card (H100 PCIe, H800, B200, GeForce names, every AMD or Intel
# device: no nvidia-smi name it knows) has no figure and takes the 4,096 fallback
TGI_CARD_F16_FLOPS = {"l4": 121e12, "l40s": 363e12, "a10g": 125e12, "a100_80g_sxm": 312e12, "a100_40g_sxm": 312e12,
                      "a100_pcie": 312e12, "h100_sxm": 900e12, "h100_nvl": 900e12, "h200_sxm": 989e12}
TGI_LAUNCHER_WIGGLE_ROOM = 0.95   # launcher/src/main.rs ComputeType::vram: env TGI_WIGGLE_ROOM, default 0.95


def tgi_compute_optimal_prefill(dep: Deployment, cuda_memory_fraction: float = 1.0) -> int:
    """launcher/src/main.rs @db931fc max_batch_prefill_tokens: the card's fp16 FLOP/s (its table) x shards / the
    model's FLOP per token (q, k, v, o and attention projections + gated MLP), 4096 without a figure or when
    implausible (<= 100); capped by the context, then by the tokens the VRAM left after 16-bit weights holds (KV and
    MLP intermediates a token; unquantised models only)."""
    m, hw = dep.model, dep.hardware
    flop = 2 * m.active_linear_params + 2 * m.num_layers * m.num_heads * m.head_dim * m.hidden_size
    optimal = int(TGI_CARD_F16_FLOPS.get(hw.name, 0.0) * dep.tp / flop) if flop else 0
    value = min(optimal if optimal > 100 else 4096, m.max_model_len)
    if dep.weight_format.bytes_per_param >= 2:   # vram_maximum: None for a quantised model
        available = hw.memory_bytes * dep.tp * cuda_memory_fraction * TGI_LAUNCHER_WIGGLE_ROOM
        inter = m.expert_params // (3 * m.hidden_size) if m.is_moe else m.intermediate_size
        per_token = 4 * m.num_kv_heads * m.head_dim * m.num_layers + (inter + inter // 2) * max(m.num_experts, 1) * 6
        if per_token and available > m.total_params * 2:
            value = min(value, int((available - m.total_params * 2) // per_token))
    return value


@dataclass(slots=True)
class _Entry:
    """One queue visit of a request (a 'segment' of at most 1024 new tokens)."""

    hold: RadixHold
    prompt: int          # tokens of this visit's prompt (original prompt + text generated before)
    out_end: int         # outputs generated when this visit ends: those before it + its max_new (<= 1024)


@ENGINES.register("tgi")
class TgiEngine(RadixCacheViews, EnginePolicy):
    Params = TgiParams
    lazy_decode = True  # speed device (module docstring)
    vendors = frozenset({"nvidia", "amd", "intel"})
    # nearest measured backend: TGI's CUDA path runs cuBLAS GEMMs and flash-attention/paged kernels shared with vLLM
    kernel_backend = "vllm"
    support_source = ("TGI docs 'Supported hardware': NVIDIA CUDA, AMD ROCm (MI210/MI250/MI300), Intel Gaudi "
                      "(tgi-gaudi backend) and Intel GPUs; also AWS Inferentia (out of scope here)")

    def __init__(self, params: TgiParams, dep: Deployment):
        p = params
        self.block = BLOCK_SIZES[p.attention]
        self.mbpt = p.max_batch_prefill_tokens or tgi_compute_optimal_prefill(dep, p.cuda_memory_fraction)
        super().__init__(params, dep)

        def kv_bytes(d: Deployment) -> float:
            mbpt = p.max_batch_prefill_tokens or tgi_compute_optimal_prefill(d, p.cuda_memory_fraction)   # self.mbpt
            free = (p.cuda_memory_fraction * d.hardware.memory_bytes - d.weight_bytes_per_device - NON_TORCH_BYTES
                    - activation_reserve_bytes(d, mbpt, 1))
            # warmup: KV = free memory x wiggle room, plus the warmup batch's own blocks (flash_causal_lm.warmup)
            return p.tgi_wiggle_room * free + mbpt * d.kv_bytes_per_token_per_device if free > 0 else 0.0

        tokens = kv_tokens_or_refuse(dep, kv_bytes, engine="tgi",
                                     rule=f"cuda_memory_fraction={p.cuda_memory_fraction} x wiggle room "
                                          f"{p.tgi_wiggle_room} of free memory")
        if p.max_batch_total_tokens:
            tokens = min(tokens, p.max_batch_total_tokens)
        capacity = max(self.block, tokens // self.block * self.block)
        self.max_total_tokens = min(p.max_total_tokens or capacity, capacity, dep.model.max_model_len)
        self.max_input_tokens = min(p.max_input_tokens or self.max_total_tokens - 1, self.max_total_tokens - 1)
        self.max_model_len = self.max_total_tokens
        self.cache = RadixCache(capacity, page_size=self.block, partial_evict=True,
                                enabled=p.prefix_caching and p.attention != "paged")
        self.queue: deque[Request] = deque()
        self.batch: list[Request] = []
        self.visits: dict[int, _Entry] = {}   # request id -> its current queue visit (batch members)
        self.decode_next = False      # after a mixed/new prefill forward, a decode forward follows
        self.waiting_tokens = 1
        self.step_token_limit = max(-(-self.mbpt // self.block) * self.block,
                                    p.max_concurrent_requests * (1 + p.speculate))   # decodes and their drafts
        # with chunking, max_batch_size only bounds the first (idle) batch; later admissions ignore it (backend.rs)
        cap = p.max_batch_size if p.max_batch_size and not p.prefill_chunking else p.max_concurrent_requests
        self.batch_size_limit = min(p.max_concurrent_requests, cap)
        # KV is reserved for the whole visit at admission: a member's only event is its visit's (or its) last token
        self.cohort = DecodeCohort(None, 0, stop=lambda r: self.visits[r.request_id].out_end) \
            if self.lazy_decode and self.speculation is None else None

    @classmethod
    def speculation_of(cls, params: TgiParams, dep: Deployment) -> Speculation | None:
        p = params
        if not p.speculate:
            return None
        knobs = AcceptanceKnobs(acceptance=p.speculate_acceptance, acceptance_dataset=p.speculate_acceptance_dataset)
        return resolve("ngram", p.speculate, knobs, target=dep.model, at="speculate")

    def make_timing(self) -> EngineTiming:
        return EngineTiming(
            # ESTIMATE: every forward is a synchronous round trip router -> gRPC -> Python shard -> router:
            # ~0.3 ms gRPC + protobuf (unix socket) + ~1.2 ms Python input prep (slots, cu_seqlens, batch
            # concatenation when new entries join) before the forward; after it ~2 ms for sampling bookkeeping,
            # stopping criteria and incremental detokenization in Python for tens of requests, plus the router's
            # filter_batch RPC (tgi_batch_concat/filter_duration are timed separately, backend.rs). Nothing
            # overlaps the GPU (docs/engines/tgi.md); design.md of TRT-LLM puts exposed host costs at 3-17 ms.
            scheduler_cpu_s=1.5e-3, output_cpu_s=2.0e-3, overlap=False, seq_cpu_s=PYTHON_SEQ_CPU_S,
            frontend_s=NATIVE_FRONTEND_S, tokenize_s_per_token=TOKENIZE_S_PER_TOKEN,
            cuda_graph_sizes=tuple(sorted(s for s in self.params.cuda_graphs if s > 0)),
            graph_padding=True, graph_mixed_steps=False)   # graphs for decode-only forwards (flash_causal_lm.py)

    # ---- queues -------------------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self.batch)

    def num_waiting(self) -> int:
        return len(self.queue)




    def refusal(self, req: Request) -> str | None:
        p = self.params
        if req.prompt_len > self.max_input_tokens:
            return f"prompt of {req.prompt_len} tokens exceeds max_input_tokens {self.max_input_tokens}"
        if req.prompt_len + req.max_tokens + max(p.speculate - 1, 0) > self.max_total_tokens:
            return (f"prompt {req.prompt_len} + max_new_tokens {req.max_tokens} exceeds max_total_tokens "
                    f"{self.max_total_tokens}")
        longest_visit = req.prompt_len + (req.max_tokens - 1) // DEFAULT_GENERATION_LENGTH * DEFAULT_GENERATION_LENGTH
        if not p.prefill_chunking and longest_visit > self.mbpt:
            return (f"prompt of up to {longest_visit} tokens exceeds max_batch_prefill_tokens {self.mbpt} without "
                    "prefill chunking")
        return None

    def add_request(self, req: Request, now: float) -> bool:
        p = self.params
        if len(self.queue) + len(self.batch) >= p.max_concurrent_requests:
            return self.reject(req, f"429 Model is overloaded (max_concurrent_requests={p.max_concurrent_requests})")
        if not self.admit_length(req):
            return False
        self.queue.append(req)
        return True

    def release(self, req: Request) -> None:
        """Free the visit's allocation; its prompt's full blocks enter the radix trie (radix.rs free)."""
        e = self.visits.pop(req.request_id, None)
        if e is not None:
            self.cache.commit(e.hold, req.token_ids[:e.prompt])
            self.cache.release(e.hold)

    def on_finished(self, finished: list[Request], now: float) -> None:
        done = {id(r) for r in finished}
        self.batch = [r for r in self.batch if id(r) not in done]
        for req in finished:
            self.release(req)

    def update(self, out: SchedulerOutput, now: float) -> StepResult:
        res = super().update(out, now)
        visits = self.visits
        ended = [r for r, _ in islice(out.scheduled, out.num_lazy, None) if r.status is Status.RUNNING
                 and r.num_output_tokens >= visits[r.request_id].out_end]
        for req in ended:       # 1024 tokens generated: back to the tail with the text appended to the prompt
            self.batch.remove(req)
            self.release(req)
            req.num_computed_tokens = 0
            req.status = Status.WAITING
            self.queue.append(req)
        if ended and self.cohort is not None:   # the same request comes back: number the batch afresh
            self.cohort.dissolve()
            self.cohort.order(self.batch, fresh=True)
        return res

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        # Invariant: every admitted request holds KV for its whole visit (no preemption ever); admission is
        # strict FCFS from the queue head; a forward's prefill tokens stay within max_batch_prefill_tokens
        # (minus the running batch's current tokens when chunking); a new-entry forward is followed by a decode.
        out = SchedulerOutput()
        num_running = len(self.batch)
        if not self.batch:
            new = self._next_batch(self.mbpt, self.params.max_batch_size, now)
            self.decode_next = False          # the loop may admit again before its first decode
            out.scheduled = new
        elif self.decode_next:
            self.decode_next = False
            self._schedule_running(out)
        elif self.params.prefill_chunking:
            self._schedule_running(out)
            current = out.num_lazy + sum(n for _, n in islice(out.scheduled, out.num_lazy, None))
            new = self._next_batch(max(self.mbpt - current, 0), None, now)
            self.decode_next = bool(new)
            out.scheduled += new              # concatenated with the running batch: one mixed forward
        else:
            new = self._unchunked_new_batch(now)
            if new:
                out.scheduled = new
            else:
                self._schedule_running(out)
        if self.cohort is not None:   # the admitted join the cohort's running order
            self.cohort.order(self.batch[num_running:], fresh=False)
        out.shape = self.make_shape(out.scheduled, out.num_lazy)
        return out

    def _unchunked_new_batch(self, now: float) -> list[tuple[Request, int]]:
        """Non-chunking models: a new batch big enough (waiting_served_ratio) is prefilled alone, pausing decode
        (none: the running batch decodes)."""
        p = self.params
        size = len(self.batch)
        min_size = None if self.waiting_tokens >= p.max_waiting_tokens else int(size * p.waiting_served_ratio)
        max_size = None if p.max_batch_size is None else max(p.max_batch_size - size, 0)
        new = self._next_batch(self.mbpt, max_size, now, min_size) if max_size != 0 else []
        if new:
            self.waiting_tokens = 1
            self.decode_next = True
            return new
        self.waiting_tokens += 1
        return new

    def _schedule_running(self, out: SchedulerOutput) -> None:
        """What the batch computes next: one token per decoding request; prefilling requests get the next
        chunk, budget = max_batch_prefill_tokens - (len(batch) - 1), newest first (flash_causal_lm.py). The cohort's
        members (steady decodes) go first."""
        budget = self.mbpt - (len(self.batch) - 1)
        batch = self.cohort.schedule_lockstep(out) if self.cohort is not None else self.batch
        scheduled = []
        speculating = self.speculation is not None
        for req in reversed(batch):
            n = req.prompt_len + req.num_output_tokens - req.num_computed_tokens   # num_new_tokens, inline
            if n > 1 or req.num_output_tokens == 0:
                n = min(n, max(budget, 0))
                budget -= n
            elif speculating:   # a decode verifies its n-gram drafts
                n += self.drafts(req, len(self.batch))
            if n > 0:
                scheduled.append((req, n))
        scheduled.reverse()
        out.scheduled += scheduled

    def _next_batch(self, budget: int, max_size: int | None, now: float,
                    min_size: int | None = None) -> list[tuple[Request, int]]:
        """queue.rs State::next_batch: from the front, reserve the worst case, stop at the first misfit."""
        if not self.queue or (min_size is not None and len(self.queue) < min_size):
            return []
        budget = -(-budget // self.block) * self.block       # padded to whole blocks
        picked: list[tuple[Request, _Entry, int, int]] = []
        prefill = 0
        for req in self.queue:
            e = self._allocate(req)
            if e is None:
                break           # not enough free blocks even after eviction: the head waits
            prefix = e.hold.cached - (e.hold.cached == e.prompt)   # at least one prompt token is computed
            postfix = e.prompt - prefix
            if prefill + postfix > budget:
                chunk = budget - prefill
                if not self.params.prefill_chunking or chunk <= 0:
                    self.cache.release(e.hold)
                    break
                picked.append((req, e, prefix, chunk))
                break
            picked.append((req, e, prefix, postfix))
            prefill += postfix
            if prefill >= budget or (max_size is not None and len(picked) >= max_size):
                break
        if min_size is not None and len(picked) < min_size:
            for _, e, _, _ in picked:           # batch too small: nothing was handed out yet
                self.cache.release(e.hold)
            return []
        for req, e, prefix, _ in picked:
            self.queue.popleft()
            self._admit(req, e, prefix, now)
        return [(req, n) for req, _, _, n in picked]

    def _allocate(self, req: Request) -> _Entry | None:
        """radix.rs RadixAllocator::allocate: match the prompt, lock it, reserve blocks for the rest."""
        prompt = req.num_tokens
        max_new = min(req.max_tokens - req.num_output_tokens, DEFAULT_GENERATION_LENGTH)
        tokens = prompt + max_new + self.params.speculate - 1
        hold = self.cache.acquire(req.token_ids, prompt)
        need = -(-(tokens - hold.cached) // self.block) * self.block
        if not self.cache.grow(hold, need):
            self.cache.release(hold)
            return None
        return _Entry(hold, prompt, req.num_output_tokens + max_new)

    def _admit(self, req: Request, e: _Entry, prefix: int, now: float) -> None:
        self.visits[req.request_id] = e
        req.num_computed_tokens = prefix
        self.cache.record_lookup(e.prompt, prefix)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = prefix
        self.mark_scheduled(req, now)
        self.batch.append(req)

    def check_invariants(self) -> None:
        self.check_cohort(self.batch)
        self.cache.check_invariants()
        assert sorted(r.request_id for r in self.batch) == sorted(self.visits), "a visit outside the batch"
        assert sum(e.hold.private for e in self.visits.values()) == self.cache.req_tokens, "private slot leak"
        assert len(self.batch) <= self.params.max_concurrent_requests
