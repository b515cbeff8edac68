"""User-facing input errors: one line naming the file, the field and the fix; the CLI exits 2 on them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class InputError(ValueError):
    """Bad user input. `str(err)` is the single line the CLI prints."""

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        prefix = ""
        if source:
            prefix += f"{source}: "
        if field:
            prefix += f"{field}: "
        super().__init__(prefix + message)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_name(kind: str, name: str, valid: Iterable[str], *, source: str | None = None,
                 field: str | None = None) -> InputError:
    """An InputError for an unknown engine/hardware/model/key name, listing the valid ones."""
    valid = sorted(valid)
    return InputError(
        f"unknown {kind} '{name}'{did_you_mean(name, valid)}; valid: {', '.join(valid)}",
        source=source, field=field,
    )
