"""Re-price every calibration row for a trial set of named terms, and a small bounded least-squares solver.

All rows' recorded steps are concatenated into one set of feature arrays; each step knows its row, its device
group, the dtype keys of its ops and its engine, so one pass of `features.reprice` prices every step and
`np.add.reduceat` folds the steps back into each row's metric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import numpy as np

from simengine.config.hardware import load_hardware
from simengine.cost.roofline import FEATURES, TERM_NAMES
from simengine.validate.features import ENGINE_FIELDS, reprice
from simengine.validate.run import Prediction

# device terms calibration may fit, as (hardware YAML name, DeviceTerms fields it sets)
DEVICE_TERMS = {"memory_bandwidth_fraction": ("memory_fraction",), "kernel_floor_s": ("kernel_floor_s",)}
GEMM_FIELDS = ("g_linear", "g_lm_head", "g_attn")   # DeviceTerms fields set by gemm_fraction.<dtype key>


@dataclass(frozen=True)
class Param:
    """One fitted term: `group` is a device group ('hw:a100_80g_sxm', 'vendor:apple') or an engine name; `prior` the
    value calibration starts from and is pulled back towards (the YAML's or the engine module's)."""

    group: str
    name: str
    lo: float
    hi: float
    scale: float        # typical magnitude: the solver works in units of this
    prior: float

    @property
    def key(self) -> str:
        return f"{self.group}.{self.name}"

    @property
    def is_device(self) -> bool:
        return self.group.startswith(("hw:", "vendor:"))


def _weighted(fun, w: np.ndarray, z: np.ndarray) -> np.ndarray:
    """`fun`'s residuals at `z`, weighted (the robust loss's current weights)."""
    return w * fun(z)


def dtype_key(device: str, dtype: str) -> str:
    """The gemm_fraction entry a compute dtype uses on a device (its own entry, else `default`); '' for GEMMs at
    an engine's own kernel rate, which no device fraction sets."""
    if not dtype:
        return ""
    return dtype if dtype in load_hardware(device).gemm_fractions else "default"


class FitData:
    """Flat per-step arrays over all rows, with the indices that map steps to rows, device groups and engines."""

    def __init__(self, preds: list[Prediction], hw_group: dict[str, str]):
        self.preds = preds
        self.hw_groups = sorted(set(hw_group.values()))
        self.engines = sorted(set(p.engine for p in preds))
        cols: dict[str, list] = {k: [] for k in (*FEATURES, "seqs", "structured", "graph", "gpu_factor", "w", "seg",
                                                 "launches", "stages", "steps_per_schedule", "overlap", "grammar",
                                                 "hwg", "eng", *GEMM_FIELDS)}
        base_dev: dict[str, list] = {k: [] for k in TERM_NAMES}
        base_eng: dict[str, list] = {k: [] for k in ENGINE_FIELDS}
        numer: list[float] = []
        rate: list[bool] = []
        row_start: list[int] = []
        offset: list[float] = []
        seg = 0
        for p in preds:
            assert p.readout is not None, "a calibration row without its readout"
            row_start.append(seg)
            numer.append(p.readout.numerator)
            rate.append(p.readout.rate)
            offset.append(p.readout.offset_s)
            for sf, w in zip(p.features, p.readout.weights, strict=True):
                n = len(sf)
                for k in FEATURES:
                    cols[k].append(np.broadcast_to(sf.f[k], (n,)))
                for k, v in (("seqs", sf.seqs), ("structured", sf.structured), ("graph", sf.graph),
                             ("gpu_factor", sf.gpu_factor), ("w", w),
                             ("seg", np.full(n, seg)), ("launches", np.full(n, sf.launches)),
                             ("stages", np.full(n, sf.stages)),
                             ("steps_per_schedule", np.full(n, sf.steps_per_schedule)),
                             ("overlap", np.full(n, sf.overlap)), ("grammar", np.full(n, sf.grammar_mask_s)),
                             ("hwg", np.full(n, self.hw_groups.index(hw_group[sf.device])
                                             if sf.device in hw_group else -1)),
                             ("eng", np.full(n, self.engines.index(p.engine)))):
                    cols[k].append(v)
                for field, dtype in zip(GEMM_FIELDS, sf.dtypes, strict=True):
                    cols[field].append(np.full(n, dtype_key(sf.device, dtype), dtype=object))
                for k in TERM_NAMES:
                    base_dev[k].append(np.full(n, getattr(sf.terms, k)))
                for k in ENGINE_FIELDS:
                    base_eng[k].append(np.full(n, sf.engine[k]))
                seg += 1
        self.cols = {k: np.concatenate(v) for k, v in cols.items()}
        self.cols["graph"] = self.cols["graph"].astype(bool)
        self.cols["overlap"] = self.cols["overlap"].astype(bool)
        self.base_dev = {k: np.concatenate(v) for k, v in base_dev.items()}
        self.base_eng = {k: np.concatenate(v) for k, v in base_eng.items()}
        self.num_segs = seg
        self.row_start = np.array(row_start)
        self.numer, self.rate = np.array(numer), np.array(rate, dtype=bool)
        self.offset = np.array(offset)
        self.measured = np.array([p.row.value for p in preds])
        self.steps = SimpleNamespace(f={k: self.cols[k] for k in FEATURES}, seqs=self.cols["seqs"],
                                     structured=self.cols["structured"], graph=self.cols["graph"],
                                     gpu_factor=self.cols["gpu_factor"],
                                     grammar_mask_s=self.cols["grammar"], launches=self.cols["launches"],
                                     stages=self.cols["stages"], steps_per_schedule=self.cols["steps_per_schedule"],
                                     overlap=self.cols["overlap"], terms=None, engine=None)

    def predict(self, params: list[Param], values: np.ndarray) -> np.ndarray:
        """Each row's metric with the given params set to `values` (the others as recorded)."""
        dev = {k: v.copy() for k, v in self.base_dev.items()}
        eng = {k: v.copy() for k, v in self.base_eng.items()}
        c = self.cols
        for p, v in zip(params, values, strict=True):
            if p.is_device:
                sel = c["hwg"] == self.hw_groups.index(p.group)
                if p.name.startswith("gemm_fraction."):
                    key = p.name.split(".", 1)[1]
                    for field in GEMM_FIELDS:
                        dev[field][sel & (c[field] == key)] = v
                else:
                    for field in DEVICE_TERMS[p.name]:
                        dev[field][sel] = v
            else:
                eng[p.name][c["eng"] == self.engines.index(p.group)] = v
        t = reprice(self.steps, SimpleNamespace(**dev), eng)  # type: ignore[arg-type]  # features in columns
        seg_sum = np.bincount(c["seg"], weights=c["w"] * t, minlength=self.num_segs)
        span = np.add.reduceat(seg_sum, self.row_start) + self.offset
        return np.where(self.rate, self.numer / np.maximum(span, 1e-30), 1e3 * span)


def least_squares(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, lo: np.ndarray, hi: np.ndarray, *,
                  iterations: int = 80, huber: float | None = None, plain: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt with box constraints (steps projected on the box). With `huber`, iteratively reweighted:
    the first `plain` residuals beyond `huber` are down-weighted by huber / |r| (weights fixed for each LM solve,
    refreshed between solves); the rest (prior terms) stay quadratic.

    Returns (x, unweighted residuals at x). Forward-difference Jacobian; `fun` maps x to residuals.
    """
    x = np.clip(np.asarray(x0, dtype=float), lo, hi)
    if huber is None:
        return _lm(fun, x, lo, hi, iterations)
    n = len(fun(x)) if plain is None else plain
    for _ in range(6):
        r = fun(x)
        w = np.ones(len(r))
        a = np.abs(r[:n])
        w[:n] = np.sqrt(np.where(a <= huber, 1.0, huber / np.maximum(a, 1e-12)))
        x_new, _ = _lm(partial(_weighted, fun, w), x, lo, hi, iterations)
        moved = np.max(np.abs(x_new - x))
        x = x_new
        if moved < 1e-6:
            break
    return x, fun(x)


def _lm(fun: Callable[[np.ndarray], np.ndarray], x: np.ndarray, lo: np.ndarray, hi: np.ndarray,
        iterations: int) -> tuple[np.ndarray, np.ndarray]:
    lam = 1e-2
    r = fun(x)
    cost = float(np.sum(r ** 2))
    for _ in range(iterations):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            h = 1e-6 * max(1.0, abs(x[j]))
            xj = x.copy()
            xj[j] = xj[j] + h if xj[j] + h <= hi[j] else xj[j] - h
            jac[:, j] = (fun(xj) - r) / (xj[j] - x[j])
        hess, grad = jac.T @ jac, jac.T @ r
        improved = False
        for _ in range(12):
            step = np.linalg.solve(hess + lam * (np.diag(np.diag(hess)) + 1e-9 * np.eye(len(x))), -grad)
            xn = np.clip(x + step, lo, hi)
            rn = fun(xn)
            cn = float(np.sum(rn ** 2))
            if np.all(np.isfinite(rn)) and cn < cost:
                improved = cost - cn > 1e-12 * max(cost, 1e-12)
                x, r, cost, lam = xn, rn, cn, max(lam / 3, 1e-9)
                break
            lam *= 8
        if not improved:
            break
    return x, r
