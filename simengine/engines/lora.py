"""Multi-LoRA serving as vLLM runs it (vllm/lora/, v1/core/sched/scheduler.py): adapter slots, their memory and loads.

Requests name adapters (Request.lora_id, workload `lora:`). The engine reserves GPU memory for `max_loras` adapter
slots at `max_lora_rank` for every target module of every layer (the stacked LoRA weights vLLM allocates at start,
so they come out of the KV pool), keeps at most `max_loras` adapters active, least recently used replaced, and
caches up to `max_cpu_loras` in host memory. A step whose batch needs an adapter that is not active loads it
first: from the host cache over the device's host link, or from disk (cost/work.py `ADAPTER_DISK_BYTES_S`) the
first time; the step waits for the load (LRUCacheWorkerLoRAManager.set_active_adapters before the forward). The
scheduler admits a waiting request only while its adapter is among the step's adapters or a slot is left (the
rest wait, later requests may pass them). The batched LoRA kernels (Punica's shrink and expand, one pair per
target module and layer) read each distinct adapter's weights once and compute on every LoRA token, padded to
max_lora_rank (cost/step.py prices them).
"""

from __future__ import annotations

from collections import OrderedDict

from simengine.cost.work import ADAPTER_BYTES_PER_PARAM, lora_params_per_rank

__all__ = ["ADAPTER_BYTES_PER_PARAM", "AdapterSlots", "lora_params_per_rank"]

class AdapterSlots:
    """The GPU's `max_loras` active adapters and the host's `max_cpu_loras` cached ones, each LRU."""

    def __init__(self, max_loras: int, max_cpu_loras: int):
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.loads_from_host = self.loads_from_disk = 0

    def activate(self, adapters: set[int]) -> tuple[list[int], list[int]]:
        """Make the step's adapters (at most max_loras) active: (loaded from the host cache, read from disk)."""
        host, disk = [], []
        for a in adapters:
            if a in self.gpu:
                self.gpu.move_to_end(a)
                continue
            if len(self.gpu) >= self.max_loras:
                evict = next(x for x in self.gpu if x not in adapters)
                del self.gpu[evict]
            self.gpu[a] = None
            if a in self.cpu:
                self.cpu.move_to_end(a)
                host.append(a)
            else:
                disk.append(a)
                self.cpu[a] = None
                if len(self.cpu) > self.max_cpu_loras:
                    self.cpu.popitem(last=False)
        self.loads_from_host += len(host)
        self.loads_from_disk += len(disk)
        return host, disk
