"""KV transfer links of a cluster (prefill/decode disaggregation): where replicas sit, the path between two of them,
and each replica's send and receive side as a SimPy resource that transfers queue on."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import simpy

from simengine.errors import InputError


@dataclass(frozen=True, slots=True)
class Path:
    """How KV moves from one replica to another: the rate of all their devices' links together, and the latency."""

    bandwidth_bytes_s: float
    latency_s: float
    kind: str                   # "nvlink" (the node's scale-up link) or "network"

    def seconds(self, num_bytes: float) -> float:
        """Time of a transfer alone on the path."""
        return num_bytes / self.bandwidth_bytes_s + self.latency_s


def place(pools) -> list[tuple[str, int]]:
    """(hardware, node) of every replica: pools in order fill nodes of their device, a replica never split across
    two nodes, and a new pool on the same device continuing in the node the last one left off."""
    where: list = []
    used: dict[str, int] = {}     # hardware -> devices taken so far
    for p in pools:
        hw, size = p.dep.hardware, p.dep.num_devices
        for _ in range(p.count):
            taken = used.get(hw.name, 0)
            if taken % hw.node_size + size > hw.node_size:   # does not fit in the node's rest: the next node
                taken += hw.node_size - taken % hw.node_size
            where.append((hw.name, taken // hw.node_size))
            used[hw.name] = taken + size
    return where


def kv_path(src_pool, dst_pool, src_at: tuple[str, int], dst_at: tuple[str, int]) -> Path:
    """The path of a KV transfer between two replicas: inside one node over the scale-up link of each device, else
    over the network, each side's devices in parallel (every rank sends its own KV shard) at the slower side's rate."""
    a, b = src_pool.dep, dst_pool.dep
    lanes = min(a.num_devices, b.num_devices)
    if src_at == dst_at:
        hw = a.hardware
        return Path(lanes * hw.link_bandwidth_bytes_s, hw.link_latency_s, "nvlink")
    for pool in (src_pool, dst_pool):
        hw = pool.dep.hardware
        if not hw.network_bandwidth_bytes_s:
            raise InputError(f"KV from pool '{src_pool.name}' to pool '{dst_pool.name}' leaves the node, and "
                             f"{hw.name} describes no network (no network: in its YAML); add one to "
                             f"hardware/{hw.vendor}/{hw.name}.yaml, or fit both pools in one node", field=pool.where)
    rate = min(a.hardware.network_bandwidth_bytes_s, b.hardware.network_bandwidth_bytes_s) * lanes
    return Path(rate, max(a.hardware.network_latency_s, b.hardware.network_latency_s), "network")


class Link:
    """One replica's send (or receive) side: transfers through it queue first come, first served, each at the path's
    full rate while it holds it; `busy_s` and `bytes` accumulate for the utilisation report."""

    def __init__(self, env: simpy.Environment):
        self.resource = simpy.Resource(env, capacity=1)
        self.busy_s = 0.0
        self.bytes = 0.0
        self.transfers = 0
        self.spans = array("d")   # start, end of each transfer it carried, in order

    def used(self, start_s: float, end_s: float, num_bytes: float) -> None:
        self.busy_s += end_s - start_s
        self.bytes += num_bytes
        self.transfers += 1
        self.spans.extend((start_s, end_s))
