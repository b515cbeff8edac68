"""Table-driven step cost: per-layer operator times interpolated from a measured CSV (`simengine profile`).

The CSV (one device, one model shape, one dtype and tp) holds rows `op,x,seconds`:
- `linear`: all GEMMs of one transformer layer (QKV, O, gate/up, down) for `x` tokens;
- `attn_prefill`: one layer's causal attention work of `x` query-key pairs (a chunk of c new tokens after k
  cached ones has c * (k + c / 2) pairs);
- `attn_decode`: one layer's decode attention reading `x` cached tokens in total (summed over the batch);
- `lm_head`: the output projection for `x` tokens that need logits.
Lines starting with `#` are metadata (`# key=value`: device, model, dtype, tp, date, torch version).

Between measured points time is interpolated linearly; below the smallest it is the smallest point's time (a
kernel never gets faster than its latency floor); above the largest it grows in proportion to x (the work).
Communication and engine overheads (launches, CUDA graphs, host time) come from the wrapped RooflineCost,
so `TableCost.step(shape)` is a drop-in replacement for `RooflineCost.step(shape)`.
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simengine.core.batch import BatchShape
from simengine.cost.roofline import RooflineCost, StepCost
from simengine.errors import InputError

OPS = ("linear", "attn_prefill", "attn_decode", "lm_head")


@dataclass(frozen=True)
class OpCurve:
    """Measured (x, seconds) points of one operator, sorted by x."""

    x: np.ndarray
    seconds: np.ndarray

    def __call__(self, x: float) -> float:
        if x <= 0:
            return 0.0
        if x <= self.x[0]:
            return float(self.seconds[0])
        if x >= self.x[-1]:
            return float(self.seconds[-1] * x / self.x[-1])
        return float(np.interp(x, self.x, self.seconds))


@dataclass(frozen=True)
class ProfileTable:
    """All operator curves of one profile CSV plus its metadata."""

    curves: dict[str, OpCurve]
    meta: dict[str, str]


def read_profile(path: str | Path) -> ProfileTable:
    """Parse a profile CSV; InputError names the file and line of any problem."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read profile ({exc.__class__.__name__})", source=str(p)) from None
    meta: dict[str, str] = {}
    points: dict[str, list[tuple[float, float]]] = {op: [] for op in OPS}
    body = []
    for n, line in enumerate(lines, start=1):
        if line.startswith("#"):
            key, _, value = line[1:].strip().partition("=")
            if value:
                meta[key.strip()] = value.strip()
        elif line.strip():
            body.append((n, line))
    if not body or [c.strip() for c in body[0][1].split(",")] != ["op", "x", "seconds"]:
        raise InputError("expected a header 'op,x,seconds'", source=str(p))
    for n, line in body[1:]:
        row = next(csv.reader([line]))
        if len(row) != 3 or row[0] not in OPS:
            raise InputError(f"expected op,x,seconds with op in {', '.join(OPS)}", source=f"{p}:{n}")
        try:
            x, s = float(row[1]), float(row[2])
        except ValueError:
            raise InputError("x and seconds must be numbers", source=f"{p}:{n}") from None
        if not (x > 0 and s > 0):
            raise InputError("x and seconds must be > 0", source=f"{p}:{n}")
        points[row[0]].append((x, s))
    missing = [op for op in ("linear", "attn_prefill", "attn_decode") if not points[op]]
    if missing:
        raise InputError(f"no rows for {', '.join(missing)}", source=str(p))
    curves = {}
    for op, pts in points.items():
        if pts:
            pts.sort()
            curves[op] = OpCurve(np.array([a for a, _ in pts]), np.array([b for _, b in pts]))
    return ProfileTable(curves, meta)


class TableCost:
    """Step time from measured per-layer operator curves; comm and overheads from `roofline`."""

    def __init__(self, table: ProfileTable, roofline: RooflineCost):
        self.table, self.roofline = table, roofline
        self.model, self.timing = roofline.model, roofline.timing
        tp = table.meta.get("tp")
        if tp is not None and int(tp) != roofline.tp:
            raise InputError(f"profile was measured for tp={tp}, the deployment has tp={roofline.tp}",
                             field="cost.table")

    def _compute_s(self, shape: BatchShape) -> float:
        c = self.table.curves
        tokens = shape.num_prefill_tokens + max(shape.padded_decode, shape.num_decode)
        layer = c["linear"](tokens)
        pairs = sum(n * (k + n / 2.0) for n, k in shape.prefill_chunks)
        layer += c["attn_prefill"](pairs) + c["attn_decode"](shape.decode_context_tokens)
        head = c["lm_head"](shape.num_logits) if "lm_head" in c else 0.0
        return layer * self.model.num_layers + head

    def decode_steps(self, shape: BatchShape, contexts: np.ndarray) -> np.ndarray:
        """`step` at each decode context, one call each (RooflineCost.decode_steps' rows)."""
        repeat = dataclasses.replace(shape)
        rows = []
        for ctx in contexts.tolist():
            repeat.decode_context_tokens = ctx
            rows.append(self.step(repeat))
        return np.array(rows, dtype=np.float64).reshape(len(rows), 5)

    def step(self, shape: BatchShape) -> StepCost:
        """Measured compute + the roofline's communication, launches, graph replay and exposed host time."""
        base = self.roofline.step(shape)
        compute = self._compute_s(shape)
        gpu = compute + base.comm_s
        t = self.timing
        if shape.cuda_graph:
            total = gpu + t.graph_replay_s
        else:
            total = max(gpu, self.roofline.launch_s)
        exposed = t.exposed_host_s(total)
        return StepCost(total + exposed, compute, 0.0, base.comm_s, total + exposed - compute - base.comm_s)
