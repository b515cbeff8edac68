"""The scenario file: a workload, a deployment, the engines to compare and the SLOs (data only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simengine.config.hardware import REPO_ROOT
from simengine.config.loader import apply_overrides, from_dict, load_yaml
from simengine.config.slo import SloConfig
from simengine.errors import InputError, unknown_name
from simengine.workload.config import WorkloadConfig

SCENARIOS_DIR = REPO_ROOT / "scenarios"


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig:
    """What serves the workload: `replicas` copies of `model` on tp x pp devices of `hardware`."""

    hardware: str
    model: str
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"          # auto = the weight's 16-bit activation dtype (fp8 weights keep a 16-bit KV)
    tp: int = 1
    pp: int = 1
    replicas: int = 1
    router: str = "least_loaded"    # least_loaded | round_robin

    def __post_init__(self):
        for k in ("tp", "pp", "replicas"):
            v = getattr(self, k)
            if v < 1 or v > 1024:
                raise InputError(f"must be an integer in 1..1024, got {v}", field=f"deployment.{k}")
        if self.router not in ("least_loaded", "round_robin"):
            raise unknown_name("router", self.router, ("least_loaded", "round_robin"), field="deployment.router")


@dataclass(frozen=True, kw_only=True)
class EngineEntry:
    """One engine to run: its registry name, a label for tables, and knob overrides."""

    engine: str
    label: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def display(self) -> str:
        return self.label or self.engine

    @classmethod
    def from_name(cls, name: str) -> EngineEntry:
        return cls(engine=name)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A whole experiment. See docs/scenarios.md."""

    name: str
    description: str = ""
    seed: int = 0
    horizon_s: float = 300.0        # arrivals stop here
    drain_s: float = 600.0          # then the engines drain for at most this long; what is left is unfinished
    deployment: DeploymentConfig
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engines: list[EngineEntry] = field(default_factory=lambda: [EngineEntry(engine="vllm")])
    slo: SloConfig = field(default_factory=SloConfig)

    def __post_init__(self):
        for k in ("horizon_s", "drain_s"):
            v = getattr(self, k)
            if not math.isfinite(v) or v < 0:
                raise InputError(f"must be a finite number >= 0, got {v}", field=k)
        if self.horizon_s == 0 and self.workload.num_requests is None and self.workload.arrival.process != "offline":
            raise InputError("horizon_s is 0 and num_requests is unset: nothing would arrive", field="horizon_s")
        if not self.engines:
            raise InputError("list at least one engine", field="engines")
        labels = [e.display for e in self.engines]
        dup = {x for x in labels if labels.count(x) > 1}
        if dup:
            raise InputError(f"engine labels must be unique; give a label to repeated {sorted(dup)}", field="engines")


def scenario_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SCENARIOS_DIR.glob("*.yaml"))}


def resolve_scenario_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.exists():
            raise InputError(f"scenario file '{name_or_path}' not found", field="SCENARIO")
        return p
    files = scenario_files()
    if name_or_path not in files:
        raise unknown_name("scenario", name_or_path, files, field="SCENARIO")
    return files[name_or_path]


def load_scenario(name_or_path: str, overrides: list[str] | None = None) -> Scenario:
    """Load a scenario by name (scenarios/<name>.yaml) or path, with dotted --set overrides applied."""
    path = resolve_scenario_path(name_or_path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise InputError("a scenario must be a YAML mapping", source=str(path))
    data = apply_overrides(data, overrides or [])
    data.setdefault("name", path.stem)
    return from_dict(Scenario, data, source=str(path))


