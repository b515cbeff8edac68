"""Length and time distributions described in YAML ({dist: lognormal, mean: 200, sigma: 0.7, max: 2048})."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from simengine.errors import InputError
from simengine.workload.datasets import check_table, sample_table, scale_for_mean


@dataclass(frozen=True, kw_only=True)
class Dist:
    """A scalar distribution. lognormal: `mean` is the distribution's mean, `sigma` the log-space std.
    empirical: a dataset's length table (simengine/workload/datasets.py) rescaled so the clipped sample has `mean`
    (the table's own mean when `mean` is not given); `min`/`max` default to the table's bounds."""

    dist: Literal["constant", "uniform", "lognormal", "normal", "exponential", "empirical"] = "constant"
    value: float | None = None   # constant
    mean: float | None = None    # lognormal, normal, exponential
    sigma: float | None = None   # lognormal (log space), normal
    low: float | None = None     # uniform
    high: float | None = None    # uniform (inclusive for integers)
    min: float | None = None     # clip after sampling
    max: float | None = None
    table: str | None = None     # empirical: a table name in simengine/workload/datasets.py (e.g. sharegpt_input)

    def __post_init__(self):
        need = {"constant": ("value",), "uniform": ("low", "high"), "lognormal": ("mean", "sigma"),
                "normal": ("mean", "sigma"), "exponential": ("mean",), "empirical": ()}[self.dist]
        for k in need:
            v = getattr(self, k)
            if v is None:
                raise InputError(f"{self.dist} needs '{k}'", field=k)
            if not math.isfinite(v) or v < 0:
                raise InputError(f"must be a finite number >= 0, got {v}", field=k)
        if self.dist == "uniform" and self.low > self.high:
            raise InputError(f"low {self.low} > high {self.high}", field="low")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise InputError(f"min {self.min} > max {self.max}", field="min")
        if (self.dist == "empirical") != (self.table is not None):
            raise InputError("'table' goes with dist: empirical (and empirical needs one)", field="table")
        if self.dist == "empirical":
            try:
                knots = check_table(self.table)
                lo, hi = self._bounds(knots)
                if self.mean is not None:
                    scale_for_mean(self.table, float(self.mean), lo, hi)
            except ValueError as exc:
                raise InputError(str(exc), field="table" if "table" in str(exc) else "mean") from None

    def _bounds(self, knots) -> tuple[float, float]:
        return (self.min if self.min is not None else knots[0][0], self.max if self.max is not None else knots[-1][0])

    def sample(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray | float:
        size = n if n is not None else None
        if self.dist == "constant":
            x = np.full(n, self.value, dtype=float) if n is not None else float(self.value)
        elif self.dist == "uniform":
            x = rng.uniform(self.low, self.high, size)
        elif self.dist == "lognormal":
            mu = math.log(max(self.mean, 1e-12)) - self.sigma ** 2 / 2
            x = rng.lognormal(mu, self.sigma, size)
        elif self.dist == "empirical":
            lo, hi = self._bounds(check_table(self.table))
            scale = 1.0 if self.mean is None else scale_for_mean(self.table, float(self.mean), lo, hi)
            return sample_table(self.table, rng, n, scale=scale, lo=lo, hi=hi)
        elif self.dist == "normal":
            x = rng.normal(self.mean, self.sigma, size)
        else:
            x = rng.exponential(self.mean, size)
        if self.min is None and self.max is None:
            return x
        lo = self.min if self.min is not None else -math.inf
        hi = self.max if self.max is not None else math.inf
        if n is None:  # a scalar: Python's min/max, ~20x cheaper than np.clip on one value
            return min(max(float(x), lo), hi)
        return np.clip(x, lo, hi)

    def sample_int(self, rng: np.random.Generator, n: int | None = None, *, at_least: int = 1):
        """Integer samples (uniform is inclusive of `high`), never below `at_least`."""
        if self.dist == "uniform":
            x = rng.integers(int(self.low), int(self.high) + 1, n)
            return np.maximum(x, at_least) if n is not None else max(int(x), at_least)
        x = self.sample(rng, n)
        if n is None:
            return max(int(round(x)), at_least)
        return np.maximum(np.rint(x).astype(np.int64), at_least)
