"""The composition root: from a scenario and an engine entry to what a run deploys (pools of replicas with their
deployment, engine and step-time model), with every check that can refuse it made before anything runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from simengine.config.dtypes import kv_bytes, resolve_compute_dtype, weight_format
from simengine.config.hardware import load_hardware
from simengine.config.loader import from_dict
from simengine.config.model import ModelSpec, load_model
from simengine.config.scenario import DeploymentConfig, EngineEntry, PoolConfig, Scenario
from simengine.core.request import Request
from simengine.cost.calibrated import apply_device_terms, apply_terms, read_engine_terms, trial_device_terms
from simengine.cost.measured import MeasuredKernels, systems
from simengine.cost.roofline import DeviceTerms, RooflineKernels
from simengine.cost.step import CostModel, Proposer
from simengine.cost.work import StepWork
from simengine.engines import ENGINES, EnginePolicy
from simengine.engines.memory import Deployment
from simengine.engines.speculative import NGRAM_LOOKUP_S, proposer_model
from simengine.errors import CannotRun, InputError
from simengine.sim.links import kv_path, place
from simengine.workload.config import shortest_prompt


def build_deployment(scenario: Scenario) -> Deployment:
    """Resolve hardware, model and dtypes of a scenario's deployment (InputError on unknown names or impossible
    combos)."""
    return resolve_deployment(scenario.deployment)


def resolve_deployment(d: DeploymentConfig, pool: PoolConfig | None = None, at: str = "") -> Deployment:
    """Resolve one deployment: a scenario's, or a pool's (`pool`, declared at `at`, e.g. pools[1]); a message names
    the pool's field where the pool set it, else the deployment's."""
    def field_of(key: str) -> str:
        return f"{at}.{key}" if pool is not None and getattr(pool, key) is not None else f"deployment.{key}"

    hw = load_hardware(d.hardware, field=field_of("hardware"))
    model = load_model(d.model, field=field_of("model"))
    fmt = weight_format(d.weight_dtype)
    kv_name = d.kv_dtype if d.kv_dtype != "auto" else ("bf16" if fmt.bytes_per_param <= 2 else fmt.name)
    if d.tp > 1 and model.num_heads % d.tp:
        valid = [t for t in range(1, max(hw.node_size, 1) + 1) if model.num_heads % t == 0]
        raise InputError(f"tp={d.tp} does not divide {model.name}'s {model.num_heads} attention heads; use one that "
                         f"does: {', '.join(map(str, valid))}", field=field_of("tp"))
    if d.pp > model.num_layers:
        raise InputError(f"pp={d.pp} exceeds {model.name}'s {model.num_layers} layers", field=field_of("pp"))
    if d.tp * d.pp > 1 and hw.link_bandwidth_bytes_s <= 0:
        raise InputError(f"{hw.name} has no device-to-device link (interconnect: none), so tp x pp must be 1; "
                         f"use one device per replica and more replicas", field=field_of("tp"))
    if d.tp * d.pp > hw.node_size:
        raise InputError(f"tp x pp = {d.tp * d.pp} exceeds {hw.name}'s node of {hw.node_size} devices linked by "
                         f"{hw.link_bandwidth_bytes_s / 1e9:.0f} GB/s; use at most {hw.node_size} per replica",
                         field=field_of("tp"))
    if d.expert_parallel and not model.is_moe:
        raise InputError(f"expert_parallel needs a mixture-of-experts model; {model.name} is dense",
                         field=field_of("expert_parallel"))
    if d.attention_dp and not model.is_moe:
        raise InputError(f"attention_dp needs a mixture-of-experts model; {model.name} is dense, so each rank would "
                         f"hold the whole model: use replicas instead", field=field_of("attention_dp"))
    if d.attention_dp and d.tp < 2:
        raise InputError("attention_dp spreads the experts over the tp devices and runs attention data-parallel on "
                         "them; set tp to 2 or more", field=field_of("tp"))
    return Deployment(model=model, hardware=hw, weight_format=fmt, kv_dtype=kv_name, kv_elem_bytes=kv_bytes(kv_name),
                      tp=d.tp, pp=d.pp, expert_parallel=d.expert_parallel or d.attention_dp,
                      attention_dp=d.attention_dp)


def build_engine(entry: EngineEntry, dep: Deployment) -> EnginePolicy:
    """Instantiate an engine policy with validated params; refuse hardware it does not run on."""
    cls = ENGINES.get(entry.engine, field="engines")
    at = f"engines[{entry.display}].params"
    params = from_dict(cls.Params, entry.params, source="scenario", field=at)
    hw = dep.hardware
    if dep.attention_dp and not cls.supports_attention_dp:
        ok = [n for n in ENGINES.names() if ENGINES.get(n).supports_attention_dp]
        raise CannotRun(f"{entry.engine} has no attention data parallelism; engines that do: {', '.join(ok)}",
                        field="deployment.attention_dp")
    if dep.expert_parallel and not cls.supports_expert_parallel:
        ok = [n for n in ENGINES.names() if ENGINES.get(n).supports_expert_parallel]
        raise CannotRun(f"{entry.engine} has no expert parallelism; engines that do: {', '.join(ok)}",
                         field="deployment.expert_parallel")
    if not cls.runs_on(hw):
        ok = [n for n in ENGINES.names() if ENGINES.get(n).runs_on(hw)]
        raise CannotRun(f"{entry.engine} does not run on {hw.name} ({hw.vendor} {hw.device_class}); engines "
                         f"that do: {', '.join(ok) or 'none'}", field="engines")
    try:
        return cls(params, dep)
    except InputError as exc:   # a knob the engine checks against the deployment: name it under the engine's params
        top = (exc.field or "").split(".")[0].split("[")[0]
        if top in ("deployment", "engines", "workload"):
            raise
        raise type(exc)(exc.message, source=exc.source, field=f"{at}.{exc.field}" if exc.field else at) from None


def cost_model(engine: EnginePolicy, grammar_mask_s: float = 0.0, *, kernels: str = "auto") -> CostModel:
    """The step-time model of an engine's own deployment (its KV dtype may differ, e.g. LMDeploy quant_policy):
    measured kernels of the engine's backend where the device has tables and `kernels` is auto, else the roofline
    at the device's physical terms; the engine's timing with its calibrated terms from
    simengine/engines/calibration.yaml (`simengine calibrate`, docs/validation.md) in place of its priors."""
    engine.timing = timing = apply_terms(engine.timing, read_engine_terms().get(engine.name, {}))
    d = engine.dep
    work = StepWork(d.model, d.hardware, weight_format=d.weight_format, kv_elem_bytes=d.kv_elem_bytes, tp=d.tp,
                    pp=d.pp, expert_parallel=d.expert_parallel, attention_dp=d.attention_dp,
                    engine_gemm_flops_s=engine.engine_gemm_flops_s(),
                    engine_attention_flops_s=engine.engine_attention_flops_s(),
                    expert_tile_columns=engine.expert_tile_columns(), decode_kv_reads=engine.decode_kv_reads(),
                    dequantize_above_tokens=engine.dequantize_above_tokens(),
                    unfused_attention=engine.unfused_attention(), layer_kernels=engine.layer_kernels())
    hw = apply_device_terms(d.hardware, trial_device_terms(d.hardware.name))
    gpu = _kernels(work, hw, engine, timing, kernels)
    proposer = None
    spec = engine.speculation
    if spec is not None:
        draft = proposer_model(spec, d.model)
        if draft is None:
            proposer = Proposer(None, NGRAM_LOOKUP_S)
        else:
            draft_work = StepWork(draft, d.hardware, weight_format=d.weight_format, kv_elem_bytes=d.kv_elem_bytes,
                                  tp=d.tp, pp=1, expert_parallel=d.expert_parallel, attention_dp=d.attention_dp)
            draft_timing = dataclasses.replace(timing, scheduler_cpu_s=0.0, output_cpu_s=0.0, seq_cpu_s=0.0)
            proposer = Proposer(CostModel(_kernels(draft_work, hw, engine, draft_timing, kernels), draft_timing),
                                batched=spec.batched_drafts)
    return CostModel(gpu, timing, grammar_mask_s=grammar_mask_s, proposer=proposer)


def _kernels(work: StepWork, hw, engine: EnginePolicy, timing, kernels: str) -> RooflineKernels:
    """Measured kernels of the engine's backend where the device has tables and `kernels` is auto, else the
    roofline at the device's physical terms."""
    # attention DP's gathers and scatters of the group's tokens go through the collective library
    custom = timing.custom_allreduce and not work.attention_dp
    terms = DeviceTerms.of(work, hw, custom_allreduce=custom)
    system, backend = hw.kernel_tables, engine.kernel_backend
    if kernels == "auto" and system and backend and system in systems():
        return MeasuredKernels(work, terms, system=system, backend=backend, custom_allreduce=custom)
    return RooflineKernels(work, terms)


@dataclass(frozen=True)
class Pool:
    """One pool of a run: `count` identical replicas numbered from `first` (the run's replica indices)."""

    name: str
    role: str                   # mixed | prefill | decode
    config: DeploymentConfig    # the scenario's deployment with the pool's own fields
    dep: Deployment
    entry: EngineEntry          # the engine its replicas run
    first: int
    count: int
    where: str                  # where in the scenario it was declared (for messages)

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.count)

    @property
    def num_devices(self) -> int:
        return self.dep.num_devices * self.count


def _prompt_field(scenario: Scenario) -> str:
    """The workload field that sets the shortest prompt (shortest_prompt's cases)."""
    wl = scenario.workload
    return ("workload.sessions.user_tokens" if wl.sessions is not None else
            "workload.documents.tokens" if wl.documents is not None else "workload.input_tokens")


def check_prompts_fit(scenario: Scenario, model: ModelSpec) -> None:
    """Refuse a workload none of whose prompts fits the model's context (every request would be refused); a
    workload with some prompts too long runs, and those requests fail as the engine refuses them."""
    shortest, context = shortest_prompt(scenario.workload), model.max_model_len
    if shortest is not None and shortest + 1 > context:
        raise InputError(f"every prompt is at least {shortest:,} tokens (shared prefix included) and {model.name}'s "
                         f"context is {context:,} tokens, so every request would be refused; draw prompts below "
                         f"{context:,} tokens or serve a model with a longer context", field=_prompt_field(scenario))


def check_engine_admits(scenario: Scenario, engine: EnginePolicy, where: str) -> None:
    """Refuse an engine configuration that refuses even the workload's shortest prompt with one output token
    (its context knobs, or a KV pool too small for it): every request would fail."""
    shortest = shortest_prompt(scenario.workload)
    if shortest is None:
        return
    probe = Request(-1, 0.0, np.zeros(shortest, dtype=np.int32), shortest, 1)
    reason = engine.refusal(probe)
    if reason is not None:
        raise CannotRun(f"{engine.name} refuses even the shortest prompt ({reason}), so every request would fail; "
                        f"raise that limit (or the memory behind it) or draw shorter prompts "
                        f"({_prompt_field(scenario)})", field=where)


def plan_pools(scenario: Scenario, entry: EngineEntry) -> list[Pool]:
    """The pools a run of `entry` deploys, resolved and checked: the first-hop pools (mixed, or prefill) numbered
    first, then the decode pools. Raises InputError on a bad layout and CannotRun when an engine cannot serve a pool
    (too little memory, unsupported hardware or role), naming the pool."""
    configs = scenario.pools_of(entry)
    index = next((i for i, e in enumerate(scenario.engines) if e is entry or e == entry), entry.display)
    where = f"engines[{index}].pools" if entry.pools else "pools" if scenario.pools else "deployment"
    roles = {c.role for c in configs}
    if "mixed" in roles and len(roles) > 1:
        raise InputError("pools are either all mixed, or prefill and decode pools (disaggregation); give every pool "
                         "role: mixed, or none", field=f"{where}[].role")
    if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
        missing = ({"prefill", "decode"} - roles).pop()
        raise InputError(f"a disaggregated cluster needs a {missing} pool as well", field=f"{where}[].role")
    disaggregated = roles == {"prefill", "decode"}
    if disaggregated and scenario.deployment.failures is not None:
        raise InputError("replica failures are not modelled with prefill/decode pools; drop deployment.failures or "
                         "use mixed pools", field="deployment.failures")
    order = sorted(range(len(configs)), key=lambda i: configs[i].role == "decode")  # first hop first (stable)
    pools, first, names = [], 0, set()
    for i in order:
        c: PoolConfig = configs[i]
        at = f"{where}[{i}]" if where != "deployment" else "deployment"
        d = c.deployment(scenario.deployment)
        dep = resolve_deployment(d, c, at) if where != "deployment" else resolve_deployment(d)
        e = entry if c.engine is None else EngineEntry(engine=c.engine, label=entry.label, params=c.params)
        name = c.name or (c.role if len(configs) > 1 else "main")
        if name in names:
            raise InputError(f"two pools are named '{name}'; give each a distinct name", field=f"{at}.name")
        names.add(name)
        count = d.num_schedulers
        pools.append(Pool(name, c.role, d, dep, e, first, count, at))
        first += count
    models = {p.dep.model.name for p in pools}
    if len(models) > 1:
        raise InputError(f"every pool serves the same model (requests are tokenised once), got {sorted(models)}",
                         field=f"{where}[].model")
    check_prompts_fit(scenario, pools[0].dep.model)
    for p in pools:
        try:
            eng = build_engine(p.entry, p.dep)
        except CannotRun as exc:
            raise CannotRun(f"pool '{p.name}': {exc.message}" if len(pools) > 1 else exc.message,
                            field=exc.field) from None
        try:   # the engine's own weights (vLLM runs FP8 weight-only where the device has no FP8 units)
            resolve_compute_dtype(eng.dep.weight_format, eng.dep.hardware.peak_flops, eng.dep.hardware.name)
        except InputError as exc:
            raise CannotRun(f"{p.entry.engine}: {exc.message}", field=exc.field) from None
        if p.role != "decode":   # a decode pool takes prompts already computed elsewhere
            check_engine_admits(scenario, eng, f"engines[{p.entry.display}].params")
        if scenario.workload.lora is not None and not eng.serves_lora():
            ok = [n for n in ENGINES.names()
                  if "enable_lora" in {f.name for f in dataclasses.fields(ENGINES.get(n).Params)}]
            # (SGLang also needs max_lora_rank: its own InputError says so when enable_lora is set without it)
            hint = ("set enable_lora: true in its params" if p.entry.engine in ok else
                    f"engines that model multi-LoRA serving: {', '.join(ok)}")
            raise CannotRun(f"the workload names LoRA adapters (workload.lora) and {p.entry.engine} does not serve "
                            f"them as configured; {hint}", field="engines")
        if p.role != "mixed" and p.role not in eng.disaggregation_roles:
            ok = [n for n in ENGINES.names() if p.role in ENGINES.get(n).disaggregation_roles]
            raise CannotRun(f"pool '{p.name}': {p.entry.engine} has no {p.role} role for prefill/decode "
                            f"disaggregation here; engines that do: {', '.join(ok)}", field=f"{p.where}.engine")
    if disaggregated:   # every prefill -> decode path must exist (KV leaving a node needs a network)
        placed = place(pools)
        for src in pools:
            for dst in pools:
                if src.role == "prefill" and dst.role == "decode":
                    for i in src.indices:
                        for j in dst.indices:
                            kv_path(src, dst, placed[i], placed[j])
    return pools
