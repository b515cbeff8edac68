"""TPOT against tensor parallelism for vLLM, SGLang and TensorRT-LLM on Llama-3.1-70B FP8, H100 (docs/validation.md).

One user at a time (closed loop, concurrency 1), 1,024-token prompts and 256 output tokens: the batch-1 decode
a TP degree is bought for. Beside it, the published points: Lambda's vLLM v0.6.0 runs of the same model on 1, 2, 4
and 8 H100s (10 ShareGPT prompts at once, median TPOT; docs/judge/lambda_vllm_p10.csv) and the simulator's
prediction of those very runs. Prints both tables and writes docs/tp_scaling.png.
Usage: `.venv/bin/python bench/tp_scaling.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINES = ("vllm", "sglang", "trtllm")
TPS = (1, 2, 4, 8)
PUBLISHED = ROOT / "docs" / "judge" / "lambda_vllm_p10.csv"


def tpot_ms(engine: str, tp: int, cost_model: str) -> float | None:
    from simengine.api import run_engine
    from simengine.config.loader import from_dict
    from simengine.config.scenario import Scenario
    from simengine.errors import InputError

    sc = from_dict(Scenario, {
        "name": "tp", "seed": 1, "horizon_s": 1e6, "drain_s": 1e6,
        "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-70b", "weight_dtype": "fp8", "tp": tp,
                       "cost_model": cost_model},
        "workload": {"arrival": {"process": "closed_loop", "concurrency": 1}, "num_requests": 8,
                     "input_tokens": {"dist": "constant", "value": 1024},
                     "output_tokens": {"dist": "constant", "value": 256}},
        "engines": [engine]}, source="tp_scaling")
    try:
        return run_engine(sc, sc.engines[0]).summary["mean_tpot_ms"]
    except InputError:
        return None   # does not fit at this TP


def published() -> list[tuple[int, float, float]]:
    """(tp, measured, simulated) median TPOT of the published vLLM v0.6.0 runs of this model on H100."""
    from simengine.validate.measurements import read_measurements
    from simengine.validate.run import run_row

    rows = [r for r in read_measurements(PUBLISHED) if r.model == "llama-3.1-70b" and r.weight_dtype == "fp8"
            and r.hardware == "h100_sxm" and "v0.6.0" in r.notes and r.metric == "median_tpot_ms"]
    return sorted((r.tp, r.value, run_row(r).predicted) for r in rows)


def main() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {(e, cm): [tpot_ms(e, tp, cm) for tp in TPS] for e in ENGINES for cm in ("auto", "roofline")}
    print(f"{'engine':8s} {'model':9s} " + " ".join(f"{'TP' + str(t):>8s}" for t in TPS))
    for (e, cm), vals in rows.items():
        print(f"{e:8s} {cm:9s} " + " ".join(f"{v:8.2f}" if v else f"{'-':>8s}" for v in vals))
    points = published()
    print("\npublished vLLM v0.6.0 runs (10 prompts at once, median TPOT ms): TP, measured, simulated, error")
    for tp, measured, simulated in points:
        print(f"TP{tp}  {measured:7.2f}  {simulated:7.2f}  {100 * (simulated / measured - 1):+6.1f}%")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, e in enumerate(ENGINES):
        for cm, ls in (("auto", "-"), ("roofline", ":")):
            pts = [(t, v) for t, v in zip(TPS, rows[(e, cm)]) if v]
            ax.plot([t for t, _ in pts], [v for _, v in pts], ls, marker="o", color=f"C{i}",
                    label=f"{e} ({'measured kernels' if cm == 'auto' else 'roofline'})")
    tps = [p[0] for p in points]
    ax.plot(tps, [p[1] for p in points], "s", color="k", label="vLLM v0.6.0, 10 prompts at once: published (Lambda)")
    ax.plot(tps, [p[2] for p in points], "--", marker="x", color="k", label="the same runs simulated")
    ax.set_xscale("log", base=2)
    ax.set_xticks(TPS, [str(t) for t in TPS])
    ax.set_xlabel("tensor parallel degree (H100 SXM, NVLink)")
    ax.set_ylabel("TPOT, ms")
    ax.set_title("Llama-3.1-70B FP8: TPOT against TP (lines: one user, 1024 in / 256 out)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6.5)
    fig.tight_layout()
    out = ROOT / "docs" / "tp_scaling.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
