"""Numeric formats: bytes per stored element and which tensor-core dtype computes with them."""

from __future__ import annotations

from dataclasses import dataclass

from simengine.errors import InputError


@dataclass(frozen=True)
class WeightFormat:
    """How a weight dtype is stored and computed."""

    name: str
    bytes_per_param: float  # including block-scale overhead
    compute_dtype: str      # the peak_tflops key the GEMMs run at
    fallback_compute: str | None = None  # used when the device lacks compute_dtype (dequantise first)
    source: str = ""
    lm_head_bytes: float | None = None   # bytes per param of the output projection when not quantised like the rest
    embedding_bytes: float | None = None  # bytes per param of the token embedding when not quantised like the rest
    dense_bytes: float | None = None      # bytes per param of the non-expert linear layers when only experts are

    @property
    def lm_head_bytes_per_param(self) -> float:
        return self.bytes_per_param if self.lm_head_bytes is None else self.lm_head_bytes

    @property
    def embedding_bytes_per_param(self) -> float:
        return self.bytes_per_param if self.embedding_bytes is None else self.embedding_bytes

    @property
    def dense_bytes_per_param(self) -> float:
        return self.bytes_per_param if self.dense_bytes is None else self.dense_bytes


# Bytes include quantisation scales. Sources in the `source` strings.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 4.0, "fp32", source="IEEE single"),
    "fp16": WeightFormat("fp16", 2.0, "fp16", source="IEEE half"),
    "bf16": WeightFormat("bf16", 2.0, "bf16", source="bfloat16"),
    # The quantisation recipes leave the output projection (lm_head) and the token embedding (a lookup table, not a
    # Linear layer) in 16 bit: NVIDIA ModelOpt's FP8/NVFP4 checkpoints (quantization_config 'exclude_modules':
    # ['lm_head']), AutoAWQ/GPTQ (lm_head not quantised), SmoothQuant W8A8 and gpt-oss's MXFP4 release, which
    # quantises only the experts (openai/gpt-oss-120b config.json quantization_config 'modules_to_not_convert':
    # model.layers.*.self_attn, model.layers.*.mlp.router, model.embed_tokens, lm_head). llama.cpp's q4_0/q8_0
    # files store `output.weight` as q6_K (210 bytes per 256 weights; llama-quant.cpp picks GGML_TYPE_Q6_K for the
    # output tensor) and q8_0, and `token_embd.weight` in the file's type.
    "fp8": WeightFormat("fp8", 1.0, "fp8", source="FP8 E4M3 W8A8; per-tensor scales negligible", lm_head_bytes=2.0,
                        embedding_bytes=2.0),
    "int8": WeightFormat("int8", 1.0, "int8", fallback_compute="fp16", lm_head_bytes=2.0, embedding_bytes=2.0,
                         source="W8A8 SmoothQuant on int8 tensor cores; W8A16 dequantises where no int8 path"),
    # AWQ/GPTQ W4A16, group size 128 with an fp16 scale (+ packed zero) per group: ~2 bytes / 128 weights
    # (AutoAWQ/GPTQ packing: 4-bit weights, fp16 scale and zero per 128-weight group); dequantised to fp16 and computed
    # in fp16.
    "int4": WeightFormat("int4", 0.5 + 2.0 / 128, "fp16", source="AWQ/GPTQ W4A16 g128", lm_head_bytes=2.0,
                         embedding_bytes=2.0),
    # llama.cpp block formats (ggml-common.h): q4_0 = 32 weights in 18 bytes, q8_0 = 32 weights in 34 bytes.
    "q4_0": WeightFormat("q4_0", 18 / 32, "fp16", source="ggml block_q4_0: fp16 scale + 16 bytes per 32",
                         lm_head_bytes=210 / 256),
    "q8_0": WeightFormat("q8_0", 34 / 32, "fp16", source="ggml block_q8_0: fp16 scale + 32 bytes per 32"),
    # Q4_K_M, the mix llama-quantize writes for that name: q4_K (144 bytes per 256 weights: fp16 scale and min, 12
    # bytes of 6-bit sub-block scales, 128 of 4-bit weights) for every layer weight except ffn_down and attn_v in
    # half the layers (llama-quant.cpp use_more_bits: the first and last eighth and every third between), which get
    # q6_K (210 bytes per 256), and q6_K for output.weight. On Llama shapes that averages 4.80 bits a layer weight
    # (Llama-2-7B 4.815, Llama-3-8B 4.797, Llama-3-70B 4.798 with its q5_K attn_v); check: Llama-3-8B Q4_K_M is
    # 4.58 GiB by llama-bench (XiongjieDai/GPU-Benchmarks-on-LLM-Inference), 4.57 GiB by this count with a q4_K
    # token_embd.
    "q4_k_m": WeightFormat("q4_k_m", 4.80 / 8, "fp16", lm_head_bytes=210 / 256,
                           source="llama-quantize Q4_K_M: q4_K with q6_K ffn_down/attn_v in half the layers"),
    # OCP MX FP4: 32 elements share one 8-bit E8M0 scale -> 4.25 bits (OCP Microscaling spec v1.0).
    "mxfp4": WeightFormat("mxfp4", 4.25 / 8, "fp4", fallback_compute="bf16", lm_head_bytes=2.0, embedding_bytes=2.0,
                          dense_bytes=2.0, source="OCP MX spec v1.0, experts only; Hopper dequantises to bf16 "
                                                  "(Marlin/Triton MoE kernels)"),
    # NVFP4: 16 elements share one FP8 E4M3 scale -> 4.5 bits (NVIDIA Blackwell NVFP4 blog, 2025).
    "nvfp4": WeightFormat("nvfp4", 4.5 / 8, "fp4", source="NVIDIA NVFP4: 16-element blocks, fp8 scale",
                          lm_head_bytes=2.0, embedding_bytes=2.0),
}
WEIGHT_FORMATS["fp4"] = WEIGHT_FORMATS["nvfp4"]  # validation CSV spelling of NVFP4
# ggml block formats: GGUF files that llama.cpp runs and the CUDA engines do not load
GGML_FORMATS = ("q4_0", "q8_0", "q4_k_m")

# KV cache element bytes (engine kv-cache-dtype options; int4/int8 per LMDeploy quant_policy).
KV_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def weight_format(name: str, *, field: str = "deployment.weight_dtype") -> WeightFormat:
    """Look up a weight dtype, or raise InputError listing the valid ones."""
    if name not in WEIGHT_FORMATS:
        from simengine.errors import unknown_name
        raise unknown_name("weight dtype", name, WEIGHT_FORMATS, field=field)
    return WEIGHT_FORMATS[name]


def kv_bytes(name: str, *, field: str = "deployment.kv_dtype") -> float:
    """Bytes per KV element for a kv dtype name."""
    if name not in KV_BYTES:
        from simengine.errors import unknown_name
        raise unknown_name("kv dtype", name, KV_BYTES, field=field)
    return KV_BYTES[name]


def resolve_compute_dtype(fmt: WeightFormat, peak_tflops: dict[str, float], device: str) -> str:
    """The dtype whose peak the GEMMs run at on this device, or InputError if it has no path."""
    if fmt.compute_dtype in peak_tflops:
        return fmt.compute_dtype
    if fmt.fallback_compute and fmt.fallback_compute in peak_tflops:
        return fmt.fallback_compute
    for alt in ("bf16", "fp16") if fmt.compute_dtype in ("fp16", "bf16") else ():
        if alt in peak_tflops:
            return alt
    have = ", ".join(sorted(peak_tflops))
    raise InputError(
        f"weight dtype {fmt.name} needs {fmt.compute_dtype} tensor cores, which {device} does not have "
        f"(it computes in {have}); choose another weight_dtype", field="deployment.weight_dtype")
