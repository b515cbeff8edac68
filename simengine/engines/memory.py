"""Memory sizing shared by the engines' rules: weights per device, activation reserve, KV bytes per token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from simengine.config.dtypes import WeightFormat
from simengine.config.hardware import Hardware
from simengine.config.model import ModelSpec
from simengine.errors import CannotRun

GIB = 2**30
# Memory the CUDA context, NCCL and allocator fragmentation take outside an engine's pools, for the engines whose
# startup accounting has not been read from their logs (TGI, TensorRT-LLM, LMDeploy, the baselines). ESTIMATE: 0.3-1.5
# GiB in vLLM's and SGLang's logs on H100 (vLLM and SGLang size their own: vllm_config.py, sglang_config.py).
NON_TORCH_BYTES = 0.75 * GIB
MIN_KV_TOKENS = 16   # a deployment whose engine rule leaves KV room for fewer tokens is refused


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """What runs where: one replica of `model` on tp x pp devices of `hardware`."""

    model: ModelSpec
    hardware: Hardware
    weight_format: WeightFormat
    kv_dtype: str
    kv_elem_bytes: float
    tp: int = 1
    pp: int = 1
    expert_parallel: bool = False  # routed experts placed whole on devices (EP = tp) rather than TP-sliced
    # attention data parallelism (docs/cluster.md 'Attention data parallelism'): this replica is one of the tp
    # ranks of a group; it attends over its own requests with every head, holds the attention and dense weights
    # whole and 1/tp of the routed experts, which are spread over the group (EP = tp)
    attention_dp: bool = False
    # a speculative proposer's weights and KV per token beside the target's (engines/speculative.py with_proposer)
    proposer_weight_bytes_per_device: float = 0.0
    proposer_kv_bytes_per_token_per_device: float = 0.0
    adapter_weight_bytes_per_device: float = 0.0   # LoRA adapter slots an engine reserves (engines/lora.py)

    @property
    def attention_tp(self) -> int:
        """Devices one request's attention (and the dense layers) is split over: 1 with attention DP, else tp."""
        return 1 if self.attention_dp else self.tp

    @property
    def num_devices(self) -> int:
        """Devices of one replica (one scheduler and its KV cache)."""
        return self.attention_tp * self.pp

    @property
    def weight_bytes_per_device(self) -> float:
        rest, experts = self.model.stored_bytes(self.weight_format)
        if self.attention_dp:   # everything but the routed experts whole on each rank, the experts spread over tp
            per_device = (rest + experts / self.tp) / self.pp
        else:
            per_device = (rest + experts) / self.num_devices
        return per_device + self.proposer_weight_bytes_per_device + self.adapter_weight_bytes_per_device

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        """KV heads are split by tp (replicated when tp exceeds them; whole with attention DP), layers by pp."""
        m = self.model
        per_token = m.kv_bytes_per_token(self.kv_elem_bytes)
        if m.kv_latent_dim:  # MLA's latent is replicated across tp ranks
            return per_token / self.pp + self.proposer_kv_bytes_per_token_per_device
        heads_per_device = max(1.0, m.num_kv_heads / self.attention_tp)
        return per_token * heads_per_device / m.num_kv_heads / self.pp + self.proposer_kv_bytes_per_token_per_device


def forward_activation_bytes(dep: Deployment, tokens: int) -> float:
    """ESTIMATE of a dummy forward's peak activations per device: MLP gate/up output and activation, hidden states."""
    m = dep.model
    return tokens * 2.0 * (3 * m.intermediate_size / dep.attention_tp + 6 * m.hidden_size)


def logits_bytes(dep: Deployment, rows: int) -> float:
    """fp32 logits over the whole vocabulary for `rows` sequences."""
    return 4.0 * rows * dep.model.vocab_size


def activation_reserve_bytes(dep: Deployment, max_tokens_per_step: int, max_seqs: int) -> float:
    """ESTIMATE of a profiling forward's peak per device: its activations and one copy of its rows' logits."""
    rows = min(max_seqs, max_tokens_per_step)
    return forward_activation_bytes(dep, max_tokens_per_step) + logits_bytes(dep, rows) / dep.attention_tp


def kv_tokens(dep: Deployment, kv_bytes: float) -> int:
    """KV tokens per replica that `kv_bytes` per device hold."""
    return int(kv_bytes // dep.kv_bytes_per_token_per_device) if kv_bytes > 0 else 0


def kv_tokens_or_refuse(dep: Deployment, kv_bytes_of: Callable[[Deployment], float], *, engine: str,
                        rule: str) -> int:
    """KV token capacity per replica from the bytes an engine's rule (`kv_bytes_of` a deployment) leaves;
    CannotRun, with the tp the same rule would accept, if it leaves room for too few tokens."""
    kv_bytes = kv_bytes_of(dep)
    tokens = kv_tokens(dep, kv_bytes)
    if tokens < MIN_KV_TOKENS:
        hw, m = dep.hardware, dep.model
        need = dep.weight_bytes_per_device / GIB
        have = hw.memory_bytes / GIB
        raise CannotRun(
            f"{m.name} does not fit on {hw.name} with {engine}: weights {need:.1f} GiB per device of "
            f"{have:.1f} GiB, leaving {max(kv_bytes, 0) / GIB:.2f} GiB for KV under {rule}; "
            f"{_what_fits(dep, kv_bytes_of)}", field="deployment")
    return tokens


def _what_fits(dep: Deployment, kv_bytes_of: Callable[[Deployment], float]) -> str:
    """The fix for weights that leave no KV room: the smallest wider tensor parallelism of the node under which the
    engine's rule leaves room, or that none does."""
    m, hw = dep.model, dep.hardware
    most = hw.node_size // dep.pp if hw.link_bandwidth_bytes_s > 0 else 1
    for tp in range(dep.tp + 1, most + 1):
        if m.num_heads % tp:   # config/scenario resolve_deployment: tp must divide the attention heads
            continue
        wider = dataclasses.replace(dep, tp=tp)
        if kv_tokens(wider, kv_bytes_of(wider)) >= MIN_KV_TOKENS:
            return f"use tp={tp}, a smaller weight_dtype (e.g. fp8 or int4) or a device with more memory"
    total = sum(m.stored_bytes(dep.weight_format)) / GIB
    return (f"no tp up to {most} ({hw.name}'s node of {hw.node_size}) leaves room for KV beside its {total:.0f} GiB "
            f"of weights: use a smaller weight_dtype (e.g. fp8 or int4) or a device with more memory")
