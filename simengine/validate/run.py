"""Execute planned experiments and read each row's metric from the steps the engine ran.

Every prediction that is a function of step times (step metrics, offline throughputs) is kept as a `Readout`
(weights over steps) plus the steps' `StepFeatures`, so calibration re-prices exactly what validation ran.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simengine.core.batch import BatchShape
from simengine.core.request import Request
from simengine.cost.step import CostModel, StepCost
from simengine.engines.base import EnginePolicy
from simengine.errors import InputError
from simengine.sim.build import build_deployment, build_engine, cost_model
from simengine.sim.runner import Runner
from simengine.validate.experiments import (
    LLAMA_BENCH_UBATCH,
    Experiment,
    Skip,
    capped_requests,
    plan_row,
    scenario_for,
)
from simengine.validate.features import StepFeatures, step_features
from simengine.validate.measurements import RATE_METRICS, Measurement


@dataclass
class Readout:
    """metric = numerator / span for rates, or 1e3 * span for times in ms, where span = sum_k w_k . t_k over
    the recorded step sequences k (replicas, and runs of different lengths) plus `offset_s` (the frontend's time
    before the first step, which no step term changes)."""

    rate: bool
    numerator: float
    weights: list[np.ndarray]
    offset_s: float = 0.0

    def value(self, seconds: list[np.ndarray]) -> float:
        span = self.offset_s + sum(float(np.dot(w, s)) for w, s in zip(self.weights, seconds, strict=True))
        if span <= 0:
            return math.nan
        return self.numerator / span if self.rate else 1e3 * span


@dataclass
class Prediction:
    """One row's predicted value, and how calibration can recompute it."""

    row: Measurement
    engine: str
    predicted: float
    readout: Readout | None = None
    features: list[StepFeatures] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted - self.row.value) / self.row.value


class RecordingCost:
    """Wraps a cost model for one replica and remembers every step's shape and the seconds it adds to the run: its
    step time, or under pipeline micro-batches its first stage's (sim/replica.py PipelinedReplica)."""

    def __init__(self, inner: CostModel):
        self.inner = inner
        self.shapes: list[BatchShape] = []
        self.seconds: list[float] = []
        self.stages = 1

    def step(self, shape: BatchShape) -> StepCost:
        c = self.inner.step(shape)
        self.shapes.append(shape)
        self.seconds.append(c.seconds)
        return c

    def stage_seconds(self, shape: BatchShape, seconds: float, stages: int) -> float:
        self.stages = stages
        self.seconds[-1] = stage = self.inner.stage_seconds(shape, seconds, stages)
        return stage


# ---- step experiments ---------------------------------------------------------------------------------
def _request(rid: int, prompt_len: int, computed: int, outputs: int) -> Request:
    req = Request(rid, 0.0, np.zeros(prompt_len + outputs + 2, dtype=np.int32), prompt_len, outputs + 1)
    req.num_computed_tokens, req.num_output_tokens = computed, outputs
    return req


def prefill_shapes(eng: EnginePolicy, batch: int, tokens: int, depth: int, ubatch: int | None) -> list[BatchShape]:
    """`batch` prompts of `tokens` after `depth` cached tokens, in one forward or in ubatches (llama-bench).
    A piece that does not reach the end of its prompt is a chunk without logits (make_shape's rule)."""
    size = ubatch or batch * tokens
    steps: list[list[tuple[Request, int]]] = []
    cur: list[tuple[Request, int]] = []
    for b in range(batch):
        done = 0
        while done < tokens:
            n = min(tokens - done, size - sum(k for _, k in cur))
            cur.append((_request(b, depth + tokens, depth + done, 0), n))
            done += n
            if sum(k for _, k in cur) == size:
                steps.append(cur)
                cur = []
    if cur:
        steps.append(cur)
    return [eng.make_shape(s) for s in steps]


def decode_shape(eng: EnginePolicy, batch: int, context: int) -> BatchShape:
    """One decode step of `batch` sequences whose new token brings them to `context` (>= 1) tokens."""
    return eng.make_shape([(_request(b, context - 1, context - 1, 1), 1) for b in range(batch)])


def step_plan(exp: Experiment, eng: EnginePolicy) -> tuple[list[BatchShape], Readout]:
    """Shapes and readout of a step metric (Splitwise and llama-bench semantics, see experiments.py)."""
    r, b = exp.row, exp.batch
    depth, isl, osl = r.ctx_depth, r.input_len or 0, r.output_len or 0   # rows carry the lengths their metric needs
    if r.metric == "prefill_ms":
        shapes = prefill_shapes(eng, b, isl, depth, None)
        return shapes, Readout(False, 1.0, [np.ones(len(shapes))])
    if r.metric == "prefill_tok_s":
        # llama-bench's physical batch: the engine's -ub (a row quoting --ubatch-size sets it), else its default
        ubatch = getattr(eng, "n_ubatch", LLAMA_BENCH_UBATCH)
        shapes = prefill_shapes(eng, b, isl, depth, ubatch)
        # it decodes the prompt n_batch tokens a call, whose ubatches pipeline over layer-split devices
        per_call = max(1, getattr(eng, "n_batch", ubatch) // ubatch)
        for i, shape in enumerate(shapes):
            shape.pipelined = getattr(eng, "pipelined", False) and i % per_call > 0
        return shapes, Readout(True, float(b * isl), [np.ones(len(shapes))])
    start = isl + depth
    if r.metric == "decode_step_ms":   # the median of O iterations: the one halfway through the generation
        shapes = [decode_shape(eng, b, start + math.ceil(osl / 2))]
        return shapes, Readout(False, 1.0, [np.ones(1)])
    shapes = [decode_shape(eng, b, start + i) for i in range(1, osl + 1)]   # decode_tok_s
    return shapes, Readout(True, float(b * osl), [np.ones(len(shapes))])


def run_step(exp: Experiment) -> Prediction:
    dep = build_deployment(exp.scenario)
    eng = build_engine(exp.entry, dep)
    cost = cost_model(eng, kernels=exp.scenario.deployment.cost_model)   # the simulator's own step-time model
    shapes, readout = step_plan(exp, eng)
    seconds = np.array([cost.step(s).seconds for s in shapes])
    return Prediction(exp.row, exp.engine, readout.value([seconds]), readout, [step_features(cost, shapes)],
                      {"steps": len(shapes)})


# ---- simulated experiments ----------------------------------------------------------------------------
# the last load-stage ladder simulated in this process (ladder_key -> _simulate's result), so that the rows read from
# one ladder's run (run_rows sends them to one worker, one after another) share it
_LADDER: dict[tuple, tuple] = {}


def ladder_key(exp: Experiment) -> tuple | None:
    """What makes a staged row's run (every stage of its ladder, whichever stage and metric the row reads), or None
    for a row whose run is its own."""
    if not exp.stage_window or exp.kind != "sim":
        return None
    return repr(dataclasses.replace(exp.scenario, name="ladder")), repr(exp.entry)


def _simulate(exp: Experiment, n: int) -> tuple[list[RecordingCost], Any, Any, float]:
    """Run the row's stream of `n` requests; every replica's steps recorded. InputError if any request fails.
    Returns (per-replica recorded costs, requests frame, recorder, the time before the first step: the frontend's
    latency and its tokenising of the first request to reach the engine)."""
    key = ladder_key(exp)
    if key is not None and key in _LADDER:
        return _LADDER[key]
    result = _run_stream(exp, n)
    if key is not None:
        _LADDER.clear()
        _LADDER[key] = result
    return result


def _run_stream(exp: Experiment, n: int) -> tuple[list[RecordingCost], Any, Any, float]:
    from simengine.metrics.frames import requests_frame

    scenario = scenario_for(exp.row, exp.engine, n, exp.params, exp.scenario.deployment.cost_model)
    runner = Runner(scenario, exp.entry)
    rec_costs = []
    for rep in runner.replicas:
        rc = RecordingCost(rep.cost)
        rep.cost = rc  # type: ignore[assignment]  # prices as the cost model does; Replica reads self.cost when its process first runs, i.e. inside run()
        rec_costs.append(rc)
    recorder = runner.run().recorder
    frame = requests_frame(recorder)
    failed = frame[frame["status"] != "completed"]
    if len(failed):
        reason = failed["fail_reason"].iloc[0] or failed["status"].iloc[0]
        raise InputError(f"{len(failed)} of {n} requests did not complete in simulation ({reason})")
    return rec_costs, frame, recorder, float(frame["first_scheduled_s"].min() - frame["arrival_s"].min())


def _offline_rate(exp: Experiment, n: int, info: dict) -> Prediction:
    """Offline throughput = requests x tokens / makespan, the makespan read from the steps (linear in them).

    When the row ran more requests than `n`, a second run of n/2 requests gives the steady-state time per
    request, T(n) - T(n/2) over n/2, and the makespan is extrapolated from the larger run: ramp-up and tail
    appear in both runs and cancel. Without a request count the value is that steady-state rate.
    """
    r = exp.row
    full = exp.full_requests
    costs, frame, _, before_first_step_s = _simulate(exp, n)
    runs = [costs]
    if full is None or full > n:
        runs.append(_simulate(exp, n // 2)[0])
        info["extrapolated"] = True
    # tokens (or requests) per request: the sample's mean (a dataset row runs its whole sample, so this is exact)
    per_req = float(_rate_numerator(r.metric, frame)) / len(frame)
    weights, feats, seconds = [], [], []
    for k, costs in enumerate(runs):
        if len(runs) == 1:
            w = 1.0
        elif full is None:
            w = 1.0 if k == 0 else -1.0
        else:
            ratio = (full - n) / (n - n // 2)
            w = 1.0 + ratio if k == 0 else -ratio
        for c in costs:
            weights.append(np.full(len(c.seconds), w / len(costs)))
            feats.append(step_features(c.inner, c.shapes, c.stages))
            seconds.append(np.asarray(c.seconds))
    numer = per_req * (full if full is not None else n - n // 2)
    # the requests reach the engine after the frontend: once in the makespan (it cancels in a steady-state rate)
    readout = Readout(True, float(numer), weights, before_first_step_s if full is not None else 0.0)
    info["steps"] = int(sum(len(s) for s in seconds))
    return Prediction(r, exp.engine, readout.value(seconds), readout, feats, info)


def _rate_numerator(metric: str, frame) -> float:
    """What a throughput metric counts over the run: output tokens, all tokens, or requests."""
    out = float(frame["num_output_tokens"].sum())
    return {"output_throughput_tok_s": out, "total_throughput_tok_s": out + float(frame["prompt_len"].sum()),
            "request_throughput": float(len(frame))}[metric]


def _latency_metric(metric: str, frame, recorder) -> float:
    """A `vllm bench serve` latency statistic (mean/median/p90/p99 of ttft/tpot/itl/e2el, in ms). TTFT, TPOT and
    E2E are per request; ITL pools every inter-token gap of every request (token-weighted), as the benchmark does."""
    from simengine.metrics.frames import itl_arrays
    from simengine.metrics.summary import metric_stats

    stat, quantity, _ = metric.split("_")
    if quantity == "itl":
        value = metric_stats("itl", *itl_arrays(recorder))[f"{stat}_itl_ms"]
        return math.nan if value is None else float(value)
    v = frame.loc[frame["status"] == "completed", f"{quantity}_ms"].dropna().to_numpy()
    if not len(v):
        return math.nan
    if stat == "mean":
        return float(np.mean(v))
    return float(np.percentile(v, 50 if stat == "median" else int(stat[1:])))


def run_sim(exp: Experiment) -> Prediction:
    probe = build_engine(exp.entry, build_deployment(exp.scenario))
    n = capped_requests(exp, probe.batch_size_limit, probe.kv_capacity_tokens())
    info = {"simulated_requests": n, "full_requests": exp.full_requests}
    r = exp.row
    if r.metric in RATE_METRICS and r.arrival.kind in ("offline", "batch"):
        return _offline_rate(exp, n, info)
    _, frame, recorder, _ = _simulate(exp, n)
    if exp.stage_window:   # the measured stage of the ladder's run (every earlier stage finished first)
        return Prediction(r, exp.engine, _stage_metric(r.metric, frame, recorder, exp.stage_window), info=info)
    if r.metric in RATE_METRICS:
        return Prediction(r, exp.engine, _rate_numerator(r.metric, frame) / float(frame["finish_s"].max()), info=info)
    return Prediction(r, exp.engine, _latency_metric(r.metric, frame, recorder), info=info)


def _stage_metric(metric: str, frame, recorder, window: tuple[int, int]) -> float:
    """A metric over one load stage's requests (`window`: the requests made before it, its count): a rate over the
    stage's span, from its start (the last finish of the stages before, as summary.json's `stages`) to its last
    finish; a per-request latency over them; ITL over the gaps between their tokens: the mean is every request's
    first-to-last token time over its gaps, summed (the gaps telescope), a quantile needs each token's time
    (scenario_for keeps them for such a row)."""
    ordered = frame.sort_values("request_id")
    first, count = window
    stage, before = ordered.iloc[first:first + count], ordered.iloc[:first]
    if metric in RATE_METRICS:
        start = float(before["finish_s"].max()) if len(before) else 0.0
        return _rate_numerator(metric, stage) / (float(stage["finish_s"].max()) - start)
    if metric == "mean_itl_ms":
        num_gaps = float((stage["num_output_tokens"] - 1).sum())
        span_s = float((stage["finish_s"] - stage["first_token_s"]).sum())
        return 1e3 * span_s / num_gaps if num_gaps else math.nan
    if "_itl_" in metric:
        times = recorder.token_times
        gaps = [np.diff(np.asarray(times[i])) for i in stage["request_id"].tolist() if i in times]
        if not gaps or not sum(len(g) for g in gaps):
            return math.nan
        from simengine.metrics.summary import metric_stats
        value = metric_stats("itl", 1e3 * np.concatenate(gaps))[f"{metric.split('_')[0]}_itl_ms"]
        return math.nan if value is None else float(value)
    return _latency_metric(metric, stage, None)


def run_row(row: Measurement, kernels: str = "auto") -> Prediction | Skip:
    """Plan and run one row (`kernels`: the deployment's cost_model, auto or roofline); anything the simulator
    refuses becomes a Skip with its one-line reason."""
    t0 = time.perf_counter()
    exp = plan_row(row, kernels)
    if isinstance(exp, Skip):
        return exp
    try:
        pred = run_step(exp) if exp.kind == "step" else run_sim(exp)
    except InputError as exc:
        return Skip(row, str(exc))
    except Exception as exc:  # an engine or simulator bug: report the row, keep validating the others
        return Skip(row, f"simulator error: {exc.__class__.__name__}: {exc}")
    pred.info["wall_s"] = round(time.perf_counter() - t0, 3)
    pred.info["notes"] = "; ".join(exp.notes)
    if not (math.isfinite(pred.predicted) and pred.predicted > 0):
        return Skip(row, f"the simulation produced no value for {row.metric}")
    return pred


def _default_sigterm() -> None:
    """A worker ends quietly when the pool terminates it: the CLI's SIGTERM handler (which unwinds the parent like
    Ctrl-C) is inherited by fork and would print each idle worker's traceback."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_task(rows: list[Measurement], kernels: str = "auto") -> list[Prediction | Skip]:
    """Run rows one after another in this process: a load-stage ladder's rows share its one run."""
    try:
        return [run_row(r, kernels) for r in rows]
    finally:
        _LADDER.clear()


def row_tasks(rows: list[Measurement], kernels: str = "auto") -> list[list[int]]:
    """The rows' indices in tasks: the rows of one load-stage ladder together, every other row alone; the slow
    simulated tasks first, so that a pool does not end waiting on one of them."""
    ladders: dict[tuple, list[int]] = {}
    tasks: list[list[int]] = []
    for i, row in enumerate(rows):
        exp = plan_row(row, kernels)
        key = None if isinstance(exp, Skip) else ladder_key(exp)
        if key is None:
            tasks.append([i])
        elif key in ladders:
            ladders[key].append(i)
        else:
            tasks.append(ladders.setdefault(key, [i]))
    return sorted(tasks, key=lambda t: (len(t) == 1, rows[t[0]].metric.endswith(("_ms", "tok_s")) and
                                        rows[t[0]].arrival.kind in ("single", "batch")))


def run_rows(rows: list[Measurement], jobs: int = 2, kernels: str = "auto") -> list[Prediction | Skip]:
    """Run every row, in `jobs` worker processes (results in row order)."""
    tasks = row_tasks(rows, kernels)
    if jobs <= 1 or len(tasks) <= 1:
        results = [run_task([rows[i] for i in t], kernels) for t in tasks]
    else:
        import functools
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ctx.Pool(jobs, initializer=_default_sigterm) as pool:
            results = pool.map(functools.partial(run_task, kernels=kernels), [[rows[i] for i in t] for t in tasks],
                               chunksize=1)
    out: list[Prediction | Skip] = [None] * len(rows)  # type: ignore[list-item]
    for task, res in zip(tasks, results, strict=True):
        for i, r in zip(task, res, strict=True):
            out[i] = r
    return out
