"""Every scenario in scenarios/ runs (short horizon) with every engine it lists, and conserves requests."""

from pathlib import Path

import pytest

from simengine.api import compare
from simengine.config.scenario import load_scenario, scenario_files

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"


def short(name: str):
    sc = load_scenario(name)
    wl = sc.workload
    rate = wl.arrival.rate if wl.sessions is None and wl.trace is None else None
    sets = [f"horizon_s={max(6, 8 / rate) if rate else 6:g}", "drain_s=120"]   # a few arrivals at a low rate too
    if wl.num_requests or wl.arrival.process == "offline":
        sets.append("workload.num_requests=24")
    if wl.sessions is not None and wl.sessions.population:
        sets += [f"workload.sessions.population={min(wl.sessions.population, 4)}", "workload.sessions.start_spread_s=1"]
    return load_scenario(name, sets)


@pytest.mark.parametrize("name", sorted(scenario_files()))
def test_scenario_runs_short(name):
    sc = load_scenario(name)
    if sc.workload.trace is not None and not (Path(__file__).resolve().parents[1] / sc.workload.trace.path).exists():
        pytest.skip(f"trace file {sc.workload.trace.path} absent")
    first = Path(scenario_files()[name]).read_text().splitlines()[0]
    assert first.startswith("# Question:"), "each scenario says what question it answers in its first line"
    assert sc.name == name, "a scenario's name is its file name: results go to results/<name>/"
    results = compare(short(name))
    assert len(results) == len(sc.engines)
    for label, r in results.items():
        s = r.summary
        assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"], label
        assert s["num_requests"] > 0, label
