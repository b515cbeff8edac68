"""vLLM V0's multi-step streaming (`--num-scheduler-steps k`, 0.5.4-0.7): a run's tokens reach the client at its end.

With k > 1, V0 scheduled once for a run of k decode steps and processed the run's sampled tokens after its last
forward (their "pythonization" waits for the GPU once it is ahead of the host), so the server streamed each request
one chunk of up to k tokens per run: vllm-project/vllm issue #6854 (the multi-step RFC, its author's answer on
streaming), Lambda Labs' vLLM v0.6.0 runs (LambdaLabsML/vllm-benchmark results/prompt_10: 12 ITL entries for a
120-token output; a 6-token request's last 5 tokens in one chunk after the 10-step run) and the SGLang v0.3 benchmark
of vLLM 0.6.0 (median ITL 231 ms at TPOT 23.6 ms). A request that finished inside the run was reported with it.
"""

from __future__ import annotations

from simengine.core.batch import StepResult
from simengine.core.request import Request


class MultiStepDelivery:
    """Holds what a run's steps stream until the run's last step: one inter-token gap per request and run (from its
    last delivered token), its token times and its finish moved to the run's end. Step rows keep the tokens each
    step computed (`StepResult.num_tokens`)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[Request, float, int]] = {}   # id -> (request, last delivered time, delivered)
        self.finished: list[Request] = []

    def before(self, scheduled: list[tuple[Request, int]]) -> None:
        """A step's batch is applied next: remember what each decoding request's client has seen so far."""
        pending = self.pending
        for req, _ in scheduled:
            if req.num_output_tokens and req.request_id not in pending:
                pending[req.request_id] = (req, req.last_token_s, req.num_output_tokens)

    def after(self, res: StepResult, now: float, run_over: bool) -> StepResult:
        """The step's result as the client sees it: nothing streamed inside a run, everything at its last step."""
        res.num_tokens = res.tokens()
        if not run_over:
            self.finished += res.finished
            res.finished, res.itl_groups = [], {}
            return res
        itl: dict[float, int] = {}
        for req, prev, delivered in self.pending.values():
            itl[prev] = itl.get(prev, 0) + 1
            req.last_token_s = now
            times = req.token_times
            if times is not None:
                for i in range(delivered, len(times)):
                    times[i] = now
        for req in self.finished:
            req.finish_s = now
        res.finished = self.finished + res.finished
        res.itl_groups = itl
        self.pending, self.finished = {}, []
        return res
