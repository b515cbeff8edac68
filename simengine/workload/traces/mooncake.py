"""Reader for Mooncake traces (kvcache-ai/Mooncake, FAST'25 release: conversation, synthetic, tool&agent).

JSON Lines, one request per line (blank lines are skipped; other keys are ignored):

    "timestamp"      -> arrival_s       milliseconds (number >= 0), made relative to the earliest row, / 1000
    "input_length"   -> input_tokens    whole number >= 1
    "output_length"  -> output_tokens   whole number >= 0 (0 is clamped to 1)
    "hash_ids"       -> block_hash_ids  list of int64 >= 0, one per 512-token block of the prompt; equal ids
                                        mean equal block content *and* equal prefix before it. The list must
                                        have exactly ceil(input_length / 512) ids (the last block is partial).

hash_block_tokens is 512. Rows need not be sorted; ties keep file order. A truncated or otherwise invalid
JSON line, a missing key or a bad value is an InputError at "path:LINE" naming the key.

`block_reuse_ratio` measures how much of the trace's prompt could come from a prefix cache of unlimited size.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path

import numpy as np

from simengine.errors import InputError
from simengine.workload.traces.base import ReplayOptions, Trace, build_trace, check_path, not_utf8, open_error

MOONCAKE_BLOCK_TOKENS = 512
KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def _whole(value: object, key: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"expected a whole number >= {minimum}, got {type(value).__name__} {value!r}",
                         source=where, field=key)
    if isinstance(value, float):
        if not value.is_integer():
            raise InputError(f"expected a whole number >= {minimum}, got {value!r}", source=where, field=key)
        value = int(value)
    number = int(math.trunc(value))   # an int (or an integer-valued float), after the checks above
    if number < minimum:
        what = "negative value" if number < 0 else "value"
        raise InputError(f"{what} {number}; expected a whole number >= {minimum}", source=where, field=key)
    return number


def read_mooncake(path: str | Path, options: ReplayOptions, rng: np.random.Generator | None = None, *,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake JSONL trace into a Trace (see the module docstring for the mapping)."""
    p = check_path(path)
    stamps: list[float | int] = []
    ins: list[int] = []
    outs: list[int] = []
    lens: list[int] = []
    flat: list[int] = []
    lines: list[int] = []
    loads = json.loads
    try:
        with open(p, encoding="utf-8-sig") as fh:
            for lineno, text in enumerate(fh, 1):
                if not text.strip():
                    continue
                where = f"{p}:{lineno}"
                try:
                    rec = loads(text)
                except json.JSONDecodeError as exc:
                    raise InputError(f"invalid JSON at column {exc.colno} ({exc.msg}); each line must be one "
                                     "complete JSON object (is the line truncated?)", source=where) from None
                if not isinstance(rec, dict):
                    raise InputError(f"expected a JSON object with keys {', '.join(KEYS)}, got "
                                     f"{type(rec).__name__}", source=where)
                for key in KEYS:
                    if key not in rec:
                        raise InputError("missing key", source=where, field=key)
                ts = rec["timestamp"]
                if isinstance(ts, bool) or not isinstance(ts, numbers.Real) or not math.isfinite(ts) or ts < 0:
                    raise InputError(f"expected milliseconds >= 0, got {ts!r}", source=where, field="timestamp")
                n_in = _whole(rec["input_length"], "input_length", where, 1)
                n_out = _whole(rec["output_length"], "output_length", where, 0)
                h = rec["hash_ids"]
                if not isinstance(h, list):
                    raise InputError(f"expected a list of block hash ids, got {type(h).__name__}",
                                     source=where, field="hash_ids")
                need = -(-n_in // block_tokens)
                if len(h) != need:
                    raise InputError(f"has {len(h)} ids but input_length {n_in} needs ceil({n_in}/{block_tokens})"
                                     f" = {need} blocks", source=where, field="hash_ids")
                stamps.append(float(ts))
                ins.append(n_in)
                outs.append(n_out)
                lens.append(len(h))
                flat.extend(h)
                lines.append(lineno)
    except UnicodeDecodeError:
        raise not_utf8(p) from None
    except OSError as exc:
        raise open_error(p, exc) from None
    if not stamps:
        raise InputError(f"empty file; expected one JSON object per line with keys {', '.join(KEYS)}",
                         source=f"{p}:1")

    ids = _hash_array(flat, lens, lines, p)
    ids.setflags(write=False)
    offsets = np.cumsum(lens)[:-1]
    per_request = np.split(ids, offsets)

    ts_arr = np.array(stamps)
    if ts_arr.dtype.kind in "iu":
        rel_s = (ts_arr - ts_arr.min()) / 1000.0
    else:
        ts_arr = ts_arr.astype(np.float64)
        rel_s = (ts_arr - ts_arr.min()) / 1000.0
    return build_trace(rel_s, np.array(ins, dtype=np.int64), np.array(outs, dtype=np.int64), per_request,
                       block_tokens, str(path), options, rng)


def _hash_array(flat: list, lens: list[int], lines: list[int], p: Path) -> np.ndarray:
    """All hash ids as one int64 array; on a bad id, name the line it came from."""
    try:
        ids = np.array(flat, dtype=np.int64) if flat else np.zeros(0, dtype=np.int64)
        exact = all(type(x) is int for x in flat) if ids.size else True
    except (TypeError, ValueError, OverflowError):
        exact = False
    if exact and (ids.size == 0 or int(ids.min()) >= 0):
        return ids
    start = 0
    for n, lineno in zip(lens, lines):
        for x in flat[start:start + n]:
            if type(x) is not int or x < 0 or x > np.iinfo(np.int64).max:
                raise InputError(f"expected whole numbers in [0, 2^63), got {x!r}",
                                 source=f"{p}:{lineno}", field="hash_ids")
        start += n
    raise AssertionError("unreachable")  # pragma: no cover


def block_reuse_ratio(trace: Trace) -> float:
    """Token-weighted fraction of prompt blocks whose hash id appeared in an earlier request of `trace`.

    Requests are taken in trace order (arrival, ties in file order). Block i of a request with L input
    tokens weighs min(B, L - i*B) tokens (B = trace.hash_block_tokens), so the ratio is the share of all
    prompt tokens an unbounded prefix cache that keeps every block could serve. Repeats inside a single
    request do not count. Raises InputError if the trace has no hash ids.
    """
    if trace.block_hash_ids is None or trace.hash_block_tokens < 1:
        raise InputError("this trace has no block hash ids (only Mooncake traces do)", source=trace.source)
    n = len(trace.block_hash_ids)
    if n == 0:
        return 0.0
    B = trace.hash_block_tokens
    lens = np.fromiter((a.shape[0] for a in trace.block_hash_ids), dtype=np.int64, count=n)
    ids = np.concatenate(trace.block_hash_ids).astype(np.int64, copy=False)
    req = np.repeat(np.arange(n, dtype=np.int64), lens)
    pos = np.arange(ids.shape[0], dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    weight = np.clip(np.repeat(trace.input_tokens, lens) - pos * B, 0, B)
    _, inverse = np.unique(ids, return_inverse=True)
    first = np.full(int(inverse.max()) + 1 if inverse.size else 0, n, dtype=np.int64)
    np.minimum.at(first, inverse, req)
    reused = req > first[inverse]
    total = int(weight.sum())
    return float(weight[reused].sum()) / total if total else 0.0
