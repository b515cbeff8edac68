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

__all__ = ["AdapterSlots", "lora_params_per_rank"]

class AdapterSlots:
    """The GPU's `max_loras` active adapters at `max_rank` and the host's `max_cpu_loras` cached ones, each LRU. An
    adapter neither active nor cached is read from disk first, unless the engine `preloaded` every adapter into host
    memory at start (SGLang's --lora-paths without max_loaded_loras)."""

    def __init__(self, max_loras: int, max_cpu_loras: int, max_rank: int, *, preloaded: bool = False):
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.preloaded = preloaded
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.loads_from_host = self.loads_from_disk = 0

    def slot_bytes_per_device(self, model, tp: int) -> float:
        """GPU memory the slots take on each device (allocated at start, so out of the KV pool)."""
        return self.max_loras * self.max_rank * lora_params_per_rank(model) * ADAPTER_BYTES_PER_PARAM / tp

    def refusal(self, req) -> str:
        """Why the engine turns a request's adapter away ('' when it serves it)."""
        if req.lora_rank > self.max_rank:
            return f"LoRA adapter {req.lora_id} of rank {req.lora_rank} exceeds max_lora_rank {self.max_rank}"
        return ""

    def admits(self, loras: set[int], req) -> bool:
        """Whether `req` may join a step whose adapters are `loras` (adding its own when it may): its adapter is
        already there, or a slot is left."""
        if req.lora_id < 0 or req.lora_id in loras:
            return True
        if len(loras) >= self.max_loras:
            return False
        loras.add(req.lora_id)
        return True

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
            if a in self.cpu or self.preloaded:
                self.cpu[a] = None
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

    def shape_step(self, scheduled, shape) -> None:
        """Activate the adapters of a step's requests and put its LoRA work in its shape."""
        ranks = {r.lora_id: r.lora_rank for r, _ in scheduled if r.lora_id >= 0}
        if not ranks:
            return
        host, disk = self.activate(set(ranks))
        shape.lora_adapters, shape.lora_rank = len(ranks), self.max_rank
        shape.lora_tokens = sum(n for r, n in scheduled if r.lora_id >= 0)
        shape.lora_host_load_ranks = sum(ranks[a] for a in host)
        shape.lora_disk_load_ranks = sum(ranks[a] for a in disk)

    def stats(self, slot_bytes_per_device: float) -> dict:
        return {"max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras,
                "slots_gb_per_device": round(slot_bytes_per_device / 1e9, 4),
                "loads_from_host": self.loads_from_host, "loads_from_disk": self.loads_from_disk}
