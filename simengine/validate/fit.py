"""Re-price every calibration row for a trial set of named terms, and a small bounded least-squares solver.

All rows' steps are concatenated into flat arrays; each step knows its row, its hardware group and its engine,
so one numpy pass prices every step and `np.add.reduceat` folds the steps back into each row's metric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from simengine.cost.calibrated import PROPOSED_TERMS
from simengine.validate.run import Prediction

HOST_TERMS = ("scheduler_cpu_s", "output_cpu_s")
TERM_NAMES = (*PROPOSED_TERMS, *HOST_TERMS)


@dataclass(frozen=True)
class Param:
    """One fitted term: `group` is a hardware group ('hw:a100_80g_sxm', 'vendor:apple') or an engine name."""

    group: str
    name: str
    lo: float
    hi: float
    scale: float        # typical magnitude: the solver works in units of this

    @property
    def key(self) -> str:
        return f"{self.group}.{self.name}"


class FitData:
    """Flat per-step arrays over all rows, with the indices that map steps to rows, groups and engines."""

    def __init__(self, preds: list[Prediction], hw_group: dict[str, str], base_terms: dict[str, dict[str, float]]):
        self.preds = preds
        self.hw_groups = sorted(set(hw_group[p.row.hardware] for p in preds))
        self.engines = sorted(set(p.engine for p in preds))
        cols: dict[str, list] = {k: [] for k in ("lin_c", "lin_m", "att_c", "att_m", "comm_fixed", "ring", "hops",
                                                 "seqs", "host_extra", "graph", "w", "seg")}
        scal: dict[str, list] = {k: [] for k in ("layers", "launch", "replay", "overlap", "hwg", "eng")}
        self.base = {t: [] for t in TERM_NAMES}
        seg_row, seg = [], 0
        self.numer, self.rate, self.row_start = [], [], []
        for i, p in enumerate(preds):
            self.row_start.append(seg)
            self.numer.append(p.readout.numerator)
            self.rate.append(p.readout.rate)
            terms = {**PROPOSED_TERMS, **base_terms.get(p.engine, {})}
            for f, w in zip(p.features, p.readout.weights, strict=True):
                n = len(f)
                for k in ("lin_c", "lin_m", "att_c", "att_m", "comm_fixed", "ring", "hops", "seqs", "host_extra",
                          "graph"):
                    cols[k].append(getattr(f, k))
                cols["w"].append(w)
                cols["seg"].append(np.full(n, seg))
                for k, v in (("layers", f.layers), ("launch", f.launch_s), ("replay", f.replay_s),
                             ("overlap", f.overlap), ("hwg", self.hw_groups.index(hw_group[p.row.hardware])),
                             ("eng", self.engines.index(p.engine))):
                    scal[k].append(np.full(n, v))
                for t in TERM_NAMES:
                    v = {"scheduler_cpu_s": f.scheduler_cpu_s, "output_cpu_s": f.output_cpu_s}.get(t, terms.get(t))
                    self.base[t].append(np.full(n, v))
                seg_row.append(i)
                seg += 1
        cat = {k: np.concatenate(v) for k, v in cols.items()}
        self.__dict__.update(cat)
        self.__dict__.update({k: np.concatenate(v) for k, v in scal.items()})
        self.base = {t: np.concatenate(v) for t, v in self.base.items()}
        self.graph = self.graph.astype(bool)
        self.overlap = self.overlap.astype(bool)
        self.num_segs = seg
        self.row_start = np.array(self.row_start)
        self.numer, self.rate = np.array(self.numer), np.array(self.rate, dtype=bool)
        self.measured = np.array([p.row.value for p in preds])

    def predict(self, g: np.ndarray, m: np.ndarray, terms: dict[str, dict[int, float]]) -> np.ndarray:
        """Each row's metric for per-hardware-group fractions g, m and per-engine term overrides."""
        x = {}
        for t in TERM_NAMES:
            arr = self.base[t]
            over = terms.get(t)
            if over:
                arr = arr.copy()
                for e, v in over.items():
                    arr[self.eng == e] = v
            x[t] = arr
        gg, mm = g[self.hwg], m[self.hwg]
        gpu = (np.maximum(self.lin_c / gg, self.lin_m / mm) + np.maximum(self.att_c / gg, self.att_m / mm)
               + self.comm_fixed + self.ring / x["allreduce_bandwidth_fraction"]
               + self.hops * x["allreduce_hop_latency_s"] + self.layers * x["layer_latency_s"])
        total = np.where(self.graph, gpu + self.replay, np.maximum(gpu, self.launch))
        host = x["scheduler_cpu_s"] + x["output_cpu_s"] + x["seq_cpu_s"] * self.seqs + self.host_extra
        t = total + np.where(self.overlap, np.maximum(0.0, host - total), host)
        seg_sum = np.bincount(self.seg, weights=self.w * t, minlength=self.num_segs)
        span = np.add.reduceat(seg_sum, self.row_start)
        return np.where(self.rate, self.numer / np.maximum(span, 1e-30), 1e3 * span)


def least_squares(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, lo: np.ndarray, hi: np.ndarray, *,
                  iterations: int = 80, huber: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt with box constraints (steps projected on the box), optionally Huber-weighted (IRLS).

    Returns (x, unweighted residuals at x). Forward-difference Jacobian; `fun` maps x to residuals.
    """
    x = np.clip(np.asarray(x0, dtype=float), lo, hi)
    lam = 1e-2

    def weighted(r: np.ndarray) -> np.ndarray:
        if huber is None:
            return r
        a = np.abs(r)
        return r * np.sqrt(np.where(a <= huber, 1.0, huber / np.maximum(a, 1e-12)))

    r = fun(x)
    cost = float(np.sum(weighted(r) ** 2))
    for _ in range(iterations):
        rw = weighted(r)
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            h = 1e-6 * max(1.0, abs(x[j]))
            xj = x.copy()
            xj[j] = xj[j] + h if xj[j] + h <= hi[j] else xj[j] - h
            jac[:, j] = (weighted(fun(xj)) - rw) / (xj[j] - x[j])
        hess, grad = jac.T @ jac, jac.T @ rw
        improved = False
        for _ in range(12):
            step = np.linalg.solve(hess + lam * (np.diag(np.diag(hess)) + 1e-9 * np.eye(len(x))), -grad)
            xn = np.clip(x + step, lo, hi)
            rn = fun(xn)
            cn = float(np.sum(weighted(rn) ** 2))
            if np.all(np.isfinite(rn)) and cn < cost:
                improved = cost - cn > 1e-12 * max(cost, 1e-12)
                x, r, cost, lam = xn, rn, cn, max(lam / 3, 1e-9)
                break
            lam *= 8
        if not improved:
            break
    return x, r
