"""The command line: list, run (files and figures written), exit codes."""

import json
import subprocess
import sys

from simengine.cli import main


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "simengine", *args], capture_output=True, text=True, cwd=cwd)


def test_list_commands(capsys):
    for what in ("engines", "hardware", "models", "scenarios"):
        assert main(["list", what]) == 0
    out = capsys.readouterr().out
    assert "vllm" in out and "mi300x" in out and "deepseek-v3" in out and "agent_multiturn" in out


def test_run_writes_results_and_figures(tmp_path):
    out, plots = tmp_path / "results", tmp_path / "plots"
    r = run_cli("run", "agent_multiturn", "--engines", "vllm,vllm-no-prefix-cache", "--out", str(out),
                "--plots", str(plots), "--set", "horizon_s=15", "--set", "workload.sessions.population=6")
    assert r.returncode == 0, r.stderr
    assert "vllm-no-prefix-cache" in r.stdout and "TTFT" in r.stdout
    name = "agent_multiturn--horizon_s-15+workload.sessions.population-6"   # a variant: beside the baseline
    for label in ("vllm", "vllm-no-prefix-cache"):
        s = json.loads((out / name / label / "summary.json").read_text())
        for key in ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                    "mean_e2el_ms", "request_goodput", "num_requests", "unfinished", "prefix_cache_hit_rate",
                    "preemptions", "mean_kv_usage"):
            assert key in s, key
        for f in ("requests.csv", "steps.csv", "config.yaml", "trace.json", "run_info.json"):
            assert (out / name / label / f).exists(), f
    assert len(list((plots / name).glob("*.png"))) >= 3


def test_bad_input_exits_2_with_one_line(tmp_path):
    r = run_cli("run", "agent_multiturn", "--set", "deployment.hardware=h100_sxn", "--out", str(tmp_path / "r"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "h100_sxm" in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


def test_unknown_engine_and_scenario(tmp_path):
    r = run_cli("run", "agent_multiturn", "--engines", "vlm", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "did you mean 'vllm'" in r.stderr
    r = run_cli("run", "no_such_scenario")
    assert r.returncode == 2 and "agent_multiturn" in r.stderr


def test_console_shows_no_library_warnings_even_when_a_figure_panel_is_empty(tmp_path):
    # every output is one token: no TPOT, so the TPOT panels draw nothing (a legend there warned before)
    r = subprocess.run([sys.executable, "-W", "error", "-m", "simengine", "run", "bursty_traffic", "--engines",
                        "vllm,sglang", "--out", str(tmp_path / "r"), "--plots", str(tmp_path / "p"),
                        "--set", "horizon_s=5", "--set", "workload.output_tokens={dist: constant, value: 1}"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
