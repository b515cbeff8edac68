"""Length and time distributions described in YAML ({dist: lognormal, mean: 200, sigma: 0.7, max: 2048})."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np

from simengine.config.loader import MAX_TOKENS, Checked, Range
from simengine.errors import InputError
from simengine.workload.datasets import check_table, sample_table, scale_for_mean

Magnitude = Annotated[float, Range(0, 1e12)]          # a time, count or length: never negative
TokenCount = Annotated[float, Range(1, MAX_TOKENS, unit="tokens (set max: to cap a long tail)")]


@dataclass(frozen=True, kw_only=True)
class Dist(Checked):
    """A scalar distribution. lognormal: `mean` is the distribution's mean, `sigma` the log-space std.
    empirical: a dataset's length table (simengine/workload/datasets.py) rescaled so the clipped sample has `mean`
    (the table's own mean when `mean` is not given); `min`/`max` default to the table's bounds."""

    dist: Literal["constant", "uniform", "lognormal", "normal", "exponential", "empirical"] = "constant"
    value: Magnitude | None = None   # constant
    mean: Magnitude | None = None    # lognormal, normal, exponential
    sigma: Annotated[float, Range(0, 10)] | None = None   # lognormal (log space), normal
    low: Magnitude | None = None     # uniform
    high: Magnitude | None = None    # uniform (inclusive for integers)
    min: Magnitude | None = None     # clip after sampling
    max: Magnitude | None = None
    table: str | None = None     # empirical: a table name in simengine/workload/datasets.py (e.g. sharegpt_input)

    def __post_init__(self):
        super().__post_init__()
        need = {"constant": ("value",), "uniform": ("low", "high"), "lognormal": ("mean", "sigma"),
                "normal": ("mean", "sigma"), "exponential": ("mean",), "empirical": ()}[self.dist]
        for k in need:
            if getattr(self, k) is None:
                raise InputError(f"{self.dist} needs '{k}'", field=k)
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

    def _given(self, name: str) -> float:
        """A parameter __post_init__ required for this `dist` (never None here)."""
        value = getattr(self, name)
        assert value is not None, f"{self.dist} without {name}"
        return value

    def draw_family(self) -> tuple[str, tuple[float, ...]] | None:
        """The numpy Generator method `sample` draws one value with and its parameters; ('constant', ()) for a
        constant (no draw), None where a value takes other draws (uniform integers, empirical tables). The method
        given arrays of parameters draws, element by element, exactly what calls for one value each would."""
        if self.dist == "constant":
            return "constant", ()
        if self.dist == "lognormal":
            sigma = self._given("sigma")
            return "lognormal", (math.log(max(self._given("mean"), 1e-12)) - sigma ** 2 / 2, sigma)
        if self.dist == "normal":
            return "normal", (self._given("mean"), self._given("sigma"))
        if self.dist == "exponential":
            return "exponential", (self._given("mean"),)
        return None

    def sample(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray | float:
        size = n if n is not None else None
        x: np.ndarray | float
        if self.dist == "constant":
            x = np.full(n, self._given("value"), dtype=float) if n is not None else float(self._given("value"))
        elif self.dist == "uniform":
            x = rng.uniform(self._given("low"), self._given("high"), size)
        elif self.dist == "empirical":
            table = str(self.table)
            lo, hi = self._bounds(check_table(table))
            scale = 1.0 if self.mean is None else scale_for_mean(table, float(self.mean), lo, hi)
            return sample_table(table, rng, n, scale=scale, lo=lo, hi=hi)
        else:
            method, params = self.draw_family()  # type: ignore[misc]   # lognormal, normal, exponential
            x = getattr(rng, method)(*params, size)
        if n is not None:
            return self.clip(x)
        if self.min is None and self.max is None:
            return x
        # a scalar: Python's min/max, ~20x cheaper than np.clip on one value
        return min(max(float(x), self.min if self.min is not None else -math.inf),
                   self.max if self.max is not None else math.inf)

    def lowest(self) -> float:
        """A value no draw falls below: the constant, uniform's low, an empirical table's lower bound, 0 for the
        open-ended families; then clipped as draws are."""
        if self.dist == "constant":
            low = self._given("value")
        elif self.dist == "uniform":
            low = self._given("low")
        elif self.dist == "empirical":
            low = self._bounds(check_table(str(self.table)))[0]
        else:
            low = 0.0 if self.dist != "normal" else -math.inf
        return float(self.clip(low))

    def sample_int(self, rng: np.random.Generator, n: int | None = None, *, at_least: int = 1):
        """Integer samples (uniform is inclusive of `high`), never below `at_least`."""
        if self.dist == "uniform":
            drawn = rng.integers(int(self._given("low")), int(self._given("high")) + 1, n)
            if self.min is not None or self.max is not None:   # clipped as every other family's draws
                return self.to_int(self.clip(drawn), n, at_least)
            return np.maximum(drawn, at_least) if n is not None else max(int(drawn), at_least)
        return self.to_int(self.sample(rng, n), n, at_least)

    def to_int(self, x, n: int | None = None, at_least: int = 1):
        """`sample_int`'s values from `sample`'s (round half to even, never below `at_least`): one, or an array."""
        if n is None:
            return max(round(float(x)), at_least)
        return np.maximum(np.rint(x).astype(np.int64), at_least)

    def clip(self, x: np.ndarray | float) -> np.ndarray | float:
        """`sample`'s clipping of an array of raw draws."""
        if self.min is None and self.max is None:
            return x
        return np.clip(x, self.min if self.min is not None else -math.inf,
                       self.max if self.max is not None else math.inf)


@dataclass(frozen=True, kw_only=True)
class TokenDist(Dist):
    """A distribution of token lengths: every value it names is at least one token and at most MAX_TOKENS."""

    value: TokenCount | None = None
    mean: TokenCount | None = None
    low: TokenCount | None = None
    high: TokenCount | None = None
    min: TokenCount | None = None
    max: TokenCount | None = None
