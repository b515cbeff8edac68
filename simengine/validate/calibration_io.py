"""Write calibrated terms: targeted edits of hardware/<vendor>/<name>.yaml (comments kept) and the engine YAML."""

from __future__ import annotations

import re
from pathlib import Path

from simengine.config.hardware import load_hardware_file
from simengine.cost.calibrated import ENGINE_TERMS_PATH, read_engine_terms
from simengine.errors import InputError

ENGINE_HEADER = """\
# Calibrated engine terms, written by `simengine calibrate FILE.csv --write` (docs/validation.md).
# engines.<registry name>.terms: EngineTiming fields (scheduler_cpu_s, output_cpu_s, seq_cpu_s, kernel_launch_s,
# graph_replay_s, frontend_s) that replace the engine module's priors; the other keys are provenance: step-time rows
# used, median |error| on them, source, date (frontend_s comes from the engine's open-loop TTFT rows). An engine
# without an entry runs on its priors. scheduler_cpu_s is one scheduling pass: a vLLM V0 multi-step run
# (--num-scheduler-steps k) shares it among its k steps (EngineTiming.steps_per_schedule).
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
    "median_abs_error_pct": "in-sample median |error| on this device's rows, percent",
    "loho_median_abs_error_pct": "median |error| with this device left out of the fit, percent",
}


def _replace_value(text: str, key: str, value: float, note: str | None, *, under: str | None = None) -> str:
    """Set the number on the line `key: N` (the first one after the line `under:` when given), keeping its source
    comment after `before:`; with no `note`, the value is the prior and the line gets its source comment back."""
    start = 0
    if under:
        m0 = re.search(rf"^\s+{under}:[ \t]*(#.*)?$", text, re.MULTILINE)
        if not m0:
            raise InputError(f"no '{under}:' mapping under efficiency to update", field=f"efficiency.{under}")
        start = m0.end()
    pat = re.compile(rf"^(\s+{key}:\s*)([0-9.]+)([ \t]*)(#.*)?$", re.MULTILINE)
    m = pat.search(text, start)
    if not m:
        raise InputError(f"no '{key}:' line under efficiency to update", field=f"efficiency.{key}")
    old_comment = (m.group(4) or "").lstrip("# ").strip()
    calibrated = "calibrated" in old_comment and "before:" in old_comment
    if note is None:
        source = old_comment
        if calibrated:   # "calibrated ...; before: N (source)" -> "source"
            w = re.match(r"\s*[0-9.eE+-]+\s*(?:\((.*)\))?\s*$", old_comment.split("before:", 1)[1])
            source = (w.group(1) or "") if w else ""
        comment = f"# {source}" if source else ""
    else:
        comment = f"# {note}; before: {m.group(2)}" + (f" ({old_comment})" if old_comment else "")
        if calibrated:   # keep the first prior, not a chain of them
            comment = f"# {note}; before:" + old_comment.split("before:", 1)[1]
    return text[:m.start()] + f"{m.group(1)}{decimal(value)}  {comment}".rstrip() + text[m.end():]


def _set_term(text: str, name: str, value: float, note: str | None, scalar_gemm: bool) -> str:
    """`_replace_value` for one calibrated term by its name (gemm_fraction.<key>, kernel_floor_s in us, others)."""
    if name.startswith("gemm_fraction."):
        key = name.split(".", 1)[1]
        return (_replace_value(text, "gemm_fraction", value, note) if scalar_gemm and key == "default"
                else _replace_value(text, key, value, note, under="gemm_fraction"))
    if name == "kernel_floor_s":
        return _replace_value(text, "kernel_floor_us", value * 1e6, note)
    return _replace_value(text, name, value, note)


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


def write_hardware_calibration(path: Path, values: dict[str, float], provenance: dict,
                               priors: dict[str, float] | None = None) -> Path:
    """Set the fitted efficiency terms (`gemm_fraction.<dtype key>`, `memory_bandwidth_fraction`,
    `kernel_floor_s`, written in us) and a `calibration:` mapping; keep every comment. `priors`: terms the fit
    could not see, set back to the device's own prior with their source comment.

    The result is re-read with the strict loader; on any error the original file is restored.
    """
    original = path.read_text(encoding="utf-8")
    note = f"calibrated {provenance.get('date', '')} ({provenance.get('scope', '')}; {provenance.get('rows')} rows)"
    text = original
    scalar_gemm = re.search(r"^\s+gemm_fraction:\s*[0-9.]+", text, re.MULTILINE) is not None
    for name, value in values.items():
        text = _set_term(text, name, value, note, scalar_gemm)
    for name, value in (priors or {}).items():
        text = _set_term(text, name, value, None, scalar_gemm)
    text = _drop_block(text, "calibration").rstrip("\n") + "\n"
    text += "calibration:                   # written by `simengine calibrate` (docs/validation.md)\n"
    for k, v in provenance.items():
        entry = f"  {k}: {_scalar(v)}"
        note = PROVENANCE_NOTES.get(k, "the term's published prior, before calibration" if k.startswith("prior_")
                                    else "provenance")
        text += f"{entry:30s} # {note}\n"
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
