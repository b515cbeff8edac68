"""Append-only recording for the hot loop: tuples and flat lists, no pandas here."""

from __future__ import annotations

from simengine.core.request import Request, Status

REQUEST_COLUMNS = (
    "request_id", "replica", "session_id", "turn", "priority", "arrival_s", "first_scheduled_s",
    "first_token_s", "finish_s", "prompt_len", "output_len", "num_output_tokens", "num_cached_tokens",
    "num_preemptions", "status", "fail_reason", "slo_class", "structured",
)
STEP_COLUMNS = (
    "replica", "start_s", "end_s", "batch_size", "prefill_tokens", "decode_tokens", "num_running",
    "num_waiting", "kv_usage", "preempted", "step_s", "compute_s", "memory_s", "comm_s", "overhead_s",
    "cuda_graph",
)


class Recorder:
    """Collects request rows, step rows and inter-token gaps (value, count) for one engine run."""

    def __init__(self):
        self.requests: list[tuple] = []
        self.steps: list[tuple] = []
        self.itl_values: list[float] = []
        self.itl_counts: list[int] = []
        self.arrived = 0

    def request(self, req: Request, replica: int, status: str) -> None:
        self.requests.append((
            req.request_id, replica, req.session_id, req.turn, req.priority, req.arrival_s,
            req.first_scheduled_s, req.first_token_s, req.finish_s, req.prompt_len, req.output_len,
            req.num_output_tokens, max(req.num_cached_tokens, 0), req.num_preemptions, status, req.fail_reason,
            req.slo_class, int(req.structured)))

    def finished(self, req: Request, replica: int) -> None:
        self.request(req, replica, "completed" if req.status is Status.FINISHED else "failed")

    def step(self, row: tuple, now: float, itl_groups: dict[float, int]) -> None:
        self.steps.append(row)
        for prev, count in itl_groups.items():
            self.itl_values.append(now - prev)
            self.itl_counts.append(count)
