"""Write calibrated terms: targeted edits of hardware/<vendor>/<name>.yaml (comments kept) and the engine YAML."""

from __future__ import annotations

import re
from pathlib import Path

from simengine.config.hardware import load_hardware_file
from simengine.cost.calibrated import ENGINE_TERMS_PATH, read_engine_terms
from simengine.errors import InputError

ENGINE_HEADER = """\
# Calibrated per-engine overhead terms, written by `simengine calibrate FILE.csv --write` (docs/validation.md).
# engines.<registry name>.terms: named terms; a name that is an EngineTiming field (scheduler_cpu_s,
# output_cpu_s, kernel_launch_s, graph_replay_s) replaces that field, the others are the proposed roofline
# terms (layer_latency_s, allreduce_hop_latency_s, allreduce_bandwidth_fraction, seq_cpu_s) documented in
# simengine/cost/calibrated.py. The other keys are provenance: rows used, median |error| on them, source, date.
"""


def decimal(v: float, digits: int = 4) -> str:
    """A plain decimal YAML number with `digits` significant digits (loaders read exponents as strings)."""
    import numpy as np

    text = np.format_float_positional(float(v), precision=digits, unique=False, fractional=False, trim="-")
    return text if "." in text else text + ".0"


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return decimal(v)
    s = str(v)
    return '"' + s.replace('"', "'") + '"'


# Trailing comments for the provenance keys (the catalog asks every number for its source comment).
PROVENANCE_NOTES = {
    "source": "measurements file the terms were fitted on",
    "date": "when `simengine calibrate --write` ran",
    "rows": "usable rows of this device in the fit",
    "scope": "device: own fractions; vendor pool: shared by the devices named",
    "pool_rows": "rows of the whole pool that shares these fractions",
    "median_abs_error_pct": "in-sample median |error| on this device's rows, percent",
    "loho_median_abs_error_pct": "median |error| with this device left out of the fit, percent",
}


def _replace_value(text: str, key: str, value: float, note: str) -> str:
    pat = re.compile(rf"^(\s+{key}:\s*)([0-9.]+)([ \t]*)(#.*)?$", re.MULTILINE)
    m = pat.search(text)
    if not m:
        raise InputError(f"no '{key}:' line under efficiency to update", field=f"efficiency.{key}")
    old_comment = (m.group(4) or "").lstrip("# ").strip()
    comment = f"# {note}; before: {m.group(2)}" + (f" ({old_comment})" if old_comment else "")
    if "calibrated" in old_comment and "before:" in old_comment:   # keep the first prior, not a chain of them
        comment = f"# {note}; before:" + old_comment.split("before:", 1)[1]
    return text[:m.start()] + f"{m.group(1)}{decimal(value)}  {comment}" + text[m.end():]


def _drop_block(text: str, key: str) -> str:
    lines = text.splitlines(keepends=True)
    out, skipping = [], False
    for line in lines:
        if line.startswith(f"{key}:"):
            skipping = True
            continue
        if skipping and (line.startswith((" ", "\t")) or not line.strip()):
            continue
        skipping = False
        out.append(line)
    return "".join(out)


def write_hardware_calibration(path: Path, gemm: float, mem: float, provenance: dict) -> Path:
    """Set efficiency.{gemm_fraction,memory_bandwidth_fraction} and a `calibration:` mapping; keep comments.

    The result is re-read with the strict loader; on any error the original file is restored.
    """
    original = path.read_text(encoding="utf-8")
    rows = provenance.get("pool_rows", provenance.get("rows"))
    note = f"calibrated {provenance.get('date', '')} ({provenance.get('scope', '')}; {rows} rows)"
    text = _replace_value(original, "gemm_fraction", gemm, note)
    text = _replace_value(text, "memory_bandwidth_fraction", mem, note)
    text = _drop_block(text, "calibration").rstrip("\n") + "\n"
    text += "calibration:                   # written by `simengine calibrate` (docs/validation.md)\n"
    for k, v in provenance.items():
        entry = f"  {k}: {_scalar(v)}"
        text += f"{entry:30s} # {PROVENANCE_NOTES.get(k, 'provenance')}\n"
    path.write_text(text, encoding="utf-8")
    try:
        load_hardware_file(path)
    except InputError:
        path.write_text(original, encoding="utf-8")
        raise
    return path


def write_engine_terms(engines: dict[str, dict], path: Path | None = None) -> Path:
    """Rewrite the engine YAML: the given engines replaced, others kept (their terms only)."""
    p = path or ENGINE_TERMS_PATH
    kept = {e: {"terms": t} for e, t in read_engine_terms(p).items() if e not in engines}
    merged = {**kept, **engines}
    out = [ENGINE_HEADER, "engines:\n"]
    for name in sorted(merged):
        entry = merged[name]
        out.append(f"  {name}:\n    terms:\n")
        for k, v in sorted(entry["terms"].items()):
            out.append(f"      {k}: {decimal(float(v))}\n")
        for k, v in entry.items():
            if k != "terms":
                out.append(f"    {k}: {_scalar(v)}\n")
    p.write_text("".join(out), encoding="utf-8")
    read_engine_terms(p)   # must parse back
    return p
