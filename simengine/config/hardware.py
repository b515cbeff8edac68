"""Accelerator specs loaded from hardware/<vendor>/<name>.yaml (units converted to SI here, nowhere else)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from simengine.config.loader import check_fraction, from_dict, load_yaml
from simengine.errors import InputError, unknown_name

REPO_ROOT = Path(__file__).resolve().parents[2]
HARDWARE_DIR = REPO_ROOT / "hardware"

# HBM/unified capacities are marketed in GiB-sized units; CUDA reports ~99.5% of that as total
# (H100 80 GB -> 81559 MiB; H200 141 GB -> 143771 MiB; ../shared/reference/hardware.md 'Units').
USABLE_FRACTION_OF_MARKETED = 0.995
COMPUTE_DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int4", "fp4")


@dataclass(frozen=True, kw_only=True)
class InterconnectYaml:
    name: str
    bandwidth_gb_s_per_direction: float
    latency_us: float


@dataclass(frozen=True, kw_only=True)
class EfficiencyYaml:
    gemm_fraction: float
    memory_bandwidth_fraction: float


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
    interconnect: InterconnectYaml
    node_size: int
    tdp_w: float | None = None
    price_usd_per_hour: float | None = None
    price_source_date: str | None = None
    efficiency: EfficiencyYaml
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
    link_latency_s: float           # one small-message all-reduce
    node_size: int
    tdp_w: float | None
    price_usd_per_hour: float | None
    gemm_fraction: float
    memory_bandwidth_fraction: float
    path: str = ""

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for a compute dtype."""
        return self.peak_flops[dtype]


def _to_hardware(y: HardwareYaml, path: Path) -> Hardware:
    src = str(path)
    if y.memory_gb <= 0 or y.memory_bandwidth_gb_s <= 0:
        raise InputError("memory_gb and memory_bandwidth_gb_s must be > 0", source=src)
    for k, v in y.peak_tflops.items():
        if k not in COMPUTE_DTYPES:
            raise unknown_name("compute dtype", k, COMPUTE_DTYPES, source=src, field="peak_tflops")
        if v <= 0:
            raise InputError(f"must be > 0, got {v}", source=src, field=f"peak_tflops.{k}")
    try:
        check_fraction(y.efficiency.gemm_fraction, "efficiency.gemm_fraction")
        check_fraction(y.efficiency.memory_bandwidth_fraction, "efficiency.memory_bandwidth_fraction")
    except InputError as exc:
        raise InputError(str(exc), source=src) from None
    if y.node_size < 1:
        raise InputError("must be >= 1", source=src, field="node_size")
    return Hardware(
        name=y.name, display_name=y.display_name, vendor=y.vendor, device_class=y.device_class,
        memory_bytes=y.memory_gb * 2**30 * USABLE_FRACTION_OF_MARKETED,
        memory_bandwidth_bytes_s=y.memory_bandwidth_gb_s * 1e9,
        peak_flops={k: v * 1e12 for k, v in y.peak_tflops.items()},
        link_bandwidth_bytes_s=y.interconnect.bandwidth_gb_s_per_direction * 1e9,
        link_latency_s=y.interconnect.latency_us * 1e-6,
        node_size=y.node_size, tdp_w=y.tdp_w, price_usd_per_hour=y.price_usd_per_hour,
        gemm_fraction=y.efficiency.gemm_fraction,
        memory_bandwidth_fraction=y.efficiency.memory_bandwidth_fraction, path=src)


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
    return _to_hardware(y, path)


@functools.cache
def _load_cached(path: Path, mtime_ns: int) -> Hardware:
    return load_hardware_file(path)


def load_hardware(name: str, *, field: str = "deployment.hardware") -> Hardware:
    """A catalog name or a path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return _load_cached(p.resolve(), p.stat().st_mtime_ns)
    files = hardware_files()
    if name not in files:
        raise unknown_name("hardware", name, files, field=field)
    path = files[name]
    return _load_cached(path, path.stat().st_mtime_ns)
