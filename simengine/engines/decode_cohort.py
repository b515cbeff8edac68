"""A simulation speed device, not an engine mechanism: steady decodes advanced as one lazy cohort.

A paged engine that schedules its running requests first, in running order, into one token budget (vLLM's V1 loop)
can hand that part of its step to a `DecodeCohort`. A steady decode (one token a step, no KV event and not its last
token in sight) joins the cohort, whose counters advance lazily: a step walks only the other running requests and
prices the cohort from two sums. When the step's tokens or blocks might not fit (a cap could bind, an allocation could
fail) the cohort is dissolved and the engine's exact per-request loop decides. Results are the same either way
(tests/engines/test_fast_paths.py; `Scenario.exact` runs without it).

What an engine declares: its step token limit, the tokens it gives a running request when the budget does not bind
(`chunk`), and its KV manager. It calls `schedule_running`, then `order` for the requests it admitted, `context_tokens`
for the step's shape and `stepped` in its update; `sync` writes every member's counters as of now.

An engine that schedules every running decode first and its running prefills after them, with what the decodes left
of the budget (Sarathi-Serve's stall-free batching), calls `schedule_decodes` instead: the cohort takes the decodes
(one token each) and hands the running prefills back, in running order, for the engine's own chunking. Their blocks
must already be held (allocated or reserved at admission), so the block check covers the decodes alone.

An engine whose every running decode takes one token a step, with no budget that could bind, and which checks its own
KV (kv is None: SGLang's token pool, TGI's and Orca's reservations made at admission) calls `schedule_lockstep` on the
steps that run its decodes and gives the others it returns their tokens; steps that pause the decodes (SGLang's
prefills, TGI's new batch prefilled alone) leave the cohort alone. The cohort's clock counts the steps that went
through it, and a member's previous token came at the end of the last one. Such an engine may say which decodes may
join (`steady`), write a member's KV holdings when its counters are written (`settle`) and stop a request before its
end (`stop`: TGI's 1,024-token visits).

Counted members: those whose only KV event is taking a block when their tokens fill the last one (their own outputs'
blocks are published at release, KVCacheManager.defer_output_publish, or never, being private, Request.private_from;
or caching is off). A member that takes a block at step s takes one every block_size steps, so the step's takers are
the members of phase s % block_size. Their blocks leave the pool on that step, in running order, but go to `spare` and
reach the member's table when it leaves the cohort (block ids are labels: nothing can tell).

Members that record every token's time (Request.token_times: the scenario's detailed requests) join like the
others: while one is in, the cohort keeps each step's end, and a member gets the times of the steps it skipped when
its counters are written.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from simengine.core.batch import SchedulerOutput
from simengine.core.request import Request, Status
from simengine.kvcache.manager import KVCacheManager

Ordered = tuple[int, Request]   # (running-order number, request)


class DecodeCohort:
    """The lazily advanced steady decodes of one engine, and the running order of the others."""

    def __init__(self, kv: KVCacheManager | None, token_limit: int, chunk: Callable[[Request, int], int] | None = None,
                 *, steady: Callable[[Request], bool] | None = None, settle: Callable[[Request], None] | None = None,
                 stop: Callable[[Request], int] | None = None):
        self.kv = kv        # None: the engine's own token pool, which the engine checks (schedule_lockstep)
        self.token_limit = token_limit
        self.chunk = chunk  # tokens the engine gives a running request with n left, budget aside (None: all n)
        self.steady = steady  # the engine's own condition on a steady decode joining (None: none)
        self.settle = settle  # writes a member's KV holdings once its counters are current (token pool engines)
        self.stop = stop      # outputs at which the engine's loop stops a request before its end (TGI's visits)
        self.steps_done = 0                # steps the cohort took part in (it carried every member): its clock
        self.last_step_end_s = -1.0        # the end of the last such step: every member's last token came then
        self.consulted = False             # this step's schedule went through the cohort
        self.remaining = 0                 # sum of (max_tokens - outputs + steps_done) at joining (max_tokens_left)
        self.members: dict[int, tuple[Request, int]] = {}  # request_id -> (req, 1)
        self.joined: dict[int, int] = {}   # request_id -> the step a member joined at (or was last brought up to date)
        self.context = 0                   # sum of (prompt + outputs - steps_done) at joining; context = this + n*steps
        self.events: dict[int, list[Ordered]] = {}  # step -> members whose blocks change or whose last token is due
        # then (a calendar: every step's list is taken whole)
        self.others: list[Ordered] = []    # running requests outside the cohort
        self.num_ordered = 0               # running-order numbers handed out
        self.phase_members: list[list[Ordered]] = [[] for _ in range(kv.block_size if kv is not None else 0)]
        self.phase_of: dict[int, int] = {}  # request_id -> phase, for counted members
        self.spare: list[int] = []         # blocks taken for counted members, not yet in their tables
        self.in_flight = 0                 # 1 between a step that carried the cohort and its update
        # members that record every token's time (Request.token_times: the scenario's detailed requests) get the end
        # of each step they skipped from step_ends, kept from step step_ends_from on while any such member is in
        self.timed = 0
        self.step_ends = array("d")
        self.step_ends_from = 0

    # ---- the engine's calls ---------------------------------------------------------------------------
    def order(self, reqs: list[Request], *, fresh: bool) -> None:
        """Number `reqs` in running order after every request numbered so far; `fresh` replaces the others (after a
        step the exact loop decided: `reqs` is then the whole running list)."""
        if not reqs and not fresh:
            return
        start = self.num_ordered
        self.num_ordered += len(reqs)
        numbered = list(zip(range(start, self.num_ordered), reqs))
        if fresh:
            self.others = numbered
        else:
            self.others += numbered

    def running_others(self) -> list[Request]:
        """The running requests outside the cohort, in running order (their counters are current)."""
        return [req for _, req in self.others if req.status is Status.RUNNING]

    def context_tokens(self, num_lazy: int) -> int:
        """Context tokens the step's `num_lazy` members read."""
        return self.context + num_lazy * self.steps_done

    def max_tokens_left(self) -> int:
        """The members' outputs still allowed (max_tokens - outputs), summed."""
        return self.remaining - len(self.members) * self.steps_done

    def stepped(self, out: SchedulerOutput, itl: dict[float, int], now: float) -> None:
        """The engine applied `out` at `now`. A step scheduled through the cohort moves its clock, and every member's
        token joins the step's gaps (each member's previous token came at the end of the last such step). An engine
        whose members sit out some steps (SGLang's prefill steps) schedules those without the cohort: its clock
        stays."""
        if self.consulted:
            if out.num_lazy:
                prev = self.last_step_end_s
                itl[prev] = itl.get(prev, 0) + out.num_lazy
            if self.timed:
                self.step_ends.append(now)
            self.steps_done += 1
            self.last_step_end_s = now
            self.consulted = False
        self.in_flight = 0

    def sync(self) -> None:
        """Every member's counters as of now (they stay members)."""
        for req, _ in self.members.values():
            self._materialise(req)
        self.joined = dict.fromkeys(self.joined, self.steps_done)

    def schedule_running(self, out: SchedulerOutput) -> int | None:
        """The running-request part of a step with the cohort advanced as a whole: steady others join it, members
        whose blocks change this step allocate (in running order, with the others), members due their last token
        leave it and the others take their tokens. Returns the budget left, or None after dissolving the cohort when
        the exact loop must decide (a cap could bind or an allocation fail)."""
        return self._schedule(out, None)

    def schedule_decodes(self, out: SchedulerOutput) -> list[Request] | None:
        """As `schedule_running`, for a decodes-first engine: the step's decodes only (one token each). Returns the
        running prefills, in running order, for the engine to schedule after the decodes, or None after dissolving
        the cohort (the decodes' tokens or blocks might not fit)."""
        prefills: list[Request] = []
        return prefills if self._schedule(out, prefills) is not None else None

    def schedule_lockstep(self, out: SchedulerOutput) -> list[Request]:
        """A step of an engine whose every running decode takes one token, with no budget that could bind, and whose
        KV the engine has checked itself (SGLang's decode step, TGI's running batch): the members go into `out`,
        advanced lazily. Returns the others in running order (members due their last token among them) for the
        engine to give their tokens."""
        others = self._join()
        self._take_due(self.steps_done, others)
        self.others = others
        out.scheduled = [*self.members.values()]
        out.num_lazy = len(self.members)
        self.in_flight = 1 if self.members else 0
        return [req for _, req in others]

    def _join(self) -> list[Ordered]:
        """Steady decodes among the others join the cohort (each with its first event in the calendar); returns the
        running others left, in running order."""
        self.in_flight = 0
        self.consulted = True
        step, cohort, events, joined = self.steps_done, self.members, self.events, self.joined
        others, prev = [], self.last_step_end_s
        kv, steady, stop = self.kv, self.steady, self.stop
        bs = kv.block_size if kv is not None else 0
        phase_members, phase_of = self.phase_members, self.phase_of
        uncached = kv is None or not kv.enable_prefix_caching
        defer = kv is not None and kv.defer_output_publish
        for entry in self.others:
            req = entry[1]
            if req.status is not Status.RUNNING:
                continue  # finished since
            out_tokens, computed = req.num_output_tokens, req.num_computed_tokens
            end = req.output_len
            if stop is not None:
                end = min(end, stop(req))
            if (out_tokens and computed == req.prompt_len + out_tokens - 1 and req.last_token_s == prev
                    and out_tokens + 1 < end and not req.structured and (steady is None or steady(req))):
                cohort[req.request_id] = (req, 1)
                joined[req.request_id] = step
                if req.token_times is not None:
                    self._time(step)
                self.context += req.prompt_len + out_tokens - step
                self.remaining += req.max_tokens - out_tokens + step
                last_in = end - 1 - out_tokens  # steps to its last token
                if kv is None:  # its one event: last token due
                    when = step + last_in
                else:
                    kv_in = req.kv_settled_tokens - computed  # tokens its blocks take before it needs another
                    if 0 <= kv_in < bs and (uncached or defer and req.unique_outputs or req.private_from <= computed):
                        phase = (step + kv_in) % bs  # counted: its blocks fill at steps step + kv_in + k * bs
                        phase_members[phase].append(entry)
                        phase_of[req.request_id] = phase
                        when = step + last_in
                    else:  # its first event: blocks change, or last token due
                        when = step + (kv_in if kv_in < last_in else last_in) if kv_in > 0 else step
                events.setdefault(when, []).append(entry)
                continue
            others.append(entry)
        return others

    def _schedule(self, out: SchedulerOutput, prefills: list[Request] | None) -> int | None:
        """`schedule_running`; with a `prefills` list, running requests that are not decodes go there unscheduled."""
        others = self._join()
        step, cohort, events = self.steps_done, self.members, self.events
        kv = self.kv
        assert kv is not None, "schedule_running and schedule_decodes check blocks: the cohort needs the KV manager"
        bs = kv.block_size
        phase_members = self.phase_members
        due = self._take_due(step, others)
        self.others = others
        # the step fits (no cap binds, no allocation fails) when every request's tokens and new blocks do
        budget = self.token_limit - len(cohort)
        chunk = self.chunk
        takers = phase_members[step % bs]  # counted members whose blocks fill: one new block each
        needed = len(due) + len(takers)  # an evented member needs at most one block
        scheduled, allocating = [], []
        for order, req in others:
            computed = req.num_computed_tokens
            n = req.prompt_len + req.num_output_tokens - computed
            if prefills is not None and (n != 1 or not req.num_output_tokens):  # Request.is_decoding, inline
                prefills.append(req)
                continue
            if chunk is not None:
                n = chunk(req, n)
            budget -= n
            if computed + n > req.kv_settled_tokens:
                needed += kv.blocks_needed(req, n)
                allocating.append((order, req, n))
            scheduled.append((req, n))
        pool = kv.pool
        free = pool.num_free
        if needed > free and due:
            needed += sum(kv.blocks_needed(r, 1) for _, r, _ in due) - len(due)
        if budget < 0 or needed > free:
            self.dissolve()
            return None
        out.scheduled = [*cohort.values(), *scheduled]
        out.num_lazy = len(cohort)
        if allocating or (due and takers):  # blocks leave the pool in running order
            allocating += due
            allocating += [(order, req, 0) for order, req in takers]
            allocating.sort()
        else:
            allocating = due
            if takers:
                self.spare += pool.allocate(len(takers))
        allocate, append, spare = kv.allocate_slots, kv.append_slot, self.spare
        for order, req, n in allocating:
            if not n:  # a counted member's block
                spare.append(pool.allocate_one())
                continue
            computed = req.num_computed_tokens
            if computed + n > req.kv_settled_tokens and not (append(req) if n == 1 else allocate(req, n)):
                raise RuntimeError(f"decode cohort step: allocation for request {req.request_id} failed after the "
                                   "block check")
            if req.request_id in cohort:  # a member: queue its next event (kv_in, last_in >= 1 after allocating)
                kv_in = req.kv_settled_tokens - computed
                last_in = req.output_len - 1 - req.num_output_tokens
                events.setdefault(step + (kv_in if kv_in < last_in else last_in), []).append((order, req))
        self.in_flight = 1 if cohort else 0  # until the update: members hold this step's blocks
        return budget

    def dissolve(self) -> None:
        """Every member back to exact per-request scheduling (a step the cohort cannot take as a whole)."""
        for req, _ in self.members.values():
            self._materialise(req)
        self.members.clear()
        self.joined.clear()
        self.events.clear()
        self.context = 0
        self.remaining = 0
        self.timed = 0
        del self.step_ends[:]
        self.phase_of.clear()
        for members in self.phase_members:
            members.clear()

    # ---- inside -------------------------------------------------------------------------------------------
    def _take_due(self, step: int, others: list[Ordered]) -> list[tuple[int, Request, int]]:
        """Members whose event is this step, in running order: those whose blocks change stay, with one token to
        allocate; those due their last token leave for `others` (kept in running order): the exact rules finish
        them."""
        due: list[tuple[int, Request, int]] = []
        now_due = self.events.pop(step, None)
        if not now_due:
            return due
        if len(now_due) > 1:
            now_due.sort()
        prev = self.last_step_end_s
        leavers = False
        joined = self.joined
        for order, req in now_due:
            rid = req.request_id
            steps = step - joined[rid]  # _materialise's counters, inline
            if steps:
                req.num_computed_tokens += steps
                req.num_output_tokens += steps
                req.last_token_s = prev
                if req.token_times is not None:
                    self._add_times(req, joined[rid])
            if self.kv is not None and req.num_output_tokens + 1 < req.output_len:  # its blocks change
                joined[rid] = step
                due.append((order, req, 1))
                continue
            del joined[rid]
            del self.members[rid]
            if req.token_times is not None:
                self.timed -= 1
            self.context -= req.prompt_len + req.num_output_tokens - step
            self.remaining -= req.max_tokens - req.num_output_tokens + step
            phase = self.phase_of.pop(rid, None)
            if phase is not None:
                self.phase_members[phase].remove((order, req))
                self._claim(req)
            elif self.settle is not None:
                self.settle(req)
            others.append((order, req))
            leavers = True
        if leavers:
            others.sort()
        return due

    def _materialise(self, req: Request) -> None:
        """Write a member's counters as of now, and put a counted member's blocks in its table (or let the engine
        settle its holdings)."""
        steps = self.steps_done - self.joined[req.request_id]
        if steps:
            req.num_computed_tokens += steps
            req.num_output_tokens += steps
            req.last_token_s = self.last_step_end_s
            if req.token_times is not None:
                self._add_times(req, self.joined[req.request_id])
        if req.request_id in self.phase_of:
            self._claim(req)
        elif self.settle is not None:
            self.settle(req)

    def _time(self, step: int) -> None:
        """A member recording its token times joined at `step`: keep every step's end from there on."""
        if not self.timed:
            self.step_ends_from = step
            del self.step_ends[:]
        self.timed += 1

    def _add_times(self, req: Request, since: int) -> None:
        """The token times of the steps a timed member skipped since step `since` (its counters already moved)."""
        base = self.step_ends_from
        req.token_times.extend(self.step_ends[since - base:self.steps_done - base])  # type: ignore[union-attr]

    def _claim(self, req: Request) -> None:
        """A counted member's blocks taken since it joined (or last claimed), from `spare` into its table; its
        counters are current (and with a step in flight, its blocks also hold the token that step computes)."""
        kv = self.kv
        assert kv is not None   # counted members are paged
        k = kv.blocks_for(req.num_computed_tokens + self.in_flight) - kv.num_blocks_of(req)
        if k:
            spare = self.spare
            kv.adopt(req, spare[-k:])
            del spare[-k:]

    def check_invariants(self, running: list[Request]) -> None:
        """Members and others are the running set (`running`: the engine's, finishing requests left out), every
        member is a steady decode with one pending event, and the counted members' phases hold. Call after `sync`."""
        members = [r for r, _ in self.members.values()]
        others = self.running_others()
        assert sorted(r.request_id for r in members + others) == sorted(r.request_id for r in running), \
            "cohort and others are not the running set"
        assert sum(map(len, self.events.values())) == len(members), "a member without its leave event"
        assert not self.spare, "blocks taken for counted members and in no table"
        counted = sorted(r.request_id for m in self.phase_members for _, r in m)
        assert counted == sorted(self.phase_of), "phase lists and phase_of disagree"
        for phase, m in enumerate(self.phase_members):
            for _, r in m:
                assert self.kv is not None
                assert r.kv_settled_tokens == self.kv.num_blocks_of(r) * self.kv.block_size, \
                    "a counted member with an event"
                bs = self.kv.block_size
                assert (self.steps_done + r.kv_settled_tokens - r.num_computed_tokens) % bs == phase, "phase drift"
        assert all(step >= self.steps_done for step in self.events), "a member stayed past its event"
        assert all(r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens < r.output_len
                   for r in members), "a member that is not a steady decode"
        assert self.context + len(members) * self.steps_done == sum(r.num_tokens for r in members)
        assert self.max_tokens_left() == sum(r.max_tokens - r.num_output_tokens for r in members)
