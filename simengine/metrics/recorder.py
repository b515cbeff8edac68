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
        self._runs: list[tuple] = []   # repeated_steps since the last flush
        self._run_rows = 0

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
        """Steps that repeat one step back to back from `start`: `row` (its STEP_FIELDS) but for each one's start
        and end (`ends`), StepCost fields (rows of `costs`), KV usage and, if given, queue length; one inter-token gap
        group each, as long as the step, of the row's `output_tokens` tokens. Kept as a run (the arrays by reference:
        the caller never changes them) and written out as rows when its chunk is read (`RunBlock`)."""
        self._runs.append((self._num_steps, self._num_gaps, row, start, ends, costs, kv_usage, num_waiting))
        self._run_rows += len(ends)
        if self._run_rows >= self.chunk_rows:
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
        if self._runs:   # the chunk keeps its runs as runs; the buffers are used again
            made = RunBlock(self._steps[:n].copy(), self._gaps[:g].copy(), self._gap_tokens[:g].copy(), self._runs)
            self._num_steps = self._num_gaps = self._run_rows = 0
            self._runs = []
            self.step_chunks.append_made(made.steps, made.num_rows, made.nbytes)
            self.itl_chunks.append_made(made.gaps, made.num_gaps, 0)
            return
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
        return self.step_chunks.rows + self._num_steps + self._run_rows

    @property
    def num_requests(self) -> int:
        return self.request_chunks.rows + len(self._request_rows)


class RunBlock:
    """A chunk of step rows and inter-token gaps whose runs of repeated steps (`Recorder.repeated_steps`) stay runs
    until read: a run keeps a few floats a step (its times, KV usage, queue; its costs often a view of the cost
    model's table) where rows take 168 bytes a step, memory a run of an overloaded engine with a few slots fills by
    the hundred megabytes. `steps()` and `gaps()` write the chunk out in the order recorded, each repeat's row and gap
    exactly as a row written at the time would be."""

    def __init__(self, singles: np.ndarray, gaps: np.ndarray, gap_tokens: np.ndarray, runs: list[tuple]):
        self.singles, self.single_gaps, self.single_gap_tokens, self.runs = singles, gaps, gap_tokens, runs
        self.lengths = np.array([len(r[4]) for r in runs])
        self.firsts = np.cumsum(self.lengths) - self.lengths   # each run's first repeat among all repeats
        repeats = int(self.lengths.sum())
        self.num_rows, self.num_gaps = len(singles) + repeats, len(gaps) + repeats
        self.nbytes = singles.nbytes + gaps.nbytes + gap_tokens.nbytes + 40 * repeats

    def _times(self) -> tuple[np.ndarray, np.ndarray]:
        """Every repeat's start and end."""
        ends = np.concatenate([r[4] for r in self.runs])
        starts = np.empty(len(ends))
        starts[1:] = ends[:-1]
        starts[self.firsts] = [r[3] for r in self.runs]
        return starts, ends

    def _placed(self, before: list[int], total: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each repeat lands among the chunk's `total` entries, run r's after its `before[r]` single entries,
        and which entries are single ones."""
        at = np.arange(int(self.lengths.sum())) + np.repeat(before, self.lengths)
        single = np.ones(total, dtype=bool)
        single[at] = False
        return at, single

    def steps(self) -> np.ndarray:
        """The chunk's step rows: each single row, and each repeat's: its run's row with its own start, end, costs,
        KV usage and queue."""
        runs, k, n = self.runs, self.lengths, len(self.singles)
        at, single = self._placed([r[0] for r in runs], self.num_rows)
        source = np.empty(self.num_rows, dtype=np.int64)   # each row's source: a single row, or its run's row
        source[single] = np.arange(n)
        source[at] = np.repeat(np.arange(n, n + len(runs)), k)
        out = np.concatenate((self.singles, np.array([r[2] for r in runs], dtype=float)))[source]
        out[at, _START], out[at, _END] = self._times()
        out[at, _COSTS] = np.concatenate([r[5] for r in runs])
        out[at, _KV_USAGE] = np.concatenate([np.asarray(r[6], dtype=float) for r in runs])
        for r, first, m in zip(runs, self.firsts.tolist(), k.tolist(), strict=True):
            if r[7] is not None:
                out[at[first:first + m], _WAITING] = r[7]
        return out.view(STEP_DTYPE).reshape(len(out))

    def gaps(self) -> np.ndarray:
        """The chunk's inter-token gap groups: each single step's, and one a repeat, as long as it, of its run's
        row's `output_tokens` tokens."""
        at, single = self._placed([r[1] for r in self.runs], self.num_gaps)
        starts, ends = self._times()
        out = np.empty(self.num_gaps, dtype=ITL_DTYPE)
        out["gap_s"][single], out["gap_s"][at] = self.single_gaps, ends - starts
        out["tokens"][single] = self.single_gap_tokens
        out["tokens"][at] = np.repeat(np.array([r[2][_OUTPUT_TOKENS] for r in self.runs], dtype=np.int64),
                                      self.lengths)
        return out

