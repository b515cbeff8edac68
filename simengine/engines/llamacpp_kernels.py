"""ggml's kernel rates: what llama.cpp's layer GEMMs and attention reach where its own kernels, or its own way of
calling cuBLAS, set the rate (EnginePolicy.engine_gemm_flops_s, engine_attention_flops_s, expert_tile_columns)."""

from __future__ import annotations

from simengine.config.dtypes import resolve_compute_dtype
from simengine.cost.work import UnfusedAttention
from simengine.engines.memory import Deployment

# ggml-cuda multiplies quantized weights with its own MMQ kernels (mmq.cu: activations quantized to q8_1, int8
# tensor-core tiles, dequantised per block in registers) for batches over 8; 16/32-bit weights go to cuBLAS.
# (q4_k_m's q4_K and q6_K got int8 tensor-core MMQ with ggml-org/llama.cpp PR #7860, 2024-06, at the legacy quants'
# rate: ESTIMATE, no per-format measurement of the tile rate)
MMQ_WEIGHT_DTYPES = ("q8_0", "q4_0", "q4_k_m", "mxfp4")
# Until PR #8075 (2024-06-24, build b3216) ggml-cuda sent quantized weights in batches over MMQ_MAX_BATCH_SIZE = 32
# tokens to cuBLAS on GPUs with FP16 tensor cores (CUDA_USE_TENSOR_CORES, on unless GGML_CUDA_FORCE_MMQ): each
# weight matrix dequantized to F16 in a scratch buffer, then the F16 path below; #8075 kept that path behind the
# build option GGML_CUDA_FORCE_CUBLAS (LlamaCppParams.cuda_force_cublas). Judged on PR #4766's RTX 4090 runs of
# that path: LLaMA 7B Q4_0 pp512 7979.85 and Q8_0 7664.00 tok/s against F16 11048.22 (docs/validation.md).
CUBLAS_DEQUANT_ABOVE_TOKENS = 32
# MMQ's throughput is a fixed amount of work per SM per cycle, not a share of the tensor peak: RTX 4090 (Ada, 128 SMs
# at 2.52 GHz) runs Llama-3-8B Q4_0 pp512 at 10358.75 tok/s with MMQ on tensor cores (ggml-org/llama.cpp PR #7676,
# ubatch 512), i.e. 2 x 6.98e9 layer weights x 10358.75 / (128 x 2.52e9) = 448 FLOP per SM per cycle (the step's
# attention, ~1%, included). That is 22% of Ada's and GA102's int8 tensor peak per SM but 11% of GA100's, whose
# SMs have twice the int8 rate: llama.cpp's published pp512 on A100 and RTX 3090 are equal within 2%, as SMs x clock
# predicts (docs/validation.md). Applies where the hardware YAML gives sm_count and boost_clock_mhz.
MMQ_FLOPS_PER_SM_CYCLE = 448.0
# ggml-cuda's FlashAttention kernel (fattn-mma-f16: f16 K/V tiles on tensor cores, softmax on the CUDA cores) is
# llama.cpp's own too, and like MMQ its prompt throughput is a fixed amount of work per SM per cycle rather than a
# share of the FP16 peak: RTX 3090 (82 SMs at 1.695 GHz) runs Llama-3-8B Q4_0 pp512 @ d32768 at 1470.93 tok/s
# (ggml-org/llama.cpp PR #17505, master, ubatch 512), 348 ms a ubatch of which 121 ms are the layer GEMMs and other
# work at depth 0 as simulated here (MMQ above), leaving 227 ms for 9.0e12 FLOP of attention (4 x 4096 FLOP per
# query-key pair, 32 layers, 512 x 33,024 pairs): 39.6 TFLOP/s = 285 FLOP per SM per cycle, 56 % of GA102's FP16
# tensor rate with FP32 accumulation. Applies with MMQ's condition (an NVIDIA device whose YAML gives sm_count and
# boost_clock_mhz); measured on GA102 only (the GB10's judged depth slope gives 380), not on A100 or Hopper.
FA_FLOPS_PER_SM_CYCLE = 285.0
# ggml's llama graph runs a layer's token-count ops unfused (src/models/llama.cpp): the q, k, v, output, gate, up and
# down projections as seven matrix multiplications, and RMS norm, its weight multiply (twice), RoPE of q and k, the
# K and V cache writes, two residual adds, SiLU and the gate product as their own kernels; attention comes on top.
# ESTIMATE: 17 kernels a layer (the graph's non-view nodes; builds that fuse norm and multiply have a few fewer).
GGML_LAYER_KERNELS = 17
MMQ_MAX_TILE_COLUMNS = 128   # mmq_x_max with tensor-core MMA (Turing and later; ggml-cuda/mmq.cuh mul_mat_q_case)
# ggml-metal multiplies matrices with its own kernels (ggml-metal.metal kernel_mul_mm: 8x8 simdgroup tiles, weights
# converted to half in threadgroup memory) for batches over a few tokens, not with Apple's MPS GEMM that the device's
# gemm_fraction describes. On M2 Ultra (76-core GPU, 27.2 TFLOPS FP16) LLaMA-7B F16 pp512 runs at 1265.30 tok/s
# (ggml-org/llama.cpp PR #3084, M2 Ultra table), i.e. 2 x 6.48e9 layer weights x 1265.30 / 27.2e12 = 0.60 of the
# FP16 peak (the step's attention and other ops, ~2%, included), where MPS reaches 0.86 (hardware/apple/*.yaml).
# The same table has quantized weights ~8% slower (Q4_0 1164.00 tok/s: the conversion), which is not modelled.
METAL_MUL_MM_PEAK_FRACTION = 0.60
# ggml-cuda sends F16 weights to cuBLAS for batches over a few tokens (ggml_cuda_mul_mat_cublas: the activations
# converted to F16, cublasGemmEx computing in FP16, CUBLAS_COMPUTE_16F, the result converted back to F32, one call per
# weight matrix at the ubatch's token count), so at the FP16-accumulate tensor rate, twice the FP32-accumulate rate
# on GeForce dies (the YAML's fp16_accumulate_tflops), and far below a large cuBLAS GEMM's share of it. On an RTX 4090
# (330.3 TFLOPS with FP16 accumulate) LLaMA 7B F16 pp512 runs at 11048.22 tok/s (ggml-org/llama.cpp PR #4766,
# 2024-01), i.e. 2 x 6.48e9 layer weights x 11048.22 / 330.3e12 = 0.43 of that peak (the step's other ops included).
# Judged on the same year's other published runs (docs/validation.md): A100 80GB PCIe 8668.24 tok/s (PR #6017: 0.36
# of 312 TFLOPS), RTX 3090 4184.85 (PR #4766 master: 0.38 of 142), RTX A6000 and RTX 6000 Ada.
CUBLAS_F16_PEAK_FRACTION = 0.43


def gemm_flops_s(dep: Deployment, force_cublas: bool = False) -> float | None:
    """ggml's layer-GEMM rate: kernel_mul_mm on Apple GPUs, cuBLAS in FP16 for F16 weights on NVIDIA (and for
    quantized ones dequantized to F16 where `force_cublas`), MMQ for quantized weights on an NVIDIA device of known
    SMs and clock (else None: the device's GEMM)."""
    hw = dep.hardware
    if hw.vendor == "apple":
        return METAL_MUL_MM_PEAK_FRACTION * hw.peak(resolve_compute_dtype(dep.weight_format, hw.peak_flops, hw.name))
    if dep.weight_format.name == "fp16" or dequantize_above_tokens(dep, force_cublas):
        if (cublas := cublas_f16_flops_s(dep)) is not None:
            return cublas
    return mmq_flops_s(dep)


def cublas_f16_flops_s(dep: Deployment) -> float | None:
    """ggml's cuBLAS calls computing in FP16 on an NVIDIA device with FP16 tensor cores (else None)."""
    hw = dep.hardware
    if hw.vendor == "nvidia" and "fp16" in hw.peak_flops:
        return CUBLAS_F16_PEAK_FRACTION * (hw.fp16_accumulate_flops or hw.peak("fp16"))
    return None


def dequantize_above_tokens(dep: Deployment, force_cublas: bool) -> int | None:
    """Token count above which the layers' quantized weights are dequantized to F16 for cuBLAS in every step (the
    GGML_CUDA_FORCE_CUBLAS path on an NVIDIA device with FP16 tensor cores), else None."""
    hw = dep.hardware
    quantized = dep.weight_format.name in MMQ_WEIGHT_DTYPES
    return CUBLAS_DEQUANT_ABOVE_TOKENS if force_cublas and quantized and hw.vendor == "nvidia" \
        and "fp16" in hw.peak_flops else None


def mmq_flops_s(dep: Deployment) -> float | None:
    """MMQ's rate for quantized weights on an NVIDIA device of known SMs and clock (else None)."""
    hw = dep.hardware
    if hw.vendor != "nvidia" or dep.weight_format.name not in MMQ_WEIGHT_DTYPES or not hw.sm_clocks_per_s:
        return None
    return MMQ_FLOPS_PER_SM_CYCLE * hw.sm_clocks_per_s


def attention_flops_s(dep: Deployment, flash_attn: bool = True) -> float | None:
    """ggml-cuda's FlashAttention rate on an NVIDIA device of known SMs and clock; without FlashAttention the two
    attention GEMMs' rate (cuBLAS in FP16 on NVIDIA, kernel_mul_mm on Apple GPUs); else None (the device's
    attention peak)."""
    hw = dep.hardware
    if not flash_attn:
        if hw.vendor == "apple":
            return METAL_MUL_MM_PEAK_FRACTION * hw.peak("fp16")
        return cublas_f16_flops_s(dep)
    return FA_FLOPS_PER_SM_CYCLE * hw.sm_clocks_per_s if hw.vendor == "nvidia" and hw.sm_clocks_per_s else None


def unfused_attention(dep: Deployment) -> UnfusedAttention:
    """ggml's attention without FlashAttention (llm_build_kqv): kq = mul_mat(k, q) writes every score, soft_max_ext
    reads and writes them, kqv = mul_mat(v, kq) reads them, all as F32 tensors. On CUDA and HIP the batched cuBLAS
    calls compute in F16, so each score is also written in F16 and converted to F32 after QK, and converted back to
    F16 before PV: 2 + 2 + 4 (QK and conversion) + 4 + 4 (softmax) + 4 + 2 + 2 (conversion and PV) = 24 bytes a
    score; Metal's kernel_mul_mm takes and gives F32 directly: 4 + 8 + 4 = 16 (ESTIMATE for the other backends,
    which read and write F32 like Metal). Six kernels a layer on CUDA (three GEMM-side conversions), three on
    Metal, where FlashAttention takes one. The mask read is not counted."""
    if dep.hardware.vendor in ("nvidia", "amd"):
        return UnfusedAttention(score_bytes=24.0, kernels_per_layer=6)
    return UnfusedAttention(score_bytes=16.0, kernels_per_layer=3)
