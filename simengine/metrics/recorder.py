"""Append-only recording for the hot loop: compact typed columns (array module), no pandas here."""

from __future__ import annotations

from array import array

import numpy as np

from simengine.core.request import Request, Status

# (name, array typecode or "" for a Python list of strings)
REQUEST_FIELDS = (
    ("request_id", "q"), ("replica", "q"), ("session_id", "q"), ("turn", "q"), ("priority", "q"),
    ("arrival_s", "d"), ("first_scheduled_s", "d"), ("first_token_s", "d"), ("finish_s", "d"),
    ("prompt_len", "q"), ("output_len", "q"), ("num_output_tokens", "q"), ("num_cached_tokens", "q"),
    ("num_preemptions", "q"), ("status", ""), ("fail_reason", ""), ("slo_class", ""), ("structured", "b"),
)
STEP_FIELDS = (
    ("replica", "q"), ("start_s", "d"), ("end_s", "d"), ("batch_size", "q"), ("prefill_tokens", "q"),
    ("decode_tokens", "q"), ("num_running", "q"), ("num_waiting", "q"), ("kv_usage", "d"), ("preempted", "q"),
    ("step_s", "d"), ("compute_s", "d"), ("memory_s", "d"), ("comm_s", "d"), ("overhead_s", "d"),
    ("measured_s", "d"), ("cuda_graph", "b"),
)
REQUEST_COLUMNS = tuple(n for n, _ in REQUEST_FIELDS)
STEP_COLUMNS = tuple(n for n, _ in STEP_FIELDS)


def _columns(fields) -> list:
    return [array(code) if code else [] for _, code in fields]


class Recorder:
    """Collects request rows, step rows and inter-token gaps (value, count) for one engine run, column-wise
    (8 bytes a number) so a million-request run stays small."""

    def __init__(self):
        self.request_cols = _columns(REQUEST_FIELDS)
        self.step_rows = array("d")  # STEP_FIELDS flattened row after row (one C-level extend per step)
        self.itl_values = array("d")
        self.itl_counts = array("q")
        self.arrived = 0

    def request(self, req: Request, replica: int, status: str) -> None:
        row = (req.request_id, replica, req.session_id, req.turn, req.priority, req.arrival_s,
               req.first_scheduled_s, req.first_token_s, req.finish_s, req.prompt_len, req.output_len,
               req.num_output_tokens, max(req.num_cached_tokens, 0), req.num_preemptions, status, req.fail_reason,
               req.slo_class, int(req.structured))
        for col, v in zip(self.request_cols, row):
            col.append(v)

    def finished(self, req: Request, replica: int) -> None:
        self.request(req, replica, "completed" if req.status is Status.FINISHED else "failed")

    def step(self, row: tuple, now: float, itl_groups: dict[float, int]) -> None:
        """`row` holds the STEP_FIELDS in order (integers and flags are exact in a double)."""
        self.step_rows.extend(row)
        if len(itl_groups) == 1:  # the usual case: every decode's previous token came from the previous step
            for prev, count in itl_groups.items():
                self.itl_values.append(now - prev)
                self.itl_counts.append(count)
        elif itl_groups:
            self.itl_values.extend([now - prev for prev in itl_groups])
            self.itl_counts.extend(itl_groups.values())

    def steps(self, rows: np.ndarray, itl_values: np.ndarray, itl_counts: np.ndarray) -> None:
        """Several steps at once: one row of STEP_FIELDS each (float64), one inter-token gap group each (float64
        values, int64 counts)."""
        self.step_rows.frombytes(np.ascontiguousarray(rows, dtype=np.float64).tobytes())
        self.itl_values.frombytes(np.ascontiguousarray(itl_values, dtype=np.float64).tobytes())
        self.itl_counts.frombytes(np.ascontiguousarray(itl_counts, dtype=np.int64).tobytes())

    @property
    def num_steps(self) -> int:
        return len(self.step_rows) // len(STEP_FIELDS)

    @property
    def num_requests(self) -> int:
        return len(self.request_cols[0])
