"""The scenario file: a workload, a deployment, the engines to compare and the SLOs (data only)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from simengine.config.hardware import REPO_ROOT
from simengine.config.loader import Checked, Range, apply_overrides, from_dict, load_yaml
from simengine.config.slo import SloConfig
from simengine.errors import InputError, unknown_name
from simengine.workload.config import MAX_REQUESTS, WorkloadConfig

SCENARIOS_DIR = REPO_ROOT / "scenarios"

# Scenario names and engine labels become folder names under results/ and plots/: no separators, no '..'.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
# Bounds past which a value is a typo, not an experiment: the run would not finish (or not fit in memory).
MAX_SIM_SECONDS = 1e7          # ~116 days of simulated time: horizon_s when no request count bounds the run
SimSeconds = Annotated[float, Range(0, 1e12, unit="seconds of simulated time")]
Devices = Annotated[int, Range(1, 1024, unit="devices")]


@dataclass(frozen=True, kw_only=True)
class FailureAt(Checked):
    """One stated failure: replica `replica` goes down at `time_s` for `down_s` seconds."""

    time_s: SimSeconds
    replica: Annotated[int, Range(0, 1023)] = 0
    down_s: Annotated[float, Range(0, 1e9, above=True, unit="seconds")] = 60.0


@dataclass(frozen=True, kw_only=True)
class FailureConfig(Checked):
    """Replica failures (docs/scenarios.md 'Failures'): stated ones (`at`) and/or a random process per replica
    (exponential times between failures with mean `mtbf_s`, to repair with mean `mttr_s`). A failed replica loses
    its KV cache and every request it holds; each is resent to another replica up to `max_retries` times (its TTFT
    and E2E keep counting from the first send), then fails; the router sends nothing to a replica that is down."""

    mtbf_s: Annotated[float, Range(0, 1e12, above=True, unit="seconds")] | None = None
    mttr_s: Annotated[float, Range(0, 1e9, above=True, unit="seconds")] = 60.0
    at: list[FailureAt] = field(default_factory=list)
    max_retries: Annotated[int, Range(0, 100, unit="retries")] = 1


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig(Checked):
    """What serves the workload: `replicas` copies of `model` on tp x pp devices of `hardware`."""

    hardware: str
    model: str
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"          # auto = the weight's 16-bit activation dtype (fp8 weights keep a 16-bit KV)
    tp: Devices = 1
    pp: Devices = 1
    replicas: Devices = 1
    router: str = "least_loaded"    # a name from `simengine list routers` (docs/cluster.md)
    router_params: dict[str, Any] = field(default_factory=dict)  # that router's knobs, by their real names
    # the router reads replica state from load reports sent every this many seconds (0: live state), and each of
    # its decisions delays the request this long (both only with several replicas)
    router_state_delay_s: Annotated[float, Range(0, 1e6, unit="seconds")] = 0.0
    router_decision_s: Annotated[float, Range(0, 1e3, unit="seconds")] = 0.0
    expert_parallel: bool = False   # MoE experts spread over the tp devices (vLLM --enable-expert-parallel,
                                    # SGLang --ep-size, TRT-LLM moe_expert_parallel_size) instead of TP-sliced
    # attention data parallelism for MoE models (TRT-LLM enable_attention_dp, SGLang --enable-dp-attention, vLLM
    # --data-parallel-size with --enable-expert-parallel): each of the tp devices schedules its own requests and
    # attends over them with every head; the routed experts are spread over the tp devices (docs/cluster.md)
    attention_dp: bool = False
    cost_model: Literal["auto", "roofline"] = "auto"  # auto: measured kernels where tables exist (docs/cost-model.md)
    failures: FailureConfig | None = None
    # prefill/decode pools (docs/cluster.md 'Disaggregation'): the KV moves once the prefill is done, or streams
    # layer by layer while it computes (Mooncake, DistServe), the decode side reserving its blocks when it starts
    kv_transfer: Literal["after_prefill", "layerwise"] = "after_prefill"

    @property
    def num_schedulers(self) -> int:
        """Replicas behind the router: one per tp x pp group, or with attention DP one per rank of each group."""
        return self.replicas * (self.tp if self.attention_dp else 1)

    def __post_init__(self):
        super().__post_init__()
        from simengine.routers.base import router_and_params

        router_and_params(self.router, self.router_params, at="deployment.")
        count = self.num_schedulers
        for i, f in enumerate(self.failures.at if self.failures else []):
            if f.replica >= count:
                raise InputError(f"replica {f.replica} does not exist: the deployment has {count} "
                                 f"(0..{count - 1})", field=f"deployment.failures.at[{i}].replica")


# DeploymentConfig fields a pool may set for itself (the others are the cluster's: router timing, failures, ...)
POOL_FIELDS = ("hardware", "model", "weight_dtype", "kv_dtype", "tp", "pp", "replicas", "expert_parallel",
               "attention_dp", "router", "router_params", "kv_transfer")


@dataclass(frozen=True, kw_only=True)
class PoolConfig(Checked):
    """A group of identical replicas (docs/cluster.md 'Pools'): the deployment's fields it does not set, its role,
    and optionally its own engine (else the engine of the run)."""

    name: str = ""
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    engine: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    hardware: str | None = None
    model: str | None = None
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    tp: Devices | None = None
    pp: Devices | None = None
    replicas: Devices | None = None
    expert_parallel: bool | None = None
    attention_dp: bool | None = None
    router: str | None = None           # the tier's router is its first pool's (mixed/prefill, and decode)
    router_params: dict[str, Any] | None = None
    kv_transfer: Literal["after_prefill", "layerwise"] | None = None   # a prefill pool's way of sending KV

    def __post_init__(self):
        super().__post_init__()
        if self.router is not None:
            from simengine.routers.base import router_and_params

            router_and_params(self.router, self.router_params or {}, at="")

    def deployment(self, base: DeploymentConfig) -> DeploymentConfig:
        """The deployment this pool runs: `base` with the fields the pool sets."""
        import dataclasses

        mine = {k: getattr(self, k) for k in POOL_FIELDS if getattr(self, k) is not None}
        if "router" in mine and "router_params" not in mine:
            mine["router_params"] = {}   # another router's knobs do not carry over
        return dataclasses.replace(base, **mine, failures=None) if mine or base.failures else base


@dataclass(frozen=True, kw_only=True)
class EngineEntry:
    """One engine to run: its registry name, a label for tables, knob overrides, and optionally its own pools
    (a cluster layout compared side by side with the others, e.g. disaggregated against colocated)."""

    engine: str
    label: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    pools: list[PoolConfig] | None = None

    @property
    def display(self) -> str:
        return self.label or self.engine

    @classmethod
    def from_name(cls, name: str) -> EngineEntry:
        return cls(engine=name)


@dataclass(frozen=True, kw_only=True)
class OutputConfig(Checked):
    """What the result files hold beyond the defaults."""

    # Requests (the first N by id) whose every token time is kept for the per-request lists of
    # vllm_bench_serve.json (ttfts, itls, latencies...). 1000 is `vllm bench serve`'s default --num-prompts
    # (vllm/benchmarks/serve.py). Statistics always cover every request; this bounds memory and file size.
    detailed_requests: Annotated[int, Range(0, 10_000_000, unit="requests")] = 1000


@dataclass(frozen=True, kw_only=True)
class Scenario(Checked):
    """A whole experiment. See docs/scenarios.md."""

    name: str
    description: str = ""
    seed: Annotated[int, Range(0, 2**63 - 1)] = 0
    horizon_s: SimSeconds = 300.0   # arrivals stop here
    drain_s: SimSeconds = 600.0     # then the engines drain for at most this long; what is left is unfinished
    deployment: DeploymentConfig
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engines: list[EngineEntry] = field(default_factory=lambda: [EngineEntry(engine="vllm")])
    slo: SloConfig = field(default_factory=SloConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    pools: list[PoolConfig] | None = None   # the cluster of every engine entry without pools of its own
    # run the reference path alone: none of the simulator's speed devices (the decode cohort and deferred block
    # publishing, closed-form repeated steps, private-token marking); the results are identical, only slower
    # (docs/performance.md 'Exact mode')
    exact: bool = False

    def pools_of(self, entry: EngineEntry) -> list[PoolConfig]:
        """The pools a run of `entry` deploys: its own, else the scenario's, else one mixed pool (the deployment)."""
        return entry.pools or self.pools or [PoolConfig()]

    def __post_init__(self):
        super().__post_init__()
        if not SAFE_NAME.match(self.name):
            raise InputError(f"'{self.name}' is used as a folder name: use letters, digits, '.', '_', '+' or '-' "
                             "(no '/', no spaces, not starting with '.')", field="name")
        if self.horizon_s > MAX_SIM_SECONDS and (self.workload.num_requests is None or self.workload.sessions):
            # with num_requests a long horizon only means "no time limit"; otherwise the run would not end
            raise InputError(f"{self.horizon_s:g} s is beyond any experiment (limit {MAX_SIM_SECONDS:g} s, ~116 days); "
                             "give seconds of simulated time, or set workload.num_requests", field="horizon_s")
        if self.horizon_s == 0 and self.workload.num_requests is None and self.workload.arrival.process != "offline":
            raise InputError("horizon_s is 0 and num_requests is unset: nothing would arrive", field="horizon_s")
        if not self.engines:
            raise InputError("list at least one engine", field="engines")
        labels = [e.display for e in self.engines]
        dup = {x for x in labels if labels.count(x) > 1}
        if dup:
            raise InputError(f"engine labels must be unique; give a label to repeated {sorted(dup)}", field="engines")
        for i, e in enumerate(self.engines):
            if not SAFE_NAME.match(e.display):
                raise InputError(f"'{e.display}' is used as a folder name: use letters, digits, '.', '_', '+' or '-'",
                                 field=f"engines[{i}].label")
        _check_scale(self)


def _check_scale(sc: Scenario) -> None:
    """Reject workloads whose size is a typo (1e12 req/s over a day): they would never finish. (Each field's own
    range is declared on its type; this checks what only their product shows.)"""
    wl = sc.workload
    arr = wl.arrival
    if getattr(wl, "trace", None) is not None or wl.sessions is not None:
        return
    if arr.process == "offline":
        if wl.num_requests is None:
            raise InputError("offline arrivals put every request at t=0, so the count must be given; set "
                             "workload.num_requests", field="workload.num_requests")
        return
    if arr.process == "closed_loop" or arr.rate is None:
        return
    window = sc.horizon_s if wl.num_requests is None else sc.horizon_s + sc.drain_s
    expected = min(arr.rate * window, wl.num_requests or math.inf)
    if expected > MAX_REQUESTS:
        raise InputError(f"{arr.rate:g} req/s over {window:g} s is ~{expected:.3g} requests, beyond what a run can "
                         f"simulate (limit {MAX_REQUESTS:g}); lower the rate or horizon_s, or set num_requests",
                         field="workload.arrival.rate")


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
        if p.exists() and (p.is_dir() or p.suffix or "/" in name_or_path):
            what = "a folder" if p.is_dir() else "not a YAML file"
            raise InputError(f"'{name_or_path}' is {what}; give a scenario name (simengine list scenarios) or a "
                             ".yaml file", field="SCENARIO")
        raise unknown_name("scenario", name_or_path, files, field="SCENARIO")
    return files[name_or_path]


def load_scenario(name_or_path: str, overrides: list[str] | None = None) -> Scenario:
    """Load a scenario by name (scenarios/<name>.yaml) or path, with dotted --set overrides applied. Overrides
    name a variant: its name is the scenario's plus the overrides (unless one sets `name`), so its results go
    beside the baseline's instead of over them."""
    path = resolve_scenario_path(name_or_path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise InputError("a scenario must be a YAML mapping", source=str(path))
    base = data.get("name", path.stem)
    data = apply_overrides(data, overrides or [])
    if overrides and data.get("name", path.stem) == base:
        data["name"] = f"{base}--{variant_slug(overrides)}"
    data.setdefault("name", path.stem)
    try:
        scenario = from_dict(Scenario, data, source=str(path))
        check_engines(scenario, source=str(path))
    except InputError as exc:   # a value an override set: say so, beside the file
        culprit = _override_of(exc.field, overrides or [])
        if culprit is None:
            raise
        raise type(exc)(exc.message, source=f"{path} (--set {culprit})", field=exc.field) from None
    return scenario


def _override_of(field: str | None, overrides: list[str]) -> str | None:
    """The last --set KEY=VALUE whose key path holds `field` or lies inside it, or None."""
    import re

    if not field:
        return None
    at = re.sub(r"\[(\w+)\]", r".\1", field)
    for o in reversed(overrides):
        key = o.split("=", 1)[0].strip()
        if at == key or at.startswith(key + ".") or key.startswith(at + "."):
            return o
    return None


def variant_slug(overrides: list[str]) -> str:
    """A folder-safe name for a list of KEY=VALUE overrides: KEY-VALUE joined by '+', other characters '_' (long
    ones shortened with a hash of the whole)."""
    import hashlib
    import re

    parts = [re.sub(r"[^A-Za-z0-9._-]+", "_", o.replace("=", "-", 1)).strip("_").replace("-_", "-") for o in overrides]
    slug = "+".join(parts)
    if len(slug) > 80:
        slug = f"{slug[:60]}-{hashlib.sha1(','.join(overrides).encode()).hexdigest()[:10]}"
    return slug


def check_engines(scenario: Scenario, *, source: str) -> None:
    """Validate each engine name and its `params:` against the engine's own params dataclass, naming the file."""
    from simengine.engines import ENGINES  # engines import config modules; import them only when loading

    for i, e in enumerate(scenario.engines):
        if e.engine not in ENGINES.names():
            raise unknown_name("engine", e.engine, ENGINES.names(), source=source, field=f"engines[{i}].engine")
        if not isinstance(e.params, dict):
            raise InputError(f"expected a mapping of {e.engine} knobs, got {type(e.params).__name__}",
                             source=source, field=f"engines[{i}].params")
        from_dict(ENGINES.get(e.engine).Params, e.params, source=source, field=f"engines[{i}].params")
    for where, pools in [("pools", scenario.pools)] + [(f"engines[{i}].pools", e.pools)
                                                       for i, e in enumerate(scenario.engines)]:
        for j, pool in enumerate(pools or []):
            if pool.engine is None:
                continue
            if pool.engine not in ENGINES.names():
                raise unknown_name("engine", pool.engine, ENGINES.names(), source=source, field=f"{where}[{j}].engine")
            from_dict(ENGINES.get(pool.engine).Params, pool.params, source=source, field=f"{where}[{j}].params")


