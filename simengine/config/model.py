"""Model shapes from HuggingFace config.json: parameter counts, weight and KV bytes derived, never typed in."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simengine.config.dtypes import WeightFormat
from simengine.config.hardware import REPO_ROOT
from simengine.errors import InputError, unknown_name

MODELS_DIR = REPO_ROOT / "models"
MAX_DIM = 100_000_000  # any one shape field (vocab 256k, context 10M, width 32k): above this it is a typo


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape. Parameter counts are per whole model (tp=1)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int              # per-head dim of K (and V for non-MLA)
    qk_head_dim: int           # per-head dim of the Q.K product (MLA: nope + rope)
    v_head_dim: int
    intermediate_size: int     # dense MLP width
    gated_mlp: bool            # SwiGLU (3 matrices) vs GELU MLP (2 matrices, BLOOM)
    vocab_size: int
    max_model_len: int
    tie_word_embeddings: bool
    kv_latent_dim: int = 0     # MLA: kv_lora_rank + qk_rope_head_dim stored per token per layer
    attn_params_per_layer: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0     # one routed expert's params in one layer
    num_moe_layers: int = 0
    shared_expert_params_per_moe_layer: int = 0
    router_params_per_moe_layer: int = 0
    sliding_window: int = 0
    num_sliding_layers: int = 0

    # ---- derived counts -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_dense_mlp_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Params of the output projection (shared with the embedding when tied; it is still a GEMM)."""
        return self.vocab_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def dense_linear_params(self) -> int:
        """Linear params every token passes through (attention, dense MLPs, shared experts, routers)."""
        moe_fixed = self.shared_expert_params_per_moe_layer + self.router_params_per_moe_layer
        return (self.num_layers * self.attn_params_per_layer
                + self.num_dense_mlp_layers * self.dense_mlp_params
                + self.num_moe_layers * moe_fixed)

    @property
    def routed_expert_params_total(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        lm = 0 if self.tie_word_embeddings else self.lm_head_params
        return (self.embedding_params + lm + self.norm_params + self.dense_linear_params
                + self.routed_expert_params_total)

    def stored_bytes(self, fmt: WeightFormat) -> tuple[float, float]:
        """(bytes of everything but the routed experts, bytes of the routed experts) as a checkpoint of `fmt` stores
        them: the embedding, LM head and non-expert layers at the format's own bytes for each, norms in 16 bit."""
        lm = 0 if self.tie_word_embeddings else self.lm_head_params
        rest = (self.embedding_params * fmt.embedding_bytes_per_param + lm * fmt.lm_head_bytes_per_param
                + self.norm_params * 2.0 + self.dense_linear_params * fmt.dense_bytes_per_param)
        return rest, self.routed_expert_params_total * fmt.bytes_per_param

    @property
    def active_params(self) -> int:
        """Params one token touches (embedding row excluded from FLOPs but counted as published)."""
        lm = 0 if self.tie_word_embeddings else self.lm_head_params
        routed = self.num_moe_layers * self.experts_per_token * self.expert_params
        return self.embedding_params + lm + self.norm_params + self.dense_linear_params + routed

    @property
    def active_linear_params(self) -> int:
        """Linear params multiplied per token in the layers (no embedding, no LM head): FLOPs = 2x this."""
        return self.dense_linear_params + self.num_moe_layers * self.experts_per_token * self.expert_params

    @property
    def num_full_attention_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    def kv_bytes_per_token_layer(self, kv_elem_bytes: float) -> float:
        """KV bytes one token stores in one attention layer (K and V, or MLA's latent)."""
        if self.kv_latent_dim:
            return self.kv_latent_dim * kv_elem_bytes
        return 2 * self.num_kv_heads * self.head_dim * kv_elem_bytes

    def kv_bytes_per_token(self, kv_elem_bytes: float) -> float:
        """KV bytes per cached token across full-attention layers (sliding layers hold only their window)."""
        return self.num_full_attention_layers * self.kv_bytes_per_token_layer(kv_elem_bytes)


def _get(cfg: dict, *names: str, default: Any = None, required: bool = True, source: str = "") -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if required and default is None:
        raise InputError(f"config.json lacks '{names[0]}' (needed to derive the model shape)", source=source,
                         field=names[0])
    return default


def _positive_int(value: Any, field: str, source: str, *, minimum: int = 1) -> int:
    """A whole number >= minimum (JSON 4096.0 is accepted as 4096); anything else names the field."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InputError(f"must be {need}, got {value!r}", source=source, field=field)
    if value > MAX_DIM:
        raise InputError(f"{value} is beyond any model's shape (limit {MAX_DIM:g}); is it a typo?", source=source,
                         field=field)
    return value


def model_from_config(cfg: dict, *, name: str, source: str) -> ModelSpec:
    """Derive a ModelSpec from a HuggingFace config.json mapping (InputError naming the field on bad values)."""
    try:
        return _model_from_config(cfg, name=name, source=source)
    except InputError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:  # a field of an odd type
        raise InputError(f"cannot derive the model shape ({exc.__class__.__name__}: {exc}); check the field types "
                         "against the model's HuggingFace config.json", source=source) from None


# Defaults of the transformers config classes for keys a checkpoint's config.json may leave out: transformers
# writes a multimodal model's text_config as a diff against its class defaults, so google/gemma-3-*-it's text_config
# has no vocab_size, head_dim, max_position_embeddings or tie flag (and gemma-3-4b-it's none of its head counts, which
# equal the defaults, 8 and 4). Only the keys that change the derived shape are listed (values from transformers'
# Gemma2Config / Gemma3TextConfig / Llama4TextConfig).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True, "sliding_window_pattern": 2},  # even layers slide, odd ones are global
    "gemma3_text": {"tie_word_embeddings": True, "vocab_size": 262208, "head_dim": 256,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                    "sliding_window": 4096, "sliding_window_pattern": 6},
    "llama4_text": {"tie_word_embeddings": False, "no_rope_layer_interval": 4},
}
# Families with an always-on shared expert of the routed experts' width but no config key counting it.
_IMPLICIT_SHARED_EXPERTS = {"llama4_text": 1}


def _windowed_layers(cfg: dict, layers: int, model_type: str, source: str) -> tuple[int, int]:
    """(window, number of layers attending only within it): sliding-window or chunked-attention layers.

    Sources, first found wins: `layer_types` (gpt-oss, newer Gemma/Llama 4 files; 'chunked_attention' layers keep
    at most `attention_chunk_size` tokens); Llama 4's `attention_chunk_size` with `no_rope_layers` (1 = a RoPE layer
    with chunked attention, 0 = a global NoPE layer; empty or absent: every `no_rope_layer_interval`-th layer is
    global); a `sliding_window_pattern` (Gemma 3: 6 = five sliding layers, then a global one; Gemma 2: 2). Chunked
    attention is stored as a window of the chunk size: a token never needs more cached keys than that."""
    layer_types = cfg.get("layer_types") or []
    sliding = _positive_int(cfg.get("sliding_window") or 0, "sliding_window", source, minimum=0)
    chunk = _positive_int(cfg.get("attention_chunk_size") or 0, "attention_chunk_size", source, minimum=0)
    if layer_types:
        n_sliding = sum(1 for t in layer_types if t == "sliding_attention") if sliding else 0
        n_chunked = sum(1 for t in layer_types if t == "chunked_attention") if chunk else 0
        if n_chunked:
            return chunk, n_chunked
        return (sliding, n_sliding) if n_sliding else (0, 0)
    if chunk and model_type == "llama4_text":
        rope_layers = cfg.get("no_rope_layers") or []
        if not rope_layers:
            interval = _positive_int(cfg.get("no_rope_layer_interval"), "no_rope_layer_interval", source)
            rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
        return chunk, sum(1 for flag in rope_layers[:layers] if flag)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
    if sliding and pattern:
        pattern = _positive_int(pattern, "sliding_window_pattern", source)
        return sliding, sum(1 for i in range(layers) if (i + 1) % pattern)
    return 0, 0


def _model_from_config(cfg: dict, *, name: str, source: str) -> ModelSpec:
    if not isinstance(cfg, dict):
        raise InputError("config.json must be a JSON object", source=source)
    outer: dict = {}
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers keep the LM here
        outer, cfg = cfg, cfg["text_config"]
        if not isinstance(cfg, dict):
            raise InputError("must be a JSON object holding the language model's config", source=source,
                             field="text_config")
    model_type = str(cfg.get("model_type", "unknown"))
    defaults = _FAMILY_DEFAULTS.get(model_type)
    if defaults:
        cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
    if outer.get("tie_word_embeddings") is not None and outer["text_config"].get("tie_word_embeddings") is None:
        cfg = {**cfg, "tie_word_embeddings": outer["tie_word_embeddings"]}  # the wrapper's flag, unless the LM sets one
    g = functools.partial(_get, cfg, source=source)
    h = _positive_int(g("hidden_size", "n_embed", "d_model"), "hidden_size", source)
    layers = _positive_int(g("num_hidden_layers", "n_layer", "num_layers"), "num_hidden_layers", source)
    heads = _positive_int(g("num_attention_heads", "n_head"), "num_attention_heads", source)
    kv_heads = _positive_int(g("num_key_value_heads", "multi_query_group_num", default=heads),
                             "num_key_value_heads", source)
    if heads % kv_heads:
        raise InputError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
                         source=source, field="num_key_value_heads")
    head_dim = _positive_int(g("head_dim", default=h // heads), "head_dim", source)
    vocab = _positive_int(g("vocab_size", "padded_vocab_size"), "vocab_size", source)
    is_bloom = model_type == "bloom"
    ffn = _positive_int(g("intermediate_size", "ffn_hidden_size", default=4 * h), "intermediate_size", source)
    # Llama 4: `intermediate_size` is the expert (and shared-expert) width, `intermediate_size_mlp` the dense layers'
    inter = _positive_int(cfg.get("intermediate_size_mlp") or ffn, "intermediate_size_mlp", source)
    max_len = _positive_int(g("max_position_embeddings", "seq_length", "max_sequence_length", default=2048),
                            "max_position_embeddings", source)
    tie = bool(cfg.get("tie_word_embeddings", is_bloom))

    kv_lora = _positive_int(cfg.get("kv_lora_rank") or 0, "kv_lora_rank", source, minimum=0)
    if kv_lora:  # Multi-head Latent Attention (DeepSeek-V2/V3)
        rope = _positive_int(g("qk_rope_head_dim"), "qk_rope_head_dim", source)
        nope = _positive_int(g("qk_nope_head_dim"), "qk_nope_head_dim", source)
        v_dim = _positive_int(g("v_head_dim"), "v_head_dim", source)
        q_lora = _positive_int(cfg.get("q_lora_rank") or 0, "q_lora_rank", source, minimum=0)
        q_params = (h * q_lora + q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
        attn = q_params + h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
        qk_dim, latent, k_dim = nope + rope, kv_lora + rope, nope + rope
    else:
        attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
        qk_dim, v_dim, latent, k_dim = head_dim, head_dim, 0, head_dim

    num_experts = _positive_int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0,
                                     required=False) or 0, "num_local_experts", source, minimum=0)
    moe: dict[str, int] = {}
    if num_experts:
        topk = _positive_int(g("num_experts_per_tok", "experts_per_token", "moe_topk"), "num_experts_per_tok",
                             source)
        if topk > num_experts:
            raise InputError(f"{topk} experts per token but only {num_experts} experts", source=source,
                             field="num_experts_per_tok")
        e_inter = _positive_int(g("moe_intermediate_size", default=ffn), "moe_intermediate_size", source)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        dense_set = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq")
                   or cfg.get("interleave_moe_layer_step") or 1)  # Llama 4 Maverick: 2, every other layer is MoE
        listed = cfg.get("moe_layers")  # Llama 4 may list its MoE layers outright
        if isinstance(listed, list):
            moe_layers = len({int(i) for i in listed if 0 <= int(i) < layers})
        else:
            moe_layers = sum(1 for i in range(layers)
                             if i >= first_dense and i not in dense_set and (i + 1) % step == 0)
        n_shared = int(cfg.get("n_shared_experts") or _IMPLICIT_SHARED_EXPERTS.get(model_type, 0))
        shared = n_shared * 3 * h * e_inter
        shared += 3 * h * int(cfg.get("shared_expert_intermediate_size") or 0)
        moe = dict(num_experts=num_experts, experts_per_token=topk, expert_params=3 * h * e_inter,
                   num_moe_layers=moe_layers, shared_expert_params_per_moe_layer=shared,
                   router_params_per_moe_layer=h * num_experts)

    window, n_sliding = _windowed_layers(cfg, layers, model_type, source)
    return ModelSpec(
        name=name, model_type=model_type, num_layers=layers, hidden_size=h, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=k_dim, qk_head_dim=qk_dim, v_head_dim=v_dim,
        intermediate_size=inter, gated_mlp=not is_bloom, vocab_size=vocab, max_model_len=max_len,
        tie_word_embeddings=tie, kv_latent_dim=latent, attn_params_per_layer=attn,
        sliding_window=window if n_sliding else 0, num_sliding_layers=n_sliding, **moe)


@functools.cache
def _catalog() -> dict[str, dict]:
    path = MODELS_DIR / "catalog.yaml"
    if not path.exists():
        return {}
    from simengine.config.loader import load_yaml
    data = load_yaml(path) or {}
    return data if isinstance(data, dict) else {}


def model_names() -> dict[str, Path]:
    """Catalog name (and alias) -> config.json path."""
    names = {p.stem: p for p in sorted(MODELS_DIR.glob("*.json"))}
    for name, entry in _catalog().items():
        if isinstance(entry, dict):
            cfg_file = MODELS_DIR / str(entry.get("config", f"{name}.json"))
            for alias in entry.get("aliases") or []:
                names[str(alias)] = cfg_file
    return names


def load_model(name: str, *, field: str = "deployment.model") -> ModelSpec:
    """A catalog name, alias, or a path to a HuggingFace config.json."""
    p = Path(name)
    if p.suffix == ".json" or p.name == "config.json":
        if not p.exists():
            raise InputError(f"model config '{name}' not found; give a catalog name or an existing "
                             f"config.json path", field=field)
        return _load_json(p.resolve(), p.stem if p.name != "config.json" else p.parent.name)
    names = model_names()
    if name not in names:
        raise unknown_name("model", name, names, field=field)
    return _load_json(names[name], name)


def _no_constant(name: str):
    raise ValueError(f"JSON {name} is not a number a model shape can have")


@functools.cache
def _load_json(path: Path, name: str) -> ModelSpec:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read ({exc.__class__.__name__}); give a UTF-8 JSON file", source=str(path)) from None
    if not text.strip():
        raise InputError("file is empty; copy the model's config.json from its HuggingFace repo", source=str(path))
    try:
        cfg = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON ({exc.msg}); is the file truncated?", source=f"{path}:{exc.lineno}") from None
    except ValueError as exc:
        raise InputError(f"{exc}; write a number", source=str(path)) from None
    return model_from_config(cfg, name=name, source=str(path))
