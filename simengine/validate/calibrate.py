"""`simengine calibrate`: fit named terms to measurements, pulled towards their documented priors; cross-validate.

Fitted terms (nothing per row):
- per engine with rows, its mechanism terms (ENGINE_TERMS): host time per step and per sequence, and the dispatch
  cost of an eager kernel where its rows ran eagerly. Every engine has priors for them in its module, so an engine
  without rows runs on priors, never bare;
- per device, or per vendor for devices with fewer than MIN_DEVICE_ROWS usable rows, its physical terms
  (gemm_fraction of the dtypes its rows compute in, memory_bandwidth_fraction, kernel_floor_us) - only where the
  roofline prices most of those rows' GPU time (MIN_ROOFLINE_SHARE): measured kernels leave nothing to learn about
  the device. The priors are published microbenchmarks (hardware/*.yaml), so the fit pays for moving away from
  them (PRIOR_SD_DEVICE in log space) and cannot teach a device what one engine's rows happen to need.
The objective is the sum of squared log(predicted / measured), Huber-weighted beyond 20 % (the spread of second-hand
and repeated values), over rows whose prediction is a function of step times (step metrics, offline throughputs);
rows flagged SUSPECT are left out and rows that repeat one configuration share one unit of weight.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simengine.config.hardware import hardware_files, load_hardware
from simengine.validate.calibration_io import write_engine_terms, write_hardware_calibration
from simengine.validate.fit import FitData, Param, dtype_key, least_squares
from simengine.validate.measurements import read_measurements
from simengine.validate.run import Prediction, run_rows

MIN_DEVICE_ROWS = 6       # fewer usable rows than this: the device shares its vendor's terms
MIN_ROOFLINE_SHARE = 0.5  # a device's terms are fitted only where the roofline prices most of its rows' GPU time
HUBER = 0.20              # beyond 20 % (log) residuals count linearly
UNSEEN_STEP = 0.25        # a term moved by this fraction either way that changes no row's prediction: no row sees it
PRIOR_SD_DEVICE = 0.15    # a device term's log-space spread around its published prior
PRIOR_SD_ENGINE = 10.0    # an engine term's log-space spread around its prior (priors are rough estimates)
ZERO_PRIOR_SD = 10.0      # a term whose prior is zero is pulled towards it in units of ten times its scale
DEVICE_BOUNDS = {"gemm_fraction": (0.1, 1.0, 0.5), "memory_bandwidth_fraction": (0.2, 1.0, 0.5),
                 "kernel_floor_s": (0.0, 50e-6, 5e-6)}
# engine mechanism terms: (low, high, scale)
ENGINE_TERMS = {"scheduler_cpu_s": (0.0, 30e-3, 1e-3), "seq_cpu_s": (0.0, 2e-3, 1e-4),
                "kernel_launch_s": (0.5e-6, 100e-6, 1e-5)}


@dataclass
class FitResult:
    params: list[Param]
    values: dict[str, float]          # Param.key -> fitted value
    hw_group: dict[str, str]          # device -> group (fitted devices only)
    predicted: np.ndarray             # per row of `preds`
    preds: list[Prediction]
    unseen: frozenset[str] = frozenset()   # Param.keys no row's prediction responds to (they keep their priors)

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


def roofline_share(preds: list[Prediction]) -> dict[str, float]:
    """Per device: the mean share of its rows' GPU time the roofline prices."""
    shares: dict[str, list[float]] = defaultdict(list)
    for p in preds:
        for sf in p.features:
            shares[sf.device].append(sf.roofline_share)
    return {d: float(np.mean(v)) for d, v in shares.items()}


def hardware_groups(preds: list[Prediction], min_rows: int = MIN_DEVICE_ROWS) -> dict[str, str]:
    """Fitted device -> 'hw:<device>' with enough rows of its own, else 'vendor:<vendor>'. Devices whose rows the
    measured kernels price are not fitted (absent)."""
    n = Counter(p.row.hardware for p in preds)
    share = roofline_share(preds)
    return {hw: (f"hw:{hw}" if c >= min_rows else f"vendor:{load_hardware(hw).vendor}")
            for hw, c in n.items() if share.get(hw, 0.0) >= MIN_ROOFLINE_SHARE}


def device_prior(device: str, term: str) -> float:
    """A device term's published prior: the value before an earlier calibration (kept in its YAML), else the
    YAML's value."""
    hw = load_hardware(device)
    if term in hw.calibration_priors:
        return hw.calibration_priors[term]
    if term.startswith("gemm_fraction."):
        return hw.gemm_fraction(term.split(".", 1)[1])
    return float(getattr(hw, term))


def _device_params(data: FitData, hw_group: dict[str, str]) -> list[Param]:
    out = []
    for g in sorted(set(hw_group.values())):
        devs = [d for d, gg in hw_group.items() if gg == g]
        keys = sorted({dtype_key(sf.device, dt) for p in data.preds for sf in p.features if sf.device in devs
                       for dt in sf.dtypes} - {""})
        for key in keys:
            lo, hi, s = DEVICE_BOUNDS["gemm_fraction"]
            out.append(Param(g, f"gemm_fraction.{key}", lo, hi, s,
                             float(np.mean([device_prior(d, f"gemm_fraction.{key}") for d in devs]))))
        for name in ("memory_bandwidth_fraction", "kernel_floor_s"):
            lo, hi, s = DEVICE_BOUNDS[name]
            out.append(Param(g, name, lo, hi, s, float(np.mean([device_prior(d, name) for d in devs]))))
    return out


def _engine_params(preds: list[Prediction]) -> list[Param]:
    out = []
    by_engine: dict[str, list] = defaultdict(list)
    for p in preds:
        by_engine[p.engine].extend(p.features)
    for eng in sorted(by_engine):
        feats = by_engine[eng]
        eager = any(not sf.graph.all() for sf in feats)
        for name, (lo, hi, s) in ENGINE_TERMS.items():
            if name == "kernel_launch_s" and not eager:
                continue
            prior = float(np.mean([sf.engine[name] for sf in feats]))
            out.append(Param(eng, name, lo, hi, s, min(max(prior, lo), hi)))
    return out


def fit(preds: list[Prediction], hw_group: dict[str, str]) -> FitResult:
    """Fit the device groups' physical terms and the mechanism terms of every engine with rows."""
    data = FitData(preds, hw_group)
    params = _device_params(data, hw_group) + _engine_params(preds)
    scale = np.array([p.scale for p in params])
    prior = np.array([p.prior for p in params])
    lo, hi = np.array([p.lo for p in params]) / scale, np.array([p.hi for p in params]) / scale
    dev = np.array([p.is_device for p in params], dtype=bool)
    weights = np.sqrt(row_weights(preds))
    log_meas = np.log(data.measured)

    def residuals(x: np.ndarray) -> np.ndarray:
        v = x * scale
        rows = weights * (np.log(data.predict(params, v)) - log_meas)
        pull = np.log(np.maximum(v, 1e-12) / np.maximum(prior, 1e-12)) / np.where(dev, PRIOR_SD_DEVICE,
                                                                                   PRIOR_SD_ENGINE)
        pull = np.where(prior <= 0, v / scale / ZERO_PRIOR_SD, pull)
        return np.concatenate([rows, pull])

    if params:
        x, _ = least_squares(residuals, prior / scale, lo, hi, huber=HUBER, plain=len(preds))
    else:
        x = np.zeros(0)
    values = {p.key: float(v) for p, v in zip(params, x * scale, strict=True)}
    predicted = data.predict(params, x * scale)
    return FitResult(params, values, hw_group, predicted, preds, unseen_terms(data, params, x * scale, predicted))


def unseen_terms(data: FitData, params: list[Param], values: np.ndarray, predicted: np.ndarray) -> frozenset[str]:
    """The terms no row responds to at the fitted values: a term moved by UNSEEN_STEP either way leaves every
    prediction as it was. An eager step lasts max(GPU time, launches), so a launch term below every step's GPU
    time is one: the solver leaves it at its prior, and it must not be reported or written as fitted."""
    out = set()
    for i, p in enumerate(params):
        if not values[i]:
            continue
        for f in (1.0 - UNSEEN_STEP, 1.0 + UNSEEN_STEP):
            trial = values.copy()
            trial[i] = values[i] * f
            if not np.array_equal(data.predict(params, trial), predicted):
                break
        else:
            out.add(p.key)
    return frozenset(out)


def engine_terms_of(res: FitResult) -> dict[str, dict[str, float]]:
    """The fitted engine terms, less those no row sees (the engine keeps its module's prior for them)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for p in res.params:
        if not p.is_device and p.key not in res.unseen:
            out[p.group][p.name] = res.values[p.key]
    return dict(out)


def predict_with(preds: list[Prediction], res: FitResult) -> np.ndarray:
    """Rows' metrics with the engine terms of `res` (the devices as recorded: their priors)."""
    data = FitData(preds, {})
    params = [p for p in res.params if not p.is_device and p.group in data.engines]
    return data.predict(params, np.array([res.values[p.key] for p in params]))


def leave_one_hardware_out(preds: list[Prediction], full: FitResult) -> list[dict]:
    """For each device: fit every term on the other devices' rows, then predict its rows with its own priors (as a
    device nobody measured would be) and the engine terms the others taught."""
    out = []
    for dev in sorted({p.row.hardware for p in preds}):
        held = [p for p in preds if p.row.hardware == dev]
        rest = [p for p in preds if p.row.hardware != dev]
        res = fit(rest, hardware_groups(rest)) if rest else full
        own = {p.engine for p in held} - {p.engine for p in rest}
        pred = predict_with(held, res)
        err = np.abs(100.0 * (pred / np.array([p.row.value for p in held]) - 1.0))
        idx = [i for i, p in enumerate(full.preds) if p.row.hardware == dev]
        out.append({"hardware": dev, "rows": len(held), "median_abs_error_pct": float(np.median(err)),
                    "p90_abs_error_pct": float(np.percentile(err, 90)),
                    "in_sample_median_abs_error_pct": float(np.median(np.abs(full.errors_pct()[idx]))),
                    "priced_by": "measured kernels" if roofline_share(held).get(dev, 1) < MIN_ROOFLINE_SHARE
                    else "roofline at its priors", "engines_only_here": sorted(own)})
    return out


def format_fit(full: FitResult, loho: list[dict] | None, n_total: int) -> str:
    lines = [f"calibration rows used: {len(full.preds)} of {n_total} (others: skipped, not step-time metrics, "
             "or SUSPECT)", "", f"{'term':52s} {'prior':>10s} {'fitted':>10s}"]
    for p in full.params:
        note = "  no row sees it: its prior stays" if p.key in full.unseen else ""
        lines.append(f"{p.key:52s} {p.prior:10.4g} {full.values[p.key]:10.4g}{note}")
    fitted_engines = {p.group for p in full.params if not p.is_device}
    if fitted_engines:
        lines.append(f"engines fitted: {', '.join(sorted(fitted_engines))}; all others run on their priors")
    e = np.abs(full.errors_pct())
    lines += ["", f"in-sample: median |err| {np.median(e):.1f}%  p90 {np.percentile(e, 90):.1f}%"]
    if loho:
        lines += ["", "leave-one-hardware-out (the device's rows predicted by a fit that never saw them):",
                  f"{'hardware':22s} {'rows':>5s} {'median|err|%':>13s} {'p90|err|%':>10s} {'in-sample':>10s}  "
                  "priced by"]
        for r in loho:
            note = f"; engine terms from its own rows only: {', '.join(r['engines_only_here'])} (priors)" \
                if r["engines_only_here"] else ""
            lines.append(f"{r['hardware']:22s} {r['rows']:5d} {r['median_abs_error_pct']:13.1f} "
                         f"{r['p90_abs_error_pct']:10.1f} {r['in_sample_median_abs_error_pct']:10.1f}  "
                         f"{r['priced_by']}{note}")
    return "\n".join(lines)


def calibrate_files(paths: list[str], *, write: bool = False, jobs: int = 2, cross_validate: bool = True,
                    test: list[str] | None = None) -> str:
    """Run every row of `paths`, fit, cross-validate by device, optionally judge the fit on the `test` files' rows
    (every metric, re-simulated with the fitted terms) and write; return the printed report."""
    rows = [r for p in paths for r in read_measurements(p)]
    results = _run_with_terms(rows, priors_only(), jobs)   # from the priors, not an earlier fit
    preds = usable([r for r in results if isinstance(r, Prediction)])
    if not preds:
        return "no row can be used for calibration"
    full = fit(preds, hardware_groups(preds))
    fit_frontend(full, rows, jobs)
    loho = leave_one_hardware_out(preds, full) if cross_validate else None
    text = format_fit(full, loho, len(rows))
    for path in test or []:
        text += "\n\n" + judge_on(full, path, jobs)
    if write:
        written = write_results(full, loho, " + ".join(Path(p).name for p in paths))
        text += "\n\nwrote " + ", ".join(str(p) for p in written)
    return text


def priors_only() -> dict:
    """Trial terms that switch every earlier fit off: no engine terms (the engines' module priors) and each device's
    published priors where a `--write` replaced them in its YAML (`calibration.prior_*`)."""
    devices = {name: dict(hw.calibration_priors) for name in hardware_files()
               if (hw := load_hardware(name)).calibration_priors}
    return {"engines": {}, "devices": devices}


FRONTEND_METRICS = ("ttft",)   # a per-request frontend delay shifts TTFT statistics by exactly its size (E2E too,
# but an E2E error is mostly the decode's, which the frontend must not absorb)
MAX_FRONTEND_S = 0.5


def fit_frontend(res: FitResult, rows: list, jobs: int = 2) -> None:
    """Second stage: each engine's frontend latency (`frontend_s`) from its open-loop TTFT rows, which a per-request
    delay shifts by exactly its size while an open-loop schedule stays the same: the median of measured
    minus simulated (the rows re-simulated with the fitted terms and no frontend), at least 0. Only rows of current
    engine versions count. Adds the terms to `res` (in place)."""
    from simengine.sim.build import build_deployment, build_engine
    from simengine.validate.bench_tools import version_params
    from simengine.validate.experiments import Experiment, engine_name, plan_row

    # rows of engine versions older than today's mechanisms (VERSION_KNOBS) ran other frontends and schedulers:
    # their TTFT gaps must not become a frontend latency every current run pays
    picked = [r for r in rows if r.arrival.kind == "poisson" and r.metric.split("_")[1] in FRONTEND_METRICS
              and not version_params(r, engine_name(r))[0]]
    if not picked:
        return
    trial = trial_terms(res)
    for e in {engine_name(r) for r in picked}:
        trial["engines"].setdefault(e, {"terms": {}})["terms"]["frontend_s"] = 0.0
    deltas: dict[str, list[float]] = defaultdict(list)
    priors: dict[str, float] = {}
    for p in _run_with_terms(picked, trial, jobs):
        if isinstance(p, Prediction):
            deltas[p.engine].append(p.row.value - p.predicted)
            if p.engine not in priors:   # the engine module's own value, before any calibration
                exp = plan_row(p.row)
                if isinstance(exp, Experiment):
                    priors[p.engine] = build_engine(exp.entry, build_deployment(exp.scenario)).timing.frontend_s
    for eng, d in sorted(deltas.items()):
        value = min(max(float(np.median(d)) * 1e-3, 0.0), MAX_FRONTEND_S)
        param = Param(eng, "frontend_s", 0.0, MAX_FRONTEND_S, 1e-3, priors.get(eng, 0.0))
        res.params.append(param)
        res.values[param.key] = value


def _run_with_terms(rows: list, terms: dict, jobs: int) -> list:
    """run_rows with a trial set of terms in place of the shipped ones (cost/calibrated.py TRIAL_TERMS_ENV)."""
    import os
    import tempfile

    import yaml

    from simengine.cost.calibrated import TRIAL_TERMS_ENV

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(terms, fh)
    old = os.environ.get(TRIAL_TERMS_ENV)
    os.environ[TRIAL_TERMS_ENV] = fh.name
    try:
        return run_rows(rows, jobs=jobs)
    finally:
        if old is None:
            os.environ.pop(TRIAL_TERMS_ENV, None)
        else:
            os.environ[TRIAL_TERMS_ENV] = old
        Path(fh.name).unlink(missing_ok=True)


def device_params_of(res: FitResult, dev: str, *, seen: bool = True) -> list[Param]:
    """The fitted terms device `dev` takes: its group's, less the GEMM fractions of dtypes it has no entry for
    (a pool fits a `fp8` fraction for its members with FP8 rows; the others priced theirs at `default`), and less
    those no row sees (`seen=False`: only those, which keep the device's own prior, not a pool's mean of them)."""
    hw = load_hardware(dev)
    group = res.hw_group[dev]
    return [p for p in res.params if p.group == group and (p.key not in res.unseen) == seen
            and (not p.name.startswith("gemm_fraction.") or p.name.split(".", 1)[1] in hw.gemm_fractions)]


def trial_terms(res: FitResult) -> dict:
    """The fitted terms as a trial-terms mapping (cost/calibrated.py TRIAL_TERMS_ENV)."""
    devices = {dev: {p.name: res.values[p.key] for p in device_params_of(res, dev)} for dev in res.hw_group}
    return {"engines": {e: {"terms": t} for e, t in engine_terms_of(res).items()}, "devices": devices}


def judge_on(res: FitResult, path: str, jobs: int = 2) -> str:
    """Every row of another measurements file, simulated with the terms `res` fitted: the error it generalises with."""
    from simengine.validate.report import abs_errors

    rows = read_measurements(path)
    results = _run_with_terms(rows, trial_terms(res), jobs)
    preds = [r for r in results if isinstance(r, Prediction)]
    lines = [f"judged on {Path(path).name} with these terms ({len(preds)} of {len(rows)} rows ran):"]
    if preds:
        e = abs_errors(preds)
        lines.append(f"  all: median |err| {np.median(e):.1f}%  p90 {np.percentile(e, 90):.1f}%")
        for eng in sorted({p.engine for p in preds}):
            ee = abs_errors([p for p in preds if p.engine == eng])
            lines.append(f"  {eng:9s} {len(ee):4d} rows: median |err| {np.median(ee):.1f}%  p90 "
                         f"{np.percentile(ee, 90):.1f}%")
    return "\n".join(lines)


def write_results(full: FitResult, loho: list[dict] | None, source: str) -> list[Path]:
    """Fitted device terms into hardware/*.yaml with provenance, and the engine terms YAML."""
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
        prov["median_abs_error_pct"] = round(float(np.median(np.abs(errs[idx]))), 2)
        if dev in cv:
            prov["loho_median_abs_error_pct"] = round(cv[dev]["median_abs_error_pct"], 2)
        fitted = device_params_of(full, dev)
        values = {p.name: full.values[p.key] for p in fitted}
        prov.update({f"prior_{p.name}": device_prior(dev, p.name) for p in fitted})
        priors = {p.name: device_prior(dev, p.name) for p in device_params_of(full, dev, seen=False)}
        written.append(write_hardware_calibration(files[dev], values, prov, priors))
    engines = {}
    for eng, terms in engine_terms_of(full).items():
        idx = [i for i, p in enumerate(full.preds) if p.engine == eng]
        engines[eng] = {"terms": terms, "rows": len(idx), "source": source, "date": today}
        if idx:   # step-time rows; an engine fitted on TTFT rows alone has its frontend term only
            engines[eng]["median_abs_error_pct"] = round(float(np.median(np.abs(errs[idx]))), 2)
    written.append(write_engine_terms(engines))
    return written
