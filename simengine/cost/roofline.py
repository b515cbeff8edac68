"""Roofline step time: each part of a forward pass is bound by compute or by memory, plus comm and overhead.

See ../shared/reference/cost-model.md for the physics. Efficiency terms are named and come from the
hardware YAML (`efficiency.gemm_fraction`, `efficiency.memory_bandwidth_fraction`); nothing per-row.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simengine.config.dtypes import WeightFormat, resolve_compute_dtype
from simengine.config.hardware import Hardware
from simengine.config.model import ModelSpec
from simengine.core.batch import BatchShape
from simengine.cost.timing import EngineTiming

ACT_BYTES = 2.0  # activations are 16-bit in every engine modelled


class StepCost(NamedTuple):
    """Seconds for one step and where they went (compute-bound, memory-bound, communication, overhead)."""

    seconds: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float


class RooflineCost:
    """Step time for one replica of `model` on `tp` x `pp` devices of `hw`."""

    def __init__(self, model: ModelSpec, hw: Hardware, *, weight_format: WeightFormat, kv_elem_bytes: float,
                 tp: int = 1, pp: int = 1, timing: EngineTiming, grammar_mask_s: float = 0.0,
                 expert_parallel: bool = False):
        self.model, self.hw, self.timing = model, hw, timing
        self.grammar_mask_s = grammar_mask_s  # host time per structured-output token (the backend's mask cost)
        self.tp, self.pp = tp, pp
        compute_dtype = resolve_compute_dtype(weight_format, hw.peak_flops, hw.name)
        attn_dtype = "bf16" if "bf16" in hw.peak_flops else ("fp16" if "fp16" in hw.peak_flops else compute_dtype)
        shards = tp  # per-device work: tensor parallel splits every GEMM; pipeline stages run in sequence
        self.linear_flops_s = hw.peak(compute_dtype) * hw.gemm_fraction * shards
        self.attn_flops_s = hw.peak(attn_dtype) * hw.gemm_fraction * shards
        self.bytes_s = hw.memory_bandwidth_bytes_s * hw.memory_bandwidth_fraction * shards
        m = model
        wb = weight_format.bytes_per_param
        self.dense_weight_bytes = m.dense_linear_params * wb
        self.expert_bytes = m.expert_params * wb
        self.lm_head_bytes = m.lm_head_params * wb
        self.active_linear_flops_per_token = 2.0 * m.active_linear_params
        self.lm_head_flops_per_token = 2.0 * m.lm_head_params
        self.act_bytes_per_token = ACT_BYTES * m.num_layers * 4 * m.hidden_size  # in/out of attn and MLP blocks
        # attention: QK^T and PV per query token per cached token, summed over heads, per layer
        self.attn_flops_per_pair = 2.0 * m.num_heads * (m.qk_head_dim + m.v_head_dim)
        self.kv_bytes_layer = m.kv_bytes_per_token_layer(kv_elem_bytes)
        self.full_layers = m.num_full_attention_layers
        self.sliding_layers = m.num_sliding_layers
        self.window = m.sliding_window
        self.allreduce_bytes_per_token = ACT_BYTES * m.hidden_size
        self.num_allreduce = 2 * m.num_layers if tp > 1 else 0
        # Expert parallelism: each MoE layer's all-reduce becomes an all-to-all dispatch + combine of every
        # token's top-k hidden states, (ep-1)/ep of them leaving the device (DeepSpeed-MoE / vLLM EP design).
        self.num_all_to_all = 2 * m.num_moe_layers if (expert_parallel and tp > 1) else 0
        if self.num_all_to_all:
            self.num_allreduce -= m.num_moe_layers
        self.a2a_bytes_per_token = ACT_BYTES * m.hidden_size * m.experts_per_token * (tp - 1) / tp
        self.ring_factor = 2.0 * (tp - 1) / tp if tp > 1 else 0.0
        self.launch_s = timing.kernel_launch_s * timing.kernels_per_layer * m.num_layers
        # engine terms (cost/calibrated.py): software latency of one all-reduce's 2(tp-1) ring hops, achieved link
        # bandwidth, and a fixed latency per layer per step
        self.allreduce_call_s = hw.link_latency_s + 2 * (tp - 1) * timing.allreduce_hop_latency_s
        self.allreduce_link_bytes_s = hw.link_bandwidth_bytes_s * timing.allreduce_bandwidth_fraction
        self.layers_latency_s = m.num_layers * timing.layer_latency_s
        # per-step constants of `step`, summed in its order
        self.step_weight_bytes = self.dense_weight_bytes + self.lm_head_bytes  # read once a step, MoE experts apart
        self.any_comm = bool(self.num_allreduce or self.num_all_to_all or pp > 1)
        self.moe = bool(m.num_experts)

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts per MoE layer for `tokens` tokens (uniform routing)."""
        m = self.model
        if not m.num_experts or tokens <= 0:
            return 0.0
        return m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens)

    def step(self, shape: BatchShape) -> StepCost:
        """Price one forward pass."""
        # attention: prefill chunks are compute-heavy, decodes read every cached token's KV
        prefill = 0
        chunks = shape.prefill_chunks
        pairs = kv_tokens_read = float(shape.decode_context_tokens)
        for c, k in chunks:
            prefill += c
            pairs += c * (k + c / 2.0)
            kv_tokens_read += k + c
        num_decode = shape.num_decode
        tokens = prefill + (shape.padded_decode if shape.padded_decode > num_decode else num_decode)
        lin_mem, lin_cmp = self._linear_s(tokens, shape.num_logits)
        bytes_s = self.bytes_s
        attn_bytes = kv_tokens_read * self.kv_bytes_layer * self.full_layers
        attn_flops = pairs * self.attn_flops_per_pair * self.full_layers
        if self.sliding_layers:
            w = self.window
            mean_ctx = shape.decode_context_tokens / max(num_decode, 1)
            sl_pairs = sum(c * min(k + c / 2.0, w) for c, k in chunks)
            sl_pairs += num_decode * min(w, mean_ctx)
            sl_read = sum(min(k + c, w) for c, k in chunks) + num_decode * min(w, mean_ctx)
            attn_flops += sl_pairs * self.attn_flops_per_pair * self.sliding_layers
            attn_bytes += sl_read * self.kv_bytes_layer * self.sliding_layers
        att_cmp = attn_flops / self.attn_flops_s
        att_mem = attn_bytes / bytes_s
        compute_s = (lin_cmp if lin_cmp >= lin_mem else 0.0) + (att_cmp if att_cmp >= att_mem else 0.0)
        memory_s = (lin_mem if lin_mem > lin_cmp else 0.0) + (att_mem if att_mem > att_cmp else 0.0)
        comm_s = self._comm_s(tokens) if self.any_comm else 0.0
        t = self.timing
        gpu_s = compute_s + memory_s + comm_s + self.layers_latency_s
        # CUDA graph: one replay launch; eager: the host enqueues kernels ahead of the GPU, the longer one wins
        gpu_total = gpu_s + t.graph_replay_s if shape.cuda_graph else max(gpu_s, self.launch_s)
        host_extra_s = t.seq_cpu_s * (num_decode + len(chunks)) + shape.num_structured * self.grammar_mask_s
        seconds = gpu_total + t.exposed_host_s(gpu_total, host_extra_s)
        return StepCost(seconds, compute_s, memory_s, comm_s, seconds - compute_s - memory_s - comm_s)

    def decode_steps(self, shape: BatchShape, contexts: np.ndarray) -> np.ndarray:
        """`step` of decode-only copies of `shape` whose decodes read `contexts[i]` tokens in all (the repeats of a
        decode step), in one numpy pass: one row (seconds, compute_s, memory_s, comm_s, overhead_s) per context, bit
        for bit `step`'s (the same operations in the same order; tests/test_cost_roofline.py)."""
        if shape.prefill_chunks:
            raise ValueError("decode_steps prices decode-only shapes")
        num_decode = shape.num_decode
        tokens = shape.padded_decode if shape.padded_decode > num_decode else num_decode
        lin_mem, lin_cmp = self._linear_s(tokens, shape.num_logits)
        bytes_s = self.bytes_s
        ctx = contexts.astype(np.float64)
        attn_bytes = ctx * self.kv_bytes_layer * self.full_layers
        attn_flops = ctx * self.attn_flops_per_pair * self.full_layers
        if self.sliding_layers:
            read = num_decode * np.minimum(self.window, contexts / max(num_decode, 1))
            attn_flops += read * self.attn_flops_per_pair * self.sliding_layers
            attn_bytes += read * self.kv_bytes_layer * self.sliding_layers
        att_cmp = attn_flops / self.attn_flops_s
        att_mem = attn_bytes / bytes_s
        out = np.empty((len(contexts), 5))
        compute_s = out[:, 1] = (lin_cmp if lin_cmp >= lin_mem else 0.0) + np.where(att_cmp >= att_mem, att_cmp, 0.0)
        memory_s = out[:, 2] = (lin_mem if lin_mem > lin_cmp else 0.0) + np.where(att_mem > att_cmp, att_mem, 0.0)
        comm_s = out[:, 3] = self._comm_s(tokens) if self.any_comm else 0.0
        t = self.timing
        gpu_s = compute_s + memory_s + comm_s + self.layers_latency_s
        gpu_total = gpu_s + t.graph_replay_s if shape.cuda_graph else np.maximum(gpu_s, self.launch_s)
        host_extra_s = t.seq_cpu_s * num_decode + shape.num_structured * self.grammar_mask_s
        seconds = out[:, 0] = gpu_total + t.exposed_host_s(gpu_total, host_extra_s)
        out[:, 4] = seconds - compute_s - memory_s - comm_s
        return out

    def _linear_s(self, tokens: int, num_logits: int) -> tuple[float, float]:
        """Linear layers and LM head of one step, (memory-bound s, compute-bound s): the weights are read once a step
        (MoE: the experts `tokens` tokens touch), the FLOPs are per token."""
        weight_bytes = self.step_weight_bytes
        if self.moe:
            weight_bytes += self.model.num_moe_layers * self.experts_touched(tokens) * self.expert_bytes
        return ((weight_bytes + tokens * self.act_bytes_per_token) / self.bytes_s,
                (tokens * self.active_linear_flops_per_token + num_logits * self.lm_head_flops_per_token)
                / self.linear_flops_s)

    def _comm_s(self, tokens: int) -> float:
        """Communication of one step: tensor-parallel all-reduces, expert-parallel all-to-alls, pipeline sends."""
        comm_s = 0.0
        if self.num_allreduce:
            comm_s = self.num_allreduce * (self.allreduce_call_s + self.ring_factor * tokens
                                           * self.allreduce_bytes_per_token / self.allreduce_link_bytes_s)
        if self.num_all_to_all:
            comm_s += self.num_all_to_all * (self.hw.link_latency_s + tokens * self.a2a_bytes_per_token
                                             / self.hw.link_bandwidth_bytes_s)
        if self.pp > 1:
            comm_s += (self.pp - 1) * (self.hw.link_latency_s
                                       + tokens * self.allreduce_bytes_per_token / self.hw.link_bandwidth_bytes_s)
        return comm_s
