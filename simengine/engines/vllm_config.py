"""vLLM's engine arguments, the defaults its OpenAI server derives from the device, and its KV memory sizing.

Knob names are the CLI flags with dashes as underscores; defaults and their sources are from vLLM 0.33.0
(vllm/engine/arg_utils.py, vllm/config/). The scheduler that uses them is engines/vllm.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from simengine.config.loader import MAX_TOKENS, Checked, MemoryFraction, Range, Sequences, Tokens
from simengine.engines.memory import Deployment, forward_activation_bytes, kv_tokens_or_refuse, logits_bytes
from simengine.engines.speculative import AcceptanceKnobs, Speculation, resolve
from simengine.errors import InputError
from simengine.kvcache.host_tier import host_tier
from simengine.kvcache.manager import KVCacheManager

GIB = 2**30
# What vLLM's memory profile (gpu_worker.determine_available_memory: util x total - weights - torch peak - non-torch
# increase) measures besides the weights, from the startup logs of vLLM 0.19.0 on H100 (llm-d-incubation/llm-d-planner
# PR #205, accuracy/results/v0.19.0; max_num_seqs 1024, 8192 batched tokens):
# - the profile run samples min(max_num_seqs, max_num_batched_tokens) rows of full-vocabulary fp32 logits with top-k
#   and top-p on (gpu_model_runner._dummy_sampler_run, PR #13594), and that sampler, not the forward, sets the torch
#   peak for a large vocabulary: 1.89 GiB for Llama-3.1-8B, 2.21 for Qwen3-8B/Qwen2.5-7B, 2.87 for gpt-oss-20b, 3.66
#   for gemma-2-27b, 3.74-3.87 x the logits. Builds between (about) 0.12 and 0.16 sorted the logits for top-k/top-p
#   and peaked at about 9.6 x (llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md: Qwen3-32B 5.64
#   GiB); that is not modelled (GPUStack's 0.10-0.11 runs of gpt-oss-120b on one H100 fit the smaller multiple).
SAMPLER_PROFILE_LOGITS_MULTIPLE = 3.8
# - non-torch memory that grows during the profile (NCCL and custom all-reduce buffers): 0.24-0.27 GiB at TP1,
#   2.06-2.21 GiB at TP2 and TP4 (same logs; 0.07 GiB with pipeline parallelism alone)
NON_TORCH_BYTES_TP1 = 0.25 * GIB
NON_TORCH_BYTES_TP = 2.1 * GIB
# - the CUDA-graph pool ("Graph capturing finished ... took X GiB", same logs; 1024 sequences, capture sizes up to
#   512): 0.64-0.96 GiB for 7-8B models of 28-36 layers, 1.41 for Qwen3-30B-A3B (48), 1.51-1.79 for 70-72B (80);
#   ESTIMATE 0.25 GiB + 20 MiB a layer on the device (gpt-oss-20b's 1.84 GiB at 24 layers is the outlier). From
#   v0.21.0 vLLM subtracts its own estimate of that pool instead ("Estimated CUDA graph memory: 0.39-0.62 GiB total"
#   in the logs found, their models unstated; vllm-project/vllm issue #45178 shows it overestimating on B200), so
#   this may be off either way by a few tenths of a GiB.
CUDA_GRAPH_POOL_BYTES = 0.25 * GIB
CUDA_GRAPH_POOL_BYTES_PER_LAYER = 20 * 2**20


@dataclass(frozen=True, kw_only=True)
class VllmSpeculativeConfig(AcceptanceKnobs):
    """--speculative-config (vllm/config/speculative.py SpeculativeConfig; the simulator's acceptance beside it)."""

    method: Literal["ngram", "eagle", "eagle3", "mtp", "draft_model"]
    # drafts per step; None: the draft's n_predict where it has one (an MTP model's MTP layers: 1), else required
    num_speculative_tokens: Annotated[int, Range(1, 64)] | None = None
    model: str | None = None   # the draft model of method draft_model (a catalog name here)


@dataclass(frozen=True, kw_only=True)
class VllmParams(Checked):
    """vLLM engine arguments (CLI flag names with dashes as underscores). Defaults from vLLM 0.33.0."""

    # None: 1024 on >=70 GB non-A100, else 256 (arg_utils get_batch_defaults); V0: 256 (EngineArgs.max_num_seqs)
    max_num_seqs: Sequences | None = None
    # None: 16384 on >=160 GB, 8192 on >=70 GB non-A100, else 2048 (same); without chunked prefill max(max_model_len,
    # 2048) (SchedulerConfig: "if max_model_len is too short, use the default for higher throughput"); V0 chunking
    # 2048 (vllm/config.py SchedulerConfig of 0.6-0.7: "chosen to have a balance between ITL and TTFT"; 512 in 0.5)
    max_num_batched_tokens: Tokens | None = None
    # None: V1 always chunks prompts; V0 chunked only past a 32K max_model_len ("Chunked prefill is enabled by
    # default for models with max_model_len > 32K", engine/arg_utils.py of 0.5-0.7) and not with multi-step (0.6.0
    # refused it: "Chunked prefill is not supported with multi-step", vllm-project/vllm issue #8274; PR #8378 then ran
    # prompts inside multi-step runs "so decodes will not have to be interrupted by prefills"). Off: whole prompts only
    enable_chunked_prefill: bool | None = None
    # env VLLM_USE_V1 (V1 the default from v0.8.0, V0 removed in 0.10). V0 without chunked prefill
    # (core/scheduler.py _schedule_default) runs a step of new prompts alone whenever any is admitted, decodes only
    # when none is, and admits a prompt only with 1 % of the blocks left free (BlockSpaceManager watermark 0.01); it
    # had no async scheduling (async_scheduling is ignored)
    use_v1: bool = True
    gpu_memory_utilization: MemoryFraction = 0.92  # config/cache.py; 0.9 before v0.21.0 (PR #38284)
    block_size: Literal[1, 8, 16, 32, 64, 128, 256] = 16  # CacheConfig.DEFAULT_BLOCK_SIZE (config/cache.py BlockSize)
    enable_prefix_caching: bool | None = None      # None: on in V1 (config/cache.py), off in V0 (EngineArgs)
    long_prefill_token_threshold: Annotated[int, Range(0, MAX_TOKENS)] = 0  # config/scheduler.py (0 = off)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # config/scheduler.py `policy`
    max_model_len: Tokens | None = None  # None: the model's max_position_embeddings, capped to fit the KV pool
    enforce_eager: bool = False                    # disables CUDA graphs
    # env VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: count the CUDA-graph pool in the KV budget (on from v0.21.0,
    # PR #38284, which raised gpu_memory_utilization to 0.92 with it; off before, the graphs taking the headroom)
    memory_profiler_estimate_cudagraphs: bool = True
    async_scheduling: bool = True  # None->auto-on in config/vllm.py; overlaps host scheduling with the GPU and
    # schedules step k+1 before step k's output is applied (v1/core/sched/async_scheduler.py)
    kv_cache_memory_bytes: Annotated[int, Range(1, 2**50)] | None = None  # overrides the gpu_memory_utilization rule
    # config/cache.py CacheConfig: "Number of GPU blocks to use. This overrides the profiled num_gpu_blocks if
    # specified" (the pool a run's log reported, when a measurement states it)
    num_gpu_blocks_override: Annotated[int, Range(1, 50_000_000)] | None = None
    # vLLM V0 (0.5.4-0.7) --num-scheduler-steps: the scheduler runs once per this many steps, so a run of decode
    # steps admits nobody new until it ends and streams its tokens at its end (engines/multi_step.py)
    # (vllm/engine/arg_utils.py of 0.6.0; removed with V0, where 1 is all)
    num_scheduler_steps: Annotated[int, Range(1, 1024)] = 1
    # speculative decoding (engines/speculative.py); V1 keeps no disable_by_batch_size (unused since V0 was removed
    # in 0.10 and deleted by PR #35060), so drafts run at every batch size
    speculative_config: VllmSpeculativeConfig | None = None
    # KV offload to CPU memory (config/cache.py CacheConfig, since 0.11.1; vllm/config/vllm.py maps it to a KV
    # connector): GiB in all, summed over the TP x PP ranks; None: off. native (the default from 0.14): the
    # OffloadingConnector's CPU tier, LRU, storing every computed full block; lmcache: LMCacheConnectorV1, storing
    # prompt blocks. A prompt continuing a GPU hit in the CPU tier loads those blocks back asynchronously
    # (WAITING_FOR_REMOTE_KVS) before it runs (docs/engines.md 'KV offload')
    kv_offloading_size: Annotated[float, Range(0, 1 << 20, above=True)] | None = None
    kv_offloading_backend: Literal["native", "lmcache"] = "native"
    # LMCache's local disk tier (lmcache/v1/config.py max_local_disk_size, env LMCACHE_MAX_LOCAL_DISK_SIZE, GiB per
    # worker; local_disk set): what the CPU tier evicts goes to disk, and is read back from there
    lmcache_max_local_disk_size: Annotated[float, Range(0, 1 << 30)] = 0.0
    # multi-LoRA serving (config/lora.py LoRAConfig; engines/lora.py): adapters active at once, the rank their slots
    # are sized for, and adapters cached in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: Annotated[int, Range(1, 1024)] = 1
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    max_cpu_loras: Annotated[int, Range(1, 1 << 20)] | None = None


V0_MAX_NUM_SEQS = 256
V0_WATERMARK = 0.01   # core/block_manager.py (V0): can_allocate leaves this share of the blocks free
V0_CHUNKED_BATCHED_TOKENS = 2048
V0_CHUNKED_PREFILL_ABOVE_MODEL_LEN = 32768
UNCHUNKED_MIN_BATCHED_TOKENS = 2048


def vllm_chunked_prefill(p: VllmParams, dep: Deployment) -> bool:
    """Whether prompts are chunked: the flag, else always in V1 and past a 32K context (single-step) in V0."""
    if p.enable_chunked_prefill is not None:
        return p.enable_chunked_prefill
    return p.use_v1 or ((p.max_model_len or dep.model.max_model_len) > V0_CHUNKED_PREFILL_ABOVE_MODEL_LEN
                        and p.num_scheduler_steps == 1)


def vllm_batch_defaults(p: VllmParams, dep: Deployment) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM's OpenAI server picks for this device, engine and chunking."""
    seqs, tokens = _device_batch_defaults(dep) if p.use_v1 else (V0_MAX_NUM_SEQS, V0_CHUNKED_BATCHED_TOKENS)
    if not vllm_chunked_prefill(p, dep):   # a step must hold a whole prompt: V1 floors its device default at the
        # context (arg_utils.py _set_default_max_num_seqs_and_batched_tokens_args), V0 floored 2048 there
        tokens = max(p.max_model_len or dep.model.max_model_len, tokens if p.use_v1 else UNCHUNKED_MIN_BATCHED_TOKENS)
    if p.use_v1:   # the same function: max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        seqs = min(seqs, p.max_num_batched_tokens or tokens)
    return seqs, tokens


def _device_batch_defaults(dep: Deployment) -> tuple[int, int]:
    """V1's (max_num_seqs, max_num_batched_tokens) by the device's memory."""
    mem_gib = dep.hardware.memory_bytes / GIB
    is_a100 = dep.hardware.name.startswith("a100")
    if mem_gib >= 160:
        return 1024, 16384
    if mem_gib >= 70 and not is_a100:
        return 1024, 8192
    return 256, 2048


def vllm_capture_sizes(max_num_seqs: int, max_batched: int) -> tuple[int, ...]:
    """CUDA-graph capture sizes: 1,2,4, 8..248 step 8, 256.. step 16, up to min(2*max_num_seqs, 512) and never past
    max_num_batched_tokens (config/vllm.py _set_cudagraph_sizes)."""
    limit = min(2 * max_num_seqs, 512, max_batched)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, limit + 1, 16))
    out = sorted({s for s in sizes if s <= limit} | ({max_batched} if max_batched <= limit else set()))
    return tuple(out)


def vllm_profile_bytes(dep: Deployment, max_num_batched_tokens: int, max_num_seqs: int) -> float:
    """Bytes per device vLLM's memory profile finds besides the weights: its torch peak and non-torch growth."""
    sampler_bytes = SAMPLER_PROFILE_LOGITS_MULTIPLE * logits_bytes(dep, min(max_num_seqs, max_num_batched_tokens))
    # every TP rank samples the whole vocabulary
    torch_peak_bytes = max(forward_activation_bytes(dep, max_num_batched_tokens), sampler_bytes)
    return torch_peak_bytes + (NON_TORCH_BYTES_TP if dep.tp > 1 else NON_TORCH_BYTES_TP1)


def vllm_kv_cache(p: VllmParams, dep: Deployment, max_num_batched_tokens: int, max_num_seqs: int) -> KVCacheManager:
    """The paged KV pool vLLM sizes on this deployment (gpu_worker.determine_available_memory: the utilisation share of
    memory less weights, the profiled activation peak and non-torch memory; or kv_cache_memory_bytes), with the CPU
    and disk offload tiers its params ask for."""
    def kv_bytes_of(d: Deployment) -> float:
        if p.kv_cache_memory_bytes:
            return float(p.kv_cache_memory_bytes)
        graph_pool_bytes = 0.0
        if p.memory_profiler_estimate_cudagraphs and not p.enforce_eager:
            graph_pool_bytes = CUDA_GRAPH_POOL_BYTES + CUDA_GRAPH_POOL_BYTES_PER_LAYER * d.model.num_layers / d.pp
        return (p.gpu_memory_utilization * d.hardware.memory_bytes - d.weight_bytes_per_device
                - vllm_profile_bytes(d, max_num_batched_tokens, max_num_seqs) - graph_pool_bytes)

    rule = ("kv_cache_memory_bytes" if p.kv_cache_memory_bytes
            else f"gpu_memory_utilization={p.gpu_memory_utilization} of total memory")
    kv_bytes = kv_bytes_of(dep)
    tokens = kv_tokens_or_refuse(dep, kv_bytes_of, engine="vllm", rule=rule)
    num_blocks = p.num_gpu_blocks_override or tokens // p.block_size
    if num_blocks > 50_000_000:  # more than any device holds (a B200 has ~13M 16-token blocks of Llama-8B)
        raise InputError(f"a KV pool of {kv_bytes / 2**30:.0f} GiB is beyond any device; give "
                         "kv_cache_memory_bytes in bytes of one device's KV cache", field="kv_cache_memory_bytes")
    if p.max_model_len and p.max_model_len > dep.model.max_model_len:
        raise InputError(f"max_model_len {p.max_model_len} exceeds {dep.model.name}'s context of "
                         f"{dep.model.max_model_len} tokens (vLLM refuses it without "
                         f"VLLM_ALLOW_LONG_MAX_MODEL_LEN); use <= {dep.model.max_model_len}", field="max_model_len")
    if p.kv_offloading_size and not p.use_v1:
        raise InputError("KV offload (the OffloadingConnector, vLLM 0.11.1 on) needs the V1 engine: set use_v1: true "
                         "or drop kv_offloading_size", field="kv_offloading_size")
    caching = p.use_v1 if p.enable_prefix_caching is None else p.enable_prefix_caching
    kv = KVCacheManager(num_blocks, p.block_size, enable_prefix_caching=caching)
    if p.kv_offloading_size:
        # native: cpu_bytes_to_use, the whole size over the TP x PP ranks, every computed block stored;
        # lmcache: max_local_cpu_size = size / (TP x PP) per worker, prompt blocks only (save_decode_cache off)
        kv.attach_host(host_tier(dep, p.kv_offloading_size * GIB / dep.num_devices, p.block_size,
                                 write_through=True, field="kv_offloading_size", caching=caching,
                                 prompt_only=p.kv_offloading_backend == "lmcache"))
    if p.lmcache_max_local_disk_size:
        if p.kv_offloading_backend != "lmcache" or kv.host is None:
            raise InputError("a local disk tier is LMCache's: set kv_offloading_backend: lmcache and "
                             "kv_offloading_size", field="lmcache_max_local_disk_size")
        kv.host.spill = host_tier(dep, p.lmcache_max_local_disk_size * GIB, p.block_size,
                                  write_through=False, field="lmcache_max_local_disk_size")
    return kv


def vllm_speculation(params: VllmParams, dep: Deployment) -> Speculation | None:
    """The speculative decoding --speculative-config asks for (engines/speculative.py), or None."""
    c = params.speculative_config
    if c is None:
        return None
    k = c.num_speculative_tokens
    if k is None:
        if c.method != "mtp":
            raise InputError(f"give num_speculative_tokens for method {c.method}",
                             field="speculative_config.num_speculative_tokens")
        k = 1   # the model's num_nextn_predict_layers (DeepSeek-V3: 1)
    return resolve(c.method, k, c, target=dep.model, at="speculative_config", draft_model=c.model, lookahead=True)


def fp8_weight_only(dep: Deployment) -> Deployment:
    """FP8 checkpoints on NVIDIA devices without FP8 tensor cores (here all Ampere, SM 8.x) run as weight-only W8A16
    through FP8 Marlin: weights stay one byte, GEMMs compute in 16 bit (vLLM docs 'FP8 W8A8': 'FP8 models will run on
    compute capability >= 7.5 (Turing) as weight-only W8A16, utilizing FP8 Marlin'; vllm-project/vllm PR #5975;
    MoE layers too, marlin_utils_fp8 per sgl-project/sglang issue #12887)."""
    fmt, hw = dep.weight_format, dep.hardware
    if fmt.name != "fp8" or "fp8" in hw.peak_flops or hw.vendor != "nvidia":
        return dep
    return dataclasses.replace(dep, weight_format=dataclasses.replace(
        fmt, fallback_compute="bf16", source=fmt.source + "; weight-only W8A16 through FP8 Marlin (vLLM)"))
