"""Sweeps: every grid point simulated once into one table, resumable, a failed point recorded while the others
finish, the same table from one process, a pool and Ray, and a Pareto front that no point dominates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simengine.planning import sweep as sw

REPO = Path(__file__).resolve().parents[1]
SCENARIO = str(REPO / "scenarios" / "chat_high_concurrency.yaml")
BASE = ["horizon_s=8"]


def _grid(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "grid.yaml"
    p.write_text(text)
    return p


EIGHT = "axes:\n  engine: [vllm, sglang]\n  workload.arrival.rate: [4, 12]\n  deployment.hardware: [h100_sxm, l4]\n"


def _table(path: Path) -> pd.DataFrame:
    df = pd.read_csv(path).drop(columns=["wall_s"])
    return df.sort_values("point").reset_index(drop=True)


def test_pool_and_single_process_give_the_same_table(tmp_path):
    grid = sw.load_grid(_grid(tmp_path, EIGHT), ["vllm"])
    a = sw.sweep(SCENARIO, BASE, grid, tmp_path / "one", jobs=1)
    b = sw.sweep(SCENARIO, BASE, grid, tmp_path / "pool", jobs=2)
    ta, tb = _table(a), _table(b)
    assert len(ta) == 8 and (ta["status"] == "ok").all()
    pd.testing.assert_frame_equal(ta, tb)


def test_ray_gives_the_same_table_as_the_local_pool(tmp_path):
    import os
    if os.environ.get("SIMENGINE_CI") == "1":
        import ray  # noqa: F401  (CI installs the extra: missing there is a failure, not a skip)
    pytest.importorskip("ray")
    grid = sw.load_grid(_grid(tmp_path, EIGHT), ["vllm"])
    a = sw.sweep(SCENARIO, BASE, grid, tmp_path / "local", jobs=2)
    b = sw.sweep(SCENARIO, BASE, grid, tmp_path / "ray", jobs=2, executor="ray")
    pd.testing.assert_frame_equal(_table(a), _table(b))


def test_an_impossible_point_is_recorded_and_the_rest_finish(tmp_path):
    grid = sw.load_grid(_grid(tmp_path, "axes:\n  deployment.model: [llama-3.1-8b, llama-3-70b]\n"
                                        "  deployment.hardware: [l4]\n"), ["vllm"])
    df = pd.read_csv(sw.sweep(SCENARIO, BASE, grid, tmp_path / "r", jobs=1))
    assert list(df["status"]) == ["ok", "failed"] or sorted(df["status"]) == ["failed", "ok"]
    bad = df[df["status"] == "failed"].iloc[0]
    assert bad["deployment.model"] == "llama-3-70b" and "does not fit on l4" in bad["reason"]


def test_a_rerun_resumes_and_a_cut_line_runs_again(tmp_path, monkeypatch):
    grid = sw.load_grid(_grid(tmp_path, "axes:\n  workload.arrival.rate: [2, 4, 6]\n"), ["vllm"])
    path = sw.sweep(SCENARIO, BASE, grid, tmp_path / "r", jobs=1)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:10])      # an interrupt cut the last line
    ran = []
    real = sw.run_point
    monkeypatch.setattr(sw, "run_point", lambda *a: ran.append(a[2]) or real(*a))
    sw.sweep(SCENARIO, BASE, grid, tmp_path / "r", jobs=1)
    assert len(ran) == 1                                       # only the cut point again
    df = pd.read_csv(path)
    assert len(df) == 3 and df["point"].is_unique
    ran.clear()
    sw.sweep(SCENARIO, BASE, grid, tmp_path / "r", jobs=1)
    assert ran == []


def test_another_grid_in_the_same_folder_is_refused(tmp_path):
    a = sw.load_grid(_grid(tmp_path, "axes:\n  workload.arrival.rate: [2]\n"), ["vllm"])
    sw.sweep(SCENARIO, BASE, a, tmp_path / "r", jobs=1)
    b = sw.load_grid(_grid(tmp_path, "axes:\n  deployment.hardware: [l4]\n"), ["vllm"])
    with pytest.raises(sw.InputError):
        sw.sweep(SCENARIO, BASE, b, tmp_path / "r", jobs=1)


@given(st.lists(st.tuples(st.floats(1, 1e4), st.floats(0, 1e4)), max_size=30))
def test_no_point_dominates_the_pareto_front(points):
    front = sw.pareto(points)
    for i in front:
        t, thr = points[i]
        assert not any(u <= t and v >= thr and (u, v) != (t, thr) and (u < t or v > thr) for u, v in points)
    for j, (u, v) in enumerate(points):      # every point off the front is dominated or equals a front point
        if j not in front:
            assert any(points[i][0] <= u and points[i][1] >= v for i in front)


@pytest.mark.parametrize("text,field", [
    ("axes: {}\n", "axes"),
    ("axes:\n  workload.arival.rate: [1]\n", "--grid"),
    ("axes:\n  engines: [vllm]\n", "axes.engines"),
    ("axes:\n  workload.arrival.rate: 3\n", "axes.workload.arrival.rate"),
    ("points: []\n", "axes"),
    ("axes:\n  deployment.hardware: [h100_sxm, h100_sxmm]\n", "did you mean 'h100_sxm'"),   # a name, not a key
    ("axes:\n  deployment.model: [llama-3.1-8b, llama-9-8b]\n", "unknown model 'llama-9-8b'"),
])
def test_bad_grids_exit_2_with_one_line(tmp_path, text, field):
    g = _grid(tmp_path, text)
    r = subprocess.run([sys.executable, "-m", "simengine", "sweep", "chat_high_concurrency", "--grid", str(g),
                        "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and field in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_sweep_cli_writes_the_table_parquet_and_pareto_figure(tmp_path):
    g = _grid(tmp_path, "axes:\n  engine: [vllm, tgi]\n  workload.arrival.rate: [3, 9]\n")
    r = subprocess.run([sys.executable, "-m", "simengine", "sweep", "chat_high_concurrency", "--grid", str(g),
                        "--set", "horizon_s=8", "--jobs", "2", "--out", str(tmp_path / "r"),
                        "--plots", str(tmp_path / "p")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "4 ok, 0 failed" in r.stdout
    assert next((tmp_path / "p").rglob("*_pareto.png")).stat().st_size > 0
    csv = next((tmp_path / "r").rglob("points.csv"))
    if sw.write_parquet(csv) is not None:
        assert len(pd.read_parquet(csv.with_suffix(".parquet"))) == 4
