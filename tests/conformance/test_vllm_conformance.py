"""simengine's vLLM policy makes vLLM's own scheduler's decisions: replay every recorded trace (record_vllm.py, vLLM's
real Scheduler on a CPU) step by step and compare what each step scheduled, preempted, admitted with which prefix
hit, and finished (docs/conformance.md)."""

from __future__ import annotations

import pytest

from tests.conformance.replay import compare, fixtures, load

MIN_IDENTICAL = 0.99   # share of steps identical, per mode
MODES = ("sync", "async")   # EngineCore.step and EngineCore.step_with_batch_queue


def _fixture(mode: str) -> dict:
    paths = [p for p in fixtures() if p.name == f"{mode}.json.gz"]
    assert paths, f"no recorded {mode} traces under tests/conformance/ (make conformance-record)"
    return load(paths[0])


@pytest.mark.parametrize("mode", MODES)
def test_steps_match_vllms_scheduler(mode):
    recorded = _fixture(mode)
    assert len(recorded["traces"]) >= 1000
    r = compare(recorded)
    share = r["identical"] / r["steps"]
    first = "\n".join(f"  trace {seed} step {k}:\n    vLLM: {theirs}\n    ours: {ours}"
                      for seed, k, theirs, ours in r["diffs"][:5])
    print(f"vLLM {recorded['vllm']} {mode}: {r['identical']:,} of {r['steps']:,} steps identical ({share:.4%}), "
          f"{len(r['diffs'])} of {r['traces']} traces differ")
    assert share >= MIN_IDENTICAL, f"{share:.2%} of steps identical; first differences:\n{first}"
    assert not r["diffs"], f"traces that differ (fix, or explain in docs/conformance.md):\n{first}"
