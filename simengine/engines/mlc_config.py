"""MLC-LLM's `serve` options and the engine config it infers per mode and device (cpp/serve/config.cc
EstimateMemoryUsageOnMode). The engine that uses them is engines/mlc.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from simengine.config.loader import BlockTokens, Checked, MemoryFraction, PoolSize, Sequences, Tokens
from simengine.engines.devices import gpu_visible_bytes
from simengine.engines.memory import Deployment, kv_tokens_or_refuse

MIB = 2**20
METAL_KV_CAP = 32768   # config.cc: Metal runtime limits the KV capacity to 32768 tokens


@dataclass(frozen=True, kw_only=True)
class MlcParams(Checked):
    """`mlc_llm serve` options and EngineConfig fields (cpp/serve/config.h, python/mlc_llm/serve/config.py)."""

    mode: Literal["local", "interactive", "server"] = "local"  # --mode (cli/serve.py)
    # None below: inferred per mode by config.cc EstimateMemoryUsageOnMode (the rules in docs/engines/mlc.md)
    max_num_sequence: Sequences | None = None      # local min(4, max_batch_size), interactive 1, server max_batch_size
    # KV tokens: local min(mem, ctx, 8192), interactive min(mem, ctx), server min(mem, max_num_sequence x ctx)
    max_total_sequence_length: PoolSize | None = None
    prefill_chunk_size: Tokens | None = None       # local/interactive min(compiled, total, ctx); server compiled
    max_single_sequence_length: Tokens | None = None  # the model's context_window_size (config.cc GetModelConfigLimits)
    max_batch_size: Sequences = 128                # compiled max batch size (gen_config default; docs/engines/mlc.md)
    compiled_prefill_chunk_size: Tokens | None = None  # None: min(context window, 8192) (model/llama/llama_model.py)
    gpu_memory_utilization: MemoryFraction = 0.85  # EngineConfig default, fraction of TOTAL memory (config.cc)
    kv_cache_page_size: BlockTokens = 16           # EngineConfig default
    prefill_mode: Literal["hybrid", "chunked"] = "hybrid"  # EngineConfig default
    prefix_cache_mode: Literal["radix", "disable"] = "radix"  # EngineConfig default
    # None: max_num_sequence (config.cc FromJSONAndInferred..)
    prefix_cache_max_num_recycling_seqs: Sequences | None = None
    opt: Literal["O0", "O1", "O2", "O3"] = "O2"    # compile --opt; O2/O3 enable cudagraph on CUDA (compiler_flags.py)


@dataclass(frozen=True, kw_only=True)
class MlcConfig:
    """The engine config MLC infers for a mode and a device (config.cc EstimateMemoryUsageOnMode)."""

    max_num_sequence: int
    max_total_sequence_length: int
    prefill_chunk_size: int
    max_single_sequence_length: int
    memory_tokens: int           # KV tokens gpu_memory_utilization leaves after params and workspaces


def mlc_memory_tokens(p: MlcParams, dep: Deployment, seqs: int, compiled_chunk: int) -> int:
    """(memory x gpu_memory_utilization - params - temp buffer - workspaces) / KV bytes per token (config.cc)."""
    def kv_bytes(d: Deployment) -> float:
        m, tp = d.model, d.tp
        nq, nkv, hd = m.num_heads / tp, max(1.0, m.num_kv_heads / tp), m.head_dim
        kv_aux = (seqs + 1) * 88 + compiled_chunk * (nq + 1) * 8 + compiled_chunk * hd * (nq + nkv) * 4 + 48 * MIB
        model_ws = compiled_chunk * 4 + seqs * 4 + (compiled_chunk * 2 + seqs) * hd * nq * 2
        logit_ws = seqs * 20 + seqs * m.vocab_size * 16.125
        # ESTIMATE: the compiled prefill's planned temp buffer per chunk token ~ the 16-bit gate/up output plus two
        # hidden-state buffers (TVM's static planner reuses the rest), a few hundred MB at chunk 2048 for 8B models
        # as MLC's "Temporary buffer" log line shows; MLC doubles it "for safety" (config.cc InferForKVCache).
        temp = 2 * compiled_chunk * 2.0 * (2 * m.intermediate_size / tp + 2 * m.hidden_size)
        budget = (p.gpu_memory_utilization * gpu_visible_bytes(d.hardware) - d.weight_bytes_per_device - temp
                  - kv_aux - model_ws - logit_ws)
        per_token = d.kv_bytes_per_token_per_device
        return budget * per_token / (per_token + 1.25)   # +1.25 B of page table per KV token

    tokens = kv_tokens_or_refuse(dep, kv_bytes, engine="mlc",
                                 rule=f"gpu_memory_utilization={p.gpu_memory_utilization} of total memory")
    return min(tokens, METAL_KV_CAP) if dep.hardware.vendor == "apple" else tokens


def mlc_engine_config(p: MlcParams, dep: Deployment) -> MlcConfig:
    ctx = p.max_single_sequence_length or dep.model.max_model_len
    compiled = p.compiled_prefill_chunk_size or min(ctx, 8192)
    seqs = p.max_num_sequence or {"local": min(4, p.max_batch_size), "interactive": 1}.get(p.mode, p.max_batch_size)
    mem = mlc_memory_tokens(p, dep, seqs, compiled)
    total = {"local": min(mem, ctx, 8192), "interactive": min(mem, ctx)}.get(p.mode, min(mem, seqs * ctx))
    total = min(p.max_total_sequence_length, mem) if p.max_total_sequence_length else total
    chunk = p.prefill_chunk_size or (compiled if p.mode == "server" else min(compiled, total, ctx))
    return MlcConfig(max_num_sequence=seqs, max_total_sequence_length=total, prefill_chunk_size=chunk,
                     max_single_sequence_length=ctx, memory_tokens=mem)
