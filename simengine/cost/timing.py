"""Engine-side fixed costs of a step: host CPU work, overlap, kernel launches and CUDA-graph coverage."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineTiming:
    """Named per-engine overhead terms. Each engine module sets them, with sources, from its mechanism."""

    scheduler_cpu_s: float            # host time to schedule and prepare one step's inputs
    output_cpu_s: float               # host time to process one step's outputs (stop checks, streaming hand-off)
    overlap: bool                     # host work of step n+1 runs while the GPU runs step n
    kernel_launch_s: float = 4e-6     # one CUDA kernel launch from Python/C++ (ESTIMATE: 2.5-5 us per launch,
                                      # NVIDIA CUDA C++ Best Practices 'kernel launch overhead')
    kernels_per_layer: int = 12       # ESTIMATE: norm, qkv, rope, attn, o, add, norm, gate_up, act, down, add, ...
    graph_replay_s: float = 20e-6     # ESTIMATE: cudaGraphLaunch of a whole decode step (~10-30 us)
    cuda_graph_sizes: tuple[int, ...] = ()   # captured decode batch sizes (sorted); empty = eager always
    graph_padding: bool = True        # pad a decode batch up to the next captured size
    graph_mixed_steps: bool = False   # piecewise graphs also cover prefill/mixed steps
    # Calibrated terms (simengine/engines/calibration.yaml, `simengine calibrate`); these defaults add nothing.
    layer_latency_s: float = 0.0      # fixed latency per layer per step (inter-kernel gaps of an unfused stack)
    allreduce_hop_latency_s: float = 0.0      # software latency per ring hop of one tensor-parallel all-reduce
    allreduce_bandwidth_fraction: float = 1.0  # achieved / nominal link bandwidth of the engine's all-reduce
    seq_cpu_s: float = 0.0            # host time per sequence in the step (sampling, stop checks, detokenising)

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
        cpu = self.scheduler_cpu_s + self.output_cpu_s + extra_cpu_s
        if not self.overlap:
            return cpu
        excess = cpu - gpu_s
        return excess * (excess > 0.0)  # max(0, excess), elementwise too (RooflineCost.decode_steps)


_SET_CACHE: dict[tuple[int, ...], frozenset[int]] = {}


def _as_set(sizes: tuple[int, ...]) -> frozenset[int]:
    s = _SET_CACHE.get(sizes)
    if s is None:
        s = _SET_CACHE[sizes] = frozenset(sizes)
    return s
