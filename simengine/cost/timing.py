"""Engine-side fixed costs of a step: host CPU work, overlap, kernel launches and CUDA-graph coverage."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Priors of host time per sequence in a step (sampling bookkeeping, stop checks, incremental detokenisation, handing the
# token to the frontend). ESTIMATE for Python engine loops: vLLM RFC #6854 measured 4-13 ms of GPU idle per V0 decode
# step, about 15-50 us per sequence at the batch of a few hundred it profiled; a native (C++) output path a quarter.
PYTHON_SEQ_CPU_S = 20e-6
NATIVE_SEQ_CPU_S = 5e-6
# Priors of the frontend's latency per request (HTTP parsing, handing the request to the engine process over
# ZMQ/gRPC, and detokenising and streaming the first token back). ESTIMATE: a Python server (vLLM, SGLang,
# TensorRT-LLM's trtllm-serve, LMDeploy api_server) about 3 ms; a native one (TGI's Rust router, llama.cpp's server)
# about 1 ms.
PYTHON_FRONTEND_S = 3e-3
NATIVE_FRONTEND_S = 1e-3
# The frontend's tokenising of the prompt, per prompt token: ~500k tokens/s on one core (MiniMax-M2.5 agentic trace
# study on vLLM 0.19, andyluo7.github.io 2026-05-14), the rate of the HF tokenizers library these servers call (the
# same order as its README's 'less than 20 seconds to tokenize a GB of text' on a many-core server). A server
# tokenises the whole text it is sent, cached prefix or not. Not a queue of one: vLLM batches concurrent prompts into
# one parallel encode and TensorRT-LLM tokenises on a worker pool; but in the order sent (sim/runner.py: a short
# prompt does not overtake a long one sent before it, as a batch's encode ends for all of its prompts at once).
TOKENIZE_S_PER_TOKEN = 2e-6
# GPU time of a decode step run by a torch.compile'd model (Inductor's fused elementwise kernels and autotuned small-M
# matmuls inside the captured graph) over the same step from the eager model's CUDA graph: Llama-3-8B, TP1, batch 1,
# sglang.bench_latency 6.42 ms compiled against 7.37 ms (sgl-project/sglang issue #1008, 2024-08-09). At batch 128 the
# compiled step was 4 % slower (12.31 against 11.84 ms), which is why SGLang compiles only up to torch_compile_max_bs.
TORCH_COMPILE_DECODE_FACTOR = 6.42 / 7.37


@dataclass(frozen=True, kw_only=True)
class EngineTiming:
    """Named per-engine overhead terms. Each engine module sets them, with sources, from its mechanism."""

    scheduler_cpu_s: float            # host time of one scheduling pass (schedule, prepare the inputs)
    output_cpu_s: float               # host time to process one step's outputs (stop checks, streaming hand-off)
    overlap: bool                     # host work of step n+1 runs while the GPU runs step n
    kernel_launch_s: float = 4e-6     # one CUDA kernel launch from Python/C++ (ESTIMATE: 2.5-5 us per launch,
                                      # NVIDIA CUDA C++ Best Practices 'kernel launch overhead')
    kernels_per_layer: int = 12       # ESTIMATE: norm, qkv, rope, attn, o, add, norm, gate_up, act, down, add, ...
    graph_replay_s: float = 20e-6     # ESTIMATE: cudaGraphLaunch of a whole decode step (~10-30 us)
    cuda_graph_sizes: tuple[int, ...] = ()   # captured decode batch sizes (sorted); empty = eager always
    graph_padding: bool = True        # pad a decode batch up to the next captured size
    graph_mixed_steps: bool = False   # piecewise graphs also cover prefill/mixed steps
    custom_allreduce: bool = False    # tensor-parallel all-reduce by the engine's own one-shot kernels (NVLink), not
                                      # the collective library (NCCL): the device's custom_allreduce_latency_us
    seq_cpu_s: float = 0.0            # host time per sequence in the step (sampling, stop checks, detokenising)
    frontend_s: float = 0.0           # per request: the serving frontend's parsing and IPC to the engine and the
                                      # first token's way back (sim/runner.py delays arrivals by it)
    tokenize_s_per_token: float = 0.0  # per prompt token: the frontend's tokenising (arrivals delayed by it too; 0
                                       # where no server fronts the engine)
    compiled_max_bs: int = 0          # decode steps replayed from a graph with at most this many sequences run a
                                      # torch.compile'd model (0: none)
    compiled_gpu_factor: float = TORCH_COMPILE_DECODE_FACTOR   # their GPU time over the uncompiled graph's
    steps_per_schedule: int = 1       # steps one scheduling pass serves (vLLM V0's --num-scheduler-steps): each
                                      # step bears scheduler_cpu_s / steps_per_schedule, so a fitted or measured
                                      # pass keeps its meaning whatever the run length
    step_cpu_s: float = field(init=False)   # host time of one step before its per-sequence work: its share of a
                                            # scheduling pass, and its outputs (derived)

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_cpu_s", self.scheduler_cpu_s / self.steps_per_schedule + self.output_cpu_s)

    def gpu_factor(self, num_decode: int, pure_decode: bool, cuda_graph: bool) -> float:
        """What the step's GPU time is multiplied by: `compiled_gpu_factor` for a compiled decode step, else 1."""
        if cuda_graph and pure_decode and 0 < num_decode <= self.compiled_max_bs:
            return self.compiled_gpu_factor
        return 1.0

    def graph_for(self, num_decode: int, pure_decode: bool) -> tuple[bool, int]:
        """(uses a graph, padded decode batch) for a step with `num_decode` decodes."""
        sizes = self.cuda_graph_sizes
        if not sizes or (not pure_decode and not self.graph_mixed_steps):
            return False, num_decode
        if not pure_decode:
            return True, num_decode
        if self.graph_padding:
            i = bisect.bisect_left(sizes, num_decode)
            return (True, sizes[i]) if i < len(sizes) else (False, num_decode)
        return (num_decode in _as_set(sizes)), num_decode

    def exposed_host_s(self, gpu_s: float, extra_cpu_s: float = 0.0) -> float:
        """Host time added to the step: all of it for a synchronous loop, only the excess when overlapped.
        `extra_cpu_s` is per-step host work such as grammar masks (overlapped with the forward the same way)."""
        cpu = self.step_cpu_s + extra_cpu_s
        if not self.overlap:
            return cpu
        excess = cpu - gpu_s
        return excess * (excess > 0.0)  # max(0, excess), elementwise too (arrays of steps)


_SET_CACHE: dict[tuple[int, ...], frozenset[int]] = {}


def _as_set(sizes: tuple[int, ...]) -> frozenset[int]:
    s = _SET_CACHE.get(sizes)
    if s is None:
        s = _SET_CACHE[sizes] = frozenset(sizes)
    return s
