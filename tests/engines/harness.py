"""The shared invariant driver for engine policies: feed requests by hand, check caps and bookkeeping every step."""

from __future__ import annotations

from simengine.core.request import Request, Status


def run_step(eng, now: float = 0.0, dt: float = 0.01):
    """One step by hand: schedule at `now`, finish it `dt` later, check the engine's bookkeeping."""
    out = eng.schedule(now)
    res = eng.update(out, now + dt)
    eng.check_invariants()
    return out, res


def run_steps(eng, steps: int, now: float = 0.0) -> list:
    """`steps` back-to-back steps 10 ms apart; their scheduler outputs."""
    return [run_step(eng, now + i * 0.01)[0] for i in range(steps)]


def drive(eng, reqs: list[Request], dt: float = 0.02, on_step=None,
          expect_empty_kv: bool = True) -> tuple[list[Request], list[Request]]:
    """Shared invariants: caps per step, no empty step while running, invariants after each update, conservation."""
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    done: list[Request] = []
    failed: list[Request] = []
    now = 0.0
    while pending or eng.has_work():
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            if not eng.add_request(r, now):
                failed.append(r)
        if not eng.has_work():
            now = pending[0].arrival_s
            continue
        out = eng.schedule(now)
        failed += out.rejected
        if out.is_empty:
            assert eng.num_running() == 0, "empty step while requests run"
            now = pending[0].arrival_s if pending else now + dt
            continue
        assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled)
        assert all(n >= 1 and r.num_computed_tokens + n <= r.num_tokens for r, n in out.scheduled)
        if eng.step_token_limit is not None:
            assert out.num_tokens <= eng.step_token_limit
        if eng.batch_size_limit is not None:
            assert len(out.scheduled) <= eng.batch_size_limit and eng.num_running() <= eng.batch_size_limit
        now += dt
        res = eng.update(out, now)
        done += res.finished
        eng.check_invariants()
        if on_step:
            on_step(eng)
    assert len(done) + len(failed) == len(reqs)
    assert all(r.status is Status.FINISHED and r.num_output_tokens == r.output_len for r in done)
    assert eng.num_running() == 0 and eng.num_waiting() == 0
    if expect_empty_kv:
        assert eng.kv_usage() == 0
    return done, failed
