"""The accuracy table run reports read (validate/accuracy.py): its families, its recording, and that it is the
simulator's current error (a sample of its rows re-run here must give the errors it holds)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from simengine.validate import accuracy as acc
from simengine.validate.measurements import METRICS, read_measurements
from simengine.validate.run import Prediction, run_row

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "validation"


def test_every_metric_a_measurement_file_may_hold_has_a_family():
    assert {m: acc.family(m) for m in METRICS if acc.family(m) is None} == {}
    assert acc.family("output_throughput_tok_s") == "throughput" and acc.family("p99_itl_ms") == "TPOT / ITL"
    assert acc.family("prefill_tok_s") == "prefill step" and acc.family("decode_step_ms") == "decode step"


def test_recording_replaces_only_the_files_own_rows(tmp_path):
    path = tmp_path / "accuracy.csv"
    acc.record(path, "a", [("r1", "vllm", "h100_sxm", "median_ttft_ms", -20.0)])
    acc.record(path, "b", [("r2", "sglang", "a100_80g_sxm", "request_throughput", 5.0)])
    acc.record(path, "a", [("r3", "vllm", "h100_sxm", "median_tpot_ms", 3.456)])
    with path.open() as fh:
        rows = list(csv.reader(fh))
    assert rows == [list(acc.COLUMNS), ["a", "r3", "vllm", "h100_sxm", "median_tpot_ms", "3.46"],
                    ["b", "r2", "sglang", "a100_80g_sxm", "request_throughput", "5.00"]]


def test_the_package_table_covers_every_measured_engine_and_both_kinds_of_file():
    rows = acc.table()
    assert len(rows) > 500
    files = {r[0] for r in rows}
    assert acc.CALIBRATION_FILES <= files and files - acc.CALIBRATION_FILES     # fitted and judged-only rows
    assert {"vllm", "sglang", "lmdeploy", "tgi", "trtllm", "llamacpp", "generic"} <= {r[2] for r in rows}


def test_an_engine_is_judged_on_the_runs_device_when_it_has_rows_there_else_on_every_device():
    on_h100 = {a["family"]: a for a in acc.for_engine("trtllm", "h100_sxm")}
    assert on_h100["throughput"]["scope"] == "h100_sxm"
    assert on_h100["throughput"]["calibration"]["rows"] > 0 and on_h100["throughput"]["judged"]["rows"] > 0
    elsewhere = {a["family"]: a for a in acc.for_engine("vllm", "mi300x")}
    assert elsewhere["throughput"]["scope"] == "every device"
    assert acc.for_engine("no-such-engine", "h100_sxm") == []
    assert acc.device_rows("h100_sxm") > 0 and "No published measurement" in acc.device_line("jetson_orin_nano")


def _files() -> list[Path]:
    """The measurement files here: docs/judge/ always, the shared files where ../shared is beside the repository."""
    shared = [SHARED / f"{f}.csv" for f in sorted(acc.CALIBRATION_FILES)]
    return [*sorted((REPO / "docs" / "judge").glob("*.csv")), *(p for p in shared if p.exists())]


def _sample() -> list:
    """The first row of each (file, engine, metric family) of the measurement files here."""
    picked: dict[tuple, tuple] = {}
    for path in _files():
        for row in read_measurements(path):
            picked.setdefault((path.stem, row.engine, acc.family(row.metric)), (path.stem, row))
    return list(picked.values())


def test_the_table_holds_the_simulators_current_error():
    """A stale table would misreport the error: `make accuracy` must run again whenever a change moves a row.
    One row of every file, engine and metric family re-runs here (44 rows with ../shared beside the
    repository: about a minute on one core)."""
    held = {(r[0], r[1], r[4]): r[5] for r in acc.table()}
    sample = _sample()
    assert {f for f, _ in sample} == {p.stem for p in _files()} and len(sample) >= 7
    stale = []
    for f, row in sample:
        pred = run_row(row)
        was = held.get((f, row.id, row.metric))
        now = pred.error_pct if isinstance(pred, Prediction) else None
        if (was is None) != (now is None) or (now is not None and abs(now - was) > 0.01):
            stale.append(f"{f} {row.id}: {was} % in the table, {now} % now")
    assert not stale, "the accuracy table is stale; run `make accuracy`:\n" + "\n".join(stale)


def test_validate_records_its_rows_in_a_table(tmp_path):
    f = tmp_path / "one.csv"
    src = REPO / "docs" / "judge" / "llamacpp.csv"
    lines = src.read_text().splitlines()
    f.write_text("\n".join(lines[:3]) + "\n")
    table = tmp_path / "acc.csv"
    r = subprocess.run([sys.executable, "-m", "simengine", "validate", str(f), "--quiet", "--out",
                        str(tmp_path / "out"), "--accuracy", str(table)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    with table.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [x["file"] for x in rows] == ["one", "one"] and {x["engine"] for x in rows} == {"llamacpp"}


@pytest.mark.parametrize("table,words", [("missing/acc.csv", "no folder"), ("bad.csv", "not an accuracy table")])
def test_a_table_it_cannot_record_into_is_refused_before_validating(tmp_path, table, words):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "simengine", "validate", str(REPO / "docs" / "judge" / "llamacpp.csv"),
                        "--out", str(out), "--accuracy", str(tmp_path / table)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--accuracy" in r.stderr and words in r.stderr and not out.exists()
    assert (tmp_path / "bad.csv").read_text() == "a,b\n1,2\n"
