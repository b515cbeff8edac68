"""`simengine profile MODEL`: time a model's GEMMs and attention on the local device, as measured-kernel tables.

Measures, for one tensor-parallel rank of the model, every GEMM of a layer (QKV, O, gate/up, down) and the LM head
over a range of token counts, decode attention over batch x KV length and causal prefill attention over
sequences x length (torch matmul and scaled_dot_product_attention; GQA by repeating the KV heads), and writes them
in the layout and columns of aiconfigurator-core's tables under kernels/<system>/ with backend `torch`:

    kernels/<system>/gemm/torch/<torch version>/gemm_perf.csv
    kernels/<system>/attention/torch/<torch version>/{generation,context}_attention_perf.csv
    kernels/<system>/collection_meta.yaml       (device, date, torch version, repeats)

A device YAML that names the folder (`kernel_tables: <system>`) then has its steps priced from these measurements
for every engine (cost/measured.py: an engine whose own backend has no tables there takes the nearest one; the
roofline prices what the profile does not cover). Latencies are milliseconds per op call, as in the package.
Dense layers only (routed experts run as grouped GEMMs, which torch matmul does not imitate).
"""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from simengine.config.hardware import REPO_ROOT
from simengine.config.model import ModelSpec, load_model
from simengine.errors import InputError

KERNELS_DIR = REPO_ROOT / "kernels"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_KV = (64, 256, 1024, 4096, 16384, 32768)
PREFILL_BATCH = (1, 2, 4, 8)
PREFILL_ISL = (128, 512, 1024, 2048, 4096, 8192)
QUICK: dict[str, Any] = {"tokens": (1, 8, 64), "decode": ((1, 2), (32, 64)), "prefill": ((1, 2), (16, 64)),
                         "repeats": 2}
DTYPES = {"bf16": ("bfloat16", "bfloat16"), "fp16": ("float16", "bfloat16")}   # torch dtype, table dtype name
GEMM_COLUMNS = ("gemm_dtype", "m", "n", "k", "latency")
ATTN_COLUMNS = ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "window_size", "attn_dtype",
                "kv_cache_dtype", "step", "latency")


def _torch():
    try:
        import torch
    except ImportError:
        raise InputError("simengine profile needs torch: pip install -e '.[profile]'", field="profile") from None
    return torch


def _timer(torch, device: str, repeats: int):
    def run(fn) -> float:
        """Median seconds of `fn` after two warm-up calls (kernel selection, allocator)."""
        fn()
        fn()
        times = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def gemm_shapes(m: ModelSpec, tp: int) -> dict[str, tuple[int, int]]:
    """(n, k) per tensor-parallel rank of the layer's GEMMs and the LM head (cost/measured.py's op shapes)."""
    if m.is_moe:
        raise InputError(f"{m.name} is a mixture of experts; profile measures dense layers only", field="model")
    heads, kv = max(1, m.num_heads // tp), max(1, -(-m.num_kv_heads // tp))
    f = m.intermediate_size // tp
    return {"qkv": ((heads + 2 * kv) * m.head_dim, m.hidden_size), "attn_out": (m.hidden_size, heads * m.v_head_dim),
            "mlp_up": ((2 if m.gated_mlp else 1) * f, m.hidden_size), "mlp_down": (m.hidden_size, f),
            "lm_head": (m.vocab_size // tp, m.hidden_size)}


def measure(m: ModelSpec, *, device: str, dtype: str, tp: int, quick: bool) -> tuple[list[tuple], list[tuple],
                                                                                       list[tuple]]:
    """(gemm rows, decode attention rows, prefill attention rows) for one rank of `m` on `device`."""
    torch = _torch()
    F = torch.nn.functional
    dt = getattr(torch, DTYPES[dtype][0])
    name = DTYPES[dtype][1]
    run = _timer(torch, device, QUICK["repeats"] if quick else 10)
    new = {"device": device, "dtype": dt}
    gemm = []
    for n, k in sorted(set(gemm_shapes(m, tp).values())):
        w = torch.randn(k, n, **new)
        for tokens in QUICK["tokens"] if quick else TOKENS:
            x = torch.randn(tokens, k, **new)
            gemm.append((name, tokens, n, k, 1e3 * run(lambda x=x, w=w: x @ w)))
    heads, kv = max(1, m.num_heads // tp), max(1, -(-m.num_kv_heads // tp))
    d, rep = m.head_dim, max(1, heads // kv)

    def attention(b: int, q_len: int, kv_len: int, causal: bool) -> float:
        q = torch.randn(b, heads, q_len, d, **new)
        key = torch.randn(b, kv, kv_len, d, **new).repeat_interleave(rep, dim=1)
        val = torch.randn(b, kv, kv_len, d, **new).repeat_interleave(rep, dim=1)
        return 1e3 * run(lambda: F.scaled_dot_product_attention(q, key, val, is_causal=causal))

    decode = [(b, 1, heads, kv, d, 0, name, name, s - 1, attention(b, 1, s, False))
              for b, s in (QUICK["decode"] if quick else [(b, s) for b in DECODE_BATCH for s in DECODE_KV])]
    prefill = [(b, s, heads, kv, d, 0, name, name, 0, attention(b, s, s, True))
               for b, s in (QUICK["prefill"] if quick else [(b, s) for b in PREFILL_BATCH for s in PREFILL_ISL])]
    return gemm, decode, prefill


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[tuple]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [",".join(columns)] + [",".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_tables(root: Path, system: str, version: str, gemm: list[tuple], decode: list[tuple],
                 prefill: list[tuple], meta: dict[str, str]) -> list[Path]:
    """The measurements as measured-kernel tables under root/system (see the module docstring)."""
    base = root / system
    out = [_write_csv(base / "gemm" / "torch" / version / "gemm_perf.csv", GEMM_COLUMNS, gemm),
           _write_csv(base / "attention" / "torch" / version / "generation_attention_perf.csv", ATTN_COLUMNS, decode),
           _write_csv(base / "attention" / "torch" / version / "context_attention_perf.csv", ATTN_COLUMNS, prefill)]
    (base / "collection_meta.yaml").write_text("".join(f"{k}: \"{v}\"\n" for k, v in meta.items()), encoding="utf-8")
    return out


def profile_command(model: str, *, out: str | None, device: str | None, dtype: str, tp: int, quick: bool) -> str:
    """Measure and write the tables; return a one-line summary."""
    if dtype not in DTYPES:
        raise InputError(f"'{dtype}' is not one of {', '.join(DTYPES)}", field="--dtype")
    if tp < 1:
        raise InputError(f"must be >= 1, got {tp}", field="--tp")
    torch = _torch()
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = load_model(model, field="MODEL")
    name = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else f"cpu {platform.processor() or ''}"
    today = _dt.date.today().isoformat()
    gemm, decode, prefill = measure(spec, device=dev, dtype=dtype, tp=tp, quick=quick)
    system = "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")
    meta = {"device": name, "model": spec.name, "dtype": dtype, "tp": str(tp), "date": today,
            "torch": torch.__version__, "repeats": str(QUICK["repeats"] if quick else 10)}
    paths = write_tables(Path(out) if out else KERNELS_DIR, system, torch.__version__.split("+")[0], gemm, decode,
                         prefill, meta)
    return (f"wrote {len(gemm)} GEMM and {len(decode) + len(prefill)} attention timings of {spec.name} ({dtype}, "
            f"tp={tp}) on {name} under {paths[0].parents[3]}; name it in a device YAML as kernel_tables: {system}")
