"""TensorRT-LLM's LLM-API arguments, its CUDA-graph sizes and the KV pool they size (tensorrt_llm/llmapi/llm_args.py,
1.x; PyTorch backend). The scheduler that uses them is engines/trtllm.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from simengine.config.loader import BlockTokens, Checked, MemoryFraction, PoolSize, Range, Sequences, Tokens
from simengine.engines.memory import NON_TORCH_BYTES, Deployment, activation_reserve_bytes, kv_tokens_or_refuse
from simengine.engines.speculative import AcceptanceKnobs, Speculation, resolve
from simengine.errors import InputError
from simengine.kvcache.host_tier import host_tier
from simengine.kvcache.manager import KVCacheManager

CapacityPolicy = Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"]


@dataclass(frozen=True, kw_only=True)
class TrtllmSpeculativeConfig(AcceptanceKnobs):
    """speculative_config (llmapi/llm_args.py: Eagle3DecodingConfig, MTPDecodingConfig, NGramDecodingConfig,
    DraftTargetDecodingConfig; PyTorch backend) and the simulator's acceptance beside it."""

    decoding_type: Literal["Eagle3", "MTP", "NGram", "DraftTarget"]
    max_draft_len: Annotated[int, Range(1, 64)] | None = None  # DecodingBaseConfig; required except MTP
    num_nextn_predict_layers: Annotated[int, Range(1, 64)] = 1  # MTPDecodingConfig: MTP's drafts
    # DecodingBaseConfig.max_concurrency: speculation off at batch sizes above it (draft_len_schedule); None: always
    max_concurrency: Annotated[int, Range(1, 1 << 20)] | None = None
    speculative_model_dir: str | None = None  # DraftTarget's draft model (a catalog name here)


@dataclass(frozen=True, kw_only=True)
class TrtllmParams(Checked):
    """TensorRT-LLM LLM-API arguments (tensorrt_llm/llmapi/llm_args.py, 1.x); nested configs flattened to leaves."""

    max_batch_size: Sequences = 2048                # BaseLlmArgs.max_batch_size (llm_args.py)
    max_num_tokens: Tokens = 8192                   # BaseLlmArgs.max_num_tokens (llm_args.py)
    max_seq_len: Tokens | None = None               # None: the model's max_position_embeddings, capped to the KV pool
    enable_chunked_prefill: bool = False            # BaseLlmArgs.enable_chunked_prefill (llm_args.py)
    capacity_scheduler_policy: CapacityPolicy = "GUARANTEED_NO_EVICT"  # scheduler_config (llm_args.py SchedulerConfig)
    free_gpu_memory_fraction: MemoryFraction = 0.9  # kv_cache_config (KvCacheConfig): fraction of FREE memory
    tokens_per_block: BlockTokens = 32              # kv_cache_config.tokens_per_block (KvCacheConfig)
    enable_block_reuse: bool = True                 # kv_cache_config.enable_block_reuse (KvCacheConfig)
    # kv_cache_config.max_tokens: an upper bound on the pool (KvCacheConfig)
    kv_cache_max_tokens: PoolSize | None = None
    disable_overlap_scheduler: bool = False         # llm_args.py; docs features/overlap-scheduler ("on by default")
    cuda_graph_config: bool = True  # llm_args.py: CudaGraphConfig() by default; null/false disables graphs
    cuda_graph_max_batch_size: Sequences = 128      # CudaGraphConfig.max_batch_size (0 -> 128)
    cuda_graph_enable_padding: bool = False         # CudaGraphConfig.enable_padding
    speculative_config: TrtllmSpeculativeConfig | None = None  # BaseLlmArgs.speculative_config (None: off)
    # kv_cache_config.host_cache_size: bytes of host memory per GPU for the secondary block pool (None/0: off);
    # blocks the GPU pool evicts are offloaded there and onboarded when a prompt reuses them (KvCacheConfig)
    host_cache_size: Annotated[int, Range(0, 1 << 50)] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.enable_chunked_prefill and self.max_num_tokens < self.tokens_per_block:
            raise InputError(f"must be >= tokens_per_block ({self.tokens_per_block}) when chunks end on blocks, "
                             f"got {self.max_num_tokens}", field="max_num_tokens")


def trtllm_capture_sizes(max_bs: int, padding: bool) -> tuple[int, ...]:
    """CudaGraphConfig._generate_cuda_graph_batch_sizes (llm_args.py): 1..31,32,64,128 or 1,2,4,8..128 (+64)."""
    if padding:
        sizes = [1, 2, 4] + [8 * i for i in range(1, 17)]
        while sizes[-1] + 64 <= max_bs:
            sizes.append(sizes[-1] + 64)
    else:
        sizes = list(range(1, 32)) + [32, 64, 128]
        sizes += [2**i for i in range(8, math.ceil(math.log2(max_bs)))] if max_bs > 1 else []
    out = sorted({s for s in sizes if s <= max_bs})
    if not out or out[-1] != max_bs:
        out.append(max_bs)
    return tuple(out)


def trtllm_kv_cache(p: TrtllmParams, dep: Deployment) -> KVCacheManager:
    """The paged KV pool (KvCacheConfig) on this deployment, with the host pool host_cache_size asks for."""
    # KV estimation: a profiling forward of max_num_tokens, then free_gpu_memory_fraction of what is left free
    def kv_bytes(d: Deployment) -> float:
        return p.free_gpu_memory_fraction * (d.hardware.memory_bytes - d.weight_bytes_per_device
                                             - activation_reserve_bytes(d, p.max_num_tokens, p.max_batch_size)
                                             - NON_TORCH_BYTES)

    rule = f"free_gpu_memory_fraction={p.free_gpu_memory_fraction} of free memory after weights and activations"
    tokens = kv_tokens_or_refuse(dep, kv_bytes, engine="trtllm", rule=rule)
    if p.kv_cache_max_tokens:
        tokens = min(tokens, p.kv_cache_max_tokens)
    num_blocks = max(1, tokens // p.tokens_per_block)
    kv = KVCacheManager(num_blocks, p.tokens_per_block, enable_prefix_caching=p.enable_block_reuse)
    if p.host_cache_size:
        kv.attach_host(host_tier(dep, p.host_cache_size, p.tokens_per_block, write_through=False,
                                 field="host_cache_size", caching=p.enable_block_reuse))
    return kv


def trtllm_speculation(p: TrtllmParams, dep: Deployment) -> Speculation | None:
    """The speculative decoding speculative_config asks for (None: off)."""
    c = p.speculative_config
    if c is None:
        return None
    if dep.pp > 1:   # py_executor.py: "Drafting is not supported for selected executor loop" (_executor_loop_pp)
        raise InputError("TensorRT-LLM does not draft in its pipeline-parallel loop; use pp 1 or remove "
                         "speculative_config", field="speculative_config")
    if c.decoding_type == "MTP":
        k = c.num_nextn_predict_layers
    elif c.max_draft_len is None:
        raise InputError(f"{c.decoding_type} needs max_draft_len > 0", field="speculative_config.max_draft_len")
    else:
        k = c.max_draft_len
    method = {"Eagle3": "eagle3", "MTP": "mtp", "NGram": "ngram", "DraftTarget": "draft_model"}[c.decoding_type]
    return resolve(method, k, c, target=dep.model, at="speculative_config", draft_model=c.speculative_model_dir,
                   model_field="speculative_model_dir", max_batch=c.max_concurrency)
