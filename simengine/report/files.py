"""Files written whole: under a hidden temporary name, renamed into place when complete (an interrupt or a
failure leaves the previous file or none, never a partial one)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_whole(path: Path, fill: Callable[[Path], object]) -> Path:
    """Call fill(temporary path), then rename it to `path`; the temporary file never outlives the call."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")   # keeps the suffix: savefig picks the format by it
    try:
        fill(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
