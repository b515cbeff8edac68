"""TurboMind's loop before v0.1.0 (LMDeploy's `prefill_passes: separate`, LlamaBatch of v0.1.0a1): prefill-only
passes for an iteration's new contexts, then one decode pass; docs/engines/lmdeploy.md "The loop by release"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from simengine.core.batch import SchedulerOutput
from simengine.kvcache.manager import NO_HIT

if TYPE_CHECKING:
    from simengine.engines.lmdeploy import LmdeployEngine


def separate_pass(self: LmdeployEngine, out: SchedulerOutput, now: float) -> None:
    """One forward of the LmdeployEngine `self` (v0.1.0a1's LlamaBatch): while the iteration's sequences have
    contexts to compute, a prefill-only pass of whole contexts but their last token, by arrival, within
    max_context_token_num tokens and (padded) longest context x sequences; then one decode pass of every sequence
    with one token left, which ends the iteration; the next one admits from the gateway first. Memory is taken as
    the unified pass takes it (later arrivals' tail blocks); a sequence that cannot fit sits the iteration out."""
    if not self._in_iteration:
        self._admit()
        self._in_iteration = True
    limit, tokens, widest, size = self.max_context_token_num, 0, 0, 0
    self._stop = len(self.seqs)
    self._produced.clear()
    i = 0
    while i < len(self.seqs):
        req = self.seqs[i]
        hit = self._resume_hit(req)
        begin = req.num_computed_tokens + hit.num_tokens
        n = req.num_tokens - begin - 1
        wide = max(widest, req.num_tokens - 1)
        if n > 0 and size and (tokens + n > limit or wide * (size + 1) > limit):
            break   # the next mini-batch
        if n > 0 and not self._make_room(i, req, n, hit, out):
            if i == 0:   # the oldest sequence can never run: answer it rather than stall
                self._drop(req, out)
                continue
            n = 0        # sits the iteration out
        if n > 0:
            self._run(req, n, hit, now, out)
            tokens, widest, size = tokens + n, wide, size + 1
        i += 1
    if not out.scheduled:   # every context computed (or none fits): the iteration's decode pass
        for i, req in enumerate(self.seqs):
            if req.num_tokens - req.num_computed_tokens == 1 and self._make_room(i, req, 1, NO_HIT, out):
                self._run(req, 1, NO_HIT, now, out)
        self._in_iteration = False
    self._active = {r.request_id for r, _ in out.scheduled}
    self._active_first = False   # (the cohort's condition; no cohort runs this loop)
