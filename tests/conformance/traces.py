"""Random scheduler traces for the vLLM conformance check: a scheduler configuration and requests (arrival step,
token ids, output length, priority), all drawn from one seed with numpy, so the recorder (in vLLM's environment)
and the replay (in ours) build the same trace from the seed alone. Pure numpy: no simengine or vLLM import."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 32000


@dataclass(frozen=True)
class TraceRequest:
    rid: int
    arrival_step: int      # added before this schedule call
    tokens: list[int]      # prompt, then the outputs the fake model samples (the last output is never read back)
    prompt_len: int
    output_len: int
    priority: int


@dataclass(frozen=True)
class Trace:
    seed: int
    block_size: int
    num_blocks: int        # vLLM's num_gpu_blocks: block 0 is the null block, num_blocks - 1 hold tokens
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    policy: str            # fcfs | priority
    max_model_len: int
    requests: list[TraceRequest]


def make_trace(seed: int) -> Trace:
    """Small pools that force preemption in some traces, shared prefixes and repeated prompts for the prefix cache,
    bursts and gaps of arrivals, both policies, and the knobs that shape a step."""
    rng = np.random.default_rng([20261201, seed])
    block_size = int(rng.choice([8, 16, 32]))
    num_blocks = int(rng.integers(12, 160))
    max_num_seqs = int(rng.choice([2, 4, 8, 16, 64]))
    max_num_batched_tokens = int(rng.choice([64, 128, 256, 512, 2048]))
    max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)   # vLLM requires it
    threshold = int(rng.choice([0, 0, 0, 32, 100]))
    policy = "priority" if rng.random() < 0.3 else "fcfs"
    caching = bool(rng.random() < 0.7)
    capacity = (num_blocks - 1) * block_size   # a request never needs more than the pool
    max_model_len = capacity
    if threshold > max_model_len:   # vLLM refuses a threshold above max_model_len
        threshold = 0
    n = int(rng.integers(3, 40))
    prefixes = [rng.integers(0, VOCAB, int(rng.integers(1, 6)) * block_size).tolist() for _ in range(3)]
    earlier: list[list[int]] = []
    reqs, step = [], 0
    for rid in range(n):
        step += int(rng.choice([0, 0, 1, 1, 2, 5]))
        output_len = int(rng.integers(1, 40))
        kind = rng.random()
        if earlier and kind < 0.15:   # the same prompt again
            prompt = list(earlier[int(rng.integers(len(earlier)))])
        else:
            prompt = prefixes[int(rng.integers(3))] if kind < 0.6 else []
            prompt = prompt + rng.integers(0, VOCAB, int(rng.integers(1, 300))).tolist()
        prompt = prompt[:max(1, capacity - output_len)]
        if len(prompt) + output_len > capacity:
            output_len = max(1, capacity - len(prompt))
        earlier.append(prompt)
        outputs = rng.integers(0, VOCAB, output_len).tolist()
        reqs.append(TraceRequest(rid, step, prompt + outputs, len(prompt), output_len, int(rng.integers(0, 4))))
    return Trace(seed, block_size, num_blocks, max_num_seqs, max_num_batched_tokens, threshold, caching, policy,
                 max_model_len, reqs)
