"""Turn a measurement row into the experiment it describes, or a skip with the reason (never a guess).

Two kinds of experiment:
- `step`: prefill_ms, decode_step_ms (Splitwise semantics: one forward of the batch) and prefill_tok_s,
  decode_tok_s (llama-bench semantics: ubatches of 512 prompt tokens; N single-token decode steps) are priced
  directly by the cost model with the engine's timing, from batch shapes the engine itself builds;
- `sim`: throughput and latency metrics run the engine in the simulator on the row's request stream.

Offline throughput rows with many requests are simulated with WAVES x the engine's steady-state concurrency
(`capped_requests`) and half that, and extrapolated at the steady-state rate (run.py `_offline_rate`); the cap
and its effect are documented in docs/validation.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from simengine.config.loader import from_dict
from simengine.config.model import load_model
from simengine.config.scenario import EngineEntry, Scenario
from simengine.engines import ENGINES
from simengine.errors import InputError
from simengine.validate.bench_tools import engine_params
from simengine.validate.measurements import RATE_METRICS, STEP_METRICS, Measurement
from simengine.workload.datasets import SHAREGPT_BOUNDS, SHAREGPT_MEANS

ENGINE_OF_ROW = {"unknown": "generic"}   # a row whose stack is not stated runs the documented generic engine
LLAMA_BENCH_UBATCH = 512   # llama-bench defaults -b 2048 -ub 512 (tools/llama-bench/llama-bench.cpp)
WAVES = 4                  # offline rows: simulate at most this many steady-state batches of requests (and half)
MIN_SIMULATED = 200        # ... but never fewer requests than this (or all of them)
OPEN_LOOP_CAP = 2000       # poisson/concurrency rows without a request count: this many requests
# ShareGPT token counts depend on the tokenizer: the sampler's means with Llama-2's 32k-vocabulary tokenizer are
# about 247 in / 233 out (LMDeploy docs/en/benchmark/a100_fp16.md: token over request throughput of its Llama-2
# 13B and 70B runs), with Llama-3's 128k tokenizer 202 / 179 (vLLM v0.6.0 blog). Used when a row states none.
SHAREGPT_MEANS_32K_VOCAB = (247.0, 233.0)
_STATED_MEANS = (re.compile(r"input\D{0,12}?(\d+)\s*/\s*output\D{0,12}?(\d+)"),   # "avg input 202 / output 179"
                 re.compile(r"(\d+)\s*input\s*/\s*(\d+)\s*output"))          # "~462 input / 256 output"


@dataclass(frozen=True)
class Skip:
    """A row that cannot run, and why."""

    row: Measurement
    reason: str


@dataclass(frozen=True)
class Experiment:
    """What to run for one row. `scenario` carries the deployment (and, for `sim`, the workload)."""

    row: Measurement
    kind: str                       # "step" | "sim"
    engine: str                     # registry name
    scenario: Scenario
    params: dict = field(default_factory=dict)   # engine knobs the row's benchmark tool set (bench_tools.py)
    batch: int = 1                  # step rows: sequences in the batch
    full_requests: int | None = None   # sim rows: requests the measurement ran (None: unknown)
    notes: list[str] = field(default_factory=list)
    stage_window: tuple[int, int] | None = None  # staged rows: the measured stage's (requests before it, count)

    @property
    def entry(self) -> EngineEntry:
        return EngineEntry(engine=self.engine, params=dict(self.params))


def engine_name(row: Measurement) -> str:
    return ENGINE_OF_ROW.get(row.engine, row.engine)


def stated_means(row: Measurement) -> tuple[float, float] | None:
    """Mean input and output tokens the notes state for the row's dataset sample, if any."""
    for pattern in _STATED_MEANS:
        m = pattern.search(row.notes)
        if m:
            return float(m.group(1)), float(m.group(2))
    return None


def row_lengths(row: Measurement) -> tuple[dict, dict, str] | str:
    """(input distribution, output distribution, note) of the row's requests, or why they cannot be pinned down.

    Stated lengths are constants. A ShareGPT row runs the ShareGPT length table (simengine/workload/datasets.py)
    at the means the row states, else at the sampler's means for the model's tokenizer family; a synthetic
    dataset with stated means (vLLM's sonnet sets: fixed input, output forced by ignore_eos) runs those means."""
    need_in = row.metric in ("prefill_ms", "prefill_tok_s") or row.metric not in STEP_METRICS
    need_out = row.metric in ("decode_step_ms", "decode_tok_s") or row.metric not in STEP_METRICS
    missing = [n for n, need, v in (("input_len", need_in, row.input_len), ("output_len", need_out,
                                                                            row.output_len)) if need and not v]
    if not missing:
        return ({"dist": "constant", "value": max(row.input_len or 1, 1)},
                {"dist": "constant", "value": max(row.output_len or 1, 1)}, "")
    ds, means = row.dataset, stated_means(row)
    if ds == "sharegpt":
        note = "ShareGPT length table"
        if means is None:
            vocab = load_model(row.model, field="model").vocab_size
            means = SHAREGPT_MEANS_32K_VOCAB if vocab <= 32768 else SHAREGPT_MEANS
            note += f" at the sampler's means for a {vocab // 1000}k-vocabulary tokenizer"
            if row.implied_output_mean:
                means = (means[0], row.implied_output_mean)
                note += " (output: the mean its source's output / request throughput implies)"
        (lo_in, hi_in), (lo_out, hi_out) = SHAREGPT_BOUNDS["input"], SHAREGPT_BOUNDS["output"]
        return ({"dist": "empirical", "table": "sharegpt_input", "mean": means[0], "min": lo_in, "max": hi_in},
                {"dist": "empirical", "table": "sharegpt_output", "mean": means[1], "min": lo_out, "max": hi_out},
                f"{note} {means[0]:g} in / {means[1]:g} out")
    if ds and means is not None:
        return ({"dist": "constant", "value": means[0]}, {"dist": "constant", "value": means[1]},
                f"{ds}: the stated mean lengths {means[0]:g} / {means[1]:g}")
    where = f" ({ds}: simengine bundles no length distribution for it)" if ds else ""
    return f"{' and '.join(missing)} not stated{where}"


_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _numbers(row: Measurement, key: str) -> list[float]:
    """The numbers of a notes item (`stage_rates=1/2/4` -> [1, 2, 4]); [] when absent."""
    return [float(x) for x in _NUMBER.findall(row.note_items.get(key, ""))]


@dataclass(frozen=True)
class Traffic:
    """What the notes' shared-prefix and load-stage items (validation README 'Machine-readable notes') add to the
    row's workload: inference-perf's shared_prefix prompt pool and all its load stages. Each stage starts once every
    request of the ones before it finished, so the stages after the measured one leave it as it was, and every row
    of one ladder is read from the same run."""

    workload: dict
    stage_window: tuple[int, int] | None   # the measured stage's requests: (requests made before it, its count)
    note: str


def row_traffic(row: Measurement) -> Traffic | str:
    """The row's shared-prefix prompts and load stages, or why they cannot be run as stated."""
    items = row.note_items
    workload: dict = {}
    notes = []
    window = None
    if "shared_prefix_len" in items or "prefix_groups" in items:
        multi_turn = row.note_flag("multi_turn")
        prefix, question = row.note_int("shared_prefix_len"), row.note_int("question_len")
        groups, per_group = row.note_int("prefix_groups"), row.note_int("prompts_per_group")
        if prefix is None or not groups or not per_group:
            return "shared-prefix traffic needs shared_prefix_len, prefix_groups and prompts_per_group in the notes"
        if question is None:
            question = (row.input_len or 0) - prefix
        if question < 1:
            return f"question_len not stated and input_len {row.input_len} leaves none past the {prefix}-token prefix"
        workload["prompt_groups"] = {"groups": groups, "prompts_per_group": per_group, "prefix_tokens": prefix,
                                     "multi_turn": multi_turn}
        workload["input_tokens"] = {"dist": "constant", "value": question}
        notes.append(f"{groups} x {per_group} prompts: {prefix}-token group prefix + {question}-token question"
                     + (", one growing conversation a prompt" if multi_turn else ""))
    if "stage_rates" in items or "stage" in items:
        rates, durations = _numbers(row, "stage_rates"), _numbers(row, "stage_duration_s")
        if not rates or not durations or len(durations) not in (1, len(rates)):
            return "a staged row needs stage_rates and stage_duration_s (one, or one per stage) in the notes"
        durations = durations * len(rates) if len(durations) == 1 else durations
        process = "constant" if row.arrival.kind == "constant" else "poisson"
        at = [i for i, r in enumerate(rates) if row.arrival.kind == process and r == row.arrival.value]
        stated = row.note_int("stage")
        if len(at) == 1:
            k = at[0]
        elif stated is not None and stated < len(rates):   # inference-perf numbers stages from 0
            k = stated
        else:
            return f"which of the stages {rates} the row measured is not clear (stage={stated}, arrival {row.arrival})"
        counts = [int(r * d) for r, d in zip(rates, durations, strict=True)]
        if not counts[k]:
            return f"stage {k} sends int({rates[k]:g} x {durations[k]:g} s) = 0 requests"
        window = (sum(counts[:k]), counts[k])
        workload["arrival"] = {"process": "stages", "stages": [
            {"rate": r, "duration_s": d, "process": process} for r, d in zip(rates, durations, strict=True)]}
        notes.append(f"stage {k} of {len(rates)} ({counts[k]} requests) after the {k} before it")
    return Traffic(workload, window, "; ".join(notes))


def row_layout(row: Measurement) -> dict:
    """The MoE layout items of the notes (`expert_parallel=true`: the experts spread over the tp devices, vLLM
    --enable-expert-parallel, SGLang / TensorRT-LLM --ep-size equal to tp; `attention_dp=true`: attention data
    parallel, SGLang --enable-dp-attention, TensorRT-LLM enable_attention_dp) as deployment fields, {} when absent."""
    return {key: True for key in ("expert_parallel", "attention_dp") if row.note_flag(key)}


def row_router(row: Measurement) -> dict:
    """The deployment's router as the notes name it (`router=NAME`, a simengine router, `router_params=k:v/k:v` with
    its knobs, and `router_state_delay_s=S`, how often it reads the replicas' load), {} when they name none (the
    deployment's default)."""
    items = row.note_items
    name = items.get("router", "").split()[:1]
    if not name:
        return {}
    delay = _NUMBER.match(items.get("router_state_delay_s", ""))
    params: dict = {}
    raw = items.get("router_params", "").split()
    for pair in raw[0].split("/") if raw else []:
        key, _, value = pair.partition(":")
        params[key] = _scalar(value)
    return {"router": name[0], "router_params": params, **({"router_state_delay_s": float(delay.group(0))}
                                                           if delay else {})}


def _scalar(text: str):
    """A notes value as the number it spells, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _arrival(row: Measurement) -> dict:
    a = row.arrival
    if a.kind in ("poisson", "constant"):
        return {"process": a.kind, "rate": a.value}
    if a.kind == "concurrency":
        return {"process": "closed_loop", "concurrency": int(a.value or 1)}
    if a.kind == "single":
        return {"process": "closed_loop", "concurrency": 1}
    return {"process": "offline"}   # offline, and batch:B (B requests at t=0)


# benchmark clients that send token ids, not text (their engines tokenise nothing): trtllm-bench (a dataset of token
# ids), LMDeploy's profile_generation.py and profile_throughput.py (the engine API, prompts tokenised beforehand) and
# MLPerf's LoadGen (token-id datasets); `prompt_token_ids=true` in the notes says so of any other
TOKEN_ID_CLIENTS = re.compile(r"(?i)trtllm-bench|profile_generation|profile_throughput|\bmlperf\b|\bloadgen\b")


def sends_token_ids(row: Measurement) -> bool:
    """Whether the row's client sent token ids (workload.prompt_token_ids): the notes' item or its benchmark."""
    return row.note_flag("prompt_token_ids") or bool(TOKEN_ID_CLIENTS.search(row.notes))


def scenario_for(row: Measurement, engine: str, num_requests: int | None = None,
                 params: dict | None = None, cost_model: str = "auto") -> Scenario:
    """The row's deployment and request stream as a Scenario (InputError on impossible values)."""
    replicas = row.num_gpus // (row.tp * row.pp)
    n = num_requests or 1
    lengths = row_lengths(row)
    if isinstance(lengths, str):
        raise InputError(lengths)
    traffic = row_traffic(row)
    if isinstance(traffic, str):
        raise InputError(traffic)
    workload = {"arrival": _arrival(row), "num_requests": n, "input_tokens": lengths[0], "output_tokens": lengths[1],
                "prompt_token_ids": sends_token_ids(row), **traffic.workload}
    data = {
        "name": row.id, "seed": 0, "horizon_s": 1.0e6, "drain_s": 1.0e6,
        "deployment": {"hardware": row.hardware, "model": row.model, "weight_dtype": row.weight_dtype,
                       "kv_dtype": row.kv_dtype, "tp": row.tp, "pp": row.pp, "replicas": replicas,
                       "cost_model": cost_model, **row_layout(row), **row_router(row)},
        "workload": workload,
        "engines": [{"engine": engine, "params": dict(params or {})}],
    }
    if traffic.stage_window:   # the stages set the count; an ITL quantile of a stage needs each token's time
        workload.pop("num_requests")
        if "_itl_" in row.metric and not row.metric.startswith("mean_"):
            data["output"] = {"detailed_requests": 10_000_000}
    return from_dict(Scenario, data, source="row")


def plan_row(row: Measurement, cost_model: str = "auto") -> Experiment | Skip:
    """The experiment a row describes, or why it cannot run. The deployment (model, hardware, dtype, memory,
    vendor support) is checked when run.py builds the engine; its InputError becomes the skip reason."""
    engine = engine_name(row)
    if engine not in ENGINES.names():
        return Skip(row, f"engine '{row.engine}' is not implemented in simengine (registry: "
                         f"{', '.join(sorted(ENGINES.names()))})")
    if row.tp < 1 or row.pp < 1:
        return Skip(row, "tp/pp not stated (0 = unknown or engine-chosen)")
    if row.num_gpus % (row.tp * row.pp):
        return Skip(row, f"num_gpus {row.num_gpus} is not a multiple of tp*pp = {row.tp * row.pp}")
    a = row.arrival
    try:
        lengths = row_lengths(row)
        if isinstance(lengths, str):
            return Skip(row, lengths)
        traffic = row_traffic(row)
        if isinstance(traffic, str):
            return Skip(row, traffic)
        params, note = engine_params(row, engine)
        if row.metric in STEP_METRICS:
            if a.kind not in ("single", "batch"):
                return Skip(row, f"step metric {row.metric} needs arrival single or batch:B, got {a}")
            return Experiment(row, "step", engine, scenario_for(row, engine, params=params, cost_model=cost_model),
                              params,
                              batch=int(a.value or 1))
        n: int | None
        if row.arrival.kind == "batch":
            n = int(a.value or 1)
        elif row.num_requests:
            n = row.num_requests
        elif a.kind == "offline":
            n = None   # steady-state throughput of a capped run
        else:
            n = OPEN_LOOP_CAP
        notes = [x for x in (note, lengths[2], traffic.note) if x]
        if n is None and a.kind == "offline":
            notes.append("num_requests not stated: steady-state rate")
        if traffic.stage_window:
            n = sum(int(s["rate"] * s["duration_s"]) for s in traffic.workload["arrival"]["stages"])
        return Experiment(row, "sim", engine, scenario_for(row, engine, n or OPEN_LOOP_CAP, params, cost_model),
                          params, full_requests=n, notes=notes, stage_window=traffic.stage_window)
    except InputError as exc:
        return Skip(row, str(exc))


def capped_requests(exp: Experiment, batch_limit: int | None, kv_tokens: int) -> int:
    """Requests to simulate for an offline row: all of them, or, for a throughput, WAVES x steady-state concurrency
    (fixed lengths only: a row with a length distribution runs its whole sample). A latency statistic of a burst
    depends on how many requests queue behind each other, so it always runs the count measured."""
    row = exp.row
    if (row.arrival.kind != "offline" or not (row.input_len and row.output_len)
            or (row.metric not in RATE_METRICS and exp.full_requests)):
        return exp.scenario.workload.num_requests or OPEN_LOOP_CAP
    per_req = (row.input_len or 1) + (row.output_len or 1)
    conc = kv_tokens // max(per_req, 1)
    if batch_limit:
        conc = min(conc, batch_limit)
    replicas = exp.scenario.deployment.replicas
    cap = max(MIN_SIMULATED, WAVES * max(conc, 1) * replicas)
    full = exp.full_requests
    return int(min(full, cap)) if full else int(cap)
