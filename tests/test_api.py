"""The Python API: simulate() takes a name, a path, a mapping or a Scenario with overrides and returns summaries,
frames, files and figures; docs/api.md's example script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import simengine
from simengine.errors import InputError

REPO = Path(__file__).resolve().parents[1]
SETS = {"horizon_s": 8, "workload.arrival.rate": 3}


def test_a_name_a_path_a_mapping_and_a_scenario_give_the_same_run():
    by_name = simengine.simulate("chat_high_concurrency", ["vllm"], SETS)
    by_path = simengine.simulate(REPO / "scenarios" / "chat_high_concurrency.yaml", ["vllm"], SETS)
    by_object = simengine.simulate(simengine.load_scenario("chat_high_concurrency"), ["vllm"], SETS)
    import yaml
    raw = yaml.safe_load((REPO / "scenarios" / "chat_high_concurrency.yaml").read_text())
    by_mapping = simengine.simulate(raw, ["vllm"], SETS)
    want = by_name["vllm"].summary
    for other in (by_path, by_object, by_mapping):
        assert other["vllm"].summary == want
    assert by_name.scenario.workload.arrival.rate == 3
    assert len(by_name["vllm"].requests) == want["num_requests"] and len(by_name["vllm"].steps) == want["num_steps"]
    assert list(by_name.summaries.index) == ["vllm"]


def test_save_and_plot_write_files(tmp_path):
    sim = simengine.simulate("chat_high_concurrency", ["vllm", "tgi"], SETS)
    folder = sim.save(tmp_path / "r")
    assert (folder / "tgi" / "summary.json").exists()
    assert len(sim.plot(tmp_path / "p")) == 5
    assert "tgi" in sim.table()


@pytest.mark.parametrize("scenario,overrides,field", [
    ("no_such_scenario", None, "SCENARIO"),
    ("chat_high_concurrency", {"workload.arrival.rate": -1}, "workload.arrival.rate"),
    ({"deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b"}, "engines": ["vlm"]}, None, "engines"),
    (42, None, "scenario"),
])
def test_bad_input_raises_input_error_naming_the_field(scenario, overrides, field):
    with pytest.raises(InputError) as e:
        simengine.simulate(scenario, overrides=overrides)
    assert field in str(e.value)


def test_the_documented_example_runs(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "examples" / "api_example.py"), str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "vLLM p99 TTFT" in r.stdout and (tmp_path / "results" / "two_loads" / "vllm" / "summary.json").exists()
