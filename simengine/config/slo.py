"""Service-level objectives (used by the scenario and by request classes)."""

from __future__ import annotations

from dataclasses import dataclass

from simengine.errors import InputError


@dataclass(frozen=True, kw_only=True)
class SloConfig:
    """A request is good if it meets every objective given (vLLM --goodput semantics; TPOT of 1-token outputs is 0)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self):
        for k in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, k)
            if v is not None and not v > 0:
                raise InputError(f"must be > 0 ms, got {v}", field=f"slo.{k}")

    @property
    def any(self) -> bool:
        return any(x is not None for x in (self.ttft_ms, self.tpot_ms, self.e2el_ms))
