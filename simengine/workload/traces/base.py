"""Common in-memory form of replayed request traces, the replay options, and helpers shared by the readers.

Every reader turns its file into per-row (relative timestamp, input tokens, output tokens[, hash ids]) and
hands them to `build_trace`, which applies `ReplayOptions` in one fixed order (see `ReplayOptions`).
All bad input becomes `simengine.errors.InputError` whose source is "path:LINE" (1-based line in the file).
"""

from __future__ import annotations

import csv
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simengine.errors import InputError

TRACE_DIR_HINT = "trace scenarios read ../shared/data/traces/ by default; pass path: <file> to read another copy"


@dataclass(frozen=True)
class Trace:
    """Requests of a replayed trace, sorted by arrival.

    The arrays are read-only when built by a reader. Rows of the file that tie on timestamp keep file order.
    """

    arrival_s: np.ndarray        # float64, seconds since the first kept row (first is 0.0), non-decreasing
    input_tokens: np.ndarray     # int64 >= 1
    output_tokens: np.ndarray    # int64 >= 1 (rows with 0 output: clamp to 1 and document)
    # Mooncake only: per request, int64 hash ids of hash_block_tokens-token blocks
    block_hash_ids: tuple[np.ndarray, ...] | None
    hash_block_tokens: int       # 512 for Mooncake, 0 otherwise
    source: str                  # path it came from

    def __post_init__(self) -> None:
        n = self.arrival_s.shape[0] if isinstance(self.arrival_s, np.ndarray) else -1
        for name in ("arrival_s", "input_tokens", "output_tokens"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.shape[0] != n:
                raise ValueError(f"Trace.{name} must be a 1-D numpy array of length {n}")
        if self.arrival_s.dtype != np.float64 or self.input_tokens.dtype != np.int64 \
                or self.output_tokens.dtype != np.int64:
            raise ValueError("Trace arrays must be float64 (arrival_s) and int64 (token counts)")
        if n and (self.arrival_s[0] != 0.0 or np.any(np.diff(self.arrival_s) < 0)
                  or not np.all(np.isfinite(self.arrival_s))):
            raise ValueError("Trace.arrival_s must start at 0.0, be finite and be non-decreasing")
        if n and (self.input_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise ValueError("Trace token counts must be >= 1")
        if self.block_hash_ids is not None:
            if len(self.block_hash_ids) != n or self.hash_block_tokens < 1:
                raise ValueError("Trace.block_hash_ids needs one array per request and hash_block_tokens >= 1")
        elif self.hash_block_tokens != 0:
            raise ValueError("Trace.hash_block_tokens must be 0 when there are no block hash ids")

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    def __eq__(self, other: object) -> bool:  # value equality (the generated one cannot compare arrays)
        if not isinstance(other, Trace):
            return NotImplemented
        if (self.hash_block_tokens, self.source) != (other.hash_block_tokens, other.source) or \
                (self.block_hash_ids is None) != (other.block_hash_ids is None):
            return False
        same = all(np.array_equal(getattr(self, f), getattr(other, f))
                   for f in ("arrival_s", "input_tokens", "output_tokens"))
        if same and self.block_hash_ids is not None and other.block_hash_ids is not None:
            same = len(self.block_hash_ids) == len(other.block_hash_ids) and all(
                np.array_equal(a, b) for a, b in zip(self.block_hash_ids, other.block_hash_ids))
        return same


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """Which rows of a trace to replay and how fast. Applied by every reader in this order:

    1. t0 = the earliest timestamp of any data row in the file (a reader's own filters, e.g. BurstGPT's
       failed rows, do not move t0); keep rows with start_s <= t - t0 < end_s (trace time, before scaling).
    2. Shift so the first kept row arrives at 0.0, then divide every arrival by `time_scale`
       (time_scale=2 replays the same requests in half the wall time: rate x2, span /2).
    3. `rate_scale` changes how many requests there are while keeping the time axis:
       * < 1: thinning -- keep each row independently with probability rate_scale, drawn from `rng`
         (the reader's rng argument; None means np.random.default_rng(0), so results are reproducible).
       * > 1: deterministic replication -- row i (0-based) is emitted floor((i+1)r) - floor(ir) times
         (so n rows become floor(n r)); the c copies of a row are spread evenly over the gap to the next
         row: copy j arrives at t_i + j (t_{i+1} - t_i) / c (the last row's copies all arrive at t_last).
         Copies carry the same token counts and, for Mooncake, the same hash ids (they share the prefix).
       * == 1: unchanged.
    4. Keep the first `max_requests` requests, then shift again so the first arrives at 0.0.
    """

    start_s: float = 0.0          # keep rows with start_s <= t - t0 < end_s (t0 = first row's timestamp)
    end_s: float | None = None
    time_scale: float = 1.0       # replay at k x speed: arrival gaps divided by time_scale
    rate_scale: float = 1.0       # < 1 thins rows at random (rng), > 1 replicates rows deterministically
    max_requests: int | None = None

    def __post_init__(self) -> None:
        _check_number("start_s", self.start_s, minimum=0.0, allow_min=True,
                      fix="give seconds from the trace's first row; 0 starts at the beginning")
        if self.end_s is not None:
            _check_number("end_s", self.end_s, minimum=0.0, allow_min=False, allow_inf=True,
                          fix="give seconds from the trace's first row, or omit it (null) to read to the end")
            if self.end_s <= self.start_s:
                raise InputError(f"must be greater than start_s ({self.start_s}), got {self.end_s}; "
                                 "omit it (null) to read to the end", field="end_s")
        _check_number("time_scale", self.time_scale, minimum=0.0, allow_min=False,
                      fix="use 1 for real time, 2 to replay twice as fast, 0.5 for half speed")
        _check_number("rate_scale", self.rate_scale, minimum=0.0, allow_min=False,
                      fix="use 1 to keep every request, 0.5 to keep about half, 2 to emit each twice")
        if self.max_requests is not None:
            v = self.max_requests
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise InputError(f"must be a whole number >= 1, got {v!r}; omit it (null) for no cap",
                                 field="max_requests")


def _check_number(name: str, value: object, *, minimum: float, allow_min: bool, fix: str,
                  allow_inf: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"must be a number, got {type(value).__name__} {value!r}; {fix}", field=name)
    v = float(value)
    if math.isnan(v):
        raise InputError(f"must be a number, got NaN; {fix}", field=name)
    if math.isinf(v) and not (allow_inf and v > 0):
        raise InputError(f"must be finite, got {v}; {fix}", field=name)
    if v < minimum or (v == minimum and not allow_min):
        need = f">= {minimum:g}" if allow_min else f"> {minimum:g}"
        raise InputError(f"must be {need}, got {value!r}; {fix}", field=name)


def prompt_token_ids_from_hash_ids(hash_ids: np.ndarray, input_len: int, block_tokens: int) -> np.ndarray:
    """Synthetic prompt token ids whose shared prefixes mirror shared leading hash ids.

    Token p of the prompt (0-based) lies in block i = p // block_tokens and equals
    hash_ids[i] * block_tokens + p % block_tokens, so block i depends on hash_ids[i] only and distinct
    hash ids give disjoint id ranges. Two prompts therefore agree on exactly their common leading blocks
    (capped by the shorter prompt) and differ at every position of the first block whose hash ids differ.
    The last block is truncated so the result has exactly input_len tokens; hash ids past the last needed
    block are ignored. The ids are identifiers for prefix matching, not vocabulary ids.

    Raises InputError if input_len > len(hash_ids) * block_tokens, or on a negative / too-large hash id.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, numbers.Integral) or block_tokens < 1:
        raise InputError(f"must be a whole number >= 1, got {block_tokens!r}", field="block_tokens")
    if isinstance(input_len, bool) or not isinstance(input_len, numbers.Integral) or input_len < 0:
        raise InputError(f"must be a whole number >= 0, got {input_len!r}", field="input_len")
    block_tokens, input_len = int(block_tokens), int(input_len)
    ids = np.asarray(hash_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InputError(f"must be a 1-D array of integers, got dtype {ids.dtype} shape {ids.shape}",
                         field="hash_ids")
    if input_len > ids.size * block_tokens:
        need = -(-input_len // block_tokens)
        raise InputError(f"input_len {input_len} needs {need} blocks of {block_tokens} tokens but only "
                         f"{ids.size} hash ids were given; pass at least {need} hash ids or a shorter input_len",
                         field="input_len")
    n_blocks = -(-input_len // block_tokens)
    used = ids[:n_blocks]
    if used.size:
        limit = np.iinfo(np.int64).max // block_tokens - 1
        if int(used.min()) < 0 or int(used.max()) > limit:
            raise InputError(f"hash ids must be in [0, {limit}] for {block_tokens}-token blocks", field="hash_ids")
    used = used.astype(np.int64, copy=False)
    pos = np.arange(input_len, dtype=np.int64)
    return used[pos // block_tokens] * block_tokens + pos % block_tokens


# ----------------------------------------------------------------------------------------------- reading


def check_path(path: str | Path) -> Path:
    """Return `path` as a Path, or raise InputError if it is not a readable file."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"file not found: {p} ({TRACE_DIR_HINT})", field="path")
    if p.is_dir():
        raise InputError(f"{p} is a directory, not a trace file ({TRACE_DIR_HINT})", field="path")
    return p


def open_error(p: Path, exc: BaseException) -> InputError:
    """An InputError for a file that cannot be read; a decoding error names the line of the bad byte."""
    if isinstance(exc, UnicodeDecodeError):
        return not_utf8(p)
    return InputError(f"cannot read file ({exc.__class__.__name__}: {exc})", source=str(p))


def not_utf8(p: Path) -> InputError:
    """An InputError at the line of the first byte that is not UTF-8."""
    try:
        data = p.read_bytes()
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        return InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8",
                          source=f"{p}:{line}")
    except OSError:
        pass
    return InputError("not UTF-8 text; save the file as UTF-8", source=str(p))


def iter_csv(p: Path, required: Sequence[str]) -> tuple[dict[str, int], Iterator[tuple[int, list[str]]]]:
    """Open a CSV trace; return {required column: index} and an iterator of (line number, row).

    Column names match case-insensitively and ignoring surrounding spaces; other columns are ignored.
    Blank lines are skipped. Errors name "path:LINE" and the column.
    """
    try:
        fh = open(p, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise open_error(p, exc) from None
    reader = csv.reader(fh)
    header: list[str] | None = None
    try:
        for row in reader:                            # the header is the first non-blank line
            if any(h.strip() for h in row):
                header = row
                break
    except UnicodeDecodeError:
        fh.close()
        raise not_utf8(p) from None
    except csv.Error as exc:
        fh.close()
        raise InputError(f"unreadable CSV header ({exc})", source=f"{p}:{reader.line_num + 1}") from None
    if header is None:
        fh.close()
        raise InputError(f"empty file; expected a CSV header with columns {', '.join(required)}",
                         source=f"{p}:1")
    header_line = reader.line_num
    names = {h.strip().lower(): i for i, h in reversed(list(enumerate(header)))}
    cols: dict[str, int] = {}
    for col in required:
        if col.lower() not in names:
            fh.close()
            raise InputError(f"missing column; the header has: {', '.join(h.strip() for h in header)}",
                             source=f"{p}:{header_line}", field=col)
        cols[col] = names[col.lower()]
    width = max(cols.values()) + 1

    def rows() -> Iterator[tuple[int, list[str]]]:
        seen = False
        with fh:
            line = header_line
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except UnicodeDecodeError:
                    raise not_utf8(p) from None
                except csv.Error as exc:
                    raise InputError(f"unreadable CSV row ({exc})", source=f"{p}:{reader.line_num + 1}") from None
                start = line + 1                      # first physical line of this record
                line = reader.line_num
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) < width:
                    missing = next(c for c, i in cols.items() if i >= len(row))
                    raise InputError(f"missing value (row has {len(row)} fields, header has {len(header)})",
                                     source=f"{p}:{start}", field=missing)
                seen = True
                yield start, row
        if not seen:
            raise InputError("no data rows after the header", source=f"{p}:{header_line + 1}")

    return cols, rows()


def parse_count(text: str, p: Path, line: int, column: str) -> int:
    """A token count field: a whole number >= 0 ("12" or "12.0")."""
    try:
        return _nonneg(int(text), text, p, line, column)
    except ValueError:
        pass
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"not a number: {text.strip()!r}; expected a whole number of tokens >= 0",
                         source=f"{p}:{line}", field=column) from None
    if not math.isfinite(v) or not v.is_integer():
        raise InputError(f"not a whole number: {text.strip()!r}; expected a whole number of tokens >= 0",
                         source=f"{p}:{line}", field=column)
    return _nonneg(int(v), text, p, line, column)


def _nonneg(v: int, text: str, p: Path, line: int, column: str) -> int:
    if v < 0:
        raise InputError(f"negative value {text.strip()!r}; expected a whole number of tokens >= 0",
                         source=f"{p}:{line}", field=column)
    return v


def parse_seconds(text: str, p: Path, line: int, column: str) -> float:
    """A timestamp field in seconds: a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"not a number: {text.strip()!r}; expected seconds >= 0",
                         source=f"{p}:{line}", field=column) from None
    if not math.isfinite(v) or v < 0:
        raise InputError(f"invalid value {text.strip()!r}; expected finite seconds >= 0",
                         source=f"{p}:{line}", field=column)
    return v


# ------------------------------------------------------------------------------------------ replaying


def build_trace(rel_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
                hash_ids: Sequence[np.ndarray] | None, hash_block_tokens: int, source: str,
                options: ReplayOptions, rng: np.random.Generator | None) -> Trace:
    """Apply `options` (see ReplayOptions) to rows whose timestamps are seconds since t0 (>= 0)."""
    if options is None:
        options = ReplayOptions()
    if not isinstance(options, ReplayOptions):
        raise InputError(f"expected ReplayOptions, got {type(options).__name__}", field="options")
    rel = np.asarray(rel_s, dtype=np.float64)
    n = rel.shape[0]
    if n == 0:
        raise InputError("no requests in the file", source=source)
    order = np.arange(n) if np.all(rel[1:] >= rel[:-1]) else np.argsort(rel, kind="stable")
    srel = rel[order]
    lo = int(np.searchsorted(srel, options.start_s, side="left"))
    hi = n if options.end_s is None else int(np.searchsorted(srel, options.end_s, side="left"))
    if hi <= lo:
        end = "end" if options.end_s is None else f"{options.end_s:g}"
        raise InputError(f"no requests with start_s <= t - t0 < end_s = [{options.start_s:g}, {end}); "
                         f"the trace's rows lie in [0, {srel[-1]:.6g}] s after its first row",
                         source=source, field="start_s" if options.end_s is None else "end_s")
    idx = order[lo:hi]
    t = (srel[lo:hi] - srel[lo]) / float(options.time_scale)

    r = float(options.rate_scale)
    if r < 1.0:
        gen = rng if rng is not None else np.random.default_rng(0)
        keep = np.asarray(gen.random(idx.shape[0]) < r)
        if not keep.any():
            raise InputError(f"rate_scale {r:g} thinned all {idx.shape[0]} requests away; use a larger "
                             "rate_scale or a wider time window", field="rate_scale")
        idx, t = idx[keep], t[keep]
    elif r > 1.0:
        m = idx.shape[0]
        i = np.arange(m + 1, dtype=np.float64)
        counts = np.diff(np.floor(i * r)).astype(np.int64)
        gap = np.append(np.diff(t), 0.0)
        rep = np.repeat(np.arange(m), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        j = np.arange(rep.shape[0]) - first
        t = np.maximum.accumulate(t[rep] + j * (gap[rep] / counts[rep]))
        idx = idx[rep]

    if options.max_requests is not None:
        idx, t = idx[:options.max_requests], t[:options.max_requests]
    t = t - t[0]

    def frozen(a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a)
        a.setflags(write=False)
        return a

    blocks = None
    if hash_ids is not None:
        blocks = tuple(hash_ids[k] for k in idx.tolist())
    return Trace(
        arrival_s=frozen(t.astype(np.float64, copy=False)),
        input_tokens=frozen(np.maximum(np.asarray(input_tokens, dtype=np.int64)[idx], 1)),
        output_tokens=frozen(np.maximum(np.asarray(output_tokens, dtype=np.int64)[idx], 1)),
        block_hash_ids=blocks,
        hash_block_tokens=int(hash_block_tokens) if blocks is not None else 0,
        source=source,
    )
