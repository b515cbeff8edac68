"""`simengine validate`, `simengine calibrate` and `simengine profile`: parse, call, print.

Wire into simengine/cli.py with `add_subcommands(sub)` in the parser and `return args.handler(args)` for these
commands in main(). Errors are InputError (the CLI prints one line and exits 2).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

COMMANDS = ("validate", "calibrate", "profile")


def _count(text: str) -> int:
    """argparse type for --jobs (ArgumentTypeError becomes the CLI's one-line input error)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"must be in 1..256, got {n}")
    return n


def add_subcommands(subparsers) -> None:
    """Register validate, calibrate and profile on an argparse subparsers object."""
    v = subparsers.add_parser("validate", help="predict published measurements and report the error per row")
    v.add_argument("file", help="measurements CSV (schema: docs/validation.md 'Measurement files')")
    v.add_argument("--out", default="results/validation", help="folder for validation.csv, skipped.csv and the plot")
    v.add_argument("--jobs", type=_count, default=2, help="worker processes (default 2)")
    v.add_argument("--quiet", action="store_true", help="print only the summary tables, not every row")
    v.add_argument("--cost-model", choices=("auto", "roofline"), default="auto",
                   help="auto: measured kernels where tables exist (default); roofline: the roofline everywhere")
    v.add_argument("--accuracy", metavar="TABLE", default=None,
                   help="record every row's error in this accuracy table, replacing the file's earlier rows "
                        "(make accuracy: simengine/validate/accuracy.csv, which run reports read)")
    v.set_defaults(handler=cmd_validate)
    c = subparsers.add_parser("calibrate", help="fit the named efficiency and overhead terms to measurements")
    c.add_argument("files", nargs="+", metavar="file", help="measurements CSVs (schema: "
                   "docs/validation.md 'Measurement files'), fitted together")
    c.add_argument("--test", action="append", default=[], metavar="FILE",
                   help="also report the error on another measurements file with the fitted terms (repeatable)")
    c.add_argument("--write", action="store_true",
                   help="write the fitted terms into hardware/*.yaml and simengine/engines/calibration.yaml")
    c.add_argument("--jobs", type=_count, default=2, help="worker processes (default 2)")
    c.add_argument("--no-cv", action="store_true", help="skip leave-one-hardware-out cross-validation")
    c.set_defaults(handler=cmd_calibrate)
    p = subparsers.add_parser("profile", help="measure a model's GEMMs and attention on the local device as "
                              "measured-kernel tables (needs torch)")
    p.add_argument("model", help="catalog model name or a config.json path")
    p.add_argument("--out", default=None, help="root folder of the tables (default kernels/)")
    p.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16")
    p.add_argument("--tp", type=_count, default=1, help="shard the layer as one of tp ranks")
    p.add_argument("--quick", action="store_true", help="few sizes, few repeats (a smoke test)")
    p.set_defaults(handler=cmd_profile)


def cmd_validate(args: argparse.Namespace) -> int:
    from simengine.validate.measurements import read_measurements
    from simengine.validate.report import format_report, plot, write_csv
    from simengine.validate.run import Prediction, run_rows

    t0 = time.perf_counter()
    if args.accuracy:   # before minutes of validation, not after
        from simengine.validate.accuracy import check_table
        check_table(Path(args.accuracy))
    rows = read_measurements(args.file)
    results = run_rows(rows, jobs=args.jobs, kernels=args.cost_model)
    preds = [r for r in results if isinstance(r, Prediction)]
    skips = [r for r in results if not isinstance(r, Prediction)]
    out = Path(args.out)
    csv_path = write_csv(preds, skips, out)
    figure = plot(preds, out / "validation_plot.png", skips) if preds else None
    print(format_report(preds, skips, rows_detail=not args.quiet).rsplit("\n", 1)[0])
    print(f"wrote {csv_path}" + (f" and {figure}" if figure else "") + f" in {time.perf_counter() - t0:.0f} s")
    if args.accuracy:
        from simengine.validate.accuracy import record
        record(Path(args.accuracy), Path(args.file).stem,
               [(p.row.id, p.engine, p.row.hardware, p.row.metric, p.error_pct) for p in preds])
        print(f"recorded {len(preds)} rows of {Path(args.file).stem} in {args.accuracy}")
    print(format_report(preds, skips, rows_detail=False).rsplit("\n", 1)[1])
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from simengine.validate.calibrate import calibrate_files

    print(calibrate_files(args.files, write=args.write, jobs=args.jobs, cross_validate=not args.no_cv,
                          test=args.test))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from simengine.validate.profile import profile_command

    print(profile_command(args.model, out=args.out, device=args.device, dtype=args.dtype, tp=args.tp,
                          quick=args.quick))
    return 0
