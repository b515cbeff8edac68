"""The operators of one forward pass on one device and their work: FLOPs, bytes, kernels, messages.

Both step-time models (the roofline, and measured kernels where tables exist) price this one op list
(docs/cost-model.md):

- linear: the layers' GEMMs (QKV, O, gate/up, down; MoE: the routed experts the step's tokens touch, shared
  experts, router) at the weights' compute dtype;
- lm_head: the output projection for the tokens that need logits;
- attn_prefill: causal attention of the prefill chunks (c tokens after k cached: c (k + c/2) query-key pairs);
- attn_decode: one query per decoding request over its whole context;
- elementwise: norms, residual adds, activation, RoPE and the KV write: memory-bound, one kernel each;
- allreduce: tensor parallelism's two all-reduces of tokens x hidden per layer;
- pp_send: pipeline stage hand-offs.

With attention data parallelism (`attention_dp`) the work is one rank's of a group of tp: attention, the dense
layers and the LM head run whole on the rank's own tokens; each MoE layer gathers the group's tokens to the experts
(1/tp of them per rank) and scatters the sums back, an all-gather and a reduce-scatter that move what one all-reduce
of the group's tokens moves. The ranks are taken to carry equal loads, so the group holds tp x the rank's tokens.

Work here is physics only: no efficiency, no measured time. `roofline.py` and `measured.py` turn it into seconds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simengine.config.dtypes import WeightFormat, resolve_compute_dtype
from simengine.config.hardware import Hardware
from simengine.config.model import ModelSpec

ACT_BYTES = 2.0            # activations are 16-bit in every engine modelled
MMVQ_MAX_BATCH = 8   # ggml-cuda: up to this many tokens a quantized GEMM runs as matrix-vector products (MMVQ)
GEMM_KERNELS_PER_LAYER = 4     # QKV, O, gate/up, down (MoE layers: the grouped expert GEMMs take the MLP's two)
ELEMENTWISE_KERNELS_PER_LAYER = 4  # two norms (+ residual adds), the activation, RoPE with the KV write

# Multi-LoRA serving (engines/lora.py)
ADAPTER_BYTES_PER_PARAM = 2.0   # LoRA weights are 16-bit (vLLM's lora_dtype "auto" follows the model's 16-bit dtype)
# ESTIMATE: a safetensors adapter read from a local NVMe SSD at ~3 GB/s (PCIe Gen4 x4 drives read 5-7 GB/s
# sequentially; file open, parse and pinned staging about halve it) plus ~5 ms to open and parse the file
ADAPTER_DISK_BYTES_S = 3e9
ADAPTER_DISK_LATENCY_S = 5e-3
LORA_KERNELS_PER_MODULE = 2     # Punica's shrink (x A) and expand (x B)
TARGET_MODULES = 4              # qkv_proj, o_proj, gate_up_proj, down_proj (vLLM's packed modules)


def lora_params_per_rank(model: ModelSpec) -> int:
    """Parameters of one rank of an adapter on every target module of every layer: r x (in + out) per module, for
    the attention projections and the dense MLP (MoE experts carry no LoRA here)."""
    h, hd = model.hidden_size, model.head_dim
    qkv_out = (model.num_heads + 2 * model.num_kv_heads) * hd
    per_layer = (h + qkv_out) + (model.num_heads * hd + h)
    if not model.is_moe:
        per_layer += (h + (2 if model.gated_mlp else 1) * model.intermediate_size) + (model.intermediate_size + h)
    return per_layer * model.num_layers




class UnfusedAttention(NamedTuple):
    """Attention as separate kernels (EnginePolicy.unfused_attention): the QK GEMM writes every score to memory,
    the softmax reads and writes them, the PV GEMM reads them."""

    score_bytes: float        # bytes moved per score (query x key x head) by those passes and any conversions
    kernels_per_layer: int    # the kernels one layer's attention takes


class StepWork:
    """Per-device work of one replica of `model` on `tp` x `pp` devices of `hw` (tensor parallel splits every GEMM
    and attention head; pipeline stages run one after another, so a step's time covers all layers), or of one rank
    of an attention-data-parallel group of tp (`attention_dp`, see the module docstring)."""

    def __init__(self, model: ModelSpec, hw: Hardware, *, weight_format: WeightFormat, kv_elem_bytes: float,
                 tp: int = 1, pp: int = 1, expert_parallel: bool = False, attention_dp: bool = False,
                 engine_gemm_flops_s: float | None = None, engine_attention_flops_s: float | None = None,
                 expert_tile_columns: int | None = None, decode_kv_reads: float = 1.0,
                 dequantize_above_tokens: int | None = None, unfused_attention: UnfusedAttention | None = None,
                 layer_kernels: int | None = None):
        m = self.model = model
        # the FLOP/s the engine reaches on these weights' layer GEMMs where its own kernels or its own way of calling
        # the vendor library set it (EnginePolicy.engine_gemm_flops_s); None: the device's peak at its gemm_fraction
        self.engine_gemm_flops_s = engine_gemm_flops_s
        # the same for the attention kernel (EnginePolicy.engine_attention_flops_s: llama.cpp's FlashAttention)
        self.engine_attention_flops_s = engine_attention_flops_s
        # the widest token tile of the engine's grouped expert GEMM, each expert padding its tokens to whole tiles
        # (EnginePolicy.expert_tile_columns: llama.cpp's MMQ); None or a model without experts: no padding
        self.expert_tile_columns = expert_tile_columns if (m.is_moe and tp == 1 and not expert_parallel) else None
        self._expert_padding: dict[int, float] = {}
        # times the engine's decode attention kernel reads each KV head's cache from memory in a step: 1 where a
        # thread block computes every query head of its KV head's group (EnginePolicy.decode_kv_reads)
        self.decode_kv_reads = decode_kv_reads
        # steps over this many tokens first dequantize the layers' quantized weights to 16 bit (a pass reading the
        # stored bytes and writing the copy), and the GEMMs then read the copy (EnginePolicy.dequantize_above_tokens:
        # llama.cpp's cuBLAS path for quantized weights); None: the GEMMs read the stored weights
        self.dequantize_above_tokens = dequantize_above_tokens
        self.dequant_copy_ratio = ACT_BYTES / weight_format.bytes_per_param
        # attention as separate kernels that keep the scores in memory (EnginePolicy.unfused_attention: llama.cpp
        # with FlashAttention off); None: a fused kernel, the scores on chip and only the causal half computed
        self.unfused_attention = unfused_attention
        self.hw, self.tp, self.pp, self.weight_format = hw, tp, pp, weight_format
        self.attention_dp = attention_dp
        # devices a token's attention and dense layers are split over; the group's tokens per rank's token at the
        # experts and in the collectives
        at = self.attention_tp = 1 if attention_dp else tp
        self.group_tokens_per_token = tp if attention_dp else 1
        self.kv_elem_bytes = kv_elem_bytes
        self.compute_dtype = resolve_compute_dtype(weight_format, hw.peak_flops, hw.name)
        # attention and the LM head compute in 16-bit (engines keep the output projection unquantised)
        self.attn_dtype = "bf16" if "bf16" in hw.peak_flops else ("fp16" if "fp16" in hw.peak_flops
                                                                   else self.compute_dtype)
        wb = weight_format.bytes_per_param
        self.dense_weight_bytes = m.dense_linear_params * weight_format.dense_bytes_per_param / at
        self.expert_bytes = m.expert_params * wb / tp   # a TP slice of every expert, or 1/tp of them whole (EP)
        self.lm_head_bytes = m.lm_head_params * weight_format.lm_head_bytes_per_param / at
        self.lm_head_dtype = self.compute_dtype if weight_format.lm_head_bytes_per_param == wb else self.attn_dtype
        # (with attention DP a rank computes, for the group's tokens routed to its experts, as many expert-token
        # pairs as its own tokens bring when the ranks are balanced)
        self.linear_flops_per_token = 2.0 * m.active_linear_params / at
        self.lm_head_flops_per_token = 2.0 * m.lm_head_params / at
        # elementwise traffic per token per layer: two norms (+ residual) read and write the hidden state (4 x 2h),
        # the gated activation reads 2 x width and writes width, RoPE reads and writes Q and K
        mlp_width = (m.experts_per_token * m.expert_params / 3 / m.hidden_size if m.is_moe
                     else m.intermediate_size) / at
        qk_width = (m.num_heads + m.num_kv_heads) * m.qk_head_dim / at
        self.elementwise_bytes_per_token = ACT_BYTES * m.num_layers * (8 * m.hidden_size + 3 * mlp_width
                                                                       + 2 * qk_width)
        kv_heads_per_device = max(1.0, m.num_kv_heads / at)
        self.kv_bytes_layer = m.kv_bytes_per_token_layer(kv_elem_bytes) * (
            1.0 if m.kv_latent_dim else kv_heads_per_device / m.num_kv_heads)
        self.kv_write_bytes_per_token = self.kv_bytes_layer * m.num_layers
        self.attn_flops_per_pair = 2.0 * m.num_heads * (m.qk_head_dim + m.v_head_dim) / at
        self.full_layers, self.sliding_layers, self.window = (m.num_full_attention_layers, m.num_sliding_layers,
                                                              m.sliding_window)
        # kernels of the token-count ops (each attention op and the LM head count their own): `layer_kernels` a layer
        # where the engine's graph runs them unfused (EnginePolicy.layer_kernels: llama.cpp's ggml graph), else the
        # fused layer's (MoE layers add the router's GEMM and, with a shared expert, its two)
        per_layer = layer_kernels or GEMM_KERNELS_PER_LAYER + ELEMENTWISE_KERNELS_PER_LAYER
        self.token_kernels = (m.num_layers * per_layer
                              + m.num_moe_layers * (1 + (2 if m.shared_expert_params_per_moe_layer else 0)))
        # communication
        self.allreduce_bytes_per_token = ACT_BYTES * m.hidden_size
        self.num_allreduce = 2 * m.num_layers if tp > 1 else 0
        # expert parallelism under tensor-parallel attention keeps both all-reduces: every rank holds every token
        # after attention's, computes the tokens routed to its own experts, and the MoE layer's all-reduce sums the
        # ranks' parts (vLLM FusedMoE without data parallelism, SGLang's default MoE backend, TensorRT-LLM without
        # attention DP: no all-to-all)
        if attention_dp:   # each MoE layer's gather and scatter of the group's tokens: one all-reduce's bytes
            self.num_allreduce = m.num_moe_layers
        self.ring_factor = 2.0 * (tp - 1) / tp if tp > 1 else 0.0
        self.expert_parallel = expert_parallel or attention_dp

    # ---- ops that depend only on the step's token count ----------------------------------------------------
    def experts_touched(self, tokens):
        """Expected distinct routed experts per MoE layer for `tokens` tokens (uniform routing; with attention DP the
        group's tokens reach every rank's experts); arrays too."""
        m = self.model
        group = tokens * self.group_tokens_per_token
        return m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** group)

    def stored_weight_bytes(self, tokens):
        """Stored bytes of the layer weights a step of `tokens` tokens reads: the dense ones and the experts it
        touches."""
        weight_bytes = self.dense_weight_bytes + 0.0 * tokens
        if self.model.num_experts:
            weight_bytes = weight_bytes + self.model.num_moe_layers * self.experts_touched(tokens) * self.expert_bytes
        return weight_bytes

    def linear(self, tokens):
        """(FLOPs, bytes) of the layers' GEMMs for `tokens` tokens: weights read once (their 16-bit copy in a step
        that dequantizes), FLOPs per token (and the padding of an engine whose expert GEMM computes whole tiles:
        `padded_expert_tokens`)."""
        weight_bytes = self.stored_weight_bytes(tokens)
        flops = tokens * self.linear_flops_per_token
        if self.expert_tile_columns:
            m = self.model
            padding = (np.fromiter(map(self.padded_expert_tokens, np.ravel(tokens).tolist()), float)
                       .reshape(np.shape(tokens)) if np.ndim(tokens) else self.padded_expert_tokens(tokens))
            flops = flops + m.num_moe_layers * 2.0 * m.expert_params * padding
        if self.dequantize_above_tokens is not None:
            weight_bytes = weight_bytes * np.where(tokens > self.dequantize_above_tokens, self.dequant_copy_ratio, 1.0)
        return flops, weight_bytes

    def dequant_bytes(self, tokens):
        """Bytes the dequantization pass of a step of `tokens` tokens moves: the stored weights read and their
        16-bit copy written (none where the GEMMs read the stored weights)."""
        if self.dequantize_above_tokens is None:
            return 0.0
        return (self.stored_weight_bytes(tokens) * (1.0 + self.dequant_copy_ratio)
                * (tokens > self.dequantize_above_tokens))

    def padded_expert_tokens(self, tokens: float) -> float:
        """Token columns an expert GEMM computes beyond its tokens in a step of `tokens` tokens, over one MoE layer's
        experts (expected, uniform routing): llama.cpp's MMQ takes a tile width mmq_x from the step's token count
        (ggml-cuda/mmq.cuh mul_mat_q_case: the multiple of 8 up to the widest with the fewest tiles over all tokens,
        16 from 48 on) and each expert computes its own tokens in whole tiles of it (the MoE path of
        ggml-org/llama.cpp PR #13199); up to 8 tokens its matrix-vector kernel (MMVQ) pads nothing."""
        tokens = int(tokens)
        cached = self._expert_padding.get(tokens)
        if cached is not None:
            return cached
        m, widest = self.model, self.expert_tile_columns
        pad = 0.0
        if widest and tokens > MMVQ_MAX_BATCH:
            best, tile = tokens + 1, 8
            for width in range(8, widest + 1, 8):
                if width >= 48 and width % 16:
                    continue
                tiles = -(-tokens // width)
                if tiles < best:
                    best, tile = tiles, width
                if best == 1:
                    break
            # an expert's tokens X ~ Binomial(tokens x k, 1/E); E[tiles] = sum over j of P(X > j x tile)
            n, p = tokens * m.experts_per_token, 1.0 / m.num_experts
            x = np.arange(n + 1)
            log_choose = np.concatenate(([0.0], np.cumsum(np.log(n - x[1:] + 1) - np.log(x[1:]))))
            log_pmf = log_choose + x * np.log(p) + (n - x) * np.log1p(-p)
            survival = 1.0 - np.cumsum(np.exp(log_pmf))    # P(X > x)
            tiles_expected = float(np.clip(survival[0:n + 1:tile], 0.0, 1.0).sum())
            pad = m.num_experts * tile * tiles_expected - n
        self._expert_padding[tokens] = pad
        return pad

    def elementwise_bytes(self, tokens):
        """Bytes of the memory-bound kernels beside the GEMMs and attention: norms, activation, RoPE, the KV write
        and any dequantization pass."""
        return tokens * (self.elementwise_bytes_per_token + self.kv_write_bytes_per_token) + self.dequant_bytes(tokens)

    def lm_head(self, logits):
        """(FLOPs, bytes) of the output projection for `logits` tokens (nothing when none needs logits)."""
        return logits * self.lm_head_flops_per_token, self.lm_head_bytes * (logits > 0)

    # ---- attention ------------------------------------------------------------------------------------------
    @staticmethod
    def prefill_pairs(chunks: list[tuple[int, int]]) -> tuple[float, float]:
        """(query-key pairs, KV tokens read) of causal attention over the prefill chunks (c new tokens after k
        cached each) in one full-attention layer."""
        pairs = read = 0.0
        for c, k in chunks:
            pairs += c * (k + c / 2.0)
            read += k + c
        return pairs, read

    def sliding_pairs(self, chunks: list[tuple[int, int]]) -> float:
        """Query-key pairs of the chunks in one sliding-window layer (each query sees at most the window)."""
        w = self.window
        return sum(c * min(k + c / 2.0, w) for c, k in chunks)

    def prefill_attention(self, chunks: list[tuple[int, int]]) -> tuple[float, float]:
        """(FLOPs, bytes) of causal attention over the prefill chunks, all layers (unfused: every query against
        every key its chunk sees, the mask applied after)."""
        if self.unfused_attention is not None:
            layers = self.full_layers + self.sliding_layers
            return (self.unfused_scores(chunks) * self.attn_flops_per_pair * layers,
                    float(sum([k + c for c, k in chunks])) * self.kv_bytes_layer * layers)
        pairs, read = self.prefill_pairs(chunks)
        flops = pairs * self.attn_flops_per_pair * self.full_layers
        nbytes = read * self.kv_bytes_layer * self.full_layers
        if self.sliding_layers:
            sl_read = sum(min(k + c, self.window) for c, k in chunks)
            flops += self.sliding_pairs(chunks) * self.attn_flops_per_pair * self.sliding_layers
            nbytes += sl_read * self.kv_bytes_layer * self.sliding_layers
        return flops, nbytes

    @staticmethod
    def unfused_scores(chunks: list[tuple[int, int]]) -> float:
        """Query-key pairs an unfused attention scores over the prefill chunks in one layer: each new token against
        its chunk's whole context (the cached keys and the chunk)."""
        return float(sum([c * (k + c) for c, k in chunks]))

    def score_bytes(self, pairs):
        """Bytes the unfused attention's score passes move for `pairs` query-key pairs a layer, all layers and the
        device's heads (zero for a fused kernel); arrays too."""
        u = self.unfused_attention
        if u is None:
            return 0.0 * pairs
        heads = self.model.num_heads / self.attention_tp
        return pairs * heads * u.score_bytes * self.model.num_layers

    def decode_attention(self, num_decode, context_tokens):
        """(FLOPs, bytes) of decode attention: `num_decode` queries over `context_tokens` cached tokens in all
        (sliding-window layers read at most their window of each request's mean context), the KV read
        `decode_kv_reads` times; arrays too."""
        flops = context_tokens * self.attn_flops_per_pair * self.full_layers
        nbytes = context_tokens * self.kv_bytes_layer * self.full_layers
        if self.sliding_layers:
            mean_ctx = context_tokens / np.maximum(num_decode, 1)
            read = num_decode * np.minimum(self.window, mean_ctx)
            flops = flops + read * self.attn_flops_per_pair * self.sliding_layers
            nbytes = nbytes + read * self.kv_bytes_layer * self.sliding_layers
        return flops, nbytes * self.decode_kv_reads

    # ---- communication --------------------------------------------------------------------------------------
    def allreduce_bytes(self, tokens):
        """Bytes one tensor-parallel all-reduce moves per device over the ring: 2 (tp-1)/tp x tokens x hidden (the
        group's tokens with attention DP)."""
        return self.ring_factor * tokens * self.group_tokens_per_token * self.allreduce_bytes_per_token
