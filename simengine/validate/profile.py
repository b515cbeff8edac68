"""`simengine profile MODEL`: time a model-shaped layer's operators on the local device (optional torch).

Measures, for one tensor-parallel rank of the model: all GEMMs of one layer (QKV, O, gate/up, down) for a range
of token counts, causal prefill attention for a range of chunk sizes, decode attention for batch x context
grids, and the LM head; writes the CSV that simengine/cost/table.py reads (op,x,seconds + `# key=value`
metadata). Dense models only (routed experts run as grouped GEMMs, which this does not imitate).
"""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import time
from pathlib import Path

from simengine.config.hardware import REPO_ROOT
from simengine.config.model import ModelSpec, load_model
from simengine.errors import InputError

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL = (128, 256, 512, 1024, 2048, 4096, 8192)
DECODE = tuple((b, c) for b in (1, 8, 32, 128) for c in (512, 2048, 8192))
QUICK = {"tokens": (1, 8, 64), "prefill": (16, 64), "decode": ((1, 32), (4, 64)), "repeats": 2}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _torch():
    try:
        import torch
    except ImportError:
        raise InputError("simengine profile needs torch: pip install -e '.[profile]'", field="profile") from None
    return torch


def _timer(torch, device: str, repeats: int):
    def run(fn) -> float:
        fn()
        fn()   # warm-up: kernel selection, allocator
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


def _shards(m: ModelSpec, tp: int) -> dict[str, int]:
    if m.is_moe:
        raise InputError(f"{m.name} is a mixture of experts; profile measures dense layers only", field="model")
    q = max(1, m.num_heads // tp)
    kv = max(1, m.num_kv_heads // tp)
    return {"h": m.hidden_size, "q": q, "kv": kv, "d": m.qk_head_dim, "dv": m.v_head_dim,
            "f": max(1, m.intermediate_size // tp), "v": max(1, m.vocab_size // tp)}


def measure(m: ModelSpec, *, device: str, dtype: str, tp: int, quick: bool) -> list[tuple[str, float, float]]:
    """(op, x, seconds) rows for one rank of `m` on `device`."""
    torch = _torch()
    F = torch.nn.functional
    dt = getattr(torch, DTYPES[dtype])
    s = _shards(m, tp)
    run = _timer(torch, device, QUICK["repeats"] if quick else 10)
    new = {"device": device, "dtype": dt}
    mlp_in = (2 if m.gated_mlp else 1) * s["f"]
    w = {"qkv": torch.randn(s["h"], (s["q"] + 2 * s["kv"]) * s["d"], **new),
         "o": torch.randn(s["q"] * s["dv"], s["h"], **new), "up": torch.randn(s["h"], mlp_in, **new),
         "down": torch.randn(s["f"], s["h"], **new), "head": torch.randn(s["h"], s["v"], **new)}
    rows = []
    for n in QUICK["tokens"] if quick else TOKENS:
        x = torch.randn(n, s["h"], **new)
        a = torch.randn(n, s["q"] * s["dv"], **new)
        g = torch.randn(n, s["f"], **new)
        rows.append(("linear", float(n), run(lambda x=x, a=a, g=g: (x @ w["qkv"], a @ w["o"], x @ w["up"],
                                                                      g @ w["down"]))))
        rows.append(("lm_head", float(n), run(lambda x=x: x @ w["head"])))
    rep = s["q"] // s["kv"]
    for c in QUICK["prefill"] if quick else PREFILL:
        q = torch.randn(1, s["q"], c, s["d"], **new)
        k = torch.randn(1, s["kv"], c, s["d"], **new).repeat_interleave(rep, dim=1)
        v = torch.randn(1, s["kv"], c, s["dv"], **new).repeat_interleave(rep, dim=1)
        t = run(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        rows.append(("attn_prefill", c * c / 2.0, t))
    for b, ctx in QUICK["decode"] if quick else DECODE:
        q = torch.randn(b, s["q"], 1, s["d"], **new)
        k = torch.randn(b, s["kv"], ctx, s["d"], **new).repeat_interleave(rep, dim=1)
        v = torch.randn(b, s["kv"], ctx, s["dv"], **new).repeat_interleave(rep, dim=1)
        rows.append(("attn_decode", float(b * ctx), run(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))))
    return rows


def write_profile(path: Path, rows: list[tuple[str, float, float]], meta: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {k}={v}" for k, v in meta.items()] + ["op,x,seconds"]
    lines += [f"{op},{x:g},{sec:.9f}" for op, x, sec in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def profile_command(model: str, *, out: str | None, device: str | None, dtype: str, tp: int, quick: bool) -> str:
    """Measure and write the CSV; return a one-line summary."""
    if dtype not in DTYPES:
        raise InputError(f"'{dtype}' is not one of {', '.join(DTYPES)}", field="--dtype")
    if tp < 1:
        raise InputError(f"must be >= 1, got {tp}", field="--tp")
    torch = _torch()
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = load_model(model, field="MODEL")
    name = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else f"cpu {platform.processor() or ''}"
    today = _dt.date.today().isoformat()
    rows = measure(spec, device=dev, dtype=dtype, tp=tp, quick=quick)
    slug = "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")
    path = Path(out) if out else REPO_ROOT / "data" / "profiles" / f"{slug}_{spec.name}_{dtype}_tp{tp}_{today}.csv"
    meta = {"device": name, "model": spec.name, "dtype": dtype, "tp": str(tp), "date": today,
            "torch": torch.__version__, "repeats": str(QUICK["repeats"] if quick else 10)}
    write_profile(path, rows, meta)
    return f"wrote {len(rows)} timings for {spec.name} ({dtype}, tp={tp}) on {name} to {path}"
