"""`simengine calibrate`: fit only named terms to measurements, cross-validate by hardware, write with provenance.

Fitted terms (nothing per row):
- per device, or per vendor for devices with fewer than MIN_DEVICE_ROWS usable rows: `gemm_fraction` and
  `memory_bandwidth_fraction` (hardware YAML `efficiency:`);
- per engine, the overhead terms in ENGINE_FREE_TERMS (simengine/engines/calibration.yaml).
The objective is the sum of squared log(predicted / measured), Huber-weighted, over rows whose prediction is
a function of step times (step metrics, offline throughputs); rows flagged SUSPECT are left out and rows that
repeat one configuration (a prefill measured once per output length) share one unit of weight.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simengine.config.hardware import hardware_files, load_hardware
from simengine.cost.calibrated import read_engine_terms
from simengine.validate.calibration_io import write_engine_terms, write_hardware_calibration
from simengine.validate.fit import FitData, Param, least_squares
from simengine.validate.measurements import read_measurements
from simengine.validate.run import Prediction, run_rows

MIN_DEVICE_ROWS = 6     # fewer usable rows than this: the device shares its vendor's fractions
HUBER = 0.10            # beyond 10 % (log) residuals count linearly: the spread of repeated or second-hand values
HW_TERMS = {"gemm_fraction": (0.1, 0.9), "memory_bandwidth_fraction": (0.3, 0.92)}
# Engine terms fitted when an engine has rows, with bounds and scale. Few, and each a mechanism:
ENGINE_FREE_TERMS: dict[str, dict[str, tuple[float, float, float]]] = {
    # the unnamed Splitwise stack: eager per-layer latency, all-reduce latency growing with tp and its achieved
    # bandwidth (prefill scales poorly with tp), host time per sequence (decode grows with batch at fixed bytes)
    "generic": {"layer_latency_s": (0.0, 2e-3, 1e-4), "allreduce_hop_latency_s": (0.0, 1e-4, 1e-5),
                "allreduce_bandwidth_fraction": (0.05, 1.0, 0.5), "seq_cpu_s": (0.0, 2e-3, 1e-4)},
    # llama.cpp: a fixed latency per layer per step (many small ggml kernels) on top of the weight stream
    "llamacpp": {"layer_latency_s": (0.0, 1e-3, 1e-4)},
    # TensorRT-LLM: the latency of its all-reduce (custom one-/two-shot kernels) per ring hop, which is what
    # separates its TP8 rows from its TP1/TP2 rows on the same device (its bandwidth fraction fits to 1: not fitted)
    "trtllm": {"allreduce_hop_latency_s": (0.0, 5e-5, 1e-5)},
}


@dataclass
class FitResult:
    params: list[Param]
    values: dict[str, float]          # Param.key -> fitted value
    hw_group: dict[str, str]          # device -> group
    predicted: np.ndarray             # per row of `preds`
    preds: list[Prediction]

    def errors_pct(self) -> np.ndarray:
        return 100.0 * (self.predicted / np.array([p.row.value for p in self.preds]) - 1.0)


def usable(preds: list[Prediction]) -> list[Prediction]:
    """Rows calibration can re-price (a step-time readout) and that carry no SUSPECT flag."""
    return [p for p in preds if p.readout is not None and "SUSPECT" not in p.row.flags]


def _config_key(p: Prediction) -> tuple:
    r = p.row
    out = None if r.metric in ("prefill_ms", "prefill_tok_s") else r.output_len
    return (p.engine, r.hardware, r.model, r.weight_dtype, r.kv_dtype, r.tp, r.pp, r.metric, str(r.arrival),
            r.input_len, out, r.ctx_depth)


def row_weights(preds: list[Prediction]) -> np.ndarray:
    """1/n for n rows that measure one configuration (so repeats do not outvote distinct ones)."""
    counts = Counter(_config_key(p) for p in preds)
    return np.array([1.0 / counts[_config_key(p)] for p in preds])


def hardware_groups(preds: list[Prediction], min_rows: int = MIN_DEVICE_ROWS) -> dict[str, str]:
    """Device -> 'hw:<device>' when it has enough rows of its own, else 'vendor:<vendor>'."""
    n = Counter(p.row.hardware for p in preds)
    return {hw: (f"hw:{hw}" if c >= min_rows else f"vendor:{load_hardware(hw).vendor}") for hw, c in n.items()}


def _prior(group: str, name: str, hw_group: dict[str, str]) -> float:
    devs = [d for d, g in hw_group.items() if g == group]
    return float(np.mean([getattr(load_hardware(d), name) for d in devs]))


def fit(preds: list[Prediction], hw_group: dict[str, str], *, fixed_terms: dict[str, dict[str, float]] | None = None,
        fit_engines: set[str] | None = None) -> FitResult:
    """Fit hardware-group fractions and the free engine terms of `fit_engines` (default: all with rows)."""
    base = {**read_engine_terms(), **(fixed_terms or {})}
    data = FitData(preds, hw_group, base)
    engines = [e for e in data.engines if e in ENGINE_FREE_TERMS and (fit_engines is None or e in fit_engines)]
    params = [Param(g, name, lo, hi, 0.5) for g in data.hw_groups for name, (lo, hi) in HW_TERMS.items()]
    params += [Param(e, t, lo, hi, s) for e in engines for t, (lo, hi, s) in ENGINE_FREE_TERMS[e].items()]
    scale = np.array([p.scale for p in params])
    x0 = np.array([(_prior(p.group, p.name, hw_group) if p.group in data.hw_groups
                    else base.get(p.group, {}).get(p.name, 1.0 if p.name.endswith("fraction") else 0.0))
                   for p in params]) / scale
    lo, hi = np.array([p.lo for p in params]) / scale, np.array([p.hi for p in params]) / scale
    weights = np.sqrt(row_weights(preds))
    log_meas = np.log(data.measured)
    ng = len(data.hw_groups)

    def predict(x: np.ndarray) -> np.ndarray:
        v = x * scale
        terms: dict[str, dict[int, float]] = defaultdict(dict)
        for p, val in zip(params[2 * ng:], v[2 * ng:], strict=True):
            terms[p.name][data.engines.index(p.group)] = val
        return data.predict(v[0:2 * ng:2], v[1:2 * ng:2], terms)

    x, _ = least_squares(lambda x: weights * (np.log(predict(x)) - log_meas), x0, lo, hi, huber=HUBER)
    values = {p.key: float(v) for p, v in zip(params, x * scale, strict=True)}
    return FitResult(params, values, hw_group, predict(x), preds)


def engine_terms_of(res: FitResult) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for p in res.params:
        if not p.group.startswith(("hw:", "vendor:")):
            out[p.group][p.name] = res.values[p.key]
    return dict(out)


def leave_one_hardware_out(preds: list[Prediction], full: FitResult) -> list[dict]:
    """For each device: fit without its rows (its vendor's other devices pooled), then predict its rows."""
    out = []
    for dev in sorted({p.row.hardware for p in preds}):
        held = [p for p in preds if p.row.hardware == dev]
        rest = [p for p in preds if p.row.hardware != dev]
        vendor = load_hardware(dev).vendor
        groups = hardware_groups(rest)
        mates = [d for d in groups if load_hardware(d).vendor == vendor]
        for d in mates:
            groups[d] = f"vendor:{vendor}"
        engines_left = {p.engine for p in rest}
        fixed = {e: t for e, t in engine_terms_of(full).items() if e not in engines_left}
        res = fit(rest, groups, fixed_terms=fixed) if rest else None
        if res is not None and mates:
            g_used = f"vendor:{vendor} ({', '.join(sorted(mates))})"
            terms = {**engine_terms_of(res), **fixed}
            hw_vals = {f"vendor:{vendor}": (res.values[f"vendor:{vendor}.gemm_fraction"],
                                            res.values[f"vendor:{vendor}.memory_bandwidth_fraction"])}
        else:
            g_used, terms = "catalog prior (no other device of this vendor)", engine_terms_of(full)
            hw = load_hardware(dev)
            hw_vals = {f"vendor:{vendor}": (hw.gemm_fraction, hw.memory_bandwidth_fraction)}
        data = FitData(held, {dev: f"vendor:{vendor}"}, {**read_engine_terms(), **terms})
        g, m = hw_vals[data.hw_groups[0]]
        pred = data.predict(np.array([g]), np.array([m]), {})
        err = np.abs(100.0 * (pred / data.measured - 1.0))
        own = np.abs(full.errors_pct()[[i for i, p in enumerate(full.preds) if p.row.hardware == dev]])
        out.append({"hardware": dev, "rows": len(held), "fractions_from": g_used, "gemm_fraction": g,
                    "memory_bandwidth_fraction": m, "median_abs_error_pct": float(np.median(err)),
                    "p90_abs_error_pct": float(np.percentile(err, 90)),
                    "in_sample_median_abs_error_pct": float(np.median(own)),
                    "engine_terms_from_own_rows": sorted(fixed)})
    return out


def format_fit(full: FitResult, loho: list[dict] | None, n_total: int) -> str:
    lines = [f"calibration rows used: {len(full.preds)} of {n_total} (others: skipped, not step-time metrics, "
             "or SUSPECT)", "", f"{'term':58s} {'before':>10s} {'fitted':>10s}"]
    for p in full.params:
        if p.group.startswith(("hw:", "vendor:")):
            before = _prior(p.group, p.name, full.hw_group)
        else:
            before = read_engine_terms().get(p.group, {}).get(p.name, float("nan"))
        lines.append(f"{p.key:58s} {before:10.4g} {full.values[p.key]:10.4g}")
    e = np.abs(full.errors_pct())
    lines += ["", f"in-sample: median |err| {np.median(e):.1f}%  p90 {np.percentile(e, 90):.1f}%"]
    if loho:
        lines += ["", "leave-one-hardware-out (device's rows predicted by a fit that never saw them):",
                  f"{'hardware':22s} {'rows':>5s} {'median|err|%':>13s} {'p90|err|%':>10s} {'in-sample':>10s}  "
                  "fractions from"]
        for r in loho:
            note = f"; engine terms from its own rows: {', '.join(r['engine_terms_from_own_rows'])}" \
                if r["engine_terms_from_own_rows"] else ""
            lines.append(f"{r['hardware']:22s} {r['rows']:5d} {r['median_abs_error_pct']:13.1f} "
                         f"{r['p90_abs_error_pct']:10.1f} {r['in_sample_median_abs_error_pct']:10.1f}  "
                         f"{r['fractions_from']}{note}")
    return "\n".join(lines)


def calibrate_file(path: str, *, write: bool = False, jobs: int = 2, cross_validate: bool = True) -> str:
    """Run every row, fit, cross-validate, optionally write; return the printed report."""
    rows = read_measurements(path)
    results = run_rows(rows, jobs=jobs)
    preds = usable([r for r in results if isinstance(r, Prediction)])
    if not preds:
        return "no row can be used for calibration"
    full = fit(preds, hardware_groups(preds))
    loho = leave_one_hardware_out(preds, full) if cross_validate else None
    text = format_fit(full, loho, len(rows))
    if write:
        written = write_results(full, loho, Path(path).name)
        text += "\n\nwrote " + ", ".join(str(p) for p in written)
    return text


def write_results(full: FitResult, loho: list[dict] | None, source: str) -> list[Path]:
    """Hardware YAML efficiency values + calibration provenance, and the engine terms YAML."""
    today = _dt.date.today().isoformat()
    errs = full.errors_pct()
    files = hardware_files()
    cv = {r["hardware"]: r for r in loho or []}
    written = []
    for dev, group in sorted(full.hw_group.items()):
        idx = [i for i, p in enumerate(full.preds) if p.row.hardware == dev]
        pool = sorted(d for d, g in full.hw_group.items() if g == group)
        prov = {"source": source, "date": today, "rows": len(idx),
                "scope": "device" if group.startswith("hw:") else f"{group[7:]} vendor pool: {' '.join(pool)}"}
        if not group.startswith("hw:"):
            prov["pool_rows"] = sum(1 for p in full.preds if full.hw_group[p.row.hardware] == group)
        prov["median_abs_error_pct"] = round(float(np.median(np.abs(errs[idx]))), 2)
        if dev in cv:
            prov["loho_median_abs_error_pct"] = round(cv[dev]["median_abs_error_pct"], 2)
        written.append(write_hardware_calibration(files[dev], full.values[f"{group}.gemm_fraction"],
                                                  full.values[f"{group}.memory_bandwidth_fraction"], prov))
    engines = {}
    for eng, terms in engine_terms_of(full).items():
        idx = [i for i, p in enumerate(full.preds) if p.engine == eng]
        engines[eng] = {"terms": terms, "rows": len(idx), "source": source, "date": today,
                        "median_abs_error_pct": round(float(np.median(np.abs(errs[idx]))), 2)}
    written.append(write_engine_terms(engines))
    return written
