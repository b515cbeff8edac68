"""Service-level objectives (used by the scenario and by request classes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from simengine.config.loader import Checked, Range

Milliseconds = Annotated[float, Range(0, 1e9, above=True, unit="milliseconds")]


@dataclass(frozen=True, kw_only=True)
class SloConfig(Checked):
    """A request is good if it meets every objective given (vLLM --goodput semantics; TPOT of 1-token outputs is 0)."""

    ttft_ms: Milliseconds | None = None
    tpot_ms: Milliseconds | None = None
    e2el_ms: Milliseconds | None = None

    @property
    def any(self) -> bool:
        return any(x is not None for x in (self.ttft_ms, self.tpot_ms, self.e2el_ms))
