"""User-facing input errors: one line naming the file, the field and the fix; the CLI exits 2 on them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class InputError(ValueError):
    """Bad user input. `str(err)` is the single line the CLI prints."""

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.message = message
        self.source = source
        self.field = field
        prefix = ""
        if source:
            prefix += f"{source}: "
        if field:
            prefix += f"{field}: "
        super().__init__(prefix + message)

    def located(self, source: str | None, field: str | None) -> InputError:
        """This error with `source` filled in if it had none and its field placed under the `field` path.

        A field that already names its full path (e.g. 'workload.sessions.population' raised inside the
        workload section) is kept; a relative one ('value' raised by a distribution) is prefixed.
        """
        if (source is None or self.source is not None) and not field:
            return self
        return InputError(self.message, source=self.source or source, field=qualify(field, self.field))


class CannotRun(InputError):
    """A valid request the deployment cannot serve with this engine: the model does not fit in memory, or the
    engine does not run on the device. A comparison lists the engine with this reason and runs the others."""


def qualify(path: str | None, inner: str | None) -> str | None:
    """Join a containing field path and a field named by a nested check, without naming a level twice."""
    if not path or not inner:
        return inner or path
    if inner == path or inner.startswith((path + ".", path + "[")):
        return inner
    head = inner.split(".")[0].split("[")[0]
    parts = path.split(".")
    if head == parts[0].split("[")[0]:
        return inner  # already a full path from the top of the file
    if parts[-1].split("[")[0] == head:
        return ".".join(parts[:-1] + [inner])  # 'slo.ttft_ms' raised by an SLO under 'workload.classes[0].slo'
    return f"{path}.{inner}"


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
