"""Accelerator specs loaded from hardware/<vendor>/<name>.yaml (units converted to SI here, nowhere else)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from simengine.config.loader import check_fraction, from_dict, load_yaml
from simengine.errors import InputError, unknown_name

REPO_ROOT = Path(__file__).resolve().parents[2]
HARDWARE_DIR = REPO_ROOT / "hardware"

# HBM/unified capacities are marketed in GiB-sized units; the CUDA runtime reports about 99 % of that as the device's
# total (cudaMemGetInfo, what engines size their pools from): H100 80 GB -> 79.18-79.22 GiB in vLLM's startup logs
# (vllm-project/vllm PR #10511; llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md;
# llm-d-incubation/llm-d-planner PR #205), A100 40 GB -> 39.5 GiB (ovg-project/kvcached PR #448: 36.33 GiB at 0.92).
# nvidia-smi's memory.total is a little larger (H100 80 GB: 81559 MiB).
USABLE_FRACTION_OF_MARKETED = 0.99
COMPUTE_DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int4", "fp4")


@dataclass(frozen=True, kw_only=True)
class InterconnectYaml:
    name: str
    bandwidth_gb_s_per_direction: float
    latency_us: float                         # one small NCCL (RCCL, HCCL, oneCCL) all-reduce call
    bandwidth_fraction: float = 1.0           # achieved all-reduce bus bandwidth / link bandwidth (nccl-tests busbw)
    custom_allreduce_latency_us: float | None = None  # one small all-reduce by engines' custom kernels (null: none)


@dataclass(frozen=True, kw_only=True)
class NetworkYaml:
    """The scale-out network between nodes, per device (each device's own NIC in DGX/HGX-style nodes)."""

    name: str
    bandwidth_gb_s_per_device: float          # per direction
    latency_us: float                         # one small RDMA transfer, end to end


@dataclass(frozen=True, kw_only=True)
class HostLinkYaml:
    """The device's link to host memory (KV offload): PCIe, or a coherent chip-to-chip link."""

    name: str
    bandwidth_gb_s: float                     # achieved host-to-device copy rate of pinned memory, per device
    latency_us: float                         # one small asynchronous copy, end to end


@dataclass(frozen=True, kw_only=True)
class EfficiencyYaml:
    gemm_fraction: float | dict[str, float]   # one value, or per compute dtype with a `default`
    memory_bandwidth_fraction: float
    kernel_floor_us: float = 0.0              # GPU time of the smallest kernel (launch-to-completion in a graph)
    sustained_compute_fraction: float = 1.0   # compute-bound rate under continuous load / in a burst (MSMF / MAMF)


@dataclass(frozen=True, kw_only=True)
class HardwareYaml:
    """The YAML file as written (human units). See hardware/README.md."""

    name: str
    display_name: str
    vendor: str
    device_class: str
    memory_gb: float
    memory_bandwidth_gb_s: float
    peak_tflops: dict[str, float]
    # dense FP16 tensor rate with FP16 accumulate where it exceeds peak_tflops.fp16 (GeForce dies: twice the
    # FP32-accumulate rate stored there); what a library call computing in FP16 reaches (llama.cpp's cuBLAS path)
    fp16_accumulate_tflops: float | None = None
    interconnect: InterconnectYaml
    node_size: int
    network: NetworkYaml | None = None        # across nodes; none: no modelled transfer leaves the node
    host_link: HostLinkYaml | None = None     # to host memory; none: KV offload to the host is refused
    tdp_w: float | None = None
    price_usd_per_hour: float | None = None
    price_source_date: str | None = None
    efficiency: EfficiencyYaml
    kernel_tables: str | None = None          # a measured-kernel system (aiconfigurator-core systems/data/<name>)
    kernel_tables_comm: bool = True           # false: its all-reduce times describe the collecting host, not the device
    sm_count: int | None = None               # streaming multiprocessors (NVIDIA; kernels whose rate is per SM)
    boost_clock_mhz: float | None = None      # the clock the datasheet's tensor peaks are quoted at
    confidence: str = "C"
    calibration: dict[str, str | float | int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator in SI units."""

    name: str
    display_name: str
    vendor: str
    device_class: str
    memory_bytes: float
    memory_bandwidth_bytes_s: float
    peak_flops: dict[str, float]
    link_bandwidth_bytes_s: float   # per direction
    link_latency_s: float           # one small-message all-reduce through the collective library (NCCL)
    node_size: int
    tdp_w: float | None
    price_usd_per_hour: float | None
    price_source_date: str | None = None   # when the price was read (its source is the comment beside it)
    gemm_fractions: dict[str, float]   # achieved / peak per compute dtype; key "default" for the others
    memory_bandwidth_fraction: float
    kernel_floor_s: float = 0.0
    # a compute-bound kernel's rate under continuous load (the power-capped clock) over its rate in the short bursts
    # that kernel tables and GEMM microbenchmarks time; 1.0 where no sustained measurement of the device exists
    sustained_compute_fraction: float = 1.0
    link_bandwidth_fraction: float = 1.0
    custom_allreduce_latency_s: float | None = None
    kernel_tables: str | None = None
    kernel_tables_comm: bool = True   # the tables' all-reduce times price the interconnect (false: the link terms do)
    sm_count: int | None = None
    boost_clock_hz: float | None = None
    fp16_accumulate_flops: float | None = None   # FP16 tensor rate with FP16 accumulate where above peak_flops["fp16"]
    # the physical terms' values before `simengine calibrate` fitted them (calibration.prior_<term> in the YAML)
    calibration_priors: dict[str, float] = field(default_factory=dict)
    network_bandwidth_bytes_s: float = 0.0   # per device and direction across nodes (0: none described)
    network_latency_s: float = 0.0
    host_link_bandwidth_bytes_s: float = 0.0  # host-to-device copies per device (0: none described)
    host_link_latency_s: float = 0.0
    path: str = ""

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for a compute dtype."""
        return self.peak_flops[dtype]

    def gemm_fraction(self, dtype: str) -> float:
        """Achieved / peak of large GEMMs computing in `dtype` (the `default` entry when the dtype has none)."""
        f = self.gemm_fractions
        return f[dtype] if dtype in f else f["default"]

    @property
    def sm_clocks_per_s(self) -> float | None:
        """SMs times their clock: the scale of a kernel whose throughput is a fixed amount of work per SM per cycle
        (None where the YAML gives neither)."""
        if self.sm_count is None or self.boost_clock_hz is None:
            return None
        return self.sm_count * self.boost_clock_hz

    def allreduce_latency_s(self, custom: bool) -> float:
        """Latency of one small all-reduce: the engine's custom kernel where the link has one, else the library's."""
        c = self.custom_allreduce_latency_s
        return c if custom and c is not None else self.link_latency_s


VENDORS = ("nvidia", "amd", "huawei", "apple", "intel", "qualcomm")
DEVICE_CLASSES = ("datacenter", "workstation", "consumer", "edge", "mobile")
CONFIDENCE = ("A", "B", "C")
# Upper bounds that catch unit slips (TB for GB, TFLOP/s typed as FLOP/s), with a wide margin over any part
# sold today (512 GB unified memory, 8 TB/s HBM3e, ~10 PFLOP/s dense FP4).
_LIMITS = {"memory_gb": 4096.0, "memory_bandwidth_gb_s": 100_000.0, "peak_tflops": 100_000.0,
           "interconnect.bandwidth_gb_s_per_direction": 100_000.0, "interconnect.latency_us": 1e6,
           "interconnect.custom_allreduce_latency_us": 1e6, "network.bandwidth_gb_s_per_device": 100_000.0,
           "network.latency_us": 1e6, "host_link.bandwidth_gb_s": 100_000.0, "host_link.latency_us": 1e6,
           "tdp_w": 100_000.0, "price_usd_per_hour": 10_000.0, "sm_count": 10_000.0, "boost_clock_mhz": 10_000.0,
           "fp16_accumulate_tflops": 100_000.0}


def _check_range(value: float | None, field: str, src: str, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    limit = _LIMITS.get(field.split(".")[0] if field.startswith("peak_tflops") else field, math.inf)
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok and value <= limit):
        need = ">= 0" if allow_zero else "> 0"
        raise InputError(f"must be a finite number {need} and <= {limit:g} (units are in the key name), got {value}",
                         source=src, field=field)


def _to_hardware(y: HardwareYaml, path: Path) -> Hardware:
    src = str(path)
    for key, valid in (("vendor", VENDORS), ("device_class", DEVICE_CLASSES), ("confidence", CONFIDENCE)):
        if getattr(y, key) not in valid:
            raise unknown_name(key.replace("_", " "), getattr(y, key), valid, source=src, field=key)
    _check_range(y.memory_gb, "memory_gb", src)
    _check_range(y.memory_bandwidth_gb_s, "memory_bandwidth_gb_s", src)
    if not y.peak_tflops:
        raise InputError("list at least one compute dtype, e.g. {bf16: 989.4}", source=src, field="peak_tflops")
    for k, v in y.peak_tflops.items():
        if k not in COMPUTE_DTYPES:
            raise unknown_name("compute dtype", k, COMPUTE_DTYPES, source=src, field="peak_tflops")
        _check_range(v, f"peak_tflops.{k}", src)
    _check_range(y.interconnect.bandwidth_gb_s_per_direction, "interconnect.bandwidth_gb_s_per_direction", src,
                 allow_zero=True)
    _check_range(y.interconnect.latency_us, "interconnect.latency_us", src, allow_zero=True)
    _check_range(y.tdp_w, "tdp_w", src)
    _check_range(y.price_usd_per_hour, "price_usd_per_hour", src, allow_zero=True)
    _check_range(y.fp16_accumulate_tflops, "fp16_accumulate_tflops", src)
    if y.fp16_accumulate_tflops is not None and y.fp16_accumulate_tflops < y.peak_tflops.get("fp16", math.inf):
        raise InputError(f"is {y.fp16_accumulate_tflops}, below peak_tflops.fp16: give it only where FP16 accumulate "
                         "runs faster than the stored fp16 rate (GeForce: twice), else leave it out",
                         source=src, field="fp16_accumulate_tflops")
    _check_range(y.sm_count, "sm_count", src)
    _check_range(y.boost_clock_mhz, "boost_clock_mhz", src)
    if (y.sm_count is None) != (y.boost_clock_mhz is None):
        raise InputError("give sm_count and boost_clock_mhz together (or neither)", source=src,
                         field="sm_count" if y.sm_count is None else "boost_clock_mhz")
    g = y.efficiency.gemm_fraction
    fractions = dict(g) if isinstance(g, dict) else {"default": g}
    if "default" not in fractions:
        raise InputError("needs a 'default' entry (the fraction for compute dtypes not listed)", source=src,
                         field="efficiency.gemm_fraction")
    for k in fractions:
        if k != "default" and k not in COMPUTE_DTYPES:
            raise unknown_name("compute dtype", k, ("default", *COMPUTE_DTYPES), source=src,
                               field="efficiency.gemm_fraction")
    try:
        for k, v in fractions.items():
            check_fraction(v, f"efficiency.gemm_fraction.{k}" if isinstance(g, dict) else "efficiency.gemm_fraction")
        check_fraction(y.efficiency.memory_bandwidth_fraction, "efficiency.memory_bandwidth_fraction")
        check_fraction(y.efficiency.sustained_compute_fraction, "efficiency.sustained_compute_fraction")
        check_fraction(y.interconnect.bandwidth_fraction, "interconnect.bandwidth_fraction")
    except InputError as exc:
        raise exc.located(src, None) from None
    if not (math.isfinite(y.efficiency.kernel_floor_us) and 0 <= y.efficiency.kernel_floor_us <= 1000):
        raise InputError(f"must be in 0..1000 us, got {y.efficiency.kernel_floor_us}", source=src,
                         field="efficiency.kernel_floor_us")
    _check_range(y.interconnect.custom_allreduce_latency_us, "interconnect.custom_allreduce_latency_us", src,
                 allow_zero=True)
    if y.network is not None:
        _check_range(y.network.bandwidth_gb_s_per_device, "network.bandwidth_gb_s_per_device", src)
        _check_range(y.network.latency_us, "network.latency_us", src, allow_zero=True)
    if y.host_link is not None:
        _check_range(y.host_link.bandwidth_gb_s, "host_link.bandwidth_gb_s", src)
        _check_range(y.host_link.latency_us, "host_link.latency_us", src, allow_zero=True)
    if not 1 <= y.node_size <= 1024:
        raise InputError(f"must be an integer in 1..1024, got {y.node_size}", source=src, field="node_size")
    if y.node_size > 1 and y.interconnect.bandwidth_gb_s_per_direction == 0:
        raise InputError(f"is 0 but node_size is {y.node_size}: devices in a node need a link; give its GB/s per "
                         "direction, or node_size: 1 for a single-device part",
                         source=src, field="interconnect.bandwidth_gb_s_per_direction")
    return Hardware(
        name=y.name, display_name=y.display_name, vendor=y.vendor, device_class=y.device_class,
        memory_bytes=y.memory_gb * 2**30 * USABLE_FRACTION_OF_MARKETED,
        memory_bandwidth_bytes_s=y.memory_bandwidth_gb_s * 1e9,
        peak_flops={k: v * 1e12 for k, v in y.peak_tflops.items()},
        link_bandwidth_bytes_s=y.interconnect.bandwidth_gb_s_per_direction * 1e9,
        link_latency_s=y.interconnect.latency_us * 1e-6,
        node_size=y.node_size, tdp_w=y.tdp_w, price_usd_per_hour=y.price_usd_per_hour,
        price_source_date=None if y.price_source_date is None else str(y.price_source_date),
        gemm_fractions=fractions, memory_bandwidth_fraction=y.efficiency.memory_bandwidth_fraction,
        kernel_floor_s=y.efficiency.kernel_floor_us * 1e-6,
        sustained_compute_fraction=y.efficiency.sustained_compute_fraction,
        link_bandwidth_fraction=y.interconnect.bandwidth_fraction,
        custom_allreduce_latency_s=(None if y.interconnect.custom_allreduce_latency_us is None
                                    else y.interconnect.custom_allreduce_latency_us * 1e-6),
        kernel_tables=y.kernel_tables, kernel_tables_comm=y.kernel_tables_comm, path=src, sm_count=y.sm_count,
        boost_clock_hz=None if y.boost_clock_mhz is None else y.boost_clock_mhz * 1e6,
        fp16_accumulate_flops=None if y.fp16_accumulate_tflops is None else y.fp16_accumulate_tflops * 1e12,
        network_bandwidth_bytes_s=0.0 if y.network is None else y.network.bandwidth_gb_s_per_device * 1e9,
        network_latency_s=0.0 if y.network is None else y.network.latency_us * 1e-6,
        host_link_bandwidth_bytes_s=0.0 if y.host_link is None else y.host_link.bandwidth_gb_s * 1e9,
        host_link_latency_s=0.0 if y.host_link is None else y.host_link.latency_us * 1e-6,
        calibration_priors={k[len("prior_"):]: float(v) for k, v in y.calibration.items()
                            if k.startswith("prior_") and isinstance(v, int | float)})


@functools.cache
def hardware_files() -> dict[str, Path]:
    """Catalog name -> YAML path, from hardware/**/*.yaml."""
    return {p.stem: p for p in sorted(HARDWARE_DIR.rglob("*.yaml"))}


def load_hardware_file(path: Path) -> Hardware:
    """Load and validate one hardware YAML file."""
    data = load_yaml(path)
    y = from_dict(HardwareYaml, data, source=str(path))
    if y.name != path.stem:
        raise InputError(f"name '{y.name}' must equal the file name '{path.stem}'", source=str(path), field="name")
    if path.parent.parent == HARDWARE_DIR and y.vendor != path.parent.name:
        raise InputError(f"vendor '{y.vendor}' must equal the catalog folder '{path.parent.name}'; move the file to "
                         f"hardware/{y.vendor}/ or correct the vendor", source=str(path), field="vendor")
    return _to_hardware(y, path)


@functools.cache
def _load_cached(path: Path, mtime_ns: int) -> Hardware:
    return load_hardware_file(path)


def load_hardware(name: str, *, field: str = "deployment.hardware") -> Hardware:
    """A catalog name or a path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise InputError(f"hardware file '{name}' not found; give a catalog name (simengine list hardware) or "
                             "an existing YAML path", field=field)
        return _load_cached(p.resolve(), p.stat().st_mtime_ns)
    files = hardware_files()
    if name not in files:
        raise unknown_name("hardware", name, files, field=field)
    path = files[name]
    return _load_cached(path, path.stat().st_mtime_ns)
