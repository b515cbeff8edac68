"""Simulator speed benchmark (`make bench`): writes results/bench.json and prints a table.

Workload: ShareGPT-like (lognormal prompt and output lengths, means ~1000 and ~250 tokens) on Llama-3.1-8B /
H100 with the vLLM policy at a rate that keeps the replica busy (90% of its measured offline throughput), at
10k, 100k, 1M and 10M requests (past the recorder's memory budget the rows go to temporary files: the 10M run's
peak RSS shows memory stays flat); every engine at 10k, with the default step-time model (measured kernels where the
kernels extra is installed), with the roofline alone (`deployment.cost_model: roofline`), to keep the measured
model's cost on record, and in the exact mode (`exact: true`, `exact_seconds_10k`: the reference path without the
speed devices, to keep their gain on record); a bare SimPy loop of 1M timeouts as the machine reference.
Each measurement runs in a fresh subprocess so its peak RSS is its own; runs up to 10k requests are repeated
(`--repeat`, default 3) and the fastest counts; the per-engine runs and the SimPy loop go in interleaved rounds (one
run of each per round), so a busy spell slows all of them alike; `per_engine_paired_ratio_to_vllm` is each engine's
time over a vLLM run made just before it, the median of `--repeat` pairs. Compare machines by the ratios.
`--profile N` instead profiles the vLLM run at N requests (cProfile) and writes the top entries by own time.
Clusters: `cluster_seconds_100k_16r`, 100k requests on 16 replicas at 16 times the rate, and `cluster_cost_ratio`,
its seconds per request over the single replica's 100k run (routing, load states and 16 engine loops).
Planning: `sweep_seconds_200`, a 200-point sweep (10 engines x 4 devices x 5 rates, 2,000 requests each) on this
machine's cores, and `capacity_runs`, the simulations one capacity search (vLLM, p99 TTFT <= 2 s) needs;
`--planning` measures only these and merges them into an existing bench.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scenario_dict(num_requests: int, rate: float | None, engine: str) -> dict:
    """`engine` may carry the cost model after a colon (vllm:roofline), a replica count after an at sign (vllm@16:
    that many replicas behind least_loaded) and `!exact` at the end (Scenario.exact: no speed devices)."""
    engine, bang, mode = engine.partition("!")
    engine, _, replicas = engine.partition("@")
    engine, _, cost_model = engine.partition(":")
    arrival = {"process": "poisson", "rate": rate} if rate else {"process": "offline"}
    return {"name": "bench", "seed": 1, "horizon_s": 1e7, "drain_s": 1e6,
            "deployment": {"hardware": "h100_sxm", "model": "llama-3.1-8b", "cost_model": cost_model or "auto",
                           "replicas": int(replicas or 1)},
            "workload": {"arrival": arrival, "num_requests": num_requests,
                         "input_tokens": {"dist": "lognormal", "mean": 1000, "sigma": 0.8, "max": 8000},
                         "output_tokens": {"dist": "lognormal", "mean": 250, "sigma": 0.8, "max": 2048}},
            "engines": [engine], "exact": bool(bang and mode == "exact")}


def child(args) -> None:
    """Run one measurement in this process and print a JSON line."""
    if args.child == "simpy":
        import simpy
        env = simpy.Environment()

        def loop():
            for _ in range(1_000_000):
                yield env.timeout(1.0)
        env.process(loop())
        t0, c0 = time.perf_counter(), time.process_time()
        env.run()
        out = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    else:
        from simengine.api import run_engine
        from simengine.config.loader import from_dict
        from simengine.config.scenario import Scenario
        sc = from_dict(Scenario, scenario_dict(args.n, args.rate, args.child), source="bench")
        prof = cProfile.Profile() if args.profile_out else None
        t0, c0 = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        r = run_engine(sc, sc.engines[0])
        if prof:
            prof.disable()
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        if prof:
            write_profile(prof, args.profile_out, f"{args.child}, {args.n} requests at {args.rate} req/s")
        spill = r.recorder.spill
        on_disk = sum(f.stat().st_size for f in spill.path("x").parent.iterdir()) if spill.on_disk else 0
        out = {"seconds": secs, "cpu_seconds": cpu, "completed": r.summary["completed"],
               "steps": r.summary["num_steps"], "request_throughput": r.summary["request_throughput"],
               "rows_on_disk_mb": round(on_disk / 2**20, 1)}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def planning(rate: float) -> dict:
    """The sweep and capacity figures (wall seconds of the whole sweep; simulations of one search)."""
    import os
    import tempfile

    import yaml

    from simengine.config.loader import from_dict
    from simengine.config.scenario import Scenario
    from simengine.engines import ENGINES
    from simengine.planning import capacity
    from simengine.planning import sweep as sw

    with tempfile.TemporaryDirectory() as tmp:
        sc_path = Path(tmp) / "bench_sweep.yaml"
        sc_path.write_text(yaml.safe_dump(scenario_dict(2000, rate, "vllm")))
        engines = [e for e in ENGINES.names() if e != "generic"]
        grid = sw.Grid({"engine": engines, "deployment.hardware": ["h100_sxm", "h200_sxm", "a100_80g_sxm", "l40s"],
                        "workload.arrival.rate": [round(f * rate, 3) for f in (0.2, 0.4, 0.6, 0.8, 1.0)]})
        t0 = time.perf_counter()
        csv = sw.sweep(str(sc_path), [], grid, Path(tmp) / "sweep", jobs=os.cpu_count() or 1)
        seconds = time.perf_counter() - t0
        import pandas as pd
        table = pd.read_csv(csv)
        sc = from_dict(Scenario, scenario_dict(2000, rate, "vllm"), source="bench")
        cap = capacity.search(sc, sc.engines[0], capacity.parse_slo("ttft_p99_ms=2000"))
    return {"sweep_points": len(table), "sweep_points_ok": int((table["status"] == "ok").sum()),
            "sweep_jobs": os.cpu_count() or 1, "sweep_seconds_200": round(seconds, 2), "capacity_runs": cap.runs,
            "capacity_req_s": round(cap.rate, 3)}


def write_profile(prof: cProfile.Profile, path: str, what: str, top: int = 25) -> None:
    """The top entries by own time, paths shortened to the repository."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    text = buf.getvalue().replace(str(ROOT) + "/", "").replace(sys.prefix + "/", "")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(f"# cProfile of the simulation ({what}); times are inflated by the profiler\n{text}")


def measure(kind: str, n: int = 0, rate: float | None = None, profile_out: str = "") -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--n", str(n)] + (["--rate", str(rate)] if rate else [])
    cmd += ["--profile-out", profile_out] if profile_out else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"bench child {kind} n={n} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_of(repeat: int, kind: str, n: int = 0, rate: float | None = None) -> dict:
    """The fastest of `repeat` runs (wall time on a shared machine only ever gets slower than the code is)."""
    return min((measure(kind, n, rate) for _ in range(repeat)), key=lambda r: r["seconds"])


def best_interleaved(repeat: int, kinds: list[str], n: int, rate: float | None) -> dict[str, dict]:
    """`best_of` for several kinds at once, run in rounds of one run of each: a busy spell on the shared machine then
    slows one run of every kind instead of every run of one, so the ratios between kinds hold."""
    best: dict[str, dict] = {}
    for _ in range(repeat):
        for kind in kinds:
            r = measure(kind, n, rate)
            if kind not in best or r["seconds"] < best[kind]["seconds"]:
                best[kind] = r
    return best


def paired_to_vllm(repeat: int, engines: list[str], n: int, rate: float | None) -> dict[str, float]:
    """Each engine's time over that of a vLLM run made just before it, the median of `repeat` such pairs: a pair sees
    the same minute of the shared machine, so its ratio is steadier than the ratio of two best-of runs."""
    ratios: dict[str, list[float]] = {e: [] for e in engines if e != "vllm"}
    for _ in range(repeat):
        for e, found in ratios.items():
            base = measure("vllm", n, rate)["seconds"]
            found.append(measure(e, n, rate)["seconds"] / base)
    return {"vllm": 1.0, **{e: round(statistics.median(found), 2) for e, found in ratios.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--child")
    p.add_argument("--n", type=int, default=0)
    p.add_argument("--rate", type=float)
    p.add_argument("--sizes", default="10000,100000,1000000,10000000")
    p.add_argument("--out", default=str(ROOT / "results" / "bench.json"))
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement up to 10k requests; the best counts")
    p.add_argument("--profile", type=int, metavar="N", help="profile the vLLM run at N requests and stop")
    p.add_argument("--profile-out", default="")
    p.add_argument("--planning", action="store_true", help="measure only the sweep and capacity figures and merge "
                                                           "them into --out")
    args = p.parse_args()
    if args.child:
        return child(args)
    from simengine.engines import ENGINES

    sizes = [int(x) for x in args.sizes.split(",")]
    capacity = measure("vllm", 2000)["request_throughput"]  # offline: the replica's saturated throughput
    rate = round(0.9 * capacity, 3)
    if args.planning:
        old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        figures = planning(old.get("rate_req_s") or rate)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**old, **figures}, indent=2) + "\n")
        for k, v in figures.items():
            print(f"{k:34s} {v!s:>12s}")
        return
    if args.profile:
        out = str(Path(args.out).with_name(f"profile_vllm_{args.profile}.txt"))
        r = measure("vllm", args.profile, rate, profile_out=out)
        print(f"{args.profile} requests: {r['seconds']:.2f} s under cProfile; top entries in {out}")
        return
    engines = [e for e in ENGINES.names() if e != "generic"]
    # the SimPy loop and every engine at the first size (default, roofline and exact) in interleaved rounds
    first_runs = best_interleaved(args.repeat, ["simpy", *engines, *(f"{e}:roofline" for e in engines),
                                                *(f"{e}!exact" for e in engines)], sizes[0], rate)
    simpy_1m = first_runs["simpy"]["seconds"]
    runs = {n: first_runs["vllm"] if n == sizes[0] else best_of(args.repeat if n <= 10_000 else 1, "vllm", n, rate)
            for n in sizes}
    per_engine = {e: first_runs[e] for e in engines}
    paired = paired_to_vllm(args.repeat, engines, sizes[0], rate)
    roofline = {e: first_runs[f"{e}:roofline"] for e in engines}
    exact = {e: first_runs[f"{e}!exact"] for e in engines}
    cluster = measure("vllm@16", 100_000, round(16 * rate, 3)) if 100_000 in runs else None
    from simengine.cost.measured import data_root
    measured_on = data_root() is not None
    xs = [math.log(n) for n in sizes]
    ys = [math.log(runs[n]["seconds"]) for n in sizes]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs) if len(xs) > 1 else 1
    first = sizes[0]
    result = {
        "sizes": sizes, "rate_req_s": rate, "offline_capacity_req_s": round(capacity, 3),
        "simpy_1m_seconds": round(simpy_1m, 3),
        "seconds_10k": round(runs.get(10000, runs[first])["seconds"], 3),
        "seconds_100k": round(runs[100000]["seconds"], 3) if 100000 in runs else None,
        "seconds_1m": round(runs[1000000]["seconds"], 3) if 1000000 in runs else None,
        "requests_per_s_10k": round(first / runs[first]["seconds"], 1),
        "steps_per_s_10k": round(runs[first]["steps"] / runs[first]["seconds"], 1),
        "seconds_10m": round(runs[10_000_000]["seconds"], 3) if 10_000_000 in runs else None,
        "peak_rss_mb_1m": round(runs[1000000]["peak_rss_mb"], 1) if 1000000 in runs else None,
        "peak_rss_mb_10m": round(runs[10_000_000]["peak_rss_mb"], 1) if 10_000_000 in runs else None,
        "peak_rss_mb": {str(n): round(r["peak_rss_mb"], 1) for n, r in runs.items()},
        "scaling_exponent": round(slope, 3),
        "ratio_10k_to_simpy_1m": round(runs[first]["seconds"] / simpy_1m, 3),
        "per_engine_seconds_10k": {e: round(r["seconds"], 3) for e, r in per_engine.items()},
        # what each engine's run simulated: an engine serving far less than the offered rate (llama.cpp's and MLC's
        # default slots, the static baseline's batches) runs more, smaller steps; MLC can stall (docs/engines/mlc.md)
        "per_engine_steps_10k": {e: r["steps"] for e, r in per_engine.items()},
        "per_engine_completed_10k": {e: r["completed"] for e, r in per_engine.items()},
        "per_engine_us_per_step_10k": {e: round(1e6 * r["seconds"] / max(r["steps"], 1), 1)
                                       for e, r in per_engine.items()},
        "per_engine_ratio_to_vllm": {e: round(r["seconds"] / per_engine["vllm"]["seconds"], 2)
                                     for e, r in per_engine.items()},
        # each engine against a vLLM run just before it, median of the pairs (the steadier figure on a busy machine)
        "per_engine_paired_ratio_to_vllm": paired,
        # process CPU seconds: less sensitive than wall time to other tenants of a shared virtual machine
        "cpu_seconds_10k": round(runs.get(10000, runs[first])["cpu_seconds"], 3),
        "per_engine_cpu_ratio_to_vllm": {e: round(r["cpu_seconds"] / per_engine["vllm"]["cpu_seconds"], 2)
                                         for e, r in per_engine.items()},
        # the default model (measured kernels when the kernels extra is installed) against the roofline alone
        "measured_kernels_installed": measured_on,
        "per_engine_roofline_seconds_10k": {e: round(r["seconds"], 3) for e, r in roofline.items()},
        "per_engine_measured_to_roofline_10k": {e: round(per_engine[e]["seconds"] / r["seconds"], 2)
                                                for e, r in roofline.items()},
        "worst_measured_to_roofline_10k": round(max(per_engine[e]["seconds"] / r["seconds"]
                                                    for e, r in roofline.items()), 2),
        # the reference path alone (Scenario.exact): what the speed devices gain, engine by engine
        "exact_seconds_10k": {e: round(r["seconds"], 3) for e, r in exact.items()},
        "exact_to_default_10k": {e: round(r["seconds"] / per_engine[e]["seconds"], 2) for e, r in exact.items()},
        "cluster_seconds_100k_16r": round(cluster["seconds"], 3) if cluster else None,
        "cluster_cost_ratio": round(cluster["seconds"] / runs[100_000]["seconds"], 3) if cluster else None,
        "runs": {str(n): r for n, r in runs.items()},
        **planning(rate),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'measurement':34s} {'value':>12s}")
    for k in ("simpy_1m_seconds", "seconds_10k", "seconds_100k", "seconds_1m", "seconds_10m", "requests_per_s_10k",
              "steps_per_s_10k", "peak_rss_mb_1m", "peak_rss_mb_10m", "scaling_exponent", "ratio_10k_to_simpy_1m",
              "cpu_seconds_10k", "cluster_seconds_100k_16r", "cluster_cost_ratio", "measured_kernels_installed",
              "worst_measured_to_roofline_10k",
              "sweep_seconds_200", "capacity_runs"):
        print(f"{k:34s} {result[k]!s:>12s}")
    for e, s in result["per_engine_seconds_10k"].items():
        print(f"{'engine ' + e + ' seconds_10k':34s} {s:>12} ({result['per_engine_ratio_to_vllm'][e]}x vllm, "
              f"{result['per_engine_paired_ratio_to_vllm'][e]}x in pairs; "
              f"roofline {result['per_engine_roofline_seconds_10k'][e]} s; exact {result['exact_seconds_10k'][e]} s; "
              f"{result['per_engine_steps_10k'][e]:,} steps, {result['per_engine_us_per_step_10k'][e]} us a step, "
              f"{result['per_engine_completed_10k'][e]:,} completed)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
