"""Append-only row arrays kept in chunks: in memory up to a budget that a run's recorder shares, then in files of a
temporary folder, so the rows of a run of any length need at most the budget in memory."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

# Rows a run keeps in memory before later chunks go to disk: a million-request run's steps and requests fit below it
# (one step row is 136 bytes, one request row 96), a ten-million-request one's do not.
MEMORY_BUDGET_BYTES = 256 << 20


class Spill:
    """The memory budget of one run's chunks, and the temporary folder (made on first use, deleted with this object
    or at exit) that takes the chunks past it."""

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = MEMORY_BUDGET_BYTES if budget_bytes is None else budget_bytes
        self.held_bytes = 0
        self._dir: tempfile.TemporaryDirectory | None = None

    def path(self, name: str) -> Path:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="simengine-rows-")
        return Path(self._dir.name) / name

    @property
    def on_disk(self) -> bool:
        return self._dir is not None

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


class _Made:
    """A chunk written out when read (Chunks.append_made)."""

    __slots__ = ("make", "rows")

    def __init__(self, make: Callable[[], np.ndarray], rows: int):
        self.make, self.rows = make, rows


class Chunks:
    """Arrays of one dtype appended in chunks; read back chunk by chunk, or a slice of one chunk."""

    def __init__(self, name: str, dtype: np.dtype, spill: Spill):
        self.name, self.dtype, self.spill = name, np.dtype(dtype), spill
        self.rows = 0
        # an array in memory, one written out when read, or (first row, rows) on disk
        self._parts: list[np.ndarray | _Made | tuple[int, int]] = []
        self._file_rows = 0

    def append(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        self.rows += len(rows)
        if self.spill.held_bytes + rows.nbytes <= self.spill.budget_bytes:
            self.spill.held_bytes += rows.nbytes
            self._parts.append(rows)
            return
        with open(self.spill.path(self.name), "ab") as f:
            rows.tofile(f)
        self._parts.append((self._file_rows, len(rows)))
        self._file_rows += len(rows)

    def append_made(self, make: Callable[[], np.ndarray], rows: int, nbytes: int) -> None:
        """A chunk of `rows` rows that `make()` writes out when read, holding `nbytes` until then: kept so within the
        budget, else written out now and kept as any chunk."""
        if not rows:
            return
        if self.spill.held_bytes + nbytes <= self.spill.budget_bytes:
            self.spill.held_bytes += nbytes
            self.rows += rows
            self._parts.append(_Made(make, rows))
            return
        self.append(make())

    def __len__(self) -> int:
        return len(self._parts)

    def chunk_rows(self, i: int) -> int:
        part = self._parts[i]
        if isinstance(part, _Made):
            return part.rows
        return part[1] if isinstance(part, tuple) else len(part)

    def read(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start:stop of chunk i."""
        part = self._parts[i]
        if isinstance(part, _Made):
            return part.make()[start:stop]
        if not isinstance(part, tuple):
            return part[start:stop]
        first, n = part
        stop = n if stop is None else min(stop, n)
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        with open(self.spill.path(self.name), "rb") as f:
            f.seek((first + start) * self.dtype.itemsize)
            return np.fromfile(f, dtype=self.dtype, count=stop - start)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self._parts)):
            yield self.read(i)

    def concat(self) -> np.ndarray:
        parts = list(self)
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)


def merged(chunks: Chunks, key: str, budget_rows: int = 1 << 18) -> Iterator[np.ndarray]:
    """The rows of chunks each sorted by `key`, as blocks in ascending order of it (a k-way merge that holds a
    window of each chunk: about `budget_rows` rows in all)."""
    n = len(chunks)
    if n == 1:
        yield chunks.read(0)
        return
    window = max(1024, budget_rows // max(n, 1))
    pos = [0] * n                                   # next row of each chunk not yet in a window
    held = [chunks.read(i, 0, window) for i in range(n)]
    for i in range(n):
        pos[i] = len(held[i])
    while True:
        live = [i for i in range(n) if len(held[i])]
        if not live:
            return
        # every row still unread in chunk i sorts after its window's last: take what sorts at or before the least
        bound = min(held[i][key][-1] for i in live if pos[i] < chunks.chunk_rows(i)) \
            if any(pos[i] < chunks.chunk_rows(i) for i in live) else None
        taken = []
        for i in live:
            cut = len(held[i]) if bound is None else int(np.searchsorted(held[i][key], bound, side="right"))
            if cut:
                taken.append(held[i][:cut])
                held[i] = held[i][cut:]
            if not len(held[i]) and pos[i] < chunks.chunk_rows(i):
                held[i] = chunks.read(i, pos[i], pos[i] + window)
                pos[i] += len(held[i])
        block = np.concatenate(taken)
        yield block[np.argsort(block[key], kind="stable")]
