"""Reader for the Azure LLM inference traces (Azure/AzurePublicDataset, 2023 Splitwise and 2024 DynamoLLM).

Both years share one CSV schema (header row, then one row per request; other columns are ignored):

    TIMESTAMP        -> arrival_s  wall-clock time "YYYY-MM-DD HH:MM:SS[.fffffff][+HH:MM|Z]"; the 2023
                                   files carry 7 fractional digits (100 ns). Parsed exactly as integer
                                   nanoseconds (fraction digits past 9 are dropped; a UTC offset, if any,
                                   is applied), then made relative to the earliest row.
    ContextTokens    -> input_tokens   (0 is clamped to 1)
    GeneratedTokens  -> output_tokens  (0 is clamped to 1: the request still costs one decode step)

Column names match case-insensitively. Rows need not be sorted; ties keep file order. Line endings may
be CRLF (the published files are). Negative or non-numeric counts and unparseable timestamps are an
InputError at "path:LINE" naming the column.
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

import numpy as np

from simengine.errors import InputError
from simengine.workload.traces.base import ReplayOptions, Trace, build_trace, check_path, iter_csv, parse_count

COL_TIME, COL_IN, COL_OUT = "TIMESTAMP", "ContextTokens", "GeneratedTokens"

_TS = re.compile(r"\s*(\d{4}-\d{1,2}-\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:[.,](\d+))?"
                 r"\s*(?:(Z|UTC)|([+-])(\d{2}):?(\d{2}))?\s*$")
_NS = 1_000_000_000


def _day_seconds(date: str, cache: dict[str, int]) -> int:
    """Seconds from 0001-01-01 to the start of `date` ("YYYY-MM-DD"); raises ValueError if invalid."""
    s = cache.get(date)
    if s is None:
        y, m, d = (int(x) for x in date.split("-"))
        s = _dt.date(y, m, d).toordinal() * 86400
        cache[date] = s
    return s


def parse_timestamp_ns(text: str, cache: dict[str, int] | None = None) -> int:
    """Nanoseconds since 0001-01-01 (UTC if an offset is given) of an Azure TIMESTAMP; ValueError if bad."""
    m = _TS.match(text)
    if m is None:
        raise ValueError("format")
    date, hh, mm, ss, frac, _utc, sign, oh, om = m.groups()
    h, mi, s = int(hh), int(mm), int(ss)
    if h > 23 or mi > 59 or s > 59:
        raise ValueError("range")
    secs = _day_seconds(date, {} if cache is None else cache) + h * 3600 + mi * 60 + s
    if sign:
        off = int(oh) * 3600 + int(om) * 60
        secs -= off if sign == "+" else -off
    ns = secs * _NS
    if frac:
        ns += int(frac[:9].ljust(9, "0"))
    return ns


def read_azure(path: str | Path, options: ReplayOptions, rng: np.random.Generator | None = None) -> Trace:
    """Read an Azure LLM inference trace CSV into a Trace (see the module docstring for the mapping)."""
    p = check_path(path)
    cols, rows = iter_csv(p, (COL_TIME, COL_IN, COL_OUT))
    it, ii, io = cols[COL_TIME], cols[COL_IN], cols[COL_OUT]
    cache: dict[str, int] = {}
    times: list[int] = []
    ins: list[int] = []
    outs: list[int] = []
    for line, row in rows:
        raw = row[it]
        try:
            times.append(parse_timestamp_ns(raw, cache))
        except ValueError:
            raise InputError(f"cannot parse timestamp {raw.strip()!r}; expected e.g. "
                             "'2023-11-16 18:15:46.6805900' (YYYY-MM-DD HH:MM:SS[.fraction])",
                             source=f"{p}:{line}", field=COL_TIME) from None
        ins.append(parse_count(row[ii], p, line, COL_IN))
        outs.append(parse_count(row[io], p, line, COL_OUT))
    t0 = min(times)
    rel_ns = np.fromiter((t - t0 for t in times), dtype=np.int64, count=len(times))
    rel_s = rel_ns / 1e9
    return build_trace(rel_s, np.array(ins, dtype=np.int64), np.array(outs, dtype=np.int64), None, 0,
                       str(path), options, rng)
