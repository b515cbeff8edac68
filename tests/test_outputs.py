"""Outputs people open: results that never vanish (a subset run keeps the other engines', a --set variant keeps
the baseline), failures counted by reason, CDFs that show the failed share, and a Perfetto trace per engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from simengine.api import compare
from simengine.config.scenario import load_scenario
from simengine.report.trace import trace_events
from tests.conftest import make_scenario

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simengine", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_subset_run_leaves_the_other_engines_results_and_figures(tmp_path):
    out, plots = tmp_path / "results", tmp_path / "plots"
    base = ["--out", str(out), "--plots", str(plots)]
    assert run_cli("run", "scenarios/agent_multiturn.yaml", "--engines", "vllm,sglang", *base,
                   "--set", "name=agent", "--set", "horizon_s=8").returncode == 0
    before = _snapshot(tmp_path)
    r = run_cli("run", "scenarios/agent_multiturn.yaml", "--engines", "vllm", *base, "--set", "name=agent",
                "--set", "horizon_s=8", "--set", "seed=11")
    assert r.returncode == 0, r.stderr
    after = _snapshot(tmp_path)
    sglang = [k for k in before if "sglang" in k]
    assert len(sglang) >= 8   # six result files and two figures
    assert all(after[k] == before[k] for k in sglang)
    assert after["results/agent/vllm/summary.json"] != before["results/agent/vllm/summary.json"]
    assert set(after) == set(before)    # nothing stale added, nothing removed; no temporary folder left
    assert not [p for p in out.rglob(".*")]


def test_a_set_variant_goes_beside_the_baseline():
    assert load_scenario("agent_multiturn").name == "agent_multiturn"
    assert load_scenario("agent_multiturn", ["horizon_s=15"]).name == "agent_multiturn--horizon_s-15"
    assert load_scenario("agent_multiturn", ["name=mine", "horizon_s=15"]).name == "mine"
    long = load_scenario("agent_multiturn", [f"workload.sessions.population={n}" for n in (3, 4, 5, 6, 7)]).name
    assert len(long) < 120 and long.startswith("agent_multiturn--workload.sessions.population-3")


def test_failures_are_counted_by_reason(tmp_path):
    r = run_cli("run", "agent_multiturn", "--engines", "vllm", "--no-plots", "--out", str(tmp_path),
                "--set", "horizon_s=5", "--set", "engines=[{engine: vllm, params: {max_model_len: 4000}}]")
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("vllm:") and "failed:" in ln]
    assert line and "exceeds max_model_len 4000" in line[0], r.stdout
    summary = json.loads(next(tmp_path.rglob("vllm/summary.json")).read_text())
    assert sum(summary["failure_reasons"].values()) == summary["failed"] > 0


def test_an_engine_that_cannot_serve_the_deployment_is_listed_and_the_others_run(tmp_path):
    """Llama-3.1-70B BF16 at TP 2 on H100: SGLang's memory rule leaves no KV, vLLM's and TRT-LLM's do."""
    common = ("--no-plots", "--out", str(tmp_path), "--set", "deployment.model=llama-3.1-70b", "--set",
              "deployment.tp=2", "--set", "horizon_s=3")
    r = run_cli("run", "agent_multiturn", "--engines", "vllm,sglang", *common)
    assert r.returncode == 0, r.stderr
    assert any(ln.startswith("sglang: did not run:") and "does not fit" in ln for ln in r.stdout.splitlines())
    assert [p.parent.name for p in tmp_path.rglob("summary.json")] == ["vllm"]
    alone = run_cli("run", "agent_multiturn", "--engines", "sglang", *common)   # the only engine asked for
    assert alone.returncode == 2 and "does not fit" in alone.stderr and "Traceback" not in alone.stderr


def test_an_engine_refusing_every_prompt_or_the_weights_is_listed_and_the_others_run(tmp_path):
    """Audit 2026-12-06: these once aborted the whole comparison (or ran it with every request failed)."""
    cases = (("engines=[{engine: vllm, params: {max_model_len: 1000}}, sglang]", "vllm", "exceeds max_model_len 1000"),
             ("engines=[vllm, sglang]", "sglang", "needs fp8 tensor cores"))   # vLLM runs FP8 weight-only there
    for engines, refused, why in cases:
        r = run_cli("run", "agent_multiturn", "--no-plots", "--out", str(tmp_path / refused), "--set", "horizon_s=3",
                    "--set", engines, "--set", "deployment.hardware=a100_80g_sxm", "--set",
                    "deployment.weight_dtype=" + ("fp8" if refused == "sglang" else "bf16"))
        assert r.returncode == 0, r.stderr
        assert any(ln.startswith(f"{refused}: did not run:") and why in ln for ln in r.stdout.splitlines()), r.stdout
        ran = [p.parent.name for p in (tmp_path / refused).rglob("summary.json")]
        assert ran == [{"vllm": "sglang", "sglang": "vllm"}[refused]]


def test_compare_takes_engine_names():
    sc = make_scenario(horizon_s=3.0, engines=["vllm", {"engine": "sglang", "label": "sg", "params": {}}])
    res = compare(sc, ["sg", "tgi"])
    assert list(res) == ["sg", "tgi"] and res["sg"].summary["engine"] == "sglang"


def test_cdfs_stop_at_the_completed_share(tmp_path, monkeypatch):
    """A run whose requests partly fail draws TTFT CDFs that top out at the completed share."""
    from simengine.report import plots
    drawn = {}
    real = plots._cdf

    def spy(ax, values, total, label, color):
        drawn[(ax.get_title() or len(drawn), label)] = (np.sum(~np.isnan(values)), total)
        return real(ax, values, total, label, color)
    monkeypatch.setattr(plots, "_cdf", spy)
    sc = make_scenario(horizon_s=10.0, workload__arrival__rate=30.0,
                       engines=[{"engine": "tgi", "params": {"max_concurrent_requests": 4}}])
    res = compare(sc)
    s = res["tgi"].summary
    assert s["failed"] > 0
    from simengine.api import write_plots
    write_plots(sc, res, tmp_path)
    shares = [n / total for n, total in drawn.values()]
    assert min(shares) < 1.0 and any(abs(x - s["completed"] / s["num_requests"]) < 1e-9 for x in shares)


def test_legends_stay_off_the_data(tmp_path, monkeypatch):
    """Every legend of every figure lies outside every panel's plotting area (engines, SLO lines and series named
    beside or below the axes, never over points)."""
    from simengine.api import write_plots
    from simengine.report import plots
    boxes = {}

    def keep(fig, path, dpi=100):
        fig.canvas.draw()
        legends = [*fig.legends, *[a.get_legend() for a in fig.axes if a.get_legend() is not None]]
        boxes[path.name] = ([lg.get_window_extent() for lg in legends], [a.get_window_extent() for a in fig.axes])
        plots.plt.close(fig)
        return path
    monkeypatch.setattr(plots, "save_figure", keep)
    sc = make_scenario(horizon_s=10.0, workload__arrival__rate=6.0, engines=["vllm", "sglang"],
                       slo={"ttft_ms": 300.0, "tpot_ms": 40.0})
    write_plots(sc, compare(sc), tmp_path)
    assert len(boxes) == 5
    for name, (legends, axes) in boxes.items():
        assert legends, name
        for lg in legends:
            for ax in axes:
                assert not lg.overlaps(ax), name


def test_trace_is_trace_event_json_with_a_track_per_replica():
    sc = make_scenario(horizon_s=10.0, deployment__replicas=2, engines=["vllm"])
    r = compare(sc)["vllm"]
    trace = json.loads(json.dumps(trace_events(r.recorder, "vllm")))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["replica 0", "replica 1", "requests"]
    steps = [e for e in events if e["ph"] == "X" and e["pid"] != 0]
    assert len(steps) == r.summary["num_steps"]
    assert {e["pid"] for e in steps} == {1, 2}
    tracks: dict[tuple, list[float]] = {}
    for e in events:
        if "ts" in e:
            tracks.setdefault((e["pid"], e.get("tid"), e["ph"] == "C" and e["name"]), []).append(e["ts"])
    assert all(ts == sorted(ts) for ts in tracks.values())
    decodes = [e for e in events if e["pid"] == 0 and e["name"] == "decode"]
    assert len(decodes) == r.summary["completed"]
    assert {e["name"] for e in events if e["ph"] == "C"} == {"KV usage %", "requests"}


def test_a_long_runs_trace_is_cut_and_says_so(monkeypatch):
    from simengine.report import trace
    monkeypatch.setattr(trace, "TRACE_MAX_STEPS", 100)
    sc = make_scenario(horizon_s=10.0, engines=["vllm"])
    r = compare(sc)["vllm"]
    t = trace.trace_events(r.recorder, "vllm")
    assert sum(1 for e in t["traceEvents"] if e["ph"] == "X" and e["pid"] == 1) == 100
    assert "first 100 steps" in t["otherData"]["contents"]


def test_the_kv_timeline_averages_every_replica_as_its_last_step_left_it():
    """Audit 2026-12-06: grouping step rows by end time drew one replica at a time (a 0-100 % zig-zag)."""
    import pandas as pd

    from simengine.report.plots import fleet_state
    steps = pd.DataFrame({"replica": [0, 1, 0, 1], "end_s": [1.0, 1.5, 2.0, 2.5],
                          "kv_usage": [1.0, 0.0, 1.0, 0.0], "num_running": [4, 0, 4, 0], "num_waiting": [1, 0, 2, 0]})
    s = fleet_state(steps, points=6)   # t = 0, 0.5, ..., 2.5
    assert s["kv"].tolist() == [0.0, 0.0, 0.5, 0.5, 0.5, 0.5]   # replica 0 full, replica 1 empty: half, not 0/1
    assert s["run"].tolist() == [0, 0, 4, 4, 4, 4] and s["wait"].tolist() == [0, 0, 1, 1, 2, 2]
