"""Frames built from the recorder's rows after a run: whole (for the API and small runs) or block by block (for
results files), and bounded views for plots."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from simengine.metrics.recorder import REQUEST_FIELDS, STEP_FIELDS, Recorder

COMPLETED = 0   # status code (recorder.STATUSES)


def latencies_ms(rows: np.ndarray) -> dict[str, np.ndarray]:
    """ttft, tpot, e2el of completed requests and the queueing time of scheduled ones, per row, in ms (NaN where
    undefined): the one definition the frames and the summary share."""
    done = rows["status"] == COMPLETED
    ttft = np.where(done, (rows["first_token_s"] - rows["arrival_s"]) * 1e3, np.nan)
    e2el = np.where(done, (rows["finish_s"] - rows["arrival_s"]) * 1e3, np.nan)
    out = rows["num_output_tokens"]
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(done & (out > 1), (e2el - ttft) / (out - 1), np.nan)
    queue = np.where(rows["first_scheduled_s"] >= 0, (rows["first_scheduled_s"] - rows["arrival_s"]) * 1e3, np.nan)
    return {"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el, "queue_ms": queue}


def _requests(rows: np.ndarray, strings: np.ndarray) -> pd.DataFrame:
    df = pd.DataFrame({name: strings[rows[name]] if code == "s" else rows[name] for name, code in REQUEST_FIELDS})
    for name, values in latencies_ms(rows).items():
        df[name] = values
    return df


def request_blocks(rec: Recorder) -> Iterator[pd.DataFrame]:
    """requests.csv's rows in ascending request id, a block at a time."""
    strings = np.asarray(rec.strings, dtype=object)
    empty = True
    for rows in rec.request_rows_by_id():
        empty = False
        yield _requests(rows, strings)
    if empty:   # the columns still
        yield _requests(np.empty(0, dtype=rec.request_chunks.dtype), strings)


def requests_frame(rec: Recorder) -> pd.DataFrame:
    """One row per request (completed, failed or unfinished), sorted by request id, with latencies in ms."""
    blocks = list(request_blocks(rec))
    return pd.concat(blocks, ignore_index=True) if len(blocks) > 1 else blocks[0]


def _steps(rows: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({name: rows[name].astype({"q": np.int64, "d": float, "b": bool}[code], copy=False)
                         for name, code in STEP_FIELDS})


def step_blocks(rec: Recorder) -> Iterator[pd.DataFrame]:
    """steps.csv's rows in the order the steps ended, a chunk at a time."""
    empty = True
    for rows in rec.step_rows():
        empty = False
        yield _steps(rows)
    if empty:   # the columns still
        yield _steps(np.empty(0, dtype=rec.step_chunks.dtype))


def steps_frame(rec: Recorder) -> pd.DataFrame:
    """One row per engine step."""
    rows = [*rec.step_rows()]
    return _steps(np.concatenate(rows) if rows else np.empty(0, dtype=rec.step_chunks.dtype))


def itl_arrays(rec: Recorder) -> tuple[np.ndarray, np.ndarray]:
    """Inter-token gaps in ms and how many tokens had each gap (token-weighted, as vLLM pools ITL)."""
    rows = [*rec.itl_rows()]
    gaps = np.concatenate(rows) if rows else np.empty(0, dtype=rec.itl_chunks.dtype)
    return gaps["gap_s"] * 1e3, gaps["tokens"].copy()


def plot_requests(rec: Recorder, max_rows: int) -> tuple[pd.DataFrame, int]:
    """The requests frame, or every k-th request by id when there are more than max_rows; returns (frame, k)."""
    k = max(1, -(-rec.num_requests // max_rows))
    if k == 1:
        return requests_frame(rec), 1
    strings = np.asarray(rec.strings, dtype=object)
    kept, seen = [], 0
    for rows in rec.request_rows_by_id():
        kept.append(_requests(rows[(-seen) % k::k], strings))
        seen += len(rows)
    return pd.concat(kept, ignore_index=True), k


def plot_steps(rec: Recorder, end_s: float, max_rows: int) -> pd.DataFrame:
    """The steps frame, or past max_rows steps the per-replica means of kv_usage, num_running and num_waiting over
    max_rows time bins (end_s: the bin's middle), which the timelines draw the same way."""
    if rec.num_steps <= max_rows:
        return steps_frame(rec)
    replicas = 1 + int(max(rows["replica"].max() for rows in rec.step_rows()))
    width = max(end_s, 1e-9) / max_rows
    size = (max_rows + 1) * replicas
    sums = {c: np.zeros(size) for c in ("kv_usage", "num_running", "num_waiting", "rows")}
    for rows in rec.step_rows():
        cell = np.minimum(rows["end_s"] // width, max_rows).astype(np.intp) * replicas + rows["replica"].astype(np.intp)
        sums["rows"] += np.bincount(cell, minlength=size)
        for c in ("kv_usage", "num_running", "num_waiting"):
            sums[c] += np.bincount(cell, weights=rows[c], minlength=size)
    hit = sums["rows"] > 0
    cells = np.flatnonzero(hit)
    return pd.DataFrame({"end_s": (cells // replicas + 0.5) * width, "replica": cells % replicas,
                         **{c: sums[c][hit] / sums["rows"][hit] for c in ("kv_usage", "num_running", "num_waiting")}})
