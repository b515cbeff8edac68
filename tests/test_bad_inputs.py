"""Bad input never crashes: the malformed-input corpus (tests/inputs/cases.yaml), prompts longer than the
model's context, and overload.

Each corpus case runs `simengine` with cwd = a fresh copy of tests/inputs/ and must exit 2 with exactly one
stderr line "simengine: error: <file>: <field>: <problem>; <fix>", no traceback, and no new file or folder
(no results/ or plots/ half-written). The default run drives every case through `simengine.cli.main` inside
ONE child process (the CLI's own entry point, ~0.05 s a case); a few representative cases, and every case
under `-m slow`, go through a separate `python -m simengine` process each (~1 s a case).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

INPUTS = Path(__file__).parent / "inputs"
CASES: dict[str, dict] = yaml.safe_load((INPUTS / "cases.yaml").read_text())
REPO = Path(__file__).resolve().parents[1]
# A few cases that also go through a real `python -m simengine` process in the default run.
SUBPROCESS_SAMPLE = ("scenarios/python_object", "scenarios/unknown_engine", "hardware/hw_negative_memory",
                     "models/m_truncated", "traces/mooncake_truncated_line", "cli/unknown_flag")

# Runs in one child process: for each case, call the CLI's main() with cwd = the copy, capture stderr/stdout,
# and record the exit code and every path that appeared under the copy.
_DRIVER = r"""
import contextlib, io, json, os, sys
from pathlib import Path
from simengine.cli import main
work, cases = Path(sys.argv[1]), json.loads(sys.stdin.read())
os.chdir(work)
def tree():
    return {str(p.relative_to(work)) for p in work.rglob("*")}
out = {}
for cid, args in cases.items():
    before = tree()
    err, so = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(so):
        try:
            rc = main(args)
        except SystemExit as exc:
            rc = exc.code
        except BaseException as exc:
            import traceback; traceback.print_exc(); rc = "raised " + exc.__class__.__name__
    out[cid] = {"rc": rc, "stderr": err.getvalue(), "stdout": so.getvalue(), "new": sorted(tree() - before)}
print(json.dumps(out))
"""


def _workdir(base: Path) -> Path:
    work = base / "inputs"
    shutil.copytree(INPUTS, work)
    (work / "scenarios.yaml").mkdir()  # cli/scenario_is_directory
    (work / "a_file.txt").write_text("a file where a folder is expected\n")  # cli/out_is_a_file and others
    (work / "cases.yaml.txt").write_text("not a scenario\n")  # cli/scenario_is_not_yaml
    return work


def _args(case: dict, work: Path) -> list[str]:
    return [str(a).replace("@INPUTS@", str(work)) for a in case["args"]]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), MPLBACKEND="Agg")
    env.pop("PYTHONWARNINGS", None)
    return env


@pytest.fixture(scope="module")
def corpus_results(tmp_path_factory) -> dict[str, dict]:
    work = _workdir(tmp_path_factory.mktemp("bad_inputs"))
    payload = json.dumps({cid: _args(c, work) for cid, c in CASES.items()})
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(work)], input=payload, capture_output=True, text=True,
                       cwd=work, env=_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _case_file(cid: str) -> str | None:
    """The file name a case's message must mention (None for command-line cases)."""
    kind, _, stem = cid.partition("/")
    if kind == "cli":
        return None
    matches = list((INPUTS / kind).glob(f"{stem}.*"))
    assert len(matches) == 1, f"{cid}: expected one file tests/inputs/{kind}/{stem}.*"
    return matches[0].name


def check_case(cid: str, rc, stderr: str, stdout: str, new: list[str]) -> None:
    case = CASES[cid]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr + stdout, stderr[-2000:]
    assert rc == 2, f"exit {rc}, stderr: {stderr[-1500:]}"
    assert len(lines) == 1, f"{len(lines)} stderr lines: {stderr[-1500:]}"
    msg = lines[0]
    assert msg.startswith("simengine: error: "), msg
    low = msg.lower()
    missing = [w for w in case["expect"] if str(w).lower() not in low]
    assert not missing, f"message lacks {missing}: {msg}"
    f = _case_file(cid)
    if f:
        assert f.lower() in low, f"message does not name the file {f}: {msg}"
    assert not new, f"left behind: {new}"


def _marks(cid: str):
    reason = CASES[cid].get("xfail")
    return [pytest.mark.xfail(reason=reason, strict=True)] if reason else []


@pytest.mark.parametrize("cid", [pytest.param(c, marks=_marks(c), id=c) for c in CASES])
def test_corpus_case(cid, corpus_results):
    r = corpus_results[cid]
    check_case(cid, r["rc"], r["stderr"], r["stdout"], r["new"])


def _run_subprocess(cid: str, tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    before = {str(p.relative_to(work)) for p in work.rglob("*")}
    p = subprocess.run([sys.executable, "-m", "simengine", *_args(CASES[cid], work)], cwd=work, env=_env(),
                       capture_output=True, text=True, timeout=300)
    new = sorted({str(p.relative_to(work)) for p in work.rglob("*")} - before)
    check_case(cid, p.returncode, p.stderr, p.stdout, new)


@pytest.mark.parametrize("cid", [pytest.param(c, marks=_marks(c), id=c) for c in SUBPROCESS_SAMPLE])
def test_corpus_case_in_its_own_process(cid, tmp_path):
    _run_subprocess(cid, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cid", [pytest.param(c, marks=_marks(c), id=c) for c in CASES])
def test_every_corpus_case_in_its_own_process(cid, tmp_path):
    _run_subprocess(cid, tmp_path)


def test_corpus_is_one_file_per_case():
    files = {f"{p.parent.name}/{p.stem}" for p in INPUTS.glob("*/*") if p.is_file()}
    files.discard("scenarios/base_ok")
    cased = {c for c in CASES if not c.startswith("cli/")}
    assert set(SUBPROCESS_SAMPLE) <= set(CASES)
    assert files == cased, (sorted(files - cased), sorted(cased - files))
    for cid, c in CASES.items():
        assert set(c) <= {"args", "expect", "xfail"}, cid
        assert c["expect"] and all(isinstance(w, str) for w in c["expect"]), f"{cid}: quote every expect entry"


# ---- requests the engine must refuse, and overload ---------------------------------------------------------

def _engines_on(hardware: str) -> list[str]:
    from simengine.config.hardware import load_hardware
    from simengine.engines import ENGINES
    hw = load_hardware(hardware)
    return [n for n in ENGINES.names()
            if hw.vendor in ENGINES.get(n).vendors and hw.device_class in ENGINES.get(n).device_classes]


@pytest.mark.parametrize("engine", _engines_on("h100_sxm"))
def test_prompt_longer_than_context_fails_the_request_not_the_run(engine):
    """Llama-2-7B has a 4096-token context: prompts of 1k-8k tokens, about half too long for it. Those are
    refused at admission (failed, with a reason, never scheduled, no token); the others are served (an engine
    may still fail some for its own reasons, e.g. llama.cpp's shared 4096-cell KV, or leave them unfinished)."""
    from simengine.api import run_engine
    from simengine.config.scenario import EngineEntry
    from tests.conftest import make_scenario

    sc = make_scenario(deployment={"hardware": "h100_sxm", "model": "llama-2-7b"}, horizon_s=10.0, drain_s=300.0,
                       workload__arrival={"process": "poisson", "rate": 2.0},
                       workload__input_tokens={"dist": "uniform", "low": 1000, "high": 8000},
                       workload__output_tokens={"dist": "constant", "value": 16}, engines=[engine])
    r = run_engine(sc, EngineEntry(engine=engine), check_invariants=True)
    s, req = r.summary, r.requests
    assert s["completed"] + s["failed"] + s["unfinished"] == s["num_requests"] == len(req) > 5
    too_long = req["prompt_len"] + 1 > 4096
    assert too_long.any() and (~too_long).any()
    bad = req[too_long]
    assert (bad["status"] == "failed").all(), bad[["prompt_len", "status"]]
    assert (bad["fail_reason"].str.len() > 0).all() and (bad["num_output_tokens"] == 0).all()
    assert (bad["first_scheduled_s"] < 0).all()
    assert (req.loc[~too_long, "status"] == "completed").any()
    assert s["failed"] >= int(too_long.sum())


def _capacity_req_s(engine: str) -> float:
    """Saturated throughput (req/s) of the overload scenario's request mix: an offline batch."""
    from simengine.api import run_engine
    from simengine.config.scenario import EngineEntry
    from tests.conftest import make_scenario

    sc = make_scenario(workload__arrival={"process": "offline"}, workload__num_requests=600,
                       workload__input_tokens={"dist": "constant", "value": 512},
                       workload__output_tokens={"dist": "constant", "value": 128}, engines=[engine])
    return run_engine(sc, EngineEntry(engine=engine)).summary["request_throughput"]


@pytest.mark.parametrize("engine", ["vllm", pytest.param("tgi", marks=pytest.mark.slow),
                                    pytest.param("sglang", marks=pytest.mark.slow)])
def test_overload_at_three_times_capacity_is_bounded_and_flagged(engine, tmp_path):
    if engine not in _engines_on("h100_sxm"):
        pytest.skip(f"{engine} is not registered")
    rate = 3.0 * _capacity_req_s(engine)
    scenario = tmp_path / "overload.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "overload", "seed": 3, "horizon_s": 30, "drain_s": 10,
        "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b"},
        "workload": {"arrival": {"process": "poisson", "rate": round(rate, 3)},
                     "input_tokens": {"dist": "constant", "value": 512},
                     "output_tokens": {"dist": "constant", "value": 128}},
        "engines": [engine]}))
    code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "p = subprocess.run([sys.executable, '-m', 'simengine', *sys.argv[1:]]); "
            "print(p.returncode, time.perf_counter() - t, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    p = subprocess.run([sys.executable, "-c", code, "run", str(scenario), "--out", str(tmp_path / "results"),
                        "--no-plots"], capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    rc, wall_s, maxrss_kib = p.stdout.split()[-3:]
    assert int(rc) == 0, p.stderr[-2000:]
    assert float(wall_s) < 120, f"{wall_s} s"          # bounded: arrivals stop at the horizon, drain is capped
    assert int(maxrss_kib) < 2 * 2**20, f"{maxrss_kib} KiB"
    s = json.loads((tmp_path / "results" / "overload" / engine / "summary.json").read_text())
    assert s["overloaded"] is True
    assert s["num_requests"] == s["completed"] + s["failed"] + s["unfinished"]
    assert s["unfinished"] + s["failed"] > 0.3 * s["num_requests"]  # a third of the offered load cannot be served


def test_overload_flag_is_false_when_load_is_light():
    from simengine.api import run_engine
    from simengine.config.scenario import EngineEntry
    from tests.conftest import make_scenario

    sc = make_scenario(workload__arrival={"process": "poisson", "rate": 1.0}, horizon_s=20.0)
    s = run_engine(sc, EngineEntry(engine="vllm")).summary
    assert s["overloaded"] is False and s["unfinished"] == 0
    assert s["num_requests"] == s["completed"] + s["failed"] + s["unfinished"]

