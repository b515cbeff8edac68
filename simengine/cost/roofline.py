"""Roofline GPU time of the step's ops from the device's physical terms (docs/cost-model.md).

Each op takes max(FLOPs / peak / gemm_fraction[dtype], bytes / bandwidth / memory_bandwidth_fraction) plus the
device's kernel floor per kernel, the peak being the one the device sustains under continuous load (datasheet peak
x sustained_compute_fraction); an all-reduce takes the link's latency plus its bytes over the achieved link
bandwidth. The terms are the device's (hardware/*.yaml `efficiency:` and `interconnect:`), shared by every engine;
whether the engine's all-reduce is a custom kernel or the collective library's is the engine's.

A step's ops are first turned into *features*, the seconds each op would take at efficiency 1 (FLOPs over peak,
bytes over bandwidth, ring bytes over the link) plus counts (kernels, all-reduce calls) and seconds that no term
changes (measured kernels, other communication); `price` adds them up at a set of terms. The simulator prices
through `price` for every token count at once and caches the result; calibration re-prices thousands of recorded
steps with trial terms through the same function. Everything takes floats or numpy arrays (`maximum` is the
builtin `max` or `np.maximum`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from simengine.config.hardware import Hardware
from simengine.cost.work import StepWork

# Per-step feature arrays: *_c / *_m are an op's seconds at gemm_fraction / memory fraction 1, floors a kernel count,
# ar_calls the all-reduce calls priced here, ar_link their ring bytes over the raw link, comm_fixed seconds of other
# communication, meas_* seconds from measured kernels (compute-, memory-bound or communication).
FEATURES = ("lin_c", "lin_m", "lm_c", "lm_m", "pre_c", "pre_m", "dec_c", "dec_m", "elem_m", "floors", "ar_calls",
            "ar_link", "comm_fixed", "meas_c", "meas_m", "meas_comm")


@dataclass(frozen=True)
class DeviceTerms:
    """The physical terms one device prices ops with: efficiencies, floors and the link."""

    g_linear: float            # gemm_fraction at the weights' compute dtype
    g_lm_head: float
    g_attn: float
    memory_fraction: float
    kernel_floor_s: float
    allreduce_latency_s: float
    link_fraction: float

    @staticmethod
    def of(work: StepWork, hw: Hardware, *, custom_allreduce: bool) -> DeviceTerms:
        return DeviceTerms(
            # an engine's own GEMM and attention kernels price at their achieved rates (StepWork.engine_gemm_flops_s,
            # engine_attention_flops_s), fraction 1
            g_linear=1.0 if work.engine_gemm_flops_s else hw.gemm_fraction(work.compute_dtype),
            g_lm_head=hw.gemm_fraction(work.lm_head_dtype),
            g_attn=1.0 if work.engine_attention_flops_s else hw.gemm_fraction(work.attn_dtype),
            memory_fraction=hw.memory_bandwidth_fraction,
            kernel_floor_s=hw.kernel_floor_s, allreduce_latency_s=hw.allreduce_latency_s(custom_allreduce),
            link_fraction=hw.link_bandwidth_fraction)


TERM_NAMES = tuple(f.name for f in fields(DeviceTerms))


def bound(c, m, g: float, mb: float, maximum=max):
    """(seconds, compute-bound part, memory-bound part) of one op from its seconds at efficiency 1."""
    cs, ms = c / g, m / mb
    cb = cs >= ms
    return maximum(cs, ms), cs * cb, ms * (cs < ms)


def price(f: dict, t, maximum=np.maximum):
    """(gpu, compute, memory, comm) seconds of steps with features `f` at terms `t` (a DeviceTerms, or any object
    with its fields as floats or per-step arrays)."""
    mb = t.memory_fraction
    lin, lin_c, lin_m = bound(f["lin_c"], f["lin_m"], t.g_linear, mb, maximum)
    lm, lm_c, lm_m = bound(f["lm_c"], f["lm_m"], t.g_lm_head, mb, maximum)
    pre, pre_c, pre_m = bound(f["pre_c"], f["pre_m"], t.g_attn, mb, maximum)
    dec, dec_c, dec_m = bound(f["dec_c"], f["dec_m"], t.g_attn, mb, maximum)
    compute = lin_c + lm_c + pre_c + dec_c + f["meas_c"]
    memory = lin_m + lm_m + pre_m + dec_m + f["elem_m"] / mb + f["meas_m"]
    comm = f["ar_calls"] * t.allreduce_latency_s + f["ar_link"] / t.link_fraction + f["comm_fixed"] + f["meas_comm"]
    return compute + memory + comm + f["floors"] * t.kernel_floor_s, compute, memory, comm


def empty_features(like) -> dict:
    """Zero features shaped like `like` (one array per feature: callers fill them in place)."""
    zero = 0.0 * np.asarray(like, dtype=float)
    return {k: zero.copy() for k in FEATURES}


class RooflineKernels:
    """GPU seconds of the op list of `work` at the device terms `terms` (see the module docstring)."""

    def __init__(self, work: StepWork, terms: DeviceTerms):
        self.work, self.terms = work, terms
        hw = work.hw
        # peaks under continuous load: tables and microbenchmarks time bursts at the boost clock, a serving loop runs
        # at the power-capped clock. An engine's own kernel rates (llama.cpp's MMQ and FlashAttention) were measured in
        # sustained runs.
        self.sustained = hw.sustained_compute_fraction
        self.linear_peak = work.engine_gemm_flops_s or hw.peak(work.compute_dtype) * self.sustained
        self.lm_head_peak = hw.peak(work.lm_head_dtype) * self.sustained
        self.attn_peak = work.engine_attention_flops_s or hw.peak(work.attn_dtype) * self.sustained
        self.bandwidth = hw.memory_bandwidth_bytes_s
        self.link_latency_s = hw.link_latency_s
        self.link_bandwidth = max(hw.link_bandwidth_bytes_s, 1.0)
        self.fallbacks: dict[str, str] = {}
        u = work.unfused_attention   # kernels of one step's attention, all layers
        self.attention_kernels = float(work.model.num_layers * (u.kernels_per_layer if u is not None else 1))

    def describe(self) -> str:
        return "roofline"

    # ---- features -------------------------------------------------------------------------------------------
    def token_features(self, tokens: np.ndarray) -> dict:
        """Features of the ops that depend only on the step's token count: the layers' GEMMs, the elementwise
        kernels and their floors, and the communication."""
        w = self.work
        f = empty_features(tokens)
        flops, nbytes = w.linear(tokens)
        f["lin_c"], f["lin_m"] = flops / self.linear_peak, nbytes / self.bandwidth
        f["elem_m"] = w.elementwise_bytes(tokens) / self.bandwidth
        f["floors"] = f["floors"] + w.token_kernels
        if w.num_allreduce:
            f["ar_calls"] = f["ar_calls"] + w.num_allreduce
            f["ar_link"] = w.num_allreduce * w.allreduce_bytes(tokens) / self.link_bandwidth
        f["comm_fixed"] = self.other_comm(tokens)
        return f

    def other_comm(self, tokens):
        """Pipeline hand-offs of one step, at the link's latency and rate."""
        w = self.work
        s = 0.0 * tokens
        if w.pp > 1:
            s = s + (w.pp - 1) * (self.link_latency_s + tokens * w.allreduce_bytes_per_token / self.link_bandwidth)
        return s

    def logit_features(self, logits: np.ndarray) -> dict:
        f = empty_features(logits)
        flops, nbytes = self.work.lm_head(logits)
        f["lm_c"], f["lm_m"] = flops / self.lm_head_peak, nbytes / self.bandwidth
        f["floors"] = f["floors"] + (logits > 0)
        return f

    def attention_features(self, prefill_chunks: list[list[tuple[int, int]]], num_decode: np.ndarray,
                           context_tokens: np.ndarray) -> dict:
        """Features of the attention ops of many steps (their prefill chunks, decodes and decode contexts)."""
        w = self.work
        f = empty_features(num_decode)
        for i, chunks in enumerate(prefill_chunks):
            if chunks:
                f["pre_c"][i], f["pre_m"][i], f["floors"][i] = self._prefill_work(chunks)
                f["elem_m"][i] = w.score_bytes(w.unfused_scores(chunks)) / self.bandwidth
        dc, dm = self._decode_work(num_decode, context_tokens)
        f["dec_c"], f["dec_m"] = dc, dm
        f["elem_m"] = f["elem_m"] + w.score_bytes(context_tokens) / self.bandwidth
        f["floors"] = f["floors"] + self.attention_kernels * (num_decode > 0)
        return f

    def _prefill_work(self, chunks):
        flops, nbytes = self.work.prefill_attention(chunks)
        return flops / self.attn_peak, nbytes / self.bandwidth, self.attention_kernels

    def _decode_work(self, num_decode, context_tokens):
        flops, nbytes = self.work.decode_attention(num_decode, context_tokens)
        return flops / self.attn_peak, nbytes / self.bandwidth

    # ---- seconds ----------------------------------------------------------------------------------------------
    def tokens(self, tokens: np.ndarray):
        """(gpu, compute, memory, comm, measured) seconds of the token-count ops, per token count."""
        f = self.token_features(tokens)
        return (*price(f, self.terms), f["meas_c"] + f["meas_m"] + f["meas_comm"])

    def logits(self, logits: np.ndarray):
        """(gpu, compute, memory, measured) seconds of the LM head for `logits` tokens."""
        f = self.logit_features(logits)
        gpu, compute, memory, _ = price(f, self.terms)
        return gpu, compute, memory, f["meas_c"] + f["meas_m"]

    def prefill(self, chunks: list[tuple[int, int]]):
        """(gpu, compute, memory, measured) seconds of the prefill chunks' attention (one kernel per layer)."""
        c, m, kernels = self._prefill_work(chunks)
        t = self.terms
        s, cs, ms = bound(c, m, t.g_attn, t.memory_fraction)
        if self.work.unfused_attention is not None:   # the score passes: kernels of their own, memory-bound
            passes = self.work.score_bytes(self.work.unfused_scores(chunks)) / self.bandwidth / t.memory_fraction
            s, ms = s + passes, ms + passes
        return s + kernels * t.kernel_floor_s, cs, ms, 0.0

    def decode(self, num_decode, context_tokens, maximum=max):
        """(gpu, compute, memory, measured) seconds of the decodes' attention (one kernel per layer)."""
        c, m = self._decode_work(num_decode, context_tokens)
        t = self.terms
        s, cs, ms = bound(c, m, t.g_attn, t.memory_fraction, maximum)
        if self.work.unfused_attention is not None:
            passes = self.work.score_bytes(context_tokens) / self.bandwidth / t.memory_fraction
            s, ms = s + passes, ms + passes
        return s + self.attention_kernels * t.kernel_floor_s, cs, ms, 0.0   # (a float broadcasts over arrays)
