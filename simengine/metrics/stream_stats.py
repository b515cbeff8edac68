"""Exact statistics of samples read in chunks: count, mean, std and np.percentile's linear percentiles of each
(optionally weighted) sample, in memory bounded by the chunk size, by radix selection on the values' bit patterns.

A pass is one read of the chunks; a call makes a few (moments, then 16-bit digits of each wanted rank's key until
the candidates are few enough to sort), whatever the number of values, so a ten-million-request run's percentiles
are the same numbers np.percentile gives on the whole sample without holding it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

# One pass: a fresh iterator of chunks, each a dict of sample name -> (values, weights or None). Values must not be
# NaN; a weight says how many times its value occurs in the sample (inter-token gaps: tokens that had that gap).
Passes = Callable[[], Iterable[dict[str, tuple[np.ndarray, np.ndarray | None]]]]

DIGIT_BITS = 16
GATHER_MAX = 1 << 20   # a rank's candidates are gathered and sorted once at most this many remain
_SIGN = np.uint64(1 << 63)


def sortable_keys(values: np.ndarray) -> np.ndarray:
    """uint64 keys that sort like the float64 values (IEEE 754: flip every bit of a negative, the sign of others)."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def key_value(key: int) -> float:
    """The float64 a sortable key stands for."""
    bits = key ^ (1 << 63) if key & (1 << 63) else ~key & ((1 << 64) - 1)
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


class _Sample:
    """One sample's running sums and, per wanted rank, the key prefix its value is known to have."""

    def __init__(self):
        self.weight = 0.0       # sample size (sum of weights)
        self.entries = 0        # values read (before weighting)
        self.total = 0.0
        self.squares = 0.0
        self.found: dict[int, float] = {}
        # open ranks grouped by what is known of their key: (prefix, shift, weight below the prefix, entries in it)
        self.groups: dict[tuple[int, int, float, int], list[int]] = {}

    @property
    def mean(self) -> float:
        return self.total / self.weight

    def open(self, ranks: Iterable[int]) -> None:
        self.groups = {(0, 64, 0.0, self.entries): sorted(set(ranks))}

    def _resolve_exact(self, group) -> None:
        for rank in self.groups.pop(group):
            self.found[rank] = key_value(group[0])


def _matching(keys: np.ndarray, prefix: int, shift: int) -> np.ndarray | slice:
    if shift >= 64:
        return slice(None)
    return (keys >> np.uint64(shift)) == np.uint64(prefix)


def _lerp(a: float, b: float, t: float) -> float:
    """np.percentile's linear interpolation (its form for t >= 0.5 keeps b exact at t = 1)."""
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def sample_stats(passes: Passes, names: Iterable[str], percentiles: Iterable[float]) -> dict[str, dict | None]:
    """Per sample name: {"count", "mean", "std", p: value for each percentile p} (std with ddof 0), or None when
    the sample is empty. Exact: the same figures as np.mean/np.std/np.percentile on the whole (expanded) sample, up
    to the rounding of sums."""
    names, percentiles = list(names), list(percentiles)
    samples = {n: _Sample() for n in names}
    for chunk in passes():                       # pass 1: sizes and sums
        for name, (v, w) in chunk.items():
            s = samples[name]
            s.entries += len(v)
            s.weight += float(len(v) if w is None else w.sum())
            s.total += float(v.sum() if w is None else np.dot(v, w))
    positions = {}
    for name, s in samples.items():
        if s.weight > 0:
            pos = {p: (s.weight - 1) * (p / 100.0) for p in percentiles}
            positions[name] = pos
            s.open(r for x in pos.values() for r in (math.floor(x), math.ceil(x)))
    squares_done = False
    while not squares_done or any(s.groups for s in samples.values() if s.weight > 0):
        _select_pass(passes, samples, squares=not squares_done)
        squares_done = True
    out: dict[str, dict | None] = {}
    for name, s in samples.items():
        if s.weight <= 0:
            out[name] = None
            continue
        stats: dict[str | float, float] = {"count": s.weight, "mean": s.mean,
                                           "std": math.sqrt(max(s.squares / s.weight, 0.0))}
        for p, x in positions[name].items():
            lo, hi = math.floor(x), math.ceil(x)
            stats[p] = _lerp(s.found[lo], s.found[hi], x - lo)
        out[name] = stats
    return out


def _select_pass(passes: Passes, samples: dict[str, _Sample], *, squares: bool) -> None:
    """One read: squared deviations (first time), and for every open rank either its next 16-bit key digit (a
    weighted histogram of the candidates) or, when few candidates remain, the candidates themselves."""
    hist: dict[tuple[str, tuple], tuple[np.ndarray, np.ndarray]] = {}
    gathered: dict[tuple[str, tuple], list[tuple[np.ndarray, np.ndarray]]] = {}
    for name, s in samples.items():
        for g in s.groups:
            if g[3] <= GATHER_MAX:
                gathered[(name, g)] = []
            else:
                hist[(name, g)] = (np.zeros(1 << DIGIT_BITS), np.zeros(1 << DIGIT_BITS, dtype=np.int64))
    for chunk in passes():
        for name, (v, w) in chunk.items():
            s = samples[name]
            if s.weight <= 0 or not len(v):
                continue
            if squares:
                d = v - s.mean
                s.squares += float(np.dot(d * d, w) if w is not None else np.dot(d, d))
            if not s.groups:
                continue
            keys = sortable_keys(v)
            ww = np.ones(len(v)) if w is None else w.astype(np.float64, copy=False)
            for g in s.groups:
                prefix, shift = g[0], g[1]
                m = _matching(keys, prefix, shift)
                if (name, g) in gathered:
                    gathered[(name, g)].append((keys[m], ww[m]))
                    continue
                digits = ((keys[m] >> np.uint64(shift - DIGIT_BITS)) & np.uint64((1 << DIGIT_BITS) - 1)).astype(np.intp)
                weights, counts = hist[(name, g)]
                weights += np.bincount(digits, weights=ww[m], minlength=1 << DIGIT_BITS)
                counts += np.bincount(digits, minlength=1 << DIGIT_BITS)
    for (name, g), parts in gathered.items():
        s = samples[name]
        keys = np.concatenate([k for k, _ in parts]) if parts else np.empty(0, dtype=np.uint64)
        wts = np.concatenate([w for _, w in parts]) if parts else np.empty(0)
        order = np.argsort(keys, kind="stable")
        keys, ends = keys[order], np.cumsum(wts[order])
        for rank in s.groups.pop(g):
            i = int(np.searchsorted(ends, rank - g[2], side="right"))
            s.found[rank] = key_value(int(keys[min(i, len(keys) - 1)]))
    for (name, g), (weights, counts) in hist.items():
        s = samples[name]
        ends = np.cumsum(weights)
        shift = g[1] - DIGIT_BITS
        for rank in s.groups.pop(g):
            j = min(int(np.searchsorted(ends, rank - g[2], side="right")), len(ends) - 1)
            below = g[2] + (float(ends[j - 1]) if j else 0.0)
            child = ((g[0] << DIGIT_BITS) | j if g[1] < 64 else j, shift, below, int(counts[j]))
            s.groups.setdefault(child, []).append(rank)
            if shift == 0:
                s._resolve_exact(child)
