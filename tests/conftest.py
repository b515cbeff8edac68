"""Shared test helpers: deployments, requests and small scenarios built in code."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from simengine.config.dtypes import kv_bytes, weight_format
from simengine.config.hardware import load_hardware
from simengine.config.loader import from_dict
from simengine.config.model import load_model
from simengine.config.scenario import Scenario
from simengine.core.request import Request
from simengine.engines.memory import Deployment

# the measured-kernel model's disk cache of shaped tables (cost/measured.py): a fresh one per session, not the user's
_CACHE = tempfile.mkdtemp(prefix="simengine-test-cache-")
os.environ["SIMENGINE_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# `make test` (and CI) draws the same examples every run, so a clean clone's result is the tree's and not the day's
# draw; `--hypothesis-profile=explore` draws new ones at the same count, `make fuzz` 1,000 generated scenarios
settings.register_profile("default", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=25, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=1000, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")


@pytest.fixture(autouse=True)
def _slow_only_when_asked(request):
    """`slow` tests run only when a -m expression selects them (`-m slow`) or SIMENGINE_SLOW=1: a plain `pytest`
    (`make test`) skips them whether or not the project deselects the marker."""
    if request.node.get_closest_marker("slow") and not request.config.getoption("markexpr") \
            and os.environ.get("SIMENGINE_SLOW") != "1":
        pytest.skip("slow: run with -m slow or SIMENGINE_SLOW=1")


def make_dep(hardware: str = "h100_sxm", model: str = "llama-3.1-8b", weight_dtype: str = "bf16",
             kv_dtype: str = "bf16", tp: int = 1, pp: int = 1) -> Deployment:
    return Deployment(model=load_model(model), hardware=load_hardware(hardware),
                      weight_format=weight_format(weight_dtype), kv_dtype=kv_dtype,
                      kv_elem_bytes=kv_bytes(kv_dtype), tp=tp, pp=pp)


_NEXT_ID = [10_000]


def make_request(prompt_len: int, output_len: int = 4, *, arrival_s: float = 0.0, tokens: np.ndarray | None = None,
                 request_id: int | None = None, seed: int | None = None, **kw) -> Request:
    if request_id is None:
        request_id = _NEXT_ID[0]
        _NEXT_ID[0] += 1
    if tokens is None:
        rng = np.random.default_rng(request_id if seed is None else seed)
        tokens = rng.integers(0, 32000, prompt_len, dtype=np.int32)
    tokens = np.asarray(tokens, dtype=np.int32)[:prompt_len]
    full = np.concatenate([tokens, np.arange(output_len, dtype=np.int32) + 50_000 + request_id])
    return Request(request_id, arrival_s, full, prompt_len, output_len, **kw)


def make_scenario(**overrides) -> Scenario:
    data = {
        "name": "test", "seed": 1, "horizon_s": 20.0, "drain_s": 200.0,
        "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b"},
        "workload": {"arrival": {"process": "poisson", "rate": 4.0},
                     "input_tokens": {"dist": "lognormal", "mean": 600, "sigma": 0.6, "max": 4000},
                     "output_tokens": {"dist": "lognormal", "mean": 120, "sigma": 0.6, "max": 600}},
        "engines": ["vllm"],
    }
    for key, value in overrides.items():
        node = data
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return from_dict(Scenario, data, source="test")


@pytest.fixture
def dep() -> Deployment:
    return make_dep()


def frontend_reach_s(runner, req) -> np.ndarray:
    """When each request of the frame `req` reached the engine's queue (its row's order): sent, then the frontend's
    fixed latency and its tokenising of the prompt, the requests sent at one instant together (when the longest of
    them is tokenised), and no sooner than those sent before them (sim/runner.py)."""
    sent = req["arrival_s"].to_numpy()
    ready = sent + runner.frontend_s + runner.tokenize_s_per_token * req["prompt_len"].to_numpy()
    instants, group = np.unique(sent, return_inverse=True)
    latest = np.full(len(instants), -np.inf)
    np.maximum.at(latest, group, ready)
    return np.maximum.accumulate(latest)[group]
