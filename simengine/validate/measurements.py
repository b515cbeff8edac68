"""Read published measurements (docs/validation.md 'Measurement files') into typed rows.

The file is plain comma-separated text with a fixed 17-column header and no quoting (the schema guarantees no
field holds a comma). Every problem is an InputError naming the file, the line and the column.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from simengine.engines import ENGINES
from simengine.errors import InputError

COLUMNS = ("id", "source", "engine", "model", "weight_dtype", "kv_dtype", "hardware", "num_gpus", "tp", "pp",
           "input_len", "output_len", "num_requests", "arrival", "metric", "value", "notes")
RATE_METRICS = ("output_throughput_tok_s", "total_throughput_tok_s", "request_throughput")
STEP_METRICS = ("prefill_ms", "decode_step_ms", "prefill_tok_s", "decode_tok_s")
# Latency statistics as `vllm bench serve` names them (vllm/benchmarks/serve.py): STAT_QUANTITY_ms
LATENCY_STATS = ("mean", "median", "p90", "p99")
LATENCY_QUANTITIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_METRICS = tuple(f"{s}_{q}_ms" for q in LATENCY_QUANTITIES for s in LATENCY_STATS)
METRICS = (*RATE_METRICS, *LATENCY_METRICS, *STEP_METRICS)
ARRIVALS = ("offline", "poisson", "constant", "concurrency", "single", "batch")
FLAGS = ("assumed", "SUSPECT", "CONFLICT", "SECONDARY", "CORRECTED")
_ID = re.compile(r"^[a-z0-9_.-]+$")
_DATASET_FLAG = re.compile(r"--dataset-name[ =]([A-Za-z0-9_-]+)")
_NOTE_ITEM = re.compile(r"^\s*([a-z_][a-z0-9_]*)\s*=\s*(\S.*?)\s*$")


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """How the measured requests arrived: kind plus its number (rate, concurrency or batch size)."""

    kind: str                  # offline | poisson | constant | concurrency | single | batch
    value: float | None = None

    def __str__(self) -> str:
        if self.value is None:
            return self.kind
        v = int(self.value) if float(self.value).is_integer() else self.value
        return f"{self.kind}:{v}"


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One row of the calibration file, typed. Blank integers are None; `line` is the 1-based file line."""

    id: str
    source: str
    engine: str
    model: str
    weight_dtype: str
    kv_dtype: str
    hardware: str
    num_gpus: int
    tp: int
    pp: int
    input_len: int | None
    output_len: int | None
    num_requests: int | None
    arrival: Arrival
    metric: str
    value: float
    notes: str = ""
    line: int = 0
    flags: frozenset[str] = field(default_factory=frozenset)
    # mean output tokens per request of the row's dataset sample as its source's own table implies (output over
    # request throughput of one run, `implied_output_means`); None where the notes state the means or nothing does
    implied_output_mean: float | None = None

    @property
    def note_items(self) -> dict[str, str]:
        """The notes' machine-readable `key=value` items (README 'Machine-readable notes'); free text ignored.
        A value is the item's text after '=' (e.g. `dataset=sharegpt (500 prompts; ...)` -> 'sharegpt (500')."""
        out: dict[str, str] = {}
        for part in self.notes.split(";"):
            m = _NOTE_ITEM.match(part)
            if m and m.group(1) not in out:
                out[m.group(1)] = m.group(2)
        return out

    def note_flag(self, key: str) -> bool:
        """A yes/no `key=...` item of the notes: true for `true`, `yes` or `1` (False when absent)."""
        return self.note_items.get(key, "").split()[:1] in (["true"], ["yes"], ["1"])

    def note_int(self, key: str) -> int | None:
        """An integer `key=N` item of the notes, or None when absent or not an integer."""
        m = re.match(r"\d+", self.note_items.get(key, ""))
        return int(m.group(0)) if m else None

    @property
    def ctx_depth(self) -> int:
        """llama-bench `@ dN` depth, written `ctx_depth=N` in the notes (0 when absent)."""
        return self.note_int("ctx_depth") or 0

    @property
    def dataset(self) -> str:
        """The length source named by `dataset=NAME` (first word, lower case), else by a benchmark command's
        `--dataset-name NAME` in the notes; '' when the notes name none."""
        text = self.note_items.get("dataset", "")
        if text:
            return text.split()[0].strip("(),").lower()
        m = _DATASET_FLAG.search(self.notes)
        return m.group(1).lower() if m else ""


def _required_int(text: str, column: str, where: str, minimum: int = 0) -> int:
    v = _int(text, column, where, blank_ok=False, minimum=minimum)
    assert v is not None   # a blank raised
    return v


def _int(text: str, column: str, where: str, *, blank_ok: bool, minimum: int = 0) -> int | None:
    text = text.strip()
    if not text:
        if blank_ok:
            return None
        raise InputError("is blank; an integer is required", source=where, field=column)
    try:
        v = int(text)
    except ValueError:
        raise InputError(f"'{text}' is not an integer", source=where, field=column) from None
    if v < minimum:
        raise InputError(f"must be >= {minimum}, got {v}", source=where, field=column)
    return v


def parse_arrival(text: str, where: str = "") -> Arrival:
    """'offline', 'single', 'poisson:RATE', 'constant:RATE' (evenly spaced), 'concurrency:N' or 'batch:N'."""
    kind, _, num = text.strip().partition(":")
    if kind not in ARRIVALS:
        raise InputError(f"'{text}' is not one of offline, single, poisson:RATE, constant:RATE, concurrency:N, "
                         "batch:N", source=where, field="arrival")
    if kind in ("offline", "single"):
        if num:
            raise InputError(f"'{text}': {kind} takes no number", source=where, field="arrival")
        return Arrival(kind=kind)
    try:
        value = float(num)
    except ValueError:
        raise InputError(f"'{text}': {kind} needs a number after ':'", source=where, field="arrival") from None
    rate = kind in ("poisson", "constant")
    if not math.isfinite(value) or value <= 0 or (not rate and not value.is_integer()):
        raise InputError(f"'{text}': {kind} needs a {'positive' if rate else 'positive integer'} "
                         "number", source=where, field="arrival")
    return Arrival(kind=kind, value=value)


def parse_row(fields: list[str], where: str, line: int) -> Measurement:
    """One data line split on commas -> Measurement (InputError naming `where` and the column)."""
    if len(fields) != len(COLUMNS):
        raise InputError(f"has {len(fields)} fields, the schema has {len(COLUMNS)} (a comma inside a field?)",
                         source=where)
    raw = dict(zip(COLUMNS, (f.strip() for f in fields), strict=True))
    if not _ID.match(raw["id"]):
        raise InputError(f"'{raw['id']}' must match [a-z0-9_.-]+", source=where, field="id")
    engines = (*ENGINES.names(), "unknown")   # the registered engines; `unknown` runs the generic one
    if raw["engine"] not in engines:
        raise InputError(f"'{raw['engine']}' is not one of {', '.join(engines)}", source=where, field="engine")
    if raw["metric"] not in METRICS:
        raise InputError(f"'{raw['metric']}' is not one of {', '.join(METRICS)}", source=where, field="metric")
    for col in ("model", "weight_dtype", "kv_dtype", "hardware"):
        if not raw[col]:
            raise InputError("is blank", source=where, field=col)
    try:
        value = float(raw["value"])
    except ValueError:
        raise InputError(f"'{raw['value']}' is not a number", source=where, field="value") from None
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"must be a finite number > 0, got {raw['value']}", source=where, field="value")
    return Measurement(
        id=raw["id"], source=raw["source"], engine=raw["engine"], model=raw["model"],
        weight_dtype=raw["weight_dtype"], kv_dtype=raw["kv_dtype"], hardware=raw["hardware"],
        num_gpus=_required_int(raw["num_gpus"], "num_gpus", where, minimum=1),
        tp=_required_int(raw["tp"], "tp", where), pp=_required_int(raw["pp"], "pp", where),
        input_len=_int(raw["input_len"], "input_len", where, blank_ok=True),
        output_len=_int(raw["output_len"], "output_len", where, blank_ok=True),
        num_requests=_int(raw["num_requests"], "num_requests", where, blank_ok=True, minimum=1),
        arrival=parse_arrival(raw["arrival"], where), metric=raw["metric"], value=value, notes=raw["notes"],
        line=line, flags=frozenset(f for f in FLAGS if f in raw["notes"]))


def read_measurements(path: str | Path) -> list[Measurement]:
    """All rows of a measurements CSV, in file order. InputError on the first bad line (with its number)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("file not found", source=str(p)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read file ({exc.__class__.__name__})", source=str(p)) from None
    lines = text.splitlines()
    if not lines:
        raise InputError("file is empty; expected the 17-column header", source=str(p))
    header = [h.strip() for h in lines[0].lstrip("\ufeff").split(",")]
    if tuple(header) != COLUMNS:
        raise InputError(f"header must be exactly {','.join(COLUMNS)}", source=f"{p}:1")
    rows: list[Measurement] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        row = parse_row(line.split(","), where, n)
        if row.id in seen:
            raise InputError(f"duplicate id '{row.id}' (first on line {seen[row.id]})", source=where, field="id")
        seen[row.id] = n
        rows.append(row)
    if not rows:
        raise InputError("has a header but no rows", source=str(p))
    return implied_output_means(rows)


IMPLIED_MEAN_SPREAD = 0.02   # runs of one sample whose output/request ratios differ by more imply nothing


def implied_output_means(rows: list[Measurement]) -> list[Measurement]:
    """Rows of a dataset sample whose notes state no mean lengths, given the mean output tokens per request that
    their source's own table implies: a run measured as both output and request throughput (same source, engine,
    device, model, TP and arrival) produced output / request tokens per request. A source's runs draw from one seeded
    sampler on one dataset and tokenizer, so every row of that source, dataset and model takes the runs' mean (a run
    of another size differs by sampling error only); runs that disagree by more than IMPLIED_MEAN_SPREAD imply
    nothing."""
    runs: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.dataset and r.metric in ("output_throughput_tok_s", "request_throughput"):
            key = (r.source, r.dataset, r.model, r.engine, r.hardware, r.tp, r.pp, r.arrival, r.num_requests)
            runs.setdefault(key, {})[r.metric] = r.value
    ratios: dict[tuple, list[float]] = {}
    for key, metrics in runs.items():
        if len(metrics) == 2:
            ratios.setdefault(key[:3], []).append(metrics["output_throughput_tok_s"] / metrics["request_throughput"])
    means = {k: sum(v) / len(v) for k, v in ratios.items() if max(v) <= min(v) * (1 + IMPLIED_MEAN_SPREAD)}
    return [dataclasses.replace(r, implied_output_mean=means[(r.source, r.dataset, r.model)])
            if r.dataset and (r.source, r.dataset, r.model) in means else r for r in rows]
