"""The malformed-input corpus generated from the configuration schema itself, so a new field cannot escape it.

Every numeric field of the scenario schema and of every registered engine's params declares a Range (checked
here). From every shipped scenario, every leaf is set in turn to values its declared type refuses: numbers
below and above their range (negative, zero where zero is meaningless, absurdly large), NaN and infinities,
a wrong type; names to one that does not exist. Every engine's numeric params are set the same way on a small
scenario. Each case runs `simengine run` (in one child process, as tests/test_bad_inputs.py does) and must exit
2 with one line naming the file and the field, no traceback, and nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml

from simengine.config.loader import Checked, range_of
from simengine.config.scenario import Scenario
from simengine.engines.base import ENGINES
from tests.test_bad_inputs import _DRIVER, _env

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))
FREE_TEXT = {"name", "description", "label"}   # any string is a valid value of these
SMALL = {"name": "corpus", "seed": 1, "horizon_s": 5, "drain_s": 30,
         "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b"},
         "workload": {"arrival": {"process": "poisson", "rate": 2},
                      "input_tokens": {"dist": "constant", "value": 100},
                      "output_tokens": {"dist": "constant", "value": 10}},
         "engines": ["vllm"]}


# ---- the schema -----------------------------------------------------------------------------------------
def _unwrap(tp: Any) -> list[Any]:
    """The alternatives of a type: Optional and unions split, None dropped."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in get_args(tp) if a is not type(None)]
    return [tp]


def _base(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is typing.Annotated else tp


def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls, include_extras=True).items() if k in names}


def _schema_classes() -> list[type]:
    seen: list[type] = []

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.append(cls)
        for tp in _hints(cls).values():
            for alt in _unwrap(tp):
                for t in (alt, *get_args(alt)):
                    if isinstance(_base(t), type) and dataclasses.is_dataclass(_base(t)):
                        walk(_base(t))
    walk(Scenario)
    for name in ENGINES.names():
        walk(ENGINES.get(name).Params)
    from simengine.workload.distributions import TokenDist
    walk(TokenDist)
    return seen


def _numeric(tp: Any) -> bool:
    return any(_base(a) in (int, float) for a in _unwrap(tp))


def _numeric_items(tp: Any) -> bool:
    return any(get_origin(a) in (list, tuple) and any(_base(i) in (int, float) for i in get_args(a))
               for a in _unwrap(tp))


def test_every_numeric_field_declares_a_range_checked_on_construction():
    missing, unchecked = [], []
    for cls in _schema_classes():
        for name, tp in _hints(cls).items():
            if _numeric(tp) and range_of(tp) is None:
                missing.append(f"{cls.__name__}.{name}")
            if _numeric_items(tp) and not any(range_of(i) for a in _unwrap(tp) for i in get_args(a)):
                missing.append(f"{cls.__name__}.{name}[]")
            if (_numeric(tp) or _numeric_items(tp)) and not issubclass(cls, Checked):
                unchecked.append(cls.__name__)
    assert not missing, f"numeric fields without a declared Range: {missing}"
    assert not unchecked, f"classes with numeric fields that do not check them: {sorted(set(unchecked))}"


@pytest.mark.parametrize("engine", ENGINES.names())
def test_engine_defaults_lie_in_their_declared_ranges(engine):
    ENGINES.get(engine).Params()   # Checked: construction raises on a default outside its range


# ---- the corpus -----------------------------------------------------------------------------------------
def _bad_numbers(tp: Any, value: float | None) -> list[Any]:
    """Values the field must refuse: out of its declared range, not finite, or not a number."""
    r = range_of(tp)
    if r is None:   # no declared range: test_every_numeric_field_declares_a_range_checked_on_construction names it
        return ["abc"]
    is_int = any(_base(a) is int for a in _unwrap(tp))
    x = abs(float(value)) if isinstance(value, int | float) else 1.0
    candidates = [-(x + 1), 0, 1e30, float("nan"), float("inf"), float("-inf")]
    out = []
    for v in candidates:
        finite = isinstance(v, int | float) and math.isfinite(v)
        if finite and v in r.also:
            continue
        if finite and (v > r.lo if r.above else v >= r.lo) and v <= r.hi:
            continue
        out.append(int(v) if finite and is_int and abs(v) < 1e18 else v)
    return [*out, "abc"]


def _leaf_cases(node: Any, tp: Any, path: list[str | int]) -> list[tuple[list[str | int], Any]]:
    """(path, bad value) for every leaf under `node`, read with the schema type `tp`."""
    alts = _unwrap(tp)
    dc = next((_base(a) for a in alts if isinstance(_base(a), type) and dataclasses.is_dataclass(_base(a))), None)
    seq = next((a for a in alts if get_origin(a) in (list, tuple)), None)
    cases: list[tuple[list[str | int], Any]] = []
    if isinstance(node, dict) and dc is not None:
        if path:
            cases.append((path, 5))                               # a scalar where a mapping belongs
        params_cls = ENGINES.get(node["engine"]).Params if path and path[0] == "engines" and "engine" in node \
            else None
        hints = _hints(dc)
        for k, v in node.items():
            sub = _hints(params_cls) if k == "params" and params_cls is not None else None
            if sub is not None:
                for pk, pv in v.items():
                    cases += _leaf_cases(pv, sub[pk], [*path, k, pk])
            elif k in hints:
                cases += _leaf_cases(v, hints[k], [*path, k])
        return cases
    if isinstance(node, list) and seq is not None:
        cases.append((path, 5))                                   # a scalar where a list belongs
        item = get_args(seq)[0]
        for i, v in enumerate(node):
            cases += _leaf_cases(v, item, [*path, i])
        return cases
    if isinstance(node, str) and dc is not None:                  # an engine given by name
        return [(path, "nosuchname"), (path, 12345)]
    if isinstance(node, bool):
        return [(path, "maybe")]
    if isinstance(node, int | float) and _numeric(tp):
        return [(path, v) for v in _bad_numbers(tp, node)]
    if isinstance(node, str):
        literal = any(get_origin(a) is Literal for a in alts)
        if path[-1] in FREE_TEXT and not literal:
            return [(path, 12345)]
        return [(path, "nosuchname"), (path, 12345)]
    return cases


def _yaml_value(v: Any) -> str:
    if isinstance(v, float) and math.isnan(v):
        return ".nan"
    if isinstance(v, float) and math.isinf(v):
        return ".inf" if v > 0 else "-.inf"
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...").strip()


def _display(path: list[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _cases() -> dict[str, dict]:
    cases = {}
    for f in SCENARIOS:
        raw = yaml.safe_load(f.read_text())
        for path, bad in _leaf_cases(raw, Scenario, []):
            setting = ".".join(str(p) for p in path) + "=" + _yaml_value(bad)
            cases[f"{f.stem}:{setting}"] = {"args": ["run", f"scenarios/{f.name}", "--set", setting],
                                            "file": f.name, "field": _display(path)}
    for engine in ENGINES.names():
        hints = _hints(ENGINES.get(engine).Params)
        for name, tp in hints.items():
            if not (_numeric(tp) or _numeric_items(tp)):
                continue
            bads = _bad_numbers(tp, None) if _numeric(tp) else [[-1], ["abc"], 5]
            for bad in bads:
                setting = f"engines.0={{engine: {engine}, params: {{{name}: {_yaml_value(bad)}}}}}"
                cases[f"{engine}:{name}={_yaml_value(bad)}"] = {
                    "args": ["run", "scenarios/corpus.yaml", "--set", setting], "file": "corpus.yaml",
                    "field": f"engines[0].params.{name}"}
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("schema_corpus")
    shutil.copytree(REPO / "scenarios", work / "scenarios")
    (work / "scenarios" / "corpus.yaml").write_text(yaml.safe_dump(SMALL))
    payload = json.dumps({cid: c["args"] for cid, c in CASES.items()})
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(work)], input=payload, capture_output=True, text=True,
                       cwd=work, env=_env(), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_corpus_covers_every_shipped_scenario_and_engine():
    assert {c.split(":")[0] for c in CASES} >= {f.stem for f in SCENARIOS} | set(ENGINES.names())
    assert len(CASES) > 500


@pytest.mark.parametrize("cid", list(CASES))
def test_schema_case(cid, results):
    r, case = results[cid], CASES[cid]
    lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
    assert "Traceback" not in r["stderr"] + r["stdout"], r["stderr"][-2000:]
    assert r["rc"] == 2, f"exit {r['rc']}: {r['stderr'][-1500:]}"
    assert len(lines) == 1, f"{len(lines)} stderr lines: {r['stderr'][-1500:]}"
    msg = lines[0]
    assert msg.startswith("simengine: error: ") and case["file"] in msg, msg
    assert case["field"] in msg, f"does not name {case['field']}: {msg}"
    assert not r["new"], f"left behind: {r['new']}"
