"""Frames built once at the end of a run from the recorder's rows."""

from __future__ import annotations

import numpy as np
import pandas as pd

from simengine.metrics.recorder import REQUEST_FIELDS, STEP_FIELDS, Recorder


def _frame(fields, cols) -> pd.DataFrame:
    return pd.DataFrame({name: (np.frombuffer(col, dtype=col.typecode) if code else col)
                         for (name, code), col in zip(fields, cols)})


def requests_frame(rec: Recorder) -> pd.DataFrame:
    """One row per request (completed, failed or unfinished), sorted by request id, with latencies in ms."""
    df = _frame(REQUEST_FIELDS, rec.request_cols)
    df = df.sort_values("request_id", kind="stable").reset_index(drop=True)
    done = df["status"] == "completed"
    ttft = np.where(done, (df["first_token_s"] - df["arrival_s"]) * 1e3, np.nan)
    e2el = np.where(done, (df["finish_s"] - df["arrival_s"]) * 1e3, np.nan)
    out = df["num_output_tokens"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(done & (out > 1), (e2el - ttft) / (out - 1), np.nan)
    queue = np.where(df["first_scheduled_s"] >= 0, (df["first_scheduled_s"] - df["arrival_s"]) * 1e3, np.nan)
    df["ttft_ms"], df["tpot_ms"], df["e2el_ms"], df["queue_ms"] = ttft, tpot, e2el, queue
    return df


def steps_frame(rec: Recorder) -> pd.DataFrame:
    """One row per engine step."""
    rows = np.frombuffer(rec.step_rows, dtype=float).reshape(-1, len(STEP_FIELDS))
    # float columns stay views of the recorder's buffer; only the integer and flag columns are converted
    return pd.DataFrame({name: rows[:, i].astype({"q": np.int64, "d": float, "b": bool}[code], copy=False)
                         for i, (name, code) in enumerate(STEP_FIELDS)}, copy=False)


def itl_arrays(rec: Recorder) -> tuple[np.ndarray, np.ndarray]:
    """Inter-token gaps in ms and how many tokens had each gap (token-weighted, as vLLM pools ITL)."""
    return np.frombuffer(rec.itl_values, dtype=float) * 1e3, np.frombuffer(rec.itl_counts, dtype=np.int64).copy()
