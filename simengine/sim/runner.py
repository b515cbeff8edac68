"""Run one engine entry's cluster (pools of replicas behind routers, KV links between prefill and decode pools) on a
scenario's request stream in a SimPy environment."""

from __future__ import annotations

import functools
import time
from array import array
from dataclasses import dataclass, field

import numpy as np
import simpy

from simengine.config.scenario import DeploymentConfig, EngineEntry, Scenario
from simengine.core.request import Request, Status
from simengine.cost.step import CostModel
from simengine.engines import EnginePolicy
from simengine.engines.memory import Deployment
from simengine.metrics.recorder import Recorder
from simengine.routers import ReplicaState, Router
from simengine.routers.base import router_and_params
from simengine.sim.build import Pool, build_engine, cost_model, plan_pools
from simengine.sim.links import Link, kv_path, place
from simengine.sim.replica import PipelinedReplica, Replica
from simengine.workload.arrivals import arrival_times, stage_times
from simengine.workload.generator import RequestFactory, SessionPlan

# A closed-loop client whose request is refused at once waits this long before its next one (1 s, like a
# client retry delay), so a refusal can never spin the simulation at one instant.
REFUSAL_BACKOFF_S = 1.0
PROGRESS_EVERY_S = 0.5   # wall-clock seconds between progress calls (a display only)


@dataclass
class RunResult:
    """Everything one engine run produced (frames are built later from the recorder's rows)."""

    scenario: Scenario
    entry: EngineEntry
    deployment: Deployment      # the first pool's
    recorder: Recorder
    end_s: float
    engines: list[EnginePolicy] = field(default_factory=list)
    partial: bool = False       # stopped at a wall-clock deadline before the run's end
    faults: dict | None = None  # with deployment.failures: failures, retries, requests failed by them, availability
    down: list[tuple[int, float, float]] = field(default_factory=list)  # (replica, down at, back up at) per failure
    pools: list[Pool] = field(default_factory=list)
    decisions: list[int] = field(default_factory=list)   # requests each replica's router sent it
    disaggregation: dict | None = None                    # KV transfers and links (prefill/decode pools)
    stalls: list[dict] = field(default_factory=list)      # replicas stuck at the end (Runner.stalls)
    # each replica's prefix-cache lookups over the run, (queried, hit) tokens, its failed engines' included
    prefix_tokens: list[tuple[int, int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.entry.display


class Tier:
    """Replicas behind one router: the first hop (mixed or prefill pools) or the decode pools. The router numbers
    them from 0 (`first` is the first one's run-wide index)."""

    def __init__(self, indices: range, config: DeploymentConfig, where: str, seed: int, salt: int):
        self.indices, self.first = indices, indices.start
        router, params = router_and_params(config.router, config.router_params, at=f"{where}.")
        self.router: Router = router(params, len(indices), np.random.default_rng([seed, salt]))


@dataclass(slots=True)
class FrontendBatch:
    """Requests sent at one instant, tokenised together: they reach the engine at `reach_s`, in the order sent."""

    sent_s: float
    requests: list[Request]
    reach_s: float
    left: bool = False


class Runner:
    """Wires arrivals, sessions, routers, replicas and KV links into one SimPy environment."""

    def __init__(self, scenario: Scenario, entry: EngineEntry, *, check_invariants: bool = False):
        self.scenario, self.entry = scenario, entry
        self.pools = plan_pools(scenario, entry)
        self.pool_of = [p for p in self.pools for _ in p.indices]   # replica index -> its pool
        self.dep = self.pools[0].dep
        self.env = simpy.Environment()
        self.recorder = Recorder()
        wl = scenario.workload
        self.factory = RequestFactory(wl, scenario.seed, self.dep.model.vocab_size,
                                      min(p.dep.model.max_model_len for p in self.pools), exact=scenario.exact)
        self.compile_s = wl.structured_output.compile_s if wl.structured_output.fraction else 0.0
        self.check_invariants = check_invariants
        self.engines = [build_engine(p.entry, p.dep) for p in self.pools for _ in p.indices]
        # prefix-cache lookups (queried, hit tokens) of each replica's engines that failed and were replaced
        self.retired_prefix_tokens: list[tuple[int, int]] = [(0, 0)] * len(self.engines)
        if scenario.exact:
            for eng in self.engines:
                eng.exact_mode()
        # private tokens are proven equal only where a block's publication depends on which blocks fill, not when: a
        # host tier's LRU keys on when each block is stored; accepted drafts move a request's computed tokens past its
        # last allocation, whose end (the tokens it had) is what a cache publishes, which a private request giving
        # its blocks up later cannot tell
        if any(eng.host_tier_stats() is not None or eng.speculation is not None for eng in self.engines):
            self.factory.mark_private = False
        self.costs: dict[str, CostModel] = {}
        self.replicas = [self._replica(i, eng) for i, eng in enumerate(self.engines)]
        # the serving frontend's time from the client's send to the engine's queue (parsing, IPC) and of the first
        # token's way back, and its tokenising per prompt token: a request reaches the engine frontend_delay_s after
        # it was sent
        self.frontend_s = self.engines[0].timing.frontend_s
        self.tokenize_s_per_token = 0.0 if wl.prompt_token_ids else self.engines[0].timing.tokenize_s_per_token
        # requests leave the frontend in the order they were sent, and those sent at one instant together (a server
        # encodes concurrent prompts as one batch, whose tokens are all ready when its longest prompt is): the
        # batch of the last send instant
        self.frontend_batch: FrontendBatch | None = None
        self.detailed_requests = scenario.output.detailed_requests  # ids below keep every token's time
        self.live: dict[int, Request] = {}
        self.waiters: dict[int, simpy.Event] = {}
        self.user_locks: dict[int, simpy.Resource] = {}   # multi-turn prompt groups: one turn of a user at a time
        self.stages_run: list[tuple[float, float, int, int]] = []   # staged arrivals: (start, end, first id, end id)
        self.sources_open = 0
        self.all_done = self.env.event()
        front = [p for p in self.pools if p.role != "decode"]
        self.front = Tier(range(front[0].first, front[-1].first + front[-1].count), front[0].config,
                          front[0].where, scenario.seed, 104729)
        back = [p for p in self.pools if p.role == "decode"]
        self.back = Tier(range(back[0].first, back[-1].first + back[-1].count), back[0].config, back[0].where,
                         scenario.seed, 130363) if back else None
        self.decisions = [0] * len(self.replicas)
        self.reported: list[ReplicaState] | None = None   # load reports (deployment.router_state_delay_s > 0)
        # replica failures (deployment.failures): which replica holds each live request, who is up, the requests
        # waiting for any replica to come back, and the log
        self.assigned: dict[int, int] = {}
        self.up = [True] * len(self.replicas)
        self.pending: list[Request] = []
        self.retries: dict[int, int] = {}
        self.down: list[list] = []      # [replica, down at, back up at or -1 while down]
        self.failed_by_fault = 0
        self.prefilling: dict[int, Request] = {}   # request id -> its copy on a prefill replica
        if self.back is not None:
            self._init_disaggregation()

    def _replica(self, i: int, eng: EnginePolicy) -> Replica:
        pool, wl = self.pool_of[i], self.scenario.workload
        cost = self.costs.get(pool.name)   # one step-time model per pool: its replicas are identical
        if cost is None:
            cost = self.costs[pool.name] = cost_model(eng, wl.structured_output.mask_s,
                                                      kernels=self.scenario.deployment.cost_model)
        else:
            eng.timing = cost.timing   # the calibrated terms cost_model gave the pool's first engine
        if pool.dep.pp > 1 and eng.supports_pipeline_microbatches:
            replica: Replica = PipelinedReplica(self.env, i, eng, cost, self.recorder, self._on_done,
                                                check_invariants=self.check_invariants, stages=pool.dep.pp)
        else:
            replica = Replica(self.env, i, eng, cost, self.recorder, self._on_done,
                              check_invariants=self.check_invariants)
        replica.watched = len(self.engines) > 1
        if pool.role == "decode":
            replica.on_kv_reserved = self._kv_reserved
        return replica

    # ---- routing and completion ---------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        self.recorder.arrived += 1
        if req.request_id < self.detailed_requests:
            req.token_times = array("d")
        self.live[req.request_id] = req
        ready = req.arrival_s + self.frontend_delay_s(req)
        batch = self.frontend_batch
        if batch is not None and batch.sent_s == req.arrival_s and not batch.left:   # sent with the batch
            batch.requests.append(req)
            batch.reach_s = max(batch.reach_s, ready)
            return
        # not before the batch sent before it (an open loop waited for frontend_s already)
        reach = ready if batch is None or batch.left else max(ready, batch.reach_s)
        self.frontend_batch = FrontendBatch(req.arrival_s, [req], reach)
        self._leave_frontend(self.frontend_batch)

    def _leave_frontend(self, batch: FrontendBatch, _event: simpy.Event | None = None) -> None:
        """The frontend hands a batch's requests on, in the order sent, once its longest prompt is tokenised (a
        later request of the batch may have moved that time on: then wait for it)."""
        if batch.reach_s > self.env.now:
            self.env.timeout(batch.reach_s - self.env.now).callbacks.append(functools.partial(self._leave_frontend,
                                                                                             batch))
            return
        batch.left = True   # a request sent at the same instant from now on starts a batch of its own
        # one decision per request picks its replica in every tier that offers a choice (a P/D proxy picks the prefill
        # and the decode replica together), so it is paid here, once, where any tier has more than one replica
        choice = len(self.front.indices) > 1 or (self.back is not None and len(self.back.indices) > 1)
        decision_s = self.scenario.deployment.router_decision_s if choice else 0.0
        for req in batch.requests:
            wait = decision_s
            if req.structured and self.compile_s:
                # the grammar compiles before the scheduler may run the request (vLLM skips it until ready,
                # SGLang keeps it in a grammar queue): it reaches the engine compile_s later
                wait += self.compile_s
            if wait > 0:
                self.env.timeout(wait).callbacks.append(functools.partial(self._route_on, req))
            else:
                self._route(req)

    def _route_on(self, req: Request, _event: simpy.Event) -> None:
        self._route(req)

    def frontend_delay_s(self, req: Request) -> float:
        """From the client's send to the engine's queue: the frontend's fixed part and its tokenising of the prompt."""
        return self.frontend_s + self.tokenize_s_per_token * req.prompt_len

    def _choose(self, tier: Tier, req: Request) -> Replica | None:
        """The replica of `tier` the router picks among those up (None when all are down)."""
        ids = tier.indices
        up = ids if all(self.up[i] for i in ids) else [i for i in ids if self.up[i]]
        if not up:
            return None
        if len(ids) == 1:
            i = up[0]
        else:
            states = [self._state(i, tier.first) for i in up]
            i = tier.first + tier.router.choose(req, states)
        self.decisions[i] += 1
        return self.replicas[i]

    def _route(self, req: Request) -> None:
        replica = self._choose(self.front, req)
        if replica is None:                  # every replica is down: the request waits for the first one back
            self.pending.append(req)
            return
        self.assigned[req.request_id] = replica.index
        if self.back is not None:
            self.prefill_at[req.request_id] = replica.index
            replica.submit(self._prefill_copy(req, self.pool_of[replica.index].config.kv_transfer))
            return
        replica.submit(req)

    def _state(self, i: int, first: int) -> ReplicaState:
        """Replica i's state as its router sees it (the last load report, or now), numbered from `first`."""
        rep = self.replicas[i]
        if self.reported is None:
            return ReplicaState.live(i - first, rep.engine, rep.waiting_published, rep.num_waiting())
        s = self.reported[i]
        return ReplicaState(i - first, s.num_running, s.num_waiting, s.kv_usage, s.kv_capacity_tokens,
                            events=rep.engine, waiting_published=s.waiting_published)

    def _live_state(self, i: int) -> ReplicaState:
        rep = self.replicas[i]
        e = rep.engine
        return ReplicaState(i, e.num_running(), rep.num_waiting(), e.kv_usage(), e.kv_capacity_tokens(),
                            waiting_published=rep.waiting_published)

    def _load_reports(self, every_s: float):
        """Every replica reports its state every `every_s` seconds; the router sees only the latest reports."""
        while True:
            self.reported = [self._live_state(i) for i in range(len(self.replicas))]
            yield self.env.timeout(every_s)

    def _tier_of(self, i: int) -> Tier:
        return self.back if self.back is not None and i in self.back.indices else self.front

    # ---- prefill/decode disaggregation ---------------------------------------------------------------------
    def _init_disaggregation(self) -> None:
        self.placement = place(self.pools)
        self.egress = [Link(self.env) for _ in self.replicas]    # a replica's devices sending KV
        self.ingress = [Link(self.env) for _ in self.replicas]   # and receiving it
        self.kv_bytes_per_token = {p.name: p.dep.model.kv_bytes_per_token(p.dep.kv_elem_bytes) for p in self.pools}
        self.prefill_at: dict[int, int] = {}             # request id -> its prefill replica
        self.prefill_end_s: dict[int, float] = {}        # request id -> when its prefill finished
        self.prefill_done: dict[int, simpy.Event] = {}   # layerwise: the copy's prefill finished
        self.decode_sent: dict[int, tuple[float, int]] = {}  # request id -> (sent to decode at, replica schedules)
        self.transfers: list[tuple] = []   # (request id, prefill replica, decode replica, bytes, queued_s, link_s,
                                           #  held_s: prefill done -> KV arrived, admission_wait_s, waited for room)
        for i in self.front.indices:
            if self.pool_of[i].config.kv_transfer == "layerwise":
                self.replicas[i].on_scheduled = self._prefill_started

    def _prefill_copy(self, req: Request, kv_transfer: str) -> Request:
        """What the prefill replica serves: the prompt and one output token (vLLM's proxy sends max_tokens=1, SGLang's
        and TRT-LLM's prefill servers stop after the first token), its KV kept when it finishes."""
        copy = resend(req)
        copy.output_len = copy.max_tokens = 1
        copy.hold_kv = True
        self.prefilling[req.request_id] = copy
        if kv_transfer == "layerwise":
            self.prefill_done[req.request_id] = self.env.event()
        return copy

    def _prefill_started(self, out) -> None:
        """Layerwise: a prefill's first chunk is running, so its decode replica is chosen and reserves blocks now, and
        the KV streams to it as the layers compute."""
        for req, _ in out.scheduled:
            if req.hold_kv and req.first_scheduled_s == self.env.now and \
                    req.request_id not in self.decode_sent:
                self._to_decode(self.live[req.request_id], req)

    def _prefilled(self, copy: Request, replica: int) -> None:
        """The prefill replica finished (or refused) the copy: the request goes on to a decode replica, whose
        reservation starts the transfer (in layerwise mode it went there when the prefill started)."""
        rid = copy.request_id
        self.front.router.finished(copy, replica - self.front.first)
        req = self.live[rid]
        if copy.status is Status.FAILED:
            del self.prefilling[rid]
            del self.prefill_at[rid]
            self.prefill_done.pop(rid, None)
            req.status, req.fail_reason, req.finish_s = Status.FAILED, copy.fail_reason, self.env.now
            self.assigned.pop(rid, None)
            self._on_done(req, replica)
            return
        self.prefill_end_s[rid] = self.env.now
        event = self.prefill_done.get(rid)
        if event is not None:
            event.succeed()
        if rid not in self.decode_sent:
            self._to_decode(req, copy)

    def _to_decode(self, req: Request, copy: Request) -> None:
        req.first_scheduled_s = copy.first_scheduled_s   # its queue time is the prefill side's
        req.num_cached_tokens = copy.num_cached_tokens
        req.remote_kv_tokens = req.prompt_len
        assert self.back is not None, "a decode hand-over without a decode pool"
        replica = self._choose(self.back, req)
        assert replica is not None, "every decode replica down: _to_decode is called only while one is up"
        self.assigned[req.request_id] = replica.index
        self.decode_sent[req.request_id] = (self.env.now, replica.schedules)
        replica.submit(req)

    def _kv_reserved(self, reqs: list[Request], replica: int) -> None:
        for req in reqs:
            self.env.process(self._transfer(req, replica))

    def _transfer(self, req: Request, dst: int):
        """Move the KV the decode replica reserved blocks for: queue on the prefill replica's send side and the decode
        replica's receive side and hold both for bytes / rate (layerwise: while the prefill computes, its last layer
        sent when it ends), then the latency; the prefill replica frees its copy and the decode replica may schedule
        the request."""
        env, rid = self.env, req.request_id
        copy = self.prefilling[rid]
        src = self.prefill_at[rid]
        src_pool, dst_pool = self.pool_of[src], self.pool_of[dst]
        path = kv_path(src_pool, dst_pool, self.placement[src], self.placement[dst])
        num_bytes = req.remote_kv_tokens * self.kv_bytes_per_token[src_pool.name]
        sent_s, schedules = self.decode_sent[rid]
        reserved_s = env.now
        # not reserved at its first chance: the next schedule call, or the one after for an engine that schedules
        # ahead (its decision for the step after the one in flight was taken before the request arrived)
        waited_for_room = self.replicas[dst].schedules > schedules + 1 + self.replicas[dst].schedules_ahead
        out, into = self.egress[src], self.ingress[dst]
        with out.resource.request() as a:
            yield a
            with into.resource.request() as b:
                yield b
                start = env.now
                yield env.timeout(num_bytes / path.bandwidth_bytes_s)
                out.used(start, env.now, num_bytes)
                into.used(start, env.now, num_bytes)
        done = self.prefill_done.get(rid)
        if done is not None:   # layerwise: the bytes went as the layers were computed; the last layer goes at the end
            if not done.triggered:
                yield done
            last = self.prefill_end_s[rid] + num_bytes / self.dep.model.num_layers / path.bandwidth_bytes_s
            if last > env.now:
                yield env.timeout(last - env.now)
        yield env.timeout(path.latency_s)
        self.replicas[src].engine.free_held(copy)
        del self.prefilling[rid], self.prefill_at[rid]
        self.decode_sent.pop(rid)
        self.prefill_done.pop(rid, None)
        end_prefill = self.prefill_end_s.pop(rid)
        self.transfers.append((rid, src, dst, num_bytes, start - reserved_s, env.now - start, env.now - end_prefill,
                               reserved_s - sent_s, waited_for_room))
        self.replicas[dst].engine.remote_kv_arrived(req, env.now)
        if req.is_finished:   # its one token came with the KV (SGLang)
            self._on_done(req, dst)
        else:
            self.replicas[dst].wake()

    # ---- failures -------------------------------------------------------------------------------------------
    def _stated_failure(self, i: int, at_s: float, down_s: float):
        yield self.env.timeout(max(at_s - self.env.now, 0.0))
        yield from self._outage(i, down_s)

    def _random_failures(self, i: int, rng):
        cfg = self.scenario.deployment.failures
        assert cfg is not None
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
        old.engine.sync()       # lazily advanced counters (the decode cohort) as of the last completed step
        pool = self.pool_of[i]
        engine = build_engine(pool.entry, pool.dep)   # what comes back: the failed engine and its cache are gone
        queried, hit = old.engine.prefix_cache_tokens()   # the lookups it served count in the run's hit rate
        self.retired_prefix_tokens[i] = (self.retired_prefix_tokens[i][0] + queried,
                                         self.retired_prefix_tokens[i][1] + hit)
        self.engines[i] = engine
        held = sorted(rid for rid, r in self.assigned.items() if r == i)
        router = self._tier_of(i).router
        for rid in held:
            del self.assigned[rid]
            if rid in self.live:
                router.finished(self.live[rid], i - self._tier_of(i).first)
        for rid in held:
            if rid in self.live:
                self._lost(self.live[rid], i)
        yield self.env.timeout(down_s)
        self.replicas[i] = self._replica(i, engine)
        self.up[i] = True
        log[2] = self.env.now
        pending, self.pending = self.pending, []
        for req in pending:
            self._route(req)

    def _lost(self, req: Request, i: int) -> None:
        """A request the failed replica held: resent (a fresh copy, same id and send time) or failed."""
        n = self.retries.get(req.request_id, 0)
        failures = self.scenario.deployment.failures
        if failures is not None and n < failures.max_retries:
            self.retries[req.request_id] = n + 1
            fresh = resend(req)
            if req.token_times is not None:
                fresh.token_times = array("d")  # the client sees only the retry's tokens
            self.live[req.request_id] = fresh
            # routed after the instant's other events: a failure of another replica at the same instant is applied
            # first, so a retry is not spent on a replica that is going down now (it waits for one back instead)
            self.env.timeout(0).callbacks.append(functools.partial(self._route_on, fresh))
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
        if self.prefilling:
            copy = self.prefilling.get(req.request_id)
            if copy is req:
                self._prefilled(req, replica)
                return
            if copy is not None:   # the decode side refused it: the prefill replica lets its KV go
                self.replicas[self.prefill_at.pop(req.request_id)].engine.free_held(copy)
                del self.prefilling[req.request_id]
                self.decode_sent.pop(req.request_id, None)
                self.prefill_done.pop(req.request_id, None)
                self.prefill_end_s.pop(req.request_id, None)
        if self.back is not None and self.live.get(req.request_id) is not req:
            # a layerwise prefill copy finishing after its request left (the decode side refused it): only the
            # prefill replica's router hears of it
            self.front.router.finished(req, replica - self.front.first)
            return
        self.live.pop(req.request_id, None)
        placed = self.assigned.pop(req.request_id, None)
        if placed is not None:
            tier = self._tier_of(placed)
            tier.router.finished(req, placed - tier.first)
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

    def _staged(self):
        """Staged arrivals (ArrivalConfig stages, inference-perf's run_stage): each stage's requests at Poisson times
        from its start, the prompt pool from its first prompt; the next stage once all of them have finished."""
        env, horizon, frontend = self.env, self.scenario.horizon_s, self.frontend_s
        for stage in self.scenario.workload.arrival.stages:
            if env.now > horizon:
                break
            self.factory.pool_next = 0
            sent, start, first = [], env.now, self.factory.next_id
            for t in stage_times(stage, self.factory.rng_arrivals, env.now).tolist():
                if t > horizon:
                    break
                if self.factory.pool_multi_turn:
                    yield env.timeout(t - env.now)
                    sent.append(env.process(self._pool_turn(*self.factory.pool_turn_slot())))
                    continue
                req = self.factory.plain_request(t)
                if t + frontend > env.now:
                    yield env.timeout(t + frontend - env.now)
                ev = self.waiters[req.request_id] = env.event()
                self.submit(req)
                sent.append(ev)
            yield env.all_of(sent)
            self.stages_run.append((start, env.now, first, self.factory.next_id))
        self._close_source()

    def _pool_turns(self):
        """Open-loop arrivals of multi-turn prompt groups: at each arrival time the next (user, question) slot
        starts a turn; the source closes when every turn has finished (a turn may wait for its user)."""
        env, horizon, wl = self.env, self.scenario.horizon_s, self.scenario.workload
        limit = wl.num_requests if wl.num_requests is not None else float("inf")
        t, made, turns = 0.0, 0, []
        while made < limit:
            times = arrival_times(wl.arrival, self.factory.rng_arrivals, int(min(4096, limit - made)), t).tolist()
            for x in times:
                if x > horizon:
                    break
                yield env.timeout(x - env.now)
                turns.append(env.process(self._pool_turn(*self.factory.pool_turn_slot())))
            if times[-1] > horizon:
                break
            made, t = made + len(times), times[-1]
        yield env.all_of(turns)
        self._close_source()

    def _pool_turn(self, user: int, question: int):
        """One multi-turn request: after the user's previous one has finished (inference-perf's session lock, taken
        before the request is timed), the conversation so far and the question; the answer extends it."""
        lock = self.user_locks.get(user)
        if lock is None:
            lock = self.user_locks[user] = simpy.Resource(self.env, capacity=1)
        with lock.request() as turn:
            yield turn
            req = self.factory.pool_turn(self.env.now, user, question)
            if self.frontend_s:
                yield self.env.timeout(self.frontend_s)
            done = yield from self._send_and_wait(req)
            self.factory.pool_turn_done(user, done)

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
            n = wl.sessions.population or 0   # population or arrival_rate: exactly one is given
            self.sources_open = n
            for i in range(n):
                self.env.process(self._session_slot(i, n))
        elif wl.arrival.process == "stages":
            self.sources_open = 1
            self.env.process(self._staged())
        elif wl.arrival.process == "closed_loop":
            self.sources_open = wl.arrival.concurrency or 0   # required of closed_loop
            for _ in range(self.sources_open):
                self.env.process(self._closed_loop_user())
        elif self.factory.pool_multi_turn:
            self.sources_open = 1
            self.env.process(self._pool_turns())
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
        for rep in self.replicas:
            rep.settle()   # repeats in flight that ended by now
        for eng in self.engines:
            eng.sync()
        for req in sorted(self.live.values(), key=lambda r: r.request_id):
            self.recorder.request(req, -1, "unfinished")
        return RunResult(self.scenario, self.entry, self.dep, self.recorder, self.env.now, self.engines, partial,
                         self.fault_summary(self.env.now), self.down_intervals(self.env.now), self.pools,
                         self.decisions, self.disaggregation_summary(self.env.now), self.stalls(),
                         [(int(t[0]), int(t[1])) for t in np.add(self.retired_prefix_tokens,
                                                                  [e.prefix_cache_tokens() for e in self.engines])])

    def stalls(self) -> list[dict]:
        """Replicas that ended the run stuck: up, work in the engine, nothing it could schedule, and no step since."""
        return [{"replica": rep.index, "since_s": round(rep.stall[0], 6),
                 "requests": rep.engine.num_running() + rep.engine.num_waiting(),
                 "reason": rep.stall[1] or "no reason given"}
                for rep in self.replicas if rep.stall is not None and not rep.stopped and rep.engine.has_work()]

    def link_spans(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Busy intervals (starts, ends) of each prefill replica's send side and decode replica's receive side."""
        if self.back is None:
            return {}
        out = {}
        for i, pool in enumerate(self.pool_of):
            link = self.egress[i] if pool.role == "prefill" else self.ingress[i]
            spans = np.frombuffer(link.spans, dtype=np.float64).reshape(-1, 2)
            out[f"{i} {pool.name} {'send' if pool.role == 'prefill' else 'receive'}"] = (spans[:, 0], spans[:, 1])
        return out

    def disaggregation_summary(self, end_s: float) -> dict | None:
        """KV transfers (their queueing on the links, time on the link, how long the prefill replica held each
        request's KV, the decode side's admission wait and how many found no room) and each link's busy fraction."""
        if self.back is None:
            return None
        t = np.array([x[3:] for x in self.transfers], dtype=float).reshape(-1, 6)

        def ms(col: int) -> dict:
            v = t[:, col] * 1e3
            if not len(v):
                return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
            return {"mean": round(float(v.mean()), 4), "p50": round(float(np.percentile(v, 50)), 4),
                    "p99": round(float(np.percentile(v, 99)), 4), "max": round(float(v.max()), 4)}

        links = []
        for i in range(len(self.replicas)):
            side, link = ("send", self.egress[i]) if self.pool_of[i].role == "prefill" else ("receive", self.ingress[i])
            links.append({"replica": i, "pool": self.pool_of[i].name, "side": side, "transfers": link.transfers,
                          "gb": round(link.bytes / 1e9, 6),
                          "busy_fraction": round(link.busy_s / end_s, 6) if end_s > 0 else 0.0})
        modes = sorted({p.config.kv_transfer for p in self.pools if p.role == "prefill"})
        return {"kv_transfer": "+".join(modes), "transfers": len(t), "kv_gb": round(float(t[:, 0].sum()) / 1e9, 6),
                "queue_ms": ms(1), "link_ms": ms(2), "kv_held_on_prefill_ms": ms(3), "decode_admission_wait_ms": ms(4),
                "waits_for_room": int(t[:, 5].sum()), "links": links}


def resend(req: Request) -> Request:
    """The client's retry of a request a failed replica lost: the same id, send time and tokens, nothing computed."""
    return Request(req.request_id, req.arrival_s, req.token_ids, req.prompt_len, req.output_len,
                   max_tokens=req.max_tokens, priority=req.priority, session_id=req.session_id, turn=req.turn,
                   slo_class=req.slo_class, structured=req.structured, unique_outputs=req.unique_outputs,
                   private_from=req.private_from, lora_id=req.lora_id, lora_rank=req.lora_rank)

