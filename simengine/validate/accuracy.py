"""How close the simulator has been on published measurements, for a run's engines and device (report.html).

`simengine validate FILE --accuracy PATH` records every row it ran (file, id, engine, device, metric, signed
error) into PATH, replacing that file's earlier rows; `make accuracy` does so for the shared measurement files and
docs/judge/ into the package's table, `accuracy.csv` beside this module. A run's report then says, per engine and
metric family, how far the simulator's predictions have been from measurements: on the rows the calibration was
fitted to and, apart, on rows nothing was fitted on (docs/judge/), on the run's device where it has such rows,
else on every device. docs/validation.md has the whole story.
"""

from __future__ import annotations

import csv
from functools import cache
from pathlib import Path

import numpy as np

from simengine.errors import InputError

TABLE = Path(__file__).with_name("accuracy.csv")
COLUMNS = ("file", "id", "engine", "hardware", "metric", "error_pct")
# the files `simengine calibrate` fits the cost terms on (docs/validation.md); every other file is judged only
CALIBRATION_FILES = frozenset({"public_measurements", "serving_measurements"})
# metric families as a run reports them; a metric in none of them is not shown
FAMILIES = (("throughput", ("_throughput",)), ("TTFT", ("ttft",)), ("TPOT / ITL", ("tpot", "itl")),
            ("E2E latency", ("e2el",)), ("prefill step", ("prefill_",)), ("decode step", ("decode_",)))
MIN_ROWS_ON_DEVICE = 3   # fewer rows of an engine on the run's device: its rows on every device speak instead


def family(metric: str) -> str | None:
    """The family a measurement's metric belongs to (None: none shown)."""
    return next((name for name, keys in FAMILIES if any(k in metric for k in keys)), None)


def check_table(path: Path) -> None:
    """InputError unless `path` can be recorded into: its folder exists and, if it exists, it is such a table."""
    if not path.parent.is_dir():
        raise InputError(f"no folder {path.parent} for the accuracy table {path}; give a path in an existing folder",
                         field="--accuracy")
    if path.exists():
        _read(path)


def record(path: Path, file: str, rows: list[tuple[str, str, str, str, float]]) -> None:
    """Replace `file`'s rows in the table at `path` with `rows` (id, engine, hardware, metric, signed error %)."""
    kept = [r for r in _read(path) if r[0] != file] if path.exists() else []
    new: list[tuple[str, ...]] = [(file, rid, engine, hw, metric, f"{err:.2f}")
                                  for rid, engine, hw, metric, err in rows]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        w.writerows(sorted(kept + new))
    tmp.replace(path)


def _read(path: Path) -> list[tuple[str, ...]]:
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or tuple(header) != COLUMNS:
            raise InputError(f"{path} is not an accuracy table (its columns must be {','.join(COLUMNS)}); give a new "
                             "file or one `simengine validate --accuracy` wrote", field="--accuracy")
        return [tuple(r) for r in reader]


@cache
def table() -> tuple[tuple[str, str, str, str, str, float], ...]:
    """The package's table (empty when it is missing)."""
    if not TABLE.exists():
        return ()
    return tuple((f, rid, e, hw, m, float(err)) for f, rid, e, hw, m, err in _read(TABLE))


def _stats(errors: list[float]) -> dict:
    e = np.array(errors, dtype=float)
    return {"rows": len(e), "median_abs_error_pct": round(float(np.median(np.abs(e))), 1),
            "median_error_pct": round(float(np.median(e)), 1)} if len(e) else {"rows": 0}


def _scoped(engine: str, hardware: str, name: str) -> tuple[str, list[tuple]]:
    """`engine`'s rows of family `name` on `hardware` when it has MIN_ROWS_ON_DEVICE or more there, else on every
    device (none: no rows), and which of the two."""
    rows = [r for r in table() if r[2] == engine and family(r[4]) == name]
    here = [r for r in rows if r[3] == hardware]
    return (hardware, here) if len(here) >= MIN_ROWS_ON_DEVICE else ("every device", rows)


def median_abs_error(engine: str, hardware: str, families: tuple[str, ...]) -> float | None:
    """The largest, over `families`, of `engine`'s median |error| on its scoped rows (calibration and judged
    together); None when it has no rows in any of them."""
    found = [float(np.median(np.abs([r[5] for r in rows]))) for rows in
             (_scoped(engine, hardware, name)[1] for name in families) if rows]
    return max(found) if found else None


def for_engine(engine: str, hardware: str) -> list[dict]:
    """Per metric family with rows of `engine`: their error on `hardware` when it has MIN_ROWS_ON_DEVICE or more
    there, else on every device, calibration rows and judged rows apart."""
    out = []
    for name, _ in FAMILIES:
        scope, chosen = _scoped(engine, hardware, name)
        if not chosen:
            continue
        out.append({"engine": engine, "family": name, "scope": scope,
                    "calibration": _stats([r[5] for r in chosen if r[0] in CALIBRATION_FILES]),
                    "judged": _stats([r[5] for r in chosen if r[0] not in CALIBRATION_FILES])})
    return out


def device_rows(hardware: str) -> int:
    """Rows of any engine measured on `hardware`."""
    return sum(1 for r in table() if r[3] == hardware)


def device_line(hardware: str) -> str:
    """One sentence on what was validated on `hardware` (a catalog name)."""
    n = device_rows(hardware)
    if not n:
        return (f"No published measurement of {hardware} was validated: its figures rest on its datasheet, its kernel "
                "tables where they exist and terms calibrated on other devices.")
    e = [r[5] for r in table() if r[3] == hardware]
    return (f"{n:,} published measurements of {hardware} were validated (median |error| "
            f"{float(np.median(np.abs(e))):.1f}%).")
