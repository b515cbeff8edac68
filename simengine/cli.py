"""`simengine run|compare|list`: parse, call, print. Exit 0 ok, 2 bad input (one line), 1 internal error,
130 interrupted (Ctrl-C or SIGTERM; one line saying what was kept)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
from pathlib import Path

from simengine.errors import CannotRun, InputError

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT = 0, 1, 2
PROGRESS_DELAY_S = 2.0   # wall seconds an engine runs before its progress bar shows


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage dump -> our one-line contract
        words = self.prog.split()
        cmd = f"simengine {words[-1]}" if len(words) > 1 else "simengine"
        raise InputError(f"{message} (see `{cmd} --help`)", field="command line")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="simengine", description="Discrete-event simulator of LLM inference serving engines.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_ in (("run", "simulate a scenario's engines and write results and plots"),
                        ("compare", "run engines side by side on the identical request stream")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("scenario", help="a name under scenarios/ or a path to a YAML file")
        s.add_argument("--engines", help="comma-separated engine names (default: the scenario's list)")
        s.add_argument("--out", default="results", help="results folder (default results/)")
        s.add_argument("--plots", default="plots", help="plots folder (default plots/)")
        s.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="override a scenario field, e.g. --set workload.arrival.rate=4")
        s.add_argument("--no-plots", action="store_true", help="skip figures")
        s.add_argument("--exact", action="store_true",
                       help="the reference path alone, without the simulator's speed devices (same results, slower; "
                            "the same as --set exact=true)")
        s.add_argument("--quiet", action="store_true", help="no progress line (it shows only on a terminal)")
        s.add_argument("--max-wall-s", type=float, metavar="SECONDS",
                       help="stop simulating after this many wall-clock seconds; results so far are written and "
                            "marked partial")
    c = sub.add_parser("capacity", help="the highest request rate each engine serves within latency limits")
    c.add_argument("scenario", help="a name under scenarios/ or a path to a YAML file (open-loop arrivals at a rate)")
    c.add_argument("--engines", help="comma-separated engine names (default: the scenario's list)")
    c.add_argument("--slo", help="statistic limits METRIC_STAT_ms=VALUE, comma-separated; METRIC ttft, tpot, itl or "
                                 "e2el, STAT mean, median, p50, p90 or p99 (e.g. ttft_p99_ms=500,tpot_p99_ms=50). "
                                 "The scenario's slo: objectives apply per request with --attainment")
    c.add_argument("--attainment", type=float, default=0.99,
                   help="share of requests that must meet the scenario's per-request objectives (default 0.99)")
    c.add_argument("--target-rate", type=float, metavar="REQ_S", help="report the GPUs needed to serve this rate")
    c.add_argument("--tolerance", type=float, default=0.02, help="relative width of the final bracket (default 0.02)")
    c.add_argument("--repeats", type=int, default=1, help="runs per rate with successive seeds (default 1)")
    c.add_argument("--price", metavar="DEVICE=USD", help="price per device-hour in place of the device YAML's")
    c.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a scenario field")
    c.add_argument("--out", default="results", help="results folder (default results/)")
    c.add_argument("--plots", default="plots", help="plots folder (default plots/)")
    c.add_argument("--no-plots", action="store_true", help="skip the figure")
    c.set_defaults(handler=cmd_capacity)
    r = sub.add_parser("recommend", help="rank every engine that runs on the scenario's device, with the evidence")
    r.add_argument("scenario", help="a name under scenarios/ or a path to a YAML file (open-loop arrivals at a rate)")
    r.add_argument("--priority", default="balanced", help="throughput (capacity per GPU), latency (p99 TTFT at the "
                                                          "scenario's rate), cost (per 1M output tokens at capacity) "
                                                          "or balanced (their geometric mean; default)")
    r.add_argument("--engines", help="comma-separated engines to rank (default: every engine that runs there)")
    r.add_argument("--slo", help="statistic limits for the capacity search, as for `simengine capacity`")
    r.add_argument("--attainment", type=float, default=0.99, help="as for `simengine capacity` (default 0.99)")
    r.add_argument("--tolerance", type=float, default=0.02, help="as for `simengine capacity` (default 0.02)")
    r.add_argument("--price", metavar="DEVICE=USD", help="price per device-hour in place of the device YAML's")
    r.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a scenario field")
    r.add_argument("--out", default="results", help="results folder (default results/)")
    r.set_defaults(handler=cmd_recommend)
    h = sub.add_parser("report", help="(re)make results/<scenario>/report.html: one page with the table, figures, "
                                      "failures and configuration")
    h.add_argument("dir", help="a results folder of one scenario, e.g. results/agent_multiturn")
    h.add_argument("--plots", help="its figures' folder (default: plots/<the folder's name>)")
    h.set_defaults(handler=cmd_report)
    w = sub.add_parser("sweep", help="simulate every combination of a grid's axes into one resumable table")
    w.add_argument("scenario", help="a name under scenarios/ or a path to a YAML file")
    w.add_argument("--grid", required=True, help="YAML file: axes: {dotted.path or engine: [values]} "
                                                "(docs/planning.md)")
    w.add_argument("--executor", default="local", help="local (a process pool, default) or ray")
    w.add_argument("--address", help="the Ray cluster to use (default: a local Ray with --jobs CPUs)")
    w.add_argument("--jobs", type=int, default=0, help="parallel simulations (default: this machine's cores)")
    w.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a scenario field")
    w.add_argument("--out", default="results", help="results folder (default results/)")
    w.add_argument("--plots", default="plots", help="plots folder (default plots/)")
    w.add_argument("--no-plots", action="store_true", help="skip the Pareto figure")
    w.set_defaults(handler=cmd_sweep)
    from simengine.validate.cli import add_subcommands
    add_subcommands(sub)
    ls = sub.add_parser("list", help="list engines, routers, hardware, models or scenarios")
    ls.add_argument("what", choices=["engines", "routers", "hardware", "models", "scenarios"])
    return p


def _engines_arg(text: str | None, scenario):
    from simengine.api import engine_entries
    if text is None:
        return engine_entries(scenario, None)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise InputError("is empty; give e.g. --engines vllm,sglang", field="--engines")
    from simengine.engines import ENGINES
    labels = {e.display for e in scenario.engines}
    for name in names:
        if name not in labels:
            ENGINES.get(name, field="--engines")   # an unknown name: one line with the valid ones
    return engine_entries(scenario, list(names))


def cmd_run(args) -> int:
    from simengine.api import compare, write_plots, write_results
    from simengine.config.scenario import load_scenario, resolve_scenario_path
    from simengine.report.tables import format_table
    from simengine.sim.build import plan_pools

    if args.exact:
        args.set = [*args.set, "exact=true"]
    scenario = load_scenario(args.scenario, args.set)
    engines = _engines_arg(args.engines, scenario)
    if args.max_wall_s is not None and not 0 < args.max_wall_s < 1e9:
        raise InputError(f"must be a number of seconds > 0, got {args.max_wall_s:g}", field="--max-wall-s")
    out = Path(args.out) / scenario.name
    _progress.update(kept=f"nothing: the simulation was running ({out} is as it was)")
    skipped: dict[str, str] = {}   # engines this deployment cannot serve, with the reason
    layouts = {}
    try:
        for e in engines:  # validate every engine and its pools before running any (no half-written results)
            try:
                layouts[e.display] = plan_pools(scenario, e)
            except CannotRun as exc:
                if len(engines) == 1:
                    raise
                skipped[e.display] = exc.message
        engines = [e for e in engines if e.display not in skipped]
        if not engines:
            raise CannotRun("no engine can serve this deployment: " + "; ".join(
                f"{k}: {v}" for k, v in skipped.items()), field="engines")
        bar = None if args.quiet or not sys.stderr.isatty() else _Progress(scenario)
        try:   # a refused trace or prompt: no write
            results = compare(scenario, engines, max_wall_s=args.max_wall_s, progress=_checked(bar))
        finally:
            if bar is not None:
                bar.clear()
        _raise_if_interrupted()   # an interrupt a finalizer swallowed during the last engine's teardown
    except InputError as exc:  # name the scenario file the bad value came from
        raise exc.located(str(resolve_scenario_path(args.scenario)), None) from None
    _progress.update(kept=f"nothing new: results were being written ({out} is as it was)")
    written = [write_results(scenario, results, Path(args.out))]
    _progress.update(kept=f"{out}/ (complete); some figures under {Path(args.plots) / scenario.name}/ may be "
                          "missing or from an earlier run")
    _raise_if_interrupted()   # swallowed while the results were written (they were written whole)
    if not args.no_plots:
        written += write_plots(scenario, results, Path(args.plots))
    from simengine.report import html
    report = html.write(written[0], None if args.no_plots else Path(args.plots) / scenario.name)
    _raise_if_interrupted()
    partial = [k for k, r in results.items() if r.summary["partial"]]
    if partial:
        print(f"stopped at --max-wall-s {args.max_wall_s:g}: {', '.join(partial)} did not finish; their results "
              "are marked partial (summary.json partial: true)", file=sys.stderr)
    d = scenario.deployment
    print(f"{scenario.name}: {d.model} ({d.weight_dtype}) on {d.replicas}x{d.tp * d.pp} {d.hardware}, "
          f"seed {scenario.seed}")
    for label, pools in layouts.items():
        if len(pools) > 1 or pools[0].config != d:
            print(f"  {label}: " + " + ".join(f"{p.name} ({p.role}, {p.entry.engine}) {p.count}x{p.dep.num_devices} "
                                               f"{p.dep.hardware.name}" for p in pools))
    print(format_table({k: v.summary for k, v in results.items()}))
    for label, reason in skipped.items():
        print(f"{label}: did not run: {reason}")
    for label, r in results.items():
        if r.summary["failed"]:
            reasons = "; ".join(f"{n:,} {reason}" for reason, n in r.summary["failure_reasons"].items())
            print(f"{label}: {r.summary['failed']:,} failed: {reasons}")
        for st in r.summary.get("stalled", ()):
            print(f"{label}: replica {st['replica']} stalled from t={st['since_s']:.1f} s to the end with "
                  f"{st['requests']:,} request(s) it could not schedule: {st['reason']}")
        if (f := r.summary.get("faults")) is not None:
            print(f"{label}: {f['failures']} replica failure(s), {f['retries']} request(s) resent, "
                  f"{f['failed_by_fault']} failed by them, availability {100 * f['availability']:.1f}%")
    from simengine.validate.accuracy import device_line
    hardware = {p.dep.hardware.name for pools in layouts.values() for p in pools}
    for name in sorted(hardware):
        print(device_line(name) + " Per engine: report.html, 'How close the simulator has been'.")
    print(f"results: {written[0]}/<engine>/summary.json" + (f"  plots: {written[1].parent}/" if len(written) > 1
                                                             else "") + f"  report: {report}")
    return EXIT_OK


class _Progress:
    """A tqdm bar per engine over simulated time against the horizon, with the requests done; it appears once an
    engine has run for PROGRESS_DELAY_S of wall time (short runs print nothing) and goes when the engine ends."""

    def __init__(self, scenario):
        self.horizon_s, self.label, self.bar, self.started = scenario.horizon_s, None, None, 0.0

    def __call__(self, label: str, k: int, n: int, simulated_s: float, done: int) -> None:
        import time

        from tqdm import tqdm

        if label != self.label:
            self.clear()
            self.label, self.started = label, time.monotonic()
        if self.bar is None:
            if time.monotonic() - self.started < PROGRESS_DELAY_S:
                return
            self.bar = tqdm(total=max(self.horizon_s, 1e-9), desc=f"[{k}/{n}] {label}", file=sys.stderr, leave=False,
                            dynamic_ncols=True, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:,.0f}/{total:,.0f} s "
                                                           "simulated [{elapsed}<{remaining}]{postfix}")
        self.bar.n = min(simulated_s, self.horizon_s)
        self.bar.set_postfix_str(f"{done:,} done" + (", draining" if simulated_s > self.horizon_s else ""))

    def clear(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar, self.label = None, None


def cmd_capacity(args) -> int:
    from simengine.config.scenario import load_scenario, resolve_scenario_path
    from simengine.planning import output
    from simengine.planning.capacity import parse_slo, rated, requests_per_run, search
    from simengine.sim.build import build_deployment, plan_pools

    scenario = load_scenario(args.scenario, args.set)
    engines = _engines_arg(args.engines, scenario)
    limits = parse_slo(args.slo)
    if args.target_rate is not None and not 0 < args.target_rate < 1e9:
        raise InputError(f"must be a rate in requests per second > 0, got {args.target_rate:g}", field="--target-rate")
    try:
        dep = build_deployment(scenario)
        for e in engines:  # every engine and its pools checked before any runs
            plan_pools(scenario, e)
        rated(scenario)
        requests_per_run(scenario)
    except InputError as exc:
        raise exc.located(str(resolve_scenario_path(args.scenario)), None) from None
    price, source = _price(args.price, dep.hardware)

    def progress(label, point):
        if sys.stderr.isatty():
            print(f"  {label}: {point.rate:.4g} req/s {'meets' if point.feasible else 'fails: ' + point.why}",
                  file=sys.stderr)
    caps = {e.display: search(scenario, e, limits, attainment=args.attainment, tolerance=args.tolerance,
                              repeats=args.repeats, progress=progress) for e in engines}
    d = scenario.deployment
    what = " and ".join(filter(None, [", ".join(map(str, limits)),
                                      f"{100 * args.attainment:g}% of requests within {_objectives(scenario.slo)}"
                                      if scenario.slo.any else ""]))
    meta = {"scenario": scenario.name, "hardware": d.hardware, "model": d.model, "replicas": d.replicas,
            "tp": d.tp, "pp": d.pp, "limits": [str(x) for x in limits],
            "objectives": _objectives(scenario.slo) if scenario.slo.any else None, "attainment": args.attainment,
            "tolerance": args.tolerance, "repeats": args.repeats, "target_rate_req_s": args.target_rate}
    path = output.write(Path(args.out) / scenario.name, meta, caps, args.target_rate, price, source)
    figure = None
    if not args.no_plots:
        figure = output.figure(caps, limits, args.attainment if scenario.slo.any else None,
                               f"{scenario.name}: capacity within {what} ({d.model} on {d.replicas}x"
                               f"{d.tp * d.pp} {d.hardware})", Path(args.plots) / scenario.name / "capacity.png")
    print(f"{scenario.name}: capacity within {what}; {d.model} ({d.weight_dtype}) on {d.replicas}x{d.tp * d.pp} "
          f"{d.hardware}, seed {scenario.seed}, bracket {100 * args.tolerance:g}%")
    print(output.table(caps, args.target_rate, price))
    print(f"results: {path}" + (f"  figure: {figure}" if figure else ""))
    return EXIT_OK


def _price(arg: str | None, hw) -> tuple[float | None, str]:
    """The device's price per hour and where it comes from (--price DEVICE=USD in place of the YAML's)."""
    from simengine.config.hardware import REPO_ROOT
    path = Path(hw.path)
    where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    price = hw.price_usd_per_hour
    source = f"price_usd_per_hour in {where}, {hw.price_source_date or 'undated'} (its source is the comment there)"
    if not arg:
        return price, source
    device, eq, usd = arg.partition("=")
    if device != hw.name or not eq:
        raise InputError(f"give DEVICE=USD for the scenario's device, e.g. --price {hw.name}=2.5", field="--price")
    try:
        price = float(usd)
    except ValueError:
        raise InputError(f"'{usd}' is not a price in USD per device-hour", field="--price") from None
    if not 0 <= price < 1e6:
        raise InputError(f"must be between 0 and 1e6 USD per device-hour, got {price:g}", field="--price")
    return price, "--price"


def cmd_recommend(args) -> int:
    import json

    import pandas as pd

    from simengine.config.scenario import load_scenario, resolve_scenario_path
    from simengine.planning.capacity import parse_slo, rated, requests_per_run
    from simengine.planning.recommend import PRIORITIES, margin_line, recommend, why
    from simengine.sim.build import build_deployment

    scenario = load_scenario(args.scenario, args.set)
    engines = _engines_arg(args.engines, scenario) if args.engines is not None else None
    limits = parse_slo(args.slo)
    if args.priority not in PRIORITIES:
        raise InputError(f"'{args.priority}' is not a priority; use one of {', '.join(PRIORITIES)}",
                         field="--priority")
    try:
        dep = build_deployment(scenario)
        rated(scenario)
        requests_per_run(scenario)
    except InputError as exc:
        raise exc.located(str(resolve_scenario_path(args.scenario)), None) from None
    if not limits and not scenario.slo.any:
        raise InputError("give a latency limit: --slo (e.g. ttft_p99_ms=500) or per-request objectives in the "
                         "scenario's slo: section", field="--slo")
    price, source = _price(args.price, dep.hardware)

    def progress(label, text):
        if sys.stderr.isatty():
            print(f"  {label}: {text}", file=sys.stderr)
    ranked = recommend(scenario, limits, priority=args.priority, attainment=args.attainment,
                       tolerance=args.tolerance, engines=engines, price=price, progress=progress)
    d, rate = scenario.deployment, scenario.workload.arrival.rate
    rows = {}
    for i, r in enumerate(ranked, 1):
        s = r.at_rate
        rows[f"{i}. {r.label}"] = {
            "score": f"{r.score:.2f}", "capacity req/s/GPU": f"{r.capacity.rate_per_device:.3g}",
            f"p99 TTFT @{rate:g}/s": "overloaded" if s["overloaded"] else f"{s['p99_ttft_ms']:.0f} ms"
            if s.get("p99_ttft_ms") is not None else "-",
            "p99 TPOT": "-" if s.get("p99_tpot_ms") is None else f"{s['p99_tpot_ms']:.1f} ms",
            "$/1M out": "-" if r.cost is None else f"{r.cost:.3f}",
            "prefix hit": f"{s['prefix_cache_hit_rate']:.0%}", "KV pool tok": f"{s['kv_capacity_tokens']:,}"}
    print(f"{scenario.name}: engines ranked by {args.priority} on {d.model} ({d.weight_dtype}) on "
          f"{d.replicas}x{d.tp * d.pp} {d.hardware}")
    print(pd.DataFrame.from_dict(rows, orient="index").to_string())
    reason = (why(ranked[0], ranked[1], args.priority) if len(ranked) > 1
              else f"{ranked[0].label} is the only engine that runs")
    print(f"recommended: {ranked[0].label} ({reason})")
    margin, within = (margin_line(ranked[0], ranked[1], args.priority, dep.hardware.name) if len(ranked) > 1
                      else ("", None))
    if margin:
        print(margin)
    out = Path(args.out) / scenario.name
    out.mkdir(parents=True, exist_ok=True)
    doc = {"scenario": scenario.name, "priority": args.priority, "limits": [str(x) for x in limits],
           "attainment": args.attainment, "price_usd_per_hour": price, "price_source": source,
           "recommended": ranked[0].label, "why": reason, "margin": margin, "lead_within_error": within,
           "ranking": [{"engine": r.label, "score": round(r.score, 4),
                        "capacity_req_s_per_device": round(r.capacity.rate_per_device, 4),
                        "capacity_limited_by": r.capacity.why_not_higher,
                        "cost_per_1m_output_tokens_usd": None if r.cost is None else round(r.cost, 4),
                        "at_scenario_rate": {k: r.at_rate.get(k) for k in (
                            "overloaded", "p99_ttft_ms", "median_ttft_ms", "p99_tpot_ms", "median_tpot_ms",
                            "prefix_cache_hit_rate", "kv_capacity_tokens", "mean_batch_size", "preemptions",
                            "failed")}} for r in ranked]}
    from simengine.report.files import write_whole
    path = write_whole(out / f"recommend_{args.priority}.json",
                       lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))
    print(f"results: {path}")
    return EXIT_OK


def cmd_report(args) -> int:
    from simengine.report import html
    d = Path(args.dir)
    if not d.is_dir():
        raise InputError(f"'{args.dir}' is not a folder; give a results folder such as results/agent_multiturn",
                         field="DIR")
    plots = Path(args.plots) if args.plots else Path("plots") / d.name
    path = html.write(d, plots if plots.exists() else None)
    print(f"report: {path}" + ("" if plots.exists() else f" (no figures: {plots} does not exist)"))
    return EXIT_OK


def cmd_sweep(args) -> int:
    from simengine.config.scenario import load_scenario
    from simengine.planning import sweep as sw

    scenario = load_scenario(args.scenario, args.set)
    grid = sw.load_grid(args.grid, [e.display if not e.params else {"engine": e.engine, "label": e.display,
                                                                    "params": e.params}
                                    for e in scenario.engines])
    points = grid.points()
    from simengine.config.hardware import load_hardware
    from simengine.config.model import load_model
    for p in points:   # every point's configuration is read before any runs: a typo stops the sweep here
        try:
            sc = load_scenario(args.scenario, args.set + sw.overrides(p))
            for d in (sc.deployment, *(sc.pools or ()), *(q for e in sc.engines for q in e.pools or ())):   # names
                if d.hardware:
                    load_hardware(d.hardware)
                if d.model:
                    load_model(d.model)
        except InputError as exc:
            where = ", ".join(f"{k}={sw.label(v)}" for k, v in p.items())
            raise InputError(f"the point {where}: {exc}", field="--grid") from None
    name = f"sweep_{Path(args.grid).stem}"
    out = Path(args.out) / scenario.name / name

    def progress(k, n, row):
        if sys.stderr.isatty():
            print(f"\r  {k}/{n} points", end="" if k < n else "\n", file=sys.stderr, flush=True)
    _progress.update(kept=f"the points finished so far in {out}/points.csv (a rerun resumes)")
    csv = sw.sweep(args.scenario, args.set, grid, out, jobs=args.jobs, executor=args.executor,
                   address=args.address, progress=progress)
    parquet = sw.write_parquet(csv)
    import pandas as pd
    table = pd.read_csv(csv)
    failed = table[table["status"] != "ok"]
    print(f"{scenario.name}: {len(points)} points of {' x '.join(f'{k} ({len(v)})' for k, v in grid.axes.items())}; "
          f"{len(table) - len(failed)} ok, {len(failed)} failed")
    for _, r in failed.head(5).iterrows():
        print(f"  failed: {', '.join(f'{k}={r[k]}' for k in grid.axes)}: {r['reason']}")
    if not args.no_plots:
        fig = sw.figure(csv, f"{scenario.name}: {name}", Path(args.plots) / scenario.name / f"{name}_pareto.png")
        print(f"figure: {fig}")
    print(f"results: {csv}" + (f" and {parquet.name}" if parquet else ""))
    return EXIT_OK


def _objectives(slo) -> str:
    return ", ".join(f"{k} {v:g} ms" for k, v in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2el_ms))
                     if v is not None)


def cmd_list(args) -> int:
    if args.what == "engines":
        from simengine.engines import ENGINES
        for name in ENGINES.names():
            cls = ENGINES.get(name)
            doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
            print(f"{name:9s} {doc[0] if doc else ''}")
            print(f"{'':9s} runs on: {', '.join(sorted(cls.vendors))} ({', '.join(sorted(cls.device_classes))})"
                  + ("" if cls.gaudi_backend or "intel" not in cls.vendors else "; no Gaudi (HPU) backend"))
    elif args.what == "routers":
        from simengine.routers import ROUTERS
        for name in ROUTERS.names():
            router = ROUTERS.get(name)
            knobs = ", ".join(f.name for f in dataclasses.fields(router.Params))
            print(f"{name:25s} {router.source}" + (f"\n{'':25s} knobs: {knobs}" if knobs else ""))
    elif args.what == "hardware":
        from simengine.config.hardware import hardware_files, load_hardware
        print(f"{'name':24s} {'vendor':9s} {'class':11s} {'mem GiB':>8s} {'BW GB/s':>8s} {'BF16 TF':>8s} "
              f"{'FP8 TF':>8s}")
        for name in hardware_files():
            h = load_hardware(name)
            bf16 = h.peak_flops.get("bf16", h.peak_flops.get("fp16", 0)) / 1e12
            fp8 = h.peak_flops.get("fp8")
            print(f"{name:24s} {h.vendor:9s} {h.device_class:11s} {h.memory_bytes / 2**30:8.0f} "
                  f"{h.memory_bandwidth_bytes_s / 1e9:8.0f} {bf16:8.1f} {fp8 / 1e12 if fp8 else float('nan'):8.1f}")
    elif args.what == "models":
        from simengine.config.model import load_model, model_names
        print(f"{'name':22s} {'type':12s} {'total B':>8s} {'active B':>9s} {'KV B/token (16-bit)':>20s}")
        for name in model_names():
            m = load_model(name)
            print(f"{name:22s} {m.model_type:12s} {m.total_params / 1e9:8.2f} {m.active_params / 1e9:9.2f} "
                  f"{m.kv_bytes_per_token(2.0):20,.0f}")
    else:
        from simengine.config.loader import load_yaml
        from simengine.config.scenario import scenario_files
        for name, path in scenario_files().items():
            first = path.read_text().splitlines()[0].lstrip("# ").strip() if path.stat().st_size else ""
            print(f"{name:32s} {first}")
            _ = load_yaml  # scenarios are validated when run
    return EXIT_OK


# what an interrupt at this point leaves behind, said in its message; whether a signal came
_progress: dict = {"kept": "nothing", "signalled": False}


def _interrupt(signum, frame):
    """Ctrl-C and SIGTERM unwind as KeyboardInterrupt: temporary files are removed, the message is printed. The
    signal is also remembered: Python swallows an exception raised while a finalizer runs (a suspended simulation
    process closed when its run is torn down prints 'Exception ignored' and the run goes on), so the simulation's
    progress checks and the end of the comparison raise it again (`_raise_if_interrupted`)."""
    _progress["signalled"] = True
    raise KeyboardInterrupt


def _raise_if_interrupted() -> None:
    if _progress["signalled"]:
        raise KeyboardInterrupt


def _checked(progress):
    """`progress` for `compare` (or none) behind a check for a signal whose KeyboardInterrupt was swallowed; the
    runner calls it about twice a wall-clock second."""
    def tick(*args):
        _raise_if_interrupted()
        if progress is not None:
            progress(*args)
    return tick


def _check_writable(flag: str, value: str | None, *, folder: bool) -> None:
    """Refuse an output path the run could not write, before minutes of simulating: a folder flag naming a file,
    a file flag naming a folder, an empty path, or a path under something that is not a writable folder."""
    if value is None:
        return
    kind = "folder" if folder else "file"
    if not value.strip():
        raise InputError(f"is empty; give a {kind} path", field=flag)
    path = Path(value)
    if path.exists() and path.is_dir() != folder:
        raise InputError(f"'{value}' is a {'file' if folder else 'folder'}; give a {kind} path", field=flag)
    base = path if folder and path.is_dir() else path.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise InputError(f"'{value}' is under '{base}', which is a file; give a {kind} path", field=flag)
    try:   # a real probe (root passes os.access everywhere, /proc refuses anyway); nothing is left behind
        os.rmdir(tempfile.mkdtemp(prefix=".simengine-probe-", dir=base))
    except OSError:
        raise InputError(f"'{base}' is not writable; give a {kind} you can write to", field=flag) from None


def _check_outputs(args) -> None:
    for flag, folder in (("out", True), ("plots", True), ("accuracy", False)):
        if flag == "plots" and getattr(args, "no_plots", False):
            continue
        _check_writable(f"--{flag}", getattr(args, flag, None), folder=folder)


def main(argv: list[str] | None = None) -> int:
    _progress.update(kept="nothing", signalled=False)
    try:
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:   # not the main thread (an embedding application): leave its handlers alone
        previous = {}
    try:
        args = _parser().parse_args(argv)
        _check_outputs(args)
        if args.command in ("run", "compare"):
            return cmd_run(args)
        if args.command == "list":
            return cmd_list(args)
        return args.handler(args)
    except InputError as exc:
        print(f"simengine: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print(f"simengine: interrupted; kept: {_progress['kept']}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        sys.stderr.close()
        return EXIT_OK
    except Exception as exc:  # an internal bug: say so, keep the traceback for the report
        import traceback
        traceback.print_exc()
        print(f"simengine: internal error: {exc.__class__.__name__}: {exc} (please report)", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
