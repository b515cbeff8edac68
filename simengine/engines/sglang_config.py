"""SGLang's server arguments, the defaults it derives from the device (memory_hook.py) and the pools they size.

Knob names are the CLI flags with dashes as underscores; defaults and their sources are from SGLang 0.5.23
(python/sglang/srt/server_args.py and arg_groups/). The scheduler that uses them is engines/sglang.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from simengine.config.loader import MAX_TOKENS, BlockTokens, Checked, MemoryFraction, PoolSize, Range, Sequences, Tokens
from simengine.engines.lora import AdapterSlots
from simengine.engines.memory import Deployment
from simengine.engines.speculative import (
    MTP_MODEL_TYPES,
    AcceptanceDataset,
    AcceptanceKnobs,
    AcceptanceRates,
    Speculation,
    resolve,
)
from simengine.errors import InputError
from simengine.kvcache.host_tier import TokenHostTier, host_tier

MIB = 2**20
# HiCache: host-tier lookups go in chunks of this many tokens (a simulator granularity: SGLang's host pool pages are
# the device's, one token with page_size 1), and a host hit under load_back_threshold tokens is recomputed
HICACHE_CHUNK = 32
HICACHE_LOAD_BACK_THRESHOLD = 10   # hiradix_cache.py HiRadixCache load_back_threshold


@dataclass(frozen=True, kw_only=True)
class SglangParams(Checked):
    """SGLang server arguments (CLI flag names with dashes as underscores). Defaults from 0.5.23."""

    # None: (gpu_mem - reserved) / gpu_mem (arg_groups/memory_hook.py)
    mem_fraction_static: MemoryFraction | None = None
    max_total_tokens: PoolSize | None = None       # caps the KV pool in tokens (fields/memory.py; model_runner min())
    # None: clamp(kv/context*512, 2048, 4096) <= kv/2 (pool_configurator.py)
    max_running_requests: Sequences | None = None
    # None: by GPU memory, 8192 on H100/H200 (memory_hook.py); -1 = off
    chunked_prefill_size: Annotated[int, Range(1, MAX_TOKENS, also=(-1,))] | None = None
    max_prefill_tokens: Tokens = 16384             # fields/schedule.py
    schedule_policy: Literal["fcfs", "lpm", "dfs-weight", "lof"] = "fcfs"  # fields/schedule.py (was lpm before)
    # fields/schedule.py; scales the initial new_token_ratio
    schedule_conservativeness: Annotated[float, Range(0, 100, above=True)] = 1.0
    page_size: BlockTokens = 1                     # overrides.py::_page_size_default on CUDA
    disable_radix_cache: bool = False              # fields/memory.py
    enable_mixed_chunk: bool = False               # fields/schedule.py
    disable_overlap_schedule: bool = False         # fields/schedule.py (overlap scheduler on by default)
    enable_priority_scheduling: bool = False       # fields/schedule.py
    schedule_low_priority_values_first: bool = False  # fields/schedule.py: default serves HIGHER values first
    disable_cuda_graph: bool = False               # fields/exec_.py
    cuda_graph_max_bs_decode: Sequences | None = None  # None: by GPU memory, 256 on H100 at tp<4 (memory_hook.py)
    # cuda_graph_runner.py compiles the captured decode graphs of up to torch_compile_max_bs sequences (fields/exec_.py;
    # enable_torch_compile since v0.2 (issue #1008); the limit was --max-torch-compile-bs in v0.3 (PR #1497's
    # commands); their price: cost/timing.py TORCH_COMPILE_DECODE_FACTOR)
    enable_torch_compile: bool = False
    torch_compile_max_bs: Sequences = 32
    context_length: Tokens | None = None           # None: the model's max_position_embeddings
    # speculative decoding (fields of server_args.py; docs/advanced_features/speculative_decoding.md): NEXTN is EAGLE
    # over a model's own MTP layer, STANDALONE a separate draft model (speculative_draft_model_path, a catalog name
    # here). None for steps/topk/draft tokens: auto, 5/4/8 for Llama, 3/1/4 otherwise; with topk 1 the draft tokens
    # are steps + 1; NGRAM verifies 12 draft tokens (its max match window) as a chain
    speculative_algorithm: Literal["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"] | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: Annotated[int, Range(1, 64)] | None = None
    speculative_eagle_topk: Annotated[int, Range(1, 64)] | None = None
    speculative_num_draft_tokens: Annotated[int, Range(2, 256)] | None = None
    # HiCache (server_args.py; mem_cache/hiradix_cache.py): a host-memory tier behind the radix cache, hicache_ratio
    # x the device pool (hicache_size GB instead when > 0); write_through copies a node out when it is inserted
    enable_hierarchical_cache: bool = False
    hicache_ratio: Annotated[float, Range(0, 1000, above=True)] = 2.0
    hicache_size: Annotated[int, Range(0, 1 << 20)] = 0
    hicache_write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    # multi-LoRA serving (server_args.py; docs/advanced_features/lora.md): adapters per batch (their GPU pool),
    # adapters held in host memory (None: every adapter, loaded at start from --lora-paths), and the rank the pool is
    # sized for (SGLang infers it from --lora-paths; here it must be given)
    enable_lora: bool = False
    max_loras_per_batch: Annotated[int, Range(1, 1024)] = 8
    max_loaded_loras: Annotated[int, Range(1, 1 << 20)] | None = None
    max_lora_rank: Annotated[int, Range(1, 1024)] | None = None
    # the simulator's acceptance model (engines/speculative.py AcceptanceKnobs), not SGLang flags
    speculative_acceptance: AcceptanceRates = None
    speculative_acceptance_dataset: AcceptanceDataset = "chat"


def sglang_gpu_defaults(dep: Deployment) -> tuple[int, int]:
    """(chunked_prefill_size, decode CUDA-graph max_bs) by GPU memory (memory_hook.py)."""
    mem, small_tp = dep.hardware.memory_bytes / MIB, dep.tp < 4
    if mem < 20 * 1024:
        return 2048, 8
    if mem < 35 * 1024:
        return 4096, 48 if small_tp else 160
    if mem < 60 * 1024:
        return 4096, 32 if small_tp else 160
    if mem < 160 * 1024:
        return 8192, 256 if small_tp else 512
    return 16384, 512


def sglang_decode_graph_sizes(max_bs: int) -> tuple[int, ...]:
    """cuda_graph_hook.py::generate_decode_cuda_graph_batch_sizes (no speculative decoding)."""
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    return tuple(sorted({s for s in sizes if s <= max_bs} | {max_bs}))


# Memory in use before the weights load (the CUDA context, and with TP or PP torch.distributed's NCCL and custom
# all-reduce buffers): SGLang's pool is mem_fraction_static of what is free then, less the weights
# (model_runner.profile_max_num_token: rest = available after load - total_before_load x (1 - mem_fraction_static)).
# Startup logs on 80 GB H100s (CUDA total 79.19 GiB): "Load weight begin. avail mem" 78.59-78.81 GiB at TP1
# (docs.sglang.ai send_request log 2025-01; sgl-project/sglang PR #4760), 77.43 at TP8 (v0.5.2rc2 Grok-2 log: "Init
# torch distributed ends. mem usage=1.25 GB"); 137.29 of 139.81 on H200 at TP8 (PR #11716). One GPU: the top of the
# logged 0.38-0.60 GiB; distributed: between H100 TP8's 1.76 and H200 TP8's 2.52. Checked against the K+V sizes the
# logs print (Llama-3.1-8B on one H100 at 0.88: 54.26 GiB; Qwen3-235B-A22B-FP8 on four at 0.93: 16.46 GiB,
# vllm-project/vllm issue #21348): tests/engines/test_sglang.py.
PRE_LOAD_BYTES_ONE_GPU = 0.6 * 2**30
PRE_LOAD_BYTES_DISTRIBUTED = 2.0 * 2**30


def sglang_kv_bytes(dep: Deployment, mem_fraction_static: float) -> float:
    """KV bytes per device: mem_fraction_static of the memory free before the weights load, less the weights."""
    pre_load_bytes = PRE_LOAD_BYTES_DISTRIBUTED if dep.tp * dep.pp > 1 else PRE_LOAD_BYTES_ONE_GPU
    return mem_fraction_static * (dep.hardware.memory_bytes - pre_load_bytes) - dep.weight_bytes_per_device


def sglang_mem_fraction_static(dep: Deployment, chunked_prefill_size: int, max_bs: int) -> float:
    """memory_hook.py: reserve 512 MB + 1.5 MB per activation token + tp*pp/8 GB + CUDA-graph buffers
    (2 MB per decode bs, 8 MB per prefill graph size), at least 10 GB on GPUs over 60 GB."""
    mem, cps = dep.hardware.memory_bytes / MIB, chunked_prefill_size
    prefill_sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
                     *range(1280, 4097, 256), *range(4608, cps + 1, 512)]    # generate_prefill_cuda_graph_batch_sizes
    reserved = 512 + max(cps, 2048) * 1.5 + dep.tp * dep.pp / 8 * 1024
    reserved += max_bs * 2 + sum(1 for x in prefill_sizes if x <= cps) * 8
    if mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mem - reserved) / mem, 3)


def sglang_speculation(p: SglangParams, dep: Deployment) -> Speculation | None:
    """The speculative decoding --speculative-algorithm asks for (None: off)."""
    algo = p.speculative_algorithm
    if algo is None:
        return None
    if algo == "NGRAM":
        drafts = (p.speculative_num_draft_tokens or 12) - 1
        steps, topk = drafts, 1
    else:
        steps, topk, tokens = (5, 4, 8) if dep.model.model_type == "llama" else (3, 1, 4)
        steps, topk = p.speculative_num_steps or steps, p.speculative_eagle_topk or topk
        tokens = steps + 1 if topk == 1 else (p.speculative_num_draft_tokens or tokens)
        drafts = tokens - 1
    method = {"EAGLE": "mtp" if dep.model.model_type in MTP_MODEL_TYPES else "eagle", "EAGLE3": "eagle3",
              "NEXTN": "mtp", "STANDALONE": "draft_model", "NGRAM": "ngram"}[algo]
    knobs = AcceptanceKnobs(acceptance=p.speculative_acceptance, acceptance_dataset=p.speculative_acceptance_dataset)
    # a tree of `drafts` tokens over `steps` positions: about drafts / steps candidates a position (<= topk)
    return resolve(method, drafts, knobs, target=dep.model, at="speculative_algorithm",
                   draft_model=p.speculative_draft_model_path, model_field="speculative_draft_model_path",
                   depth=min(steps, drafts), width=min(float(topk), drafts / min(steps, drafts)))


def sglang_adapter_slots(p: SglangParams) -> AdapterSlots | None:
    """The LoRA memory pool of max_loras_per_batch adapters at max_lora_rank (None: LoRA off)."""
    if not p.enable_lora:
        return None
    if p.max_lora_rank is None:
        raise InputError("give the rank the LoRA pool is sized for (SGLang infers it from --lora-paths)",
                         field="max_lora_rank")
    if p.max_loaded_loras is not None and p.max_loaded_loras < p.max_loras_per_batch:
        raise InputError(f"must be >= max_loras_per_batch ({p.max_loras_per_batch}), got {p.max_loaded_loras}",
                         field="max_loaded_loras")
    return AdapterSlots(p.max_loras_per_batch, p.max_loaded_loras or (1 << 30), p.max_lora_rank,
                        preloaded=p.max_loaded_loras is None)


def sglang_host_tier(p: SglangParams, dep: Deployment, pool_tokens: int) -> TokenHostTier | None:
    """HiCache's host tier behind a device pool of `pool_tokens` (None: off)."""
    if not p.enable_hierarchical_cache:
        return None
    if p.hicache_write_policy != "write_through":
        raise InputError(f"{p.hicache_write_policy} is not modelled; use write_through (the default)",
                         field="hicache_write_policy")
    size = p.hicache_size * 1e9 if p.hicache_size else p.hicache_ratio * pool_tokens * dep.kv_bytes_per_token_per_device
    return TokenHostTier(host_tier(dep, size, HICACHE_CHUNK, write_through=True, field="enable_hierarchical_cache",
                                   caching=not p.disable_radix_cache), HICACHE_CHUNK, HICACHE_LOAD_BACK_THRESHOLD)
