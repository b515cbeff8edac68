"""LMDeploy TurboMind's engine options (TurbomindEngineConfig) and the defaults it derives per device and KV format.
The engine that uses them is engines/lmdeploy.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from simengine.config.dtypes import kv_bytes
from simengine.config.loader import BlockTokens, Checked, Range, Sequences, Tokens
from simengine.engines.memory import Deployment
from simengine.errors import CannotRun, InputError

# utils.py get_max_batch_size: substring of the CUDA device name -> default max_batch_size (others 128)
MAX_BATCH_BY_DEVICE = {"a100": 384, "a800": 384, "h100": 1024, "h800": 1024, "l20y": 1024, "h200": 1024}
KV_BY_QUANT_POLICY = {4: "int4", 8: "int8"}   # messages.py QuantPolicy: 0 = 16-bit, 4 = int4, 8 = int8


@dataclass(frozen=True, kw_only=True)
class LmdeployParams(Checked):
    """TurbomindEngineConfig fields (lmdeploy/messages.py, v0.16.0) plus the stateful-session switch."""

    max_batch_size: Sequences | None = None      # None: A100/A800 384, H100/H800/H200/L20Y 1024, else 128 (utils.py)
    session_len: Tokens | None = None            # None: the model's context length (capped to the KV pool here)
    max_prefill_token_num: Tokens = 8192         # messages.py; forward budget = this + max_batch_size (turbomind.cc)
    max_context_token_num: Tokens | None = None  # None: session_len (engine_config.h); caps the pass's prefill contexts
    # messages.py: fraction of FREE memory after weights (> 1: block count)
    cache_max_entry_count: Annotated[float, Range(0, 1e9, above=True)] = 0.8
    cache_block_seq_len: BlockTokens = 64        # messages.py
    enable_prefix_caching: bool = False          # messages.py
    quant_policy: Literal[0, 4, 8] = 0           # messages.py: KV 16-bit / int4 / int8 (FP8 KV is rejected)
    async_: Literal[0, 1] = 1                    # messages.py; turbomind.cc phases_ = async_ ? 2 : 1
    # lmdeploy's session API: pipeline/engine calls with session_id and sequence_start/sequence_end=False keep
    # a conversation's KV between turns. Off = every turn is a fresh sequence (sequence_start=end=True).
    interactive_sessions: bool = False
    # TurboMind's decode attention kernel, by release (not a knob: validation sets it from the version measured).
    # "decoding" (src/turbomind/kernels/attention/decoding.cu, v0.3.0 on): on sm80+ a thread block computes a KV
    # head's whole group of 4, 5, 6 or 8 query heads and reads its cache once. "decoder_multihead_attention"
    # (kernels/decoder_multihead_attention, v0.1-v0.2.x): at most 4 query heads a block (the 8-head variant is
    # commented out of DispatchDecoderMultiheadAttention), one with an int8 KV cache, so each block of a group
    # re-reads its KV head: Llama-2-70B's groups of 8 read the cache twice a step
    decode_attention_kernel: Literal["decoding", "decoder_multihead_attention"] = "decoding"
    # TurboMind's loop, by release (not a knob either). "unified" (InternLM/lmdeploy PR #775 'Unify prefill & decode
    # passes', first in v0.1.0): one pass a forward over every sequence. "separate" (v0.1.0a1 and before,
    # LlamaBatch::InternalThreadEntry): an iteration admits from the gateway, computes every new sequence's context
    # but its last token in prefill-only passes (ContextDecode: mini-batches of at most max_context_token_num tokens,
    # a sequence whole, the batch's longest context x its size within the same limit), then runs one decode pass in
    # which every sequence computes one token, the new ones their last prompt token (Generate), and admits again
    prefill_passes: Literal["unified", "separate"] = "unified"


def turbomind_decode_kv_reads(p: LmdeployParams, dep: Deployment) -> float:
    """Times TurboMind's decode attention reads each KV head's cache a step (LmdeployParams.decode_attention_kernel):
    the query heads sharing a KV head over the heads one thread block computes."""
    group = max(1, dep.model.num_heads // max(1, dep.model.num_kv_heads))
    if p.decode_attention_kernel == "decoding" or group == 1:
        return 1.0
    per_block = 1 if p.quant_policy else 4 if group % 4 == 0 else 2 if group % 2 == 0 else 1
    return group / per_block


def turbomind_max_batch_size(dep: Deployment) -> int:
    name = dep.hardware.name.lower()
    return next((v for k, v in MAX_BATCH_BY_DEVICE.items() if k in name), 128)


def turbomind_kv(dep: Deployment, quant_policy: int) -> Deployment:
    """The deployment with TurboMind's KV format: quant_policy (or an int8/int4 kv_dtype) sets bytes per token."""
    if dep.kv_dtype == "fp8":
        raise CannotRun("TurboMind has no FP8 KV cache (messages.py accepts quant_policy 0, 4 or 8); use "
                        "kv_dtype int8 or int4, or params.quant_policy", field="deployment.kv_dtype")
    implied = {v: k for k, v in KV_BY_QUANT_POLICY.items()}.get(dep.kv_dtype, 0)
    if quant_policy and implied and quant_policy != implied:
        raise InputError(f"quant_policy {quant_policy} contradicts deployment.kv_dtype {dep.kv_dtype}",
                         field="engines.params.quant_policy")
    name = KV_BY_QUANT_POLICY.get(quant_policy or implied, dep.kv_dtype)
    return dataclasses.replace(dep, kv_dtype=name, kv_elem_bytes=kv_bytes(name))
