"""Frames built once at the end of a run from the recorder's rows."""

from __future__ import annotations

import numpy as np
import pandas as pd

from simengine.metrics.recorder import REQUEST_COLUMNS, STEP_COLUMNS, Recorder


def requests_frame(rec: Recorder) -> pd.DataFrame:
    """One row per request (completed, failed or unfinished), sorted by request id, with latencies in ms."""
    df = pd.DataFrame.from_records(rec.requests, columns=REQUEST_COLUMNS)
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
    return pd.DataFrame.from_records(rec.steps, columns=STEP_COLUMNS)


def itl_arrays(rec: Recorder) -> tuple[np.ndarray, np.ndarray]:
    """Inter-token gaps in ms and how many tokens had each gap (token-weighted, as vLLM pools ITL)."""
    return np.asarray(rec.itl_values, dtype=float) * 1e3, np.asarray(rec.itl_counts, dtype=np.int64)
