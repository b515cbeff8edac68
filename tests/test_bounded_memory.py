"""Bounded memory for long runs: rows past the memory budget go to temporary files, statistics are exact in
bounded memory, and a run whose rows are all on disk gives the same summary, frames and files as one in memory."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simengine.api import compare, run_engine, write_plots, write_results
from simengine.metrics import chunks, recorder, stream_stats, summary
from simengine.metrics.chunks import Chunks, Spill, merged
from simengine.metrics.frames import plot_requests, plot_steps, steps_frame
from tests.conftest import make_scenario

floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(values=st.lists(floats, min_size=1, max_size=300), weighted=st.booleans(), data=st.data(),
       gather_max=st.sampled_from([1, 4, 1 << 20]))
def test_stream_stats_equal_numpy(values, weighted, data, gather_max):
    """Mean, std and the percentiles equal numpy's on the whole (weight-expanded) sample, however it is chunked and
    however few candidates may be gathered (1: every rank found digit by digit down to the last key bit)."""
    v = np.array(values)
    w = np.array(data.draw(st.lists(st.integers(0, 4), min_size=len(v), max_size=len(v)))) if weighted else None
    if w is not None and w.sum() == 0:
        w[0] = 1
    cuts = sorted(data.draw(st.lists(st.integers(0, len(v)), max_size=4)))
    parts = np.split(np.arange(len(v)), cuts)
    old, stream_stats.GATHER_MAX = stream_stats.GATHER_MAX, gather_max
    try:
        got = stream_stats.sample_stats(lambda: ({"x": (v[p], None if w is None else w[p])} for p in parts), ["x"],
                                        (0, 50, 90, 99, 100))["x"]
    finally:
        stream_stats.GATHER_MAX = old
    full = v if w is None else np.repeat(v, w)
    for p in (0, 50, 90, 99, 100):
        assert got[p] == pytest.approx(np.percentile(full, p), rel=1e-12, abs=1e-12)
    assert got["count"] == len(full)
    assert got["mean"] == pytest.approx(full.mean(), rel=1e-9, abs=1e-9)
    assert got["std"] == pytest.approx(full.std(), rel=1e-9, abs=1e-6)


def test_stream_stats_empty_sample():
    assert stream_stats.sample_stats(lambda: [{"x": (np.empty(0), None)}], ["x"], (50,)) == {"x": None}


@given(sizes=st.lists(st.integers(0, 40), min_size=0, max_size=8), budget=st.sampled_from([0, 200, 1 << 20]),
       seed=st.integers(0, 1000))
def test_merged_chunks_come_out_in_key_order(sizes, budget, seed):
    """Chunks each sorted by key, some in memory and some on disk, merge into one ascending sequence holding
    every row once, whatever the window."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype([("key", "i8"), ("value", "f8")])
    spill = Spill(budget)
    store = Chunks("rows", dtype, spill)
    keys = rng.permutation(sum(sizes) * 3)[:sum(sizes)]
    start = 0
    for n in sizes:
        rows = np.zeros(n, dtype=dtype)
        rows["key"] = np.sort(keys[start:start + n])
        rows["value"] = rows["key"] * 0.5
        store.append(rows)
        start += n
    out = [b for b in merged(store, "key", budget_rows=1)]
    got = np.concatenate(out) if out else np.empty(0, dtype=dtype)
    assert list(got["key"]) == sorted(keys.tolist())
    assert np.array_equal(got["value"], got["key"] * 0.5)
    if budget == 0 and sum(sizes):
        assert spill.on_disk
    spill.close()


@pytest.fixture
def on_disk(monkeypatch):
    """Every row on disk at once: no memory budget, chunks of 50 rows."""
    monkeypatch.setattr(chunks, "MEMORY_BUDGET_BYTES", 0)
    monkeypatch.setattr(recorder, "CHUNK_ROWS", 50)


def _scenario(**kw):
    return make_scenario(horizon_s=40.0, workload__arrival__rate=8.0, **kw)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tgi"])
def test_rows_on_disk_give_the_same_results(engine, monkeypatch, tmp_path):
    """The same run with its rows in memory and with all of them in temporary files (chunks of 50 rows): identical
    summary, frames and results files."""
    sc = _scenario(engines=[engine])
    mem = run_engine(sc, sc.engines[0])
    assert not mem.recorder.spill.on_disk
    monkeypatch.setattr(chunks, "MEMORY_BUDGET_BYTES", 0)
    monkeypatch.setattr(recorder, "CHUNK_ROWS", 50)
    disk = run_engine(sc, sc.engines[0])
    assert disk.recorder.spill.on_disk and len(disk.recorder.request_chunks) > 3
    assert disk.summary == mem.summary
    assert disk.requests.equals(mem.requests)
    assert disk.steps.equals(mem.steps)
    assert np.array_equal(disk.itl_ms, mem.itl_ms) and np.array_equal(disk.itl_counts, mem.itl_counts)
    a = write_results(sc, {"x": mem}, tmp_path / "mem")
    b = write_results(sc, {"x": disk}, tmp_path / "disk")
    for name in ("summary.json", "requests.csv", "steps.csv"):
        assert (a / "x" / name).read_bytes() == (b / "x" / name).read_bytes(), name


def test_classes_and_failures_summarised_from_disk(monkeypatch):
    """Per-class figures and a load limit's refusals (counted as shed) come out the same from disk."""
    sc = _scenario(engines=[{"engine": "tgi", "params": {"max_concurrent_requests": 8}}],
                   workload__classes=[{"name": "chat", "weight": 2, "slo": {"ttft_ms": 500}},
                                      {"name": "batch", "weight": 1}])
    mem = run_engine(sc, sc.engines[0]).summary
    monkeypatch.setattr(chunks, "MEMORY_BUDGET_BYTES", 0)
    monkeypatch.setattr(recorder, "CHUNK_ROWS", 50)
    disk = run_engine(sc, sc.engines[0]).summary
    assert mem["failed"] > 0.05 * mem["num_requests"] and mem["overloaded"] is True   # refused with 429: shed
    assert set(mem["classes"]) == {"chat", "batch"} and mem["classes"]["chat"]["slo_attainment"] is not None
    assert disk == mem


def test_plots_of_a_long_run_are_bounded(on_disk, monkeypatch, tmp_path):
    """Past the plot limit the timelines draw every k-th request and time-binned step means; the bins' means are
    the means of the steps in them."""
    sc = _scenario()
    r = compare(sc)["vllm"]
    n = r.recorder.num_requests
    req, every = plot_requests(r.recorder, max(1, n // 5))
    assert every >= 5 and len(req) == len(range(0, n, every))
    assert list(req["request_id"]) == sorted(req["request_id"])
    binned = plot_steps(r.recorder, r.end_s, 10)
    assert len(binned) <= 11
    steps = steps_frame(r.recorder)
    width = r.end_s / 10
    first = steps[steps["end_s"] < width]
    assert binned["kv_usage"].iloc[0] == pytest.approx(first["kv_usage"].mean())
    from simengine import api
    monkeypatch.setattr(api, "PLOT_MAX_ROWS", max(1, n // 5))
    written = write_plots(sc, {"vllm": r}, tmp_path)
    assert all(p.stat().st_size > 0 for p in written)


def test_spill_files_go_with_the_run(on_disk):
    """The temporary files are deleted when the recorder closes its spill."""
    sc = _scenario()
    r = run_engine(sc, sc.engines[0])
    folder = r.recorder.spill.path("requests").parent
    assert folder.exists() and any(folder.iterdir())
    r.recorder.spill.close()
    assert not folder.exists()
    json.dumps(r.summary)


def test_reason_codes_follow_first_appearance_so_a_run_summarises_alike_in_every_process():
    """String codes are handed out in the order requests first show a string, not a set's hash order (which
    PYTHONHASHSEED changes), and `failure_reasons` labels a kind by the numbers its reasons hold, sorted: the same in
    every process."""
    from simengine.core.request import Request

    rec = recorder.Recorder(chunk_rows=4)
    reasons = [f"prompt of {100 + i} tokens exceeds max_num_tokens 64" for i in range(40)]
    for i, reason in enumerate(reasons):
        req = Request(i, 0.0, np.zeros(200, dtype=np.int32), 100 + i, 1)
        req.fail_reason = reason
        rec.request(req, 0, "failed")
    rec.request_rows()   # flushes the rest
    assert [s for s in rec.strings if s.startswith("prompt")] == reasons
    counts = np.zeros(len(rec.strings), dtype=np.int64)
    counts[[rec.strings.index(r) for r in reasons]] = 1
    assert summary.failure_reasons(rec.strings, counts) == {"prompt of 100-139 tokens exceeds max_num_tokens 64": 40}


@given(calls=st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 3)), max_size=40),
       chunk_rows=st.sampled_from([1, 2, 3, 5, 1 << 16]), budget=st.sampled_from([0, 1 << 30]))
def test_step_rows_and_gaps_come_back_in_order_however_chunked(calls, chunk_rows, budget):
    """Single steps (with 0-3 gap groups) and runs of repeated steps (one group each, their queue lengths given or
    not) interleaved: the rows and the gaps come back in the order recorded and as recorded, whatever the chunk size
    and wherever the chunks are kept (runs stay runs in memory until read, and are written out when spilled)."""
    rec = recorder.Recorder(Spill(budget_bytes=budget), chunk_rows=chunk_rows)
    width = len(recorder.STEP_FIELDS)
    col = {name: recorder.STEP_COLUMNS.index(name) for name in ("start_s", "end_s", "output_tokens", "step_s")}
    rows, gaps = [], []
    for block, k, groups in calls:
        if block:   # a run of repeats of one row: their own times, costs and KV usage
            start = float(len(rows))
            row = [start] * width
            row[col["output_tokens"]] = 7
            ends = start + 0.5 * np.arange(1, k + 1)
            costs = np.arange(k, dtype=float)[:, None] + np.zeros((k, 6))
            waiting = np.arange(k) + 3.0 if groups % 2 else None   # queue lengths where arrivals came meanwhile
            rec.repeated_steps(tuple(row), start, ends, costs, ends * 0.01, waiting)
            expect = np.array([row] * k)
            if waiting is not None:
                expect[:, recorder.STEP_COLUMNS.index("num_waiting")] = waiting
            expect[:, col["start_s"]] = np.concatenate(([start], ends[:-1]))
            expect[:, col["end_s"]] = ends
            expect[:, col["step_s"]:col["step_s"] + 6] = costs
            expect[:, recorder.STEP_COLUMNS.index("kv_usage")] = ends * 0.01
            rows.extend(map(tuple, expect.tolist()))
            gaps.extend((0.5, 7) for _ in range(k))
        else:
            now = float(len(rows))
            itl = {now - 0.25 * (j + 1): j + 1 for j in range(groups)}
            rec.step(tuple([now] * width), now, itl)
            rows.append(tuple([now] * width))
            gaps.extend((now - prev, count) for prev, count in itl.items())
    assert rec.num_steps == len(rows)
    got = [tuple(r) for c in rec.step_rows() for r in c.tolist()]
    assert got == rows
    itl = [(float(v), int(t)) for c in rec.itl_rows() for v, t in zip(c["gap_s"], c["tokens"])]
    assert itl == gaps
