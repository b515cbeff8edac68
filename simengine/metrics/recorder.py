"""Append-only recording for the hot loop: compact typed columns (array module) and chunk-sized numpy buffers, flushed
in chunks of numpy rows that stay in memory up to a budget and go to temporary files past it (metrics/chunks.py); no
pandas here."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np

from simengine.core.request import Request, Status
from simengine.metrics.chunks import Chunks, Spill, merged

# (name, array typecode; "s" for a string, kept as a code into the recorder's `strings`)
REQUEST_FIELDS = (
    ("request_id", "q"), ("replica", "q"), ("session_id", "q"), ("turn", "q"), ("priority", "q"),
    ("arrival_s", "d"), ("first_scheduled_s", "d"), ("first_token_s", "d"), ("finish_s", "d"),
    ("prompt_len", "q"), ("output_len", "q"), ("num_output_tokens", "q"), ("num_cached_tokens", "q"),
    ("num_preemptions", "q"), ("status", "s"), ("fail_reason", "s"), ("slo_class", "s"), ("structured", "b"),
)
STEP_FIELDS = (
    ("replica", "q"), ("start_s", "d"), ("end_s", "d"), ("batch_size", "q"), ("prefill_tokens", "q"),
    ("decode_tokens", "q"), ("num_running", "q"), ("num_waiting", "q"), ("kv_usage", "d"), ("preempted", "q"),
    ("step_s", "d"), ("compute_s", "d"), ("memory_s", "d"), ("comm_s", "d"), ("overhead_s", "d"),
    ("measured_s", "d"), ("cuda_graph", "b"), ("output_tokens", "q"), ("draft_tokens", "q"),
)
REQUEST_COLUMNS = tuple(n for n, _ in REQUEST_FIELDS)
STEP_COLUMNS = tuple(n for n, _ in STEP_FIELDS)
_NUMPY = {"q": "i8", "d": "f8", "b": "i1", "s": "i4"}
REQUEST_DTYPE = np.dtype([(n, _NUMPY[c]) for n, c in REQUEST_FIELDS])
STEP_DTYPE = np.dtype([(n, "f8") for n in STEP_COLUMNS])   # integers and flags are exact in a double
ITL_DTYPE = np.dtype([("gap_s", "f8"), ("tokens", "i8")])
_START, _END, _WAITING, _KV_USAGE, _OUTPUT_TOKENS = (STEP_COLUMNS.index(c) for c in (
    "start_s", "end_s", "num_waiting", "kv_usage", "output_tokens"))
_COSTS = slice(STEP_COLUMNS.index("step_s"), STEP_COLUMNS.index("measured_s") + 1)   # the StepCost fields, in order
STATUSES = ("completed", "failed", "unfinished")   # codes 0, 1, 2 of the status column
CHUNK_ROWS = 1 << 16


class Recorder:
    """Collects request rows, step rows, inter-token gaps (value, count) and the detailed requests' token times
    for one engine run. Rows gather in typed columns and move to `Chunks` every CHUNK_ROWS rows (requests sorted
    by id within a chunk), so memory stays flat however long the run: see Spill's budget."""

    def __init__(self, spill: Spill | None = None, chunk_rows: int | None = None):
        self.spill = spill if spill is not None else Spill()
        self.chunk_rows = CHUNK_ROWS if chunk_rows is None else chunk_rows
        self.request_chunks = Chunks("requests", REQUEST_DTYPE, self.spill)
        self.step_chunks = Chunks("steps", STEP_DTYPE, self.spill)
        self.itl_chunks = Chunks("itl", ITL_DTYPE, self.spill)
        self._strings: list[str] = [*STATUSES, ""]
        self._codes = {s: i for i, s in enumerate(self._strings)}
        self._request_rows: list[tuple] = []   # rows of REQUEST_FIELDS, typed into columns at each flush
        # step rows and inter-token gap groups gather in buffers of a chunk's size, written in place (an array grown
        # step by step is copied each time it outgrows its memory, which costs more than the writes)
        self._new_step_buffers()
        self.arrived = 0
        self.token_times: dict[int, array] = {}  # request id -> its output tokens' times (detailed requests only)

    # ---- writing (the hot loop) -------------------------------------------------------------------------------
    def request(self, req: Request, replica: int, status: str) -> None:
        row = (req.request_id, replica, req.session_id, req.turn, req.priority, req.arrival_s,
               req.first_scheduled_s, req.first_token_s, req.finish_s, req.prompt_len, req.output_len,
               req.num_output_tokens, max(req.num_cached_tokens, 0), req.num_preemptions, status, req.fail_reason,
               req.slo_class, int(req.structured))
        if req.token_times is not None:
            self.token_times[req.request_id] = req.token_times
        self._request_rows.append(row)
        if len(self._request_rows) >= self.chunk_rows:
            self._flush_requests()

    def finished(self, req: Request, replica: int) -> None:
        self.request(req, replica, "completed" if req.status is Status.FINISHED else "failed")

    def _new_step_buffers(self) -> None:
        self._steps = np.empty((self.chunk_rows, len(STEP_FIELDS)))
        self._num_steps = 0
        self._gaps = np.empty(2 * self.chunk_rows)   # usually one group a step; a flush makes room for more
        self._gap_tokens = np.empty(2 * self.chunk_rows, dtype=np.int64)
        self._num_gaps = 0

    def step(self, row: tuple, now: float, itl_groups: dict[float, int]) -> None:
        """`row` holds the STEP_FIELDS in order (integers and flags are exact in a double)."""
        i, g = self._num_steps, self._num_gaps
        if g + len(itl_groups) > len(self._gaps):
            self._flush_steps()
            i = g = 0
            if len(itl_groups) > len(self._gaps):   # more groups in one step than a buffer holds (tiny chunks)
                self._gaps, self._gap_tokens = np.empty(len(itl_groups)), np.empty(len(itl_groups), dtype=np.int64)
        self._steps[i] = row
        for prev, count in itl_groups.items():
            self._gaps[g] = now - prev
            self._gap_tokens[g] = count
            g += 1
        self._num_steps, self._num_gaps = i + 1, g
        if i + 1 == self.chunk_rows:
            self._flush_steps()

    def repeated_steps(self, row: tuple, start: float, ends: np.ndarray, costs: np.ndarray, kv_usage,
                       num_waiting: np.ndarray | None = None) -> None:
        """Steps that repeat one step back to back from `start`, written in place: `row` (its STEP_FIELDS) but for
        each one's start and end (`ends`), StepCost fields (rows of `costs`), KV usage and, if given, queue length;
        one inter-token gap group each, as long as the step, of the row's `output_tokens` tokens."""
        done, n = 0, len(ends)
        while done < n:
            i, g = self._num_steps, self._num_gaps
            k = min(n - done, self.chunk_rows - i, len(self._gaps) - g)
            rows = self._steps[i:i + k]
            rows[:] = row
            rows[0, _START] = ends[done - 1] if done else start
            rows[1:, _START] = ends[done:done + k - 1]
            rows[:, _END] = ends[done:done + k]
            rows[:, _COSTS] = costs[done:done + k]
            rows[:, _KV_USAGE] = kv_usage[done:done + k]
            if num_waiting is not None:
                rows[:, _WAITING] = num_waiting[done:done + k]
            np.subtract(rows[:, _END], rows[:, _START], out=self._gaps[g:g + k])
            self._gap_tokens[g:g + k] = rows[0, _OUTPUT_TOKENS]
            self._num_steps, self._num_gaps = i + k, g + k
            done += k
            if i + k == self.chunk_rows or g + k == len(self._gaps):
                self._flush_steps()

    def _code(self, s: str) -> int:
        code = self._codes.get(s)
        if code is None:
            code = self._codes[s] = len(self._strings)
            self._strings.append(s)
        return code

    def _flush_requests(self) -> None:
        if not self._request_rows:
            return
        rows = np.empty(len(self._request_rows), dtype=REQUEST_DTYPE)
        for (name, code), col in zip(REQUEST_FIELDS, zip(*self._request_rows, strict=True), strict=True):
            if code == "s":
                # codes in order of first appearance (not a set's hash order): the same run, the same codes
                lookup = {s: self._code(s) for s in dict.fromkeys(col)}
                rows[name] = [lookup[s] for s in col]
            else:   # array() refuses a value of the wrong type (a float in an integer column)
                rows[name] = np.frombuffer(array(code, col), dtype=code)
        self.request_chunks.append(rows[np.argsort(rows["request_id"], kind="stable")])
        self._request_rows = []

    def _flush_steps(self) -> None:
        n, g = self._num_steps, self._num_gaps
        if not n and not g:
            return
        steps, gaps, tokens = self._steps, self._gaps, self._gap_tokens
        self._new_step_buffers()
        if n:   # a full buffer becomes the chunk; part of one is copied, so a chunk holds no unused memory
            block = steps if n == len(steps) else steps[:n].copy()
            self.step_chunks.append(block.view(STEP_DTYPE).reshape(n))
        if g:
            rows = np.empty(g, dtype=ITL_DTYPE)
            rows["gap_s"], rows["tokens"] = gaps[:g], tokens[:g]
            self.itl_chunks.append(rows)

    def flush(self) -> None:
        """Move every buffered row to the chunks (the readers below do it first)."""
        self._flush_requests()
        self._flush_steps()

    # ---- reading (after the run) ------------------------------------------------------------------------------
    def request_rows(self) -> Iterator[np.ndarray]:
        """Request rows chunk by chunk, in no particular order across chunks (for totals and statistics)."""
        self.flush()
        return iter(self.request_chunks)

    def request_rows_by_id(self) -> Iterator[np.ndarray]:
        """Request rows in ascending request id, block by block."""
        self.flush()
        return merged(self.request_chunks, "request_id")

    def step_rows(self) -> Iterator[np.ndarray]:
        self.flush()
        return iter(self.step_chunks)

    def itl_rows(self) -> Iterator[np.ndarray]:
        self.flush()
        return iter(self.itl_chunks)

    @property
    def strings(self) -> list[str]:
        """The values of the string columns, by code (of every row recorded so far)."""
        self.flush()
        return self._strings

    def code(self, s: str) -> int | None:
        """The code of a string column's value, None if no row has it."""
        self.flush()
        return self._codes.get(s)

    @property
    def num_steps(self) -> int:
        return self.step_chunks.rows + self._num_steps

    @property
    def num_requests(self) -> int:
        return self.request_chunks.rows + len(self._request_rows)
