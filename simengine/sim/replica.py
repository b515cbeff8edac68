"""One replica: the engine loop process (schedule -> cost -> hold the GPU for the step -> update)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import simpy

from simengine.core.batch import BatchShape, SchedulerOutput
from simengine.core.request import Request
from simengine.cost.step import CostModel, StepCost
from simengine.engines.base import EnginePolicy
from simengine.metrics.recorder import Recorder
from simengine.sim.links import Link


class Replica:
    """Runs one engine policy. Idle, it parks on an event that `submit` triggers (no polling)."""

    def __init__(self, env: simpy.Environment, index: int, engine: EnginePolicy, cost: CostModel,
                 recorder: Recorder, on_done: Callable[[Request, int], None], *, check_invariants: bool = False):
        self.env, self.index, self.engine, self.cost = env, index, engine, cost
        self.recorder, self.on_done = recorder, on_done
        self.gpu = simpy.Resource(env, capacity=1)
        self.check = check_invariants
        self._wake: simpy.Event | None = None
        self.schedules = 0          # schedule calls so far
        # requests left waiting by the last schedule call: the engine's published queue (vLLM sets its
        # num_requests_waiting gauge from the scheduler's stats at the end of each step, before the arrivals that
        # came in during the step join the scheduler)
        self.waiting_published = 0
        # prefill/decode disaggregation (the runner sets them on pools that need them): called with the requests a
        # decode engine reserved blocks for, and with each step's output on a layerwise prefill replica
        self.on_kv_reserved: Callable[[list[Request], int], None] | None = None
        self.on_scheduled: Callable[[SchedulerOutput], None] | None = None
        # KV offload: the link to host memory that loads back offloaded KV, and (tokens, queued s, link s) per load
        self.host_link = Link(env)
        self.host_loads: list[tuple[int, float, float]] = []
        self.stopped = False
        # the engine scheduled nothing with work waiting and has run no step since: (since when, its reason)
        self.stall: tuple[float, str] | None = None
        # whether anyone but arrivals reads the engine in the middle of a step (a router choosing among replicas, load
        # reports, disaggregation: every run of more than one replica); the runner clears it for a replica alone
        self.watched = True
        # repeats running on through arrivals (`_through`) until applied: (out, StepCost rows, start, ends, queue at
        # start, whether update applies the last, each arrival's (time, queue length after it) meanwhile)
        self._in_flight: tuple | None = None
        # an engine that schedules ahead (EnginePolicy.schedules_ahead) took the decision for the next step as the
        # running one started: what arrives during a step waits here and joins the queue after the next decision
        self.schedules_ahead = engine.schedules_ahead
        assert not (self.schedules_ahead and engine.repeats_outlast_arrivals), "repeats through arrivals see them"
        # a step of an engine that schedules ahead is in flight (or just ended, before the decision that follows it)
        self._stepping = False
        self._inbox: list[Request] = []
        self.process = env.process(self.run())

    def num_waiting(self) -> int:
        """Requests the replica holds that have not started: the engine's queue and those held for its next one."""
        return self.engine.num_waiting() + len(self._inbox)

    def submit(self, req: Request) -> None:
        """Hand a request to the engine (held until the next decision has been taken where it schedules ahead and a
        step is in flight); a rejection is final and reported at once."""
        if self._stepping:
            self._inbox.append(req)
            return
        if not self.engine.add_request(req, self.env.now):
            self.on_done(req, self.index)
            return
        if self._in_flight is not None:
            self._in_flight[-1].append((self.env.now, self.engine.num_waiting()))
        self.wake()

    def wake(self) -> None:
        """Something changed outside the engine loop (an arrival, remote KV in place): schedule again if parked."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def scheduled(self, out: SchedulerOutput) -> None:
        """Bookkeeping after each schedule call: the count, the published queue, and the disaggregation hooks."""
        self.schedules += 1
        self.waiting_published = self.engine.num_waiting()
        if out.kv_reserved:
            assert self.on_kv_reserved is not None, "a decode-role engine reserved KV on a replica without a KV path"
            self.on_kv_reserved(out.kv_reserved, self.index)
        for req in out.kv_loads:
            self.env.process(self._load_from_host(req))
        if self.on_scheduled is not None and out.scheduled:
            self.on_scheduled(out)

    def _load_from_host(self, req: Request):
        """Copy a request's offloaded KV back over the replica's host link (each device its own shard, in parallel;
        loads queue first come, first served), then hand it to the engine."""
        link, engine, env = self.host_link, self.engine, self.env
        num_bytes = req.remote_kv_tokens * engine.dep.kv_bytes_per_token_per_device
        asked = env.now
        with link.resource.request() as hold:
            yield hold
            start = env.now
            yield env.timeout(engine.host_load_seconds(req))
        link.used(start, env.now, num_bytes)
        self.host_loads.append((req.remote_kv_tokens, start - asked, env.now - start))
        if self.stopped or engine.loading.get(req.request_id) is not req:
            return   # the replica failed meanwhile: the engine and its reservation are gone
        engine.remote_kv_arrived(req, env.now)
        self.wake()

    def stop(self) -> None:
        """The replica failed: its processes end where they are (a step in flight is lost with the engine)."""
        self.stopped = True
        self.settle(lost_at_now=True)
        if self.process.is_alive:
            self.process.interrupt()

    def run(self):
        try:
            yield from self._loop()
        except simpy.Interrupt:   # stop(): the step in flight and the engine are gone
            return

    def _loop(self):
        env = self.env
        while True:
            if not self.engine.has_work():
                self._wake = env.event()
                yield self._wake
                continue
            # hold the GPU for the whole busy period (steps back to back), release it when going idle
            with self.gpu.request() as hold:
                yield hold
                stalled = yield from self._busy_period()
            if stalled is not None:  # waiting work that cannot start until something changes (an arrival) wakes us
                if self.stall is None:
                    self.stall = (env.now, stalled)
                self._wake = env.event()
                yield self._wake

    def _busy_period(self):
        """Steps back to back while the engine has work. Returns None when it ran out of work, or the engine's idle
        reason when waiting work could not be scheduled (the replica then parks until something changes)."""
        env, engine, cost = self.env, self.engine, self.cost
        while engine.has_work() or self._inbox:
            out = engine.schedule(env.now)
            self.scheduled(out)
            for req in out.rejected:
                self.on_done(req, self.index)
            received = self._receive()
            if not out.scheduled:
                if engine.num_running():
                    raise RuntimeError(f"{engine.name} scheduled nothing with {engine.num_running()} running "
                                       f"({out.idle_reason or 'no reason given'})")
                if out.rejected or out.released or received:   # blocks were freed, or requests came: decide again
                    continue
                return out.idle_reason
            self.stall = None
            c = cost.step(out.shape)
            start = env.now
            self._stepping = self.schedules_ahead
            yield env.timeout(c.seconds)
            self._complete(out, c, start, env.now)
            # drafts and adapters: each step its own
            repeats = engine.repeat_steps(out) if engine.speculation is None and not out.shape.lora_adapters else 0
            if repeats:  # steps the engine proved identical: no schedule call
                yield from self._repeat(out, repeats)
        self._stepping = False
        return None

    def _receive(self) -> bool:
        """After a decision: the requests held while the step before it ran join the engine's queue (the next
        decision sees them), and arrivals go straight to the engine until the next step starts. Whether any came."""
        self._stepping = False
        if not self._inbox:
            return False
        held, self._inbox = self._inbox, []
        for req in held:
            self.submit(req)
        return True

    def _repeat(self, out: SchedulerOutput, steps: int):
        """Run up to `steps` repeats of `out`, priced in one pass. Those that end before the next event anywhere in the
        simulation (so nothing can look at the engine meanwhile) are applied together under one timeout, at the
        times one timeout a step would give. The first repeat that someone else could watch (an arrival, a router
        reading the engine's KV) or whose end one timeout cannot land on ends the repeats, and the engine schedules
        again: a schedule call takes the step's KV at its start, where applying a repeat takes it at its end. Unless
        nobody else reads the engine (not `watched`) and the engine proves that arrivals change none of its repeats
        (`repeats_outlast_arrivals`): then the repeats run on through any event under one timeout and are applied
        at its end (`_through`). Where requests may finish in the last repeat (`last_repeat_by_update`), `update`
        applies it, as any step: after a timeout of its own, or at the end of the one it shares through arrivals."""
        env, shape, engine = self.env, out.shape, self.engine
        ctx = shape.decode_context_tokens
        growth = engine.context_growth(shape)
        costs = self.cost.decode_run(shape, growth, steps)
        seconds = costs[:, 0]
        outlast = not self.watched and engine.repeats_outlast_arrivals
        bulk = steps - 1 if engine.last_repeat_by_update else steps   # the repeats apply_repeats may apply
        ends = np.empty(steps + 1)   # ends[j]: repeat j - 1's end; one addition a step, in order, as timeouts add
        ends[0], ends[1:] = env.now, seconds
        np.add.accumulate(ends, out=ends)
        i = 0
        while outlast and i < steps:   # no event can read the engine before the repeats end
            k = steps - i
            while k > 1 and env.now + (ends[i + k] - env.now) != ends[i + k]:   # one timeout lands where steps end
                k -= 1
            yield from self._through(out, costs[i:i + k], ends[i + 1:i + k + 1], i + k > bulk)
            i += k
        if not outlast:   # those that end before anyone acts; cut short, the engine schedules again
            start = env.now
            i = int(np.searchsorted(ends[1:bulk + 1], env.peek()))
            while i and start + (ends[i] - start) != ends[i]:
                i -= 1
            if i:
                self._complete_repeats(out, costs[:i], start, ends[1:i + 1])
                yield env.timeout(float(ends[i]) - start)
        if i == bulk < steps and not outlast and env.now + seconds[i] < env.peek():
            start = env.now
            yield env.timeout(float(seconds[i]))
            self._complete_last(out, costs[i], start, env.now)
            i += 1
        shape.decode_context_tokens = ctx + growth * i

    def _through(self, out: SchedulerOutput, costs: np.ndarray, ends: np.ndarray, by_update: bool):
        """Repeats of `out` ending at `ends` under one timeout (one repeat: its own step's timeout, which lands on its
        end), applied at its end, the last by `update` if `by_update`. Arrivals meanwhile only queue (`submit` logs
        the queue they leave, for the rows of the repeats that end after them); a failure or the end of the run
        applies those that ended by then (`settle`)."""
        start = self.env.now
        self._in_flight = (out, costs, start, ends, self.engine.num_waiting(), by_update, [])
        yield self.env.timeout(float(ends[-1]) - start if len(ends) > 1 else float(costs[0, 0]))
        self.settle()

    def settle(self, *, lost_at_now: bool = False) -> None:
        """Apply the repeats in flight under `_through` that ended by now (a step ending at this instant counts,
        unless `lost_at_now`: a failure now loses it). Called when their timeout fires, at a failure and at the end
        of the run; a no-op with none in flight."""
        if self._in_flight is None:
            return
        out, costs, start, ends, waiting, by_update, arrivals = self._in_flight
        self._in_flight = None
        n = int(np.searchsorted(ends, self.env.now, side="left" if lost_at_now else "right"))
        last = by_update and n == len(ends)   # the step a request finishes in ended: `update` applies it
        if n - last:
            queue = None
            if arrivals:   # each row's queue as the last arrival before its end left it
                times, after = zip(*arrivals)
                queue = np.array((waiting, *after))[np.searchsorted(times, ends[:n - last], side="right")]
            self._complete_repeats(out, costs[:n - last], start, ends[:n - last], queue)
        if last:
            self._complete_last(out, costs[-1], float(ends[-2]) if n > 1 else start, float(ends[-1]))

    def _complete_last(self, out: SchedulerOutput, cost: np.ndarray, start: float, end: float) -> None:
        """The last repeat of `out`, a request finishing in it (`last_repeat_by_update`): applied by `update`, as any
        step, without the preemptions `out` may have carried (`cost`: its StepCost fields)."""
        self._complete(SchedulerOutput(scheduled=out.scheduled, shape=out.shape), StepCost(*cost.tolist()), start, end)

    def _complete_repeats(self, out: SchedulerOutput, costs: np.ndarray, start: float, ends: np.ndarray,
                          waiting: np.ndarray | None = None) -> None:
        """`_complete` for repeats of `out` ending at `ends` (their StepCost fields as rows of `costs`): the same step
        rows and inter-token gaps (each repeat's decodes all sampled their previous token at the step before's end).
        `waiting`: each row's queue length where arrivals came between the repeats (the engine's now otherwise)."""
        engine = self.engine
        k = len(ends)
        usages = engine.apply_repeats(out, ends.tolist())
        shape, n = out.shape, len(out.scheduled)
        if k == 1 and waiting is None:   # _complete's row (cheaper than an array for one)
            end = float(ends[0])
            self.recorder.step(self._row(start, end, n, shape, usages[0], 0, costs[0].tolist(), n), end, {start: n})
            if self.check:
                engine.check_invariants()
            return
        # _complete's row: what all repeats share (repeats preempt nobody, though `out` may have, and carry no drafts)
        row = self._row(start, start, n, shape, 0.0, 0, costs[0].tolist(), n)
        self.recorder.repeated_steps(row, start, ends, costs, usages, waiting)
        if self.check:
            engine.check_invariants()

    def _complete(self, out: SchedulerOutput, c: StepCost, start: float, now: float) -> None:
        """A step's batch came back at `now`: apply it to the engine, record the step, report finished requests."""
        engine = self.engine
        res = engine.update(out, now)
        self.recorder.step(self._row(start, now, len(out.scheduled), out.shape, engine.kv_usage(), len(out.preempted),
                                     c, res.tokens()), now, res.itl_groups)
        if self.check:
            engine.check_invariants()
        for req in res.finished:
            self.on_done(req, self.index)

    def _row(self, start: float, end: float, n: int, shape: BatchShape, kv_usage: float, preempted: int, cost,
             output_tokens: int) -> tuple:
        """A step's row of STEP_FIELDS (`cost`: the StepCost fields in order), the queues as they are now (requests
        held for the engine's next decision among the waiting)."""
        engine = self.engine
        return (self.index, start, end, n, shape.num_prefill_tokens, shape.num_decode, engine.num_running_reported(),
                self.num_waiting(), kv_usage, preempted, *cost, shape.cuda_graph, output_tokens, shape.spec_tokens)


class PipelinedReplica(Replica):
    """Pipeline parallelism with `stages` micro-batches in flight (vLLM V1's batch queue, TensorRT-LLM's PP loop): a
    new batch enters the first stage every stage time (the GPU work / stages, plus the host work each rank does per
    micro-batch: CostModel.stage_seconds) while each batch needs the whole step time to come out, so throughput
    scales with the stages until the host work per micro-batch binds, and one request's latency does not improve.
    The engine must skip requests whose batch is still in flight (`EnginePolicy.supports_pipeline_microbatches`)."""

    def __init__(self, *args, stages: int, **kw):
        self.stages = stages
        super().__init__(*args, **kw)
        self.entry = simpy.Resource(self.env, capacity=1)  # the first stage: one micro-batch enters at a time
        self._changed = self.env.event()

    def _notify(self) -> None:
        ev, self._changed = self._changed, self.env.event()
        ev.succeed()

    def submit(self, req: Request) -> None:
        if not self.engine.add_request(req, self.env.now):
            self.on_done(req, self.index)
            return
        self._notify()

    def wake(self) -> None:
        self._notify()

    def run(self):
        self.lanes = [self.env.process(self._lane()) for _ in range(self.stages)]
        yield self.env.timeout(0)

    def stop(self) -> None:
        for lane in getattr(self, "lanes", ()):
            if lane.is_alive:
                lane.interrupt()

    def _lane(self):
        try:
            yield from self._lane_loop()
        except simpy.Interrupt:   # stop(): the micro-batches in flight are lost with the engine
            return

    def _lane_loop(self):
        env, engine = self.env, self.engine
        while True:
            out = engine.schedule(env.now) if engine.has_work() else None
            if out is not None:
                self.scheduled(out)
            for req in out.rejected if out else ():
                self.on_done(req, self.index)
            if out is None or out.is_empty:  # everything runnable is in flight (or nothing waits): wait
                yield self._changed
                continue
            held = [r.request_id for r, _ in out.scheduled]
            engine.in_flight.update(held)   # no other micro-batch schedules them until this one's update
            c = self.cost.step(out.shape)
            stage = self.cost.stage_seconds(out.shape, c.seconds, self.stages)
            start = env.now
            with self.entry.request() as hold:
                yield hold
                yield env.timeout(stage)
            yield env.timeout(c.seconds - stage)
            engine.in_flight.difference_update(held)
            self._complete(out, c, start, env.now)
            self._notify()
