"""Build a deployment and run one engine on a scenario's request stream in a SimPy environment."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import numpy as np
import simpy

from simengine.config.dtypes import kv_bytes, weight_format
from simengine.config.hardware import load_hardware
from simengine.config.loader import from_dict
from simengine.config.model import load_model
from simengine.config.scenario import EngineEntry, Scenario
from simengine.core.request import Request, Status
from simengine.cost.calibrated import apply_device_terms, apply_terms, read_engine_terms, trial_device_terms
from simengine.cost.measured import MeasuredKernels, systems
from simengine.cost.roofline import DeviceTerms, RooflineKernels
from simengine.cost.step import CostModel
from simengine.cost.work import StepWork
from simengine.engines import ENGINES, EnginePolicy
from simengine.engines.memory import Deployment
from simengine.errors import CannotRun, InputError
from simengine.metrics.recorder import Recorder
from simengine.routers import ROUTERS, ReplicaState
from simengine.sim.replica import PipelinedReplica, Replica
from simengine.workload.generator import RequestFactory, SessionPlan

# A closed-loop client whose request is refused at once waits this long before its next one (1 s, like a
# client retry delay), so a refusal can never spin the simulation at one instant.
REFUSAL_BACKOFF_S = 1.0
PROGRESS_EVERY_S = 0.5   # wall-clock seconds between progress calls (a display only)


def build_deployment(scenario: Scenario) -> Deployment:
    """Resolve hardware, model and dtypes of a scenario (InputError on unknown names or impossible combos)."""
    d = scenario.deployment
    hw = load_hardware(d.hardware)
    model = load_model(d.model)
    fmt = weight_format(d.weight_dtype)
    kv_name = d.kv_dtype if d.kv_dtype != "auto" else ("bf16" if fmt.bytes_per_param <= 2 else fmt.name)
    if d.tp > 1 and model.num_heads % d.tp:
        raise InputError(f"tp={d.tp} does not divide {model.name}'s {model.num_heads} attention heads",
                         field="deployment.tp")
    if d.pp > model.num_layers:
        raise InputError(f"pp={d.pp} exceeds {model.name}'s {model.num_layers} layers", field="deployment.pp")
    if d.tp * d.pp > 1 and hw.link_bandwidth_bytes_s <= 0:
        raise InputError(f"{hw.name} has no device-to-device link (interconnect: none), so tp x pp must be 1; "
                         f"use one device per replica and more replicas", field="deployment.tp")
    if d.tp * d.pp > hw.node_size:
        raise InputError(f"tp x pp = {d.tp * d.pp} exceeds {hw.name}'s node of {hw.node_size} devices linked by "
                         f"{hw.link_bandwidth_bytes_s / 1e9:.0f} GB/s; use at most {hw.node_size} per replica",
                         field="deployment.tp")
    if d.expert_parallel and not model.is_moe:
        raise InputError(f"expert_parallel needs a mixture-of-experts model; {model.name} is dense",
                         field="deployment.expert_parallel")
    return Deployment(model=model, hardware=hw, weight_format=fmt, kv_dtype=kv_name,
                      kv_elem_bytes=kv_bytes(kv_name), tp=d.tp, pp=d.pp, expert_parallel=d.expert_parallel)


def build_engine(entry: EngineEntry, dep: Deployment) -> EnginePolicy:
    """Instantiate an engine policy with validated params; refuse hardware it does not run on."""
    cls = ENGINES.get(entry.engine, field="engines")
    params = from_dict(cls.Params, entry.params, source="scenario", field=f"engines[{entry.display}].params")
    hw = dep.hardware
    if dep.expert_parallel and not cls.supports_expert_parallel:
        ok = [n for n in ENGINES.names() if ENGINES.get(n).supports_expert_parallel]
        raise CannotRun(f"{entry.engine} has no expert parallelism; engines that do: {', '.join(ok)}",
                         field="deployment.expert_parallel")
    if hw.vendor not in cls.vendors or hw.device_class not in cls.device_classes:
        ok = [n for n in ENGINES.names()
              if hw.vendor in ENGINES.get(n).vendors and hw.device_class in ENGINES.get(n).device_classes]
        raise CannotRun(f"{entry.engine} does not run on {hw.name} ({hw.vendor} {hw.device_class}); engines "
                         f"that do: {', '.join(ok) or 'none'}", field="engines")
    return cls(params, dep)


def cost_model(engine: EnginePolicy, grammar_mask_s: float = 0.0, *, kernels: str = "auto") -> CostModel:
    """The step-time model of an engine's own deployment (its KV dtype may differ, e.g. LMDeploy quant_policy):
    measured kernels of the engine's backend where the device has tables and `kernels` is auto, else the roofline
    at the device's physical terms; the engine's timing with its calibrated terms from
    simengine/engines/calibration.yaml (`simengine calibrate`, docs/validation.md) in place of its priors."""
    engine.timing = timing = apply_terms(engine.timing, read_engine_terms().get(engine.name, {}))
    d = engine.dep
    work = StepWork(d.model, d.hardware, weight_format=d.weight_format, kv_elem_bytes=d.kv_elem_bytes, tp=d.tp,
                    pp=d.pp, expert_parallel=d.expert_parallel, engine_gemm_flops_s=engine.engine_gemm_flops_s())
    hw = apply_device_terms(d.hardware, trial_device_terms(d.hardware.name))
    terms = DeviceTerms.of(work, hw, custom_allreduce=timing.custom_allreduce)
    system, backend = d.hardware.kernel_tables, engine.kernel_backend
    if kernels == "auto" and system and backend and system in systems():
        gpu = MeasuredKernels(work, terms, system=system, backend=backend, custom_allreduce=timing.custom_allreduce)
    else:
        gpu = RooflineKernels(work, terms)
    return CostModel(gpu, timing, grammar_mask_s=grammar_mask_s)


@dataclass
class RunResult:
    """Everything one engine run produced (frames are built later from the recorder's rows)."""

    scenario: Scenario
    entry: EngineEntry
    deployment: Deployment
    recorder: Recorder
    end_s: float
    engines: list[EnginePolicy] = field(default_factory=list)
    partial: bool = False       # stopped at a wall-clock deadline before the run's end
    faults: dict | None = None  # with deployment.failures: failures, retries, requests failed by them, availability
    down: list[tuple[int, float, float]] = field(default_factory=list)  # (replica, down at, back up at) per failure

    @property
    def label(self) -> str:
        return self.entry.display


class Runner:
    """Wires arrivals, sessions, a router and replicas into one SimPy environment."""

    def __init__(self, scenario: Scenario, entry: EngineEntry, *, check_invariants: bool = False):
        self.scenario, self.entry = scenario, entry
        self.dep = build_deployment(scenario)
        self.env = simpy.Environment()
        self.recorder = Recorder()
        wl = scenario.workload
        self.factory = RequestFactory(wl, scenario.seed, self.dep.model.vocab_size, self.dep.model.max_model_len)
        self.compile_s = wl.structured_output.compile_s if wl.structured_output.fraction else 0.0
        self.engines = [build_engine(entry, self.dep) for _ in range(scenario.deployment.replicas)]
        self.replicas = [
            self._replica(i, eng, cost_model(eng, wl.structured_output.mask_s,
                                             kernels=scenario.deployment.cost_model), check_invariants)
            for i, eng in enumerate(self.engines)]
        # the serving frontend's time from the client's send to the engine's queue (parsing, tokenising, IPC) and
        # of the first token's way back: every request reaches the engine this much after it was sent
        self.frontend_s = self.engines[0].timing.frontend_s
        self.detailed_requests = scenario.output.detailed_requests  # ids below keep every token's time
        self.live: dict[int, Request] = {}
        self.waiters: dict[int, simpy.Event] = {}
        self.sources_open = 0
        self.all_done = self.env.event()
        d = scenario.deployment
        router = ROUTERS.get(d.router, field="deployment.router")
        self.router = router(from_dict(router.Params, d.router_params, source="scenario",
                                       field="deployment.router_params"),
                             d.replicas, np.random.default_rng([scenario.seed, 104729]))
        self.reported: list[ReplicaState] | None = None   # load reports (deployment.router_state_delay_s > 0)
        # replica failures (deployment.failures): which replica holds each live request, who is up, the requests
        # waiting for any replica to come back, and the log
        self.check_invariants = check_invariants
        self.assigned: dict[int, int] = {}
        self.up = [True] * len(self.replicas)
        self.pending: list[Request] = []
        self.retries: dict[int, int] = {}
        self.down: list[list] = []      # [replica, down at, back up at or -1 while down]
        self.failed_by_fault = 0

    def _replica(self, i: int, eng: EnginePolicy, cost, check: bool) -> Replica:
        if self.dep.pp > 1 and eng.supports_pipeline_microbatches:
            return PipelinedReplica(self.env, i, eng, cost, self.recorder, self._on_done, check_invariants=check,
                                    stages=self.dep.pp)
        return Replica(self.env, i, eng, cost, self.recorder, self._on_done, check_invariants=check)

    # ---- routing and completion ---------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        self.recorder.arrived += 1
        if req.request_id < self.detailed_requests:
            req.token_times = array("d")
        self.live[req.request_id] = req
        wait = req.arrival_s + self.frontend_s - self.env.now   # an open loop already waited for it
        if len(self.replicas) > 1:
            wait += self.scenario.deployment.router_decision_s
        if req.structured and self.compile_s:
            # the grammar compiles before the scheduler may run the request (vLLM skips it until ready,
            # SGLang keeps it in a grammar queue): it reaches the engine compile_s later
            wait += self.compile_s
        if wait > 0:
            self.env.process(self._submit_after(req, wait))
            return
        self._route(req)

    def _submit_after(self, req: Request, delay_s: float):
        yield self.env.timeout(delay_s)
        self._route(req)

    def _route(self, req: Request) -> None:
        up = self.replicas if all(self.up) else [r for r in self.replicas if self.up[r.index]]
        if not up:                  # every replica is down: the request waits for the first one back
            self.pending.append(req)
            return
        if len(self.replicas) == 1:
            replica = up[0]
        elif self.reported is not None:   # the last load report of each replica that is up
            replica = self.replicas[self.router.choose(req, [self.reported[r.index] for r in up])]
        else:
            replica = self.replicas[self.router.choose(req, [self._state(r) for r in up])]
        self.assigned[req.request_id] = replica.index
        replica.submit(req)

    @staticmethod
    def _state(r: Replica) -> ReplicaState:
        e = r.engine
        return ReplicaState(r.index, e.num_running(), e.num_waiting(), e.kv_usage(), e.kv_capacity_tokens())

    def _load_reports(self, every_s: float):
        """Every replica reports its state every `every_s` seconds; the router sees only the latest reports."""
        while True:
            self.reported = [self._state(r) for r in self.replicas]
            yield self.env.timeout(every_s)

    # ---- failures -------------------------------------------------------------------------------------------
    def _stated_failure(self, i: int, at_s: float, down_s: float):
        yield self.env.timeout(max(at_s - self.env.now, 0.0))
        yield from self._outage(i, down_s)

    def _random_failures(self, i: int, rng):
        cfg = self.scenario.deployment.failures
        while True:
            yield self.env.timeout(float(rng.exponential(cfg.mtbf_s)))
            yield from self._outage(i, float(rng.exponential(cfg.mttr_s)))

    def _outage(self, i: int, down_s: float):
        """Replica i fails now: its step in flight, KV cache and requests are lost; it is back after down_s with a
        fresh engine (an empty cache)."""
        if not self.up[i]:          # already down (a stated failure during a random one): nothing more is lost
            return
        self.up[i] = False
        log = [i, self.env.now, -1.0]
        self.down.append(log)
        old = self.replicas[i]
        old.stop()
        old.engine.sync()       # lazily advanced counters (vLLM's decode cohort) as of the last completed step
        engine = build_engine(self.entry, self.dep)   # what comes back: the failed engine and its cache are gone
        self.engines[i] = engine
        held = sorted(rid for rid, r in self.assigned.items() if r == i)
        for rid in held:
            del self.assigned[rid]
            if rid in self.live:
                self.router.finished(self.live[rid], i)
        for rid in held:
            if rid in self.live:
                self._lost(self.live[rid], i)
        yield self.env.timeout(down_s)
        wl = self.scenario.workload
        self.replicas[i] = self._replica(i, engine, cost_model(engine, wl.structured_output.mask_s,
                                                               kernels=self.scenario.deployment.cost_model),
                                         self.check_invariants)
        self.up[i] = True
        log[2] = self.env.now
        pending, self.pending = self.pending, []
        for req in pending:
            self._route(req)

    def _lost(self, req: Request, i: int) -> None:
        """A request the failed replica held: resent (a fresh copy, same id and send time) or failed."""
        n = self.retries.get(req.request_id, 0)
        if n < self.scenario.deployment.failures.max_retries:
            self.retries[req.request_id] = n + 1
            fresh = resend(req)
            if req.token_times is not None:
                fresh.token_times = array("d")  # the client sees only the retry's tokens
            self.live[req.request_id] = fresh
            self._route(fresh)
            return
        req.status = Status.FAILED
        req.fail_reason = f"replica {i} failed" + (f" (after {n} retries)" if n else "")
        req.finish_s = self.env.now
        self.failed_by_fault += 1
        self._on_done(req, i)

    def start_load_reports(self) -> None:
        delay = self.scenario.deployment.router_state_delay_s
        if delay > 0 and len(self.replicas) > 1:
            self.env.process(self._load_reports(delay))

    def start_failures(self) -> None:
        cfg = self.scenario.deployment.failures
        if cfg is None:
            return
        for f in cfg.at:
            self.env.process(self._stated_failure(f.replica, f.time_s, f.down_s))
        if cfg.mtbf_s is not None:
            for i in range(len(self.replicas)):   # each replica its own stream, derived from the seed
                self.env.process(self._random_failures(i, np.random.default_rng([self.scenario.seed, 7919, i])))

    def down_intervals(self, end_s: float) -> list[tuple[int, float, float]]:
        """(replica, down at, back up at) of every failure; one still down at the end runs to `end_s`."""
        return [(i, at, up if up >= 0 else end_s) for i, at, up in self.down]

    def fault_summary(self, end_s: float) -> dict | None:
        if self.scenario.deployment.failures is None:
            return None
        down_s = sum(up - at for _, at, up in self.down_intervals(end_s))
        return {"failures": len(self.down), "retries": sum(self.retries.values()),
                "failed_by_fault": self.failed_by_fault,
                "availability": 1.0 - down_s / (len(self.replicas) * end_s) if end_s > 0 else 1.0}

    def _on_done(self, req: Request, replica: int) -> None:
        self.live.pop(req.request_id, None)
        placed = self.assigned.pop(req.request_id, None)
        if placed is not None:
            self.router.finished(req, placed)
        if req.status is Status.FAILED and req.finish_s < 0:
            req.finish_s = self.env.now  # when the engine refused it: requests.csv's finish_s of a failed row
        self.recorder.finished(req, replica)
        ev = self.waiters.pop(req.request_id, None)
        if ev is not None:
            ev.succeed(req)
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.sources_open == 0 and not self.live and not self.all_done.triggered:
            self.all_done.succeed()

    # ---- processes --------------------------------------------------------------------------------------
    def _open_loop(self):
        env, horizon = self.env, self.scenario.horizon_s
        frontend = self.frontend_s
        for req in self.factory.open_loop(horizon if self.scenario.workload.num_requests is None else float("inf")):
            if req.arrival_s + frontend > env.now:   # the request reaches the engine through the frontend
                yield env.timeout(req.arrival_s + frontend - env.now)
            self.submit(req)
        self._close_source()

    def _closed_loop_user(self):
        env, horizon, cap = self.env, self.scenario.horizon_s, self.scenario.workload.num_requests
        while env.now <= horizon and (cap is None or self.factory.next_id < cap):
            req = self.factory.plain_request(env.now)
            started = env.now
            yield from self._send_and_wait(req)
            if env.now == started:  # refused at once: back off instead of retrying at the same instant forever
                yield env.timeout(REFUSAL_BACKOFF_S)
        self._close_source()

    def _session_slot(self, first_index: int, stride: int):
        env, horizon = self.env, self.scenario.horizon_s
        index = first_index
        while env.now <= horizon:
            plan = self.factory.session(index)
            if index == first_index and plan.start_offset_s:
                yield env.timeout(plan.start_offset_s)
            started = env.now
            yield from self._run_session(plan)
            if env.now == started:  # refused at once (e.g. the prompt overflows the model): the next user comes
                yield env.timeout(max(self.factory.think_time(plan), REFUSAL_BACKOFF_S))  # later, not this instant
            index += stride
        self._close_source()

    def _open_sessions(self):
        env = self.env
        for index, t in enumerate(self.factory.session_start_times(self.scenario.horizon_s)):
            yield env.timeout(t - env.now)
            self.sources_open += 1
            env.process(self._one_session(self.factory.session(index)))
        self._close_source()

    def _one_session(self, plan: SessionPlan):
        yield from self._run_session(plan)
        self._close_source()

    def _run_session(self, plan: SessionPlan):
        env, horizon = self.env, self.scenario.horizon_s
        previous = None
        for turn in range(plan.turns):
            if env.now > horizon:
                return
            plan.turn = turn
            req = self.factory.session_turn(plan, env.now, previous)
            done = yield from self._send_and_wait(req)
            if done.status is not Status.FINISHED:
                return  # the engine rejected the grown context: the conversation ends here
            previous = req
            if turn + 1 < plan.turns:
                yield env.timeout(self.factory.think_time(plan))

    def _send_and_wait(self, req: Request):
        ev = self.env.event()
        self.waiters[req.request_id] = ev
        self.submit(req)
        if req.request_id not in self.waiters:  # rejected synchronously
            return req
        return (yield ev)

    def _close_source(self) -> None:
        self.sources_open -= 1
        self._maybe_done()

    def start_sources(self) -> None:
        wl = self.scenario.workload
        if wl.sessions is not None and wl.sessions.arrival_rate is not None:
            self.sources_open = 1
            self.env.process(self._open_sessions())
        elif wl.sessions is not None:
            n = wl.sessions.population
            self.sources_open = n
            for i in range(n):
                self.env.process(self._session_slot(i, n))
        elif wl.arrival.process == "closed_loop":
            self.sources_open = wl.arrival.concurrency
            for _ in range(wl.arrival.concurrency):
                self.env.process(self._closed_loop_user())
        else:
            self.sources_open = 1
            self.env.process(self._open_loop())

    def run(self, deadline: float | None = None, progress=None) -> RunResult:
        """Simulate to the end (every request done, or horizon + drain); with `deadline` (a time.monotonic()
        value) stop there instead, the run marked partial and what is in flight recorded as unfinished.
        `progress(simulated_s, requests_done)` is called about twice a wall-clock second (a display only)."""
        self.start_sources()
        self.start_failures()
        self.start_load_reports()
        limit = self.env.timeout(self.scenario.horizon_s + self.scenario.drain_s)
        end = self.env.any_of([self.all_done, limit])
        partial = False
        if deadline is None and progress is None:
            self.env.run(until=end)
        else:   # the wall clock is read here only, every 4096 events, never by a policy
            events, shown = 0, time.monotonic()
            while not end.processed and self.env.peek() != simpy.core.Infinity:
                if events % 4096 == 0:
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        partial = True
                        break
                    if progress is not None and now - shown >= PROGRESS_EVERY_S:
                        progress(self.env.now, self.recorder.num_requests)
                        shown = now
                self.env.step()
                events += 1
        for eng in self.engines:
            eng.sync()
        for req in sorted(self.live.values(), key=lambda r: r.request_id):
            self.recorder.request(req, -1, "unfinished")
        return RunResult(self.scenario, self.entry, self.dep, self.recorder, self.env.now, self.engines, partial,
                         self.fault_summary(self.env.now), self.down_intervals(self.env.now))


def resend(req: Request) -> Request:
    """The client's retry of a request a failed replica lost: the same id, send time and tokens, nothing computed."""
    return Request(req.request_id, req.arrival_s, req.token_ids, req.prompt_len, req.output_len,
                   max_tokens=req.max_tokens, priority=req.priority, session_id=req.session_id, turn=req.turn,
                   slo_class=req.slo_class, structured=req.structured, unique_outputs=req.unique_outputs,
                   private_from=req.private_from)

