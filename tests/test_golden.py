"""Golden summaries: every engine on a fixed set of runs must reproduce the stored summary.json figures.

Speed work on the hot path (schedulers, KV manager, recorder, cost model) must not change what is simulated; this
test pins the results. After a change that is meant to alter results, regenerate with
`SIMENGINE_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py` and say why in the commit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from simengine.api import run_engine
from simengine.config.hardware import load_hardware
from simengine.config.loader import from_dict
from simengine.config.scenario import Scenario, load_scenario
from simengine.cost.measured import data_root
from simengine.engines import ENGINES as REGISTRY

GOLDEN = Path(__file__).parent / "golden" / "summaries.json"
REGEN = os.environ.get("SIMENGINE_REGEN_GOLDEN") == "1"
ENGINES = REGISTRY.names()   # every registered engine: a new one gets its goldens with the next regeneration


def stress(engine: str) -> Scenario:
    """ShareGPT-like lengths at 1.5x an L4's capacity: queueing, KV pressure and preemption."""
    return from_dict(Scenario, {
        "name": "golden", "seed": 3, "horizon_s": 1e6, "drain_s": 1e6,
        "deployment": {"hardware": "l4", "model": "llama-3.1-8b"},
        "workload": {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 150,
                     "input_tokens": {"dist": "lognormal", "mean": 1200, "sigma": 0.8, "max": 6000},
                     "output_tokens": {"dist": "lognormal", "mean": 250, "sigma": 0.8, "max": 1500}},
        "engines": [engine]}, source="golden")


def prefix(engine: str) -> Scenario:
    """The agent scenario's sessions (shared prefixes, growing context) for 40 s (H100: measured kernels)."""
    return load_scenario("agent_multiturn", ["horizon_s=40", "drain_s=600", f"engines=[{engine}]"])


CASES = {f"{kind}/{e}": (build, e) for kind, build in (("stress", stress), ("prefix", prefix)) for e in ENGINES}


def _numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)}


@pytest.fixture(scope="module")
def golden():
    data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    yield data
    if REGEN:
        GOLDEN.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_summary(case, exact, golden):
    """Both modes give the stored figures: the speed devices change nothing (Scenario.exact runs without them)."""
    if REGEN and exact:
        pytest.skip("goldens are regenerated from the default mode; the exact mode is checked against them")
    build, engine = CASES[case]
    sc = dataclasses.replace(build(engine), exact=exact)
    if load_hardware(sc.deployment.hardware).kernel_tables and data_root() is None:
        pytest.skip("this device's golden figures come from measured kernels: install the kernels extra")
    got = _numbers(run_engine(sc, sc.engines[0]).summary)
    if REGEN:
        golden[case] = got
        return
    assert case in golden, f"no golden for {case}: regenerate with SIMENGINE_REGEN_GOLDEN=1"
    want = golden[case]
    assert set(got) == set(want), f"{case}: summary keys changed"
    diff = {k: (want[k], got[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=1e-9, abs_tol=1e-9)}
    assert not diff, f"{case}: changed figures (golden, now): {diff}"
