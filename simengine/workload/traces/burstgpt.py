"""Reader for BurstGPT traces (HPMLL/BurstGPT: ChatGPT and GPT-4 traffic served by Azure OpenAI).

CSV with a header row; columns are found by name (case-insensitive), so the 6-column release
(Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type) and later releases that add
Session ID / Elapsed time both read:

    Timestamp        -> arrival_s      seconds (number >= 0), made relative to the earliest row
    Request tokens   -> input_tokens   whole number >= 0 (0 is clamped to 1)
    Response tokens  -> output_tokens  whole number >= 0; 0 marks a failed request (see below)
    Model            -> only used by the optional `models` filter (e.g. {"ChatGPT"} or {"GPT-4"})
    Total tokens, Log Type, Session ID, Elapsed time -> ignored (not validated)

Failed requests: BurstGPT logs failures with Response tokens = 0 (the *_without_fails_* files are the same
data with those rows removed). They are dropped by default, so reading BurstGPT_1.csv gives the same
requests as BurstGPT_without_fails_1.csv. Pass keep_failed=True to replay them as 1-token outputs (their
prefill load arrives, the failure itself is not modelled). Dropped rows still count for t0, so a time window
means the same span of the file either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from simengine.errors import InputError
from simengine.workload.traces.base import (
    ReplayOptions,
    Trace,
    build_trace,
    check_path,
    iter_csv,
    parse_count,
    parse_seconds,
)

COL_TIME, COL_MODEL, COL_IN, COL_OUT = "Timestamp", "Model", "Request tokens", "Response tokens"


def read_burstgpt(path: str | Path, options: ReplayOptions, rng: np.random.Generator | None = None, *,
                  keep_failed: bool = False, models: Iterable[str] | None = None) -> Trace:
    """Read a BurstGPT CSV into a Trace (see the module docstring for the mapping and failed rows)."""
    p = check_path(path)
    wanted = None if models is None else {m.strip().lower() for m in models}
    required = (COL_TIME, COL_IN, COL_OUT) + ((COL_MODEL,) if wanted is not None else ())
    cols, rows = iter_csv(p, required)
    it, ii, io = cols[COL_TIME], cols[COL_IN], cols[COL_OUT]
    im = cols.get(COL_MODEL)
    times: list[float] = []
    ins: list[int] = []
    outs: list[int] = []
    keep: list[bool] = []
    seen_models: set[str] = set()
    for line, row in rows:
        times.append(parse_seconds(row[it], p, line, COL_TIME))
        ins.append(parse_count(row[ii], p, line, COL_IN))
        n_out = parse_count(row[io], p, line, COL_OUT)
        outs.append(n_out)
        ok = keep_failed or n_out > 0
        if wanted is not None and im is not None:
            model = row[im].strip()
            seen_models.add(model)
            ok = ok and model.lower() in wanted
        keep.append(ok)
    t = np.array(times, dtype=np.float64)
    mask = np.array(keep, dtype=bool)
    if not mask.any():
        why = "every row is a failed request (Response tokens 0); pass keep_failed=True to replay them"
        if wanted is not None:
            why = (f"no successful row has Model in {sorted(wanted)}; the file has models "
                   f"{', '.join(sorted(seen_models))}")
        raise InputError(f"no requests to replay: {why}", source=str(p))
    rel_s = t[mask] - t.min()
    return build_trace(rel_s, np.array(ins, dtype=np.int64)[mask], np.array(outs, dtype=np.int64)[mask],
                       None, 0, str(path), options, rng)
