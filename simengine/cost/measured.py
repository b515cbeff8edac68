"""Measured kernel times for the step's ops, from NVIDIA's aiconfigurator-core operator tables (Apache-2.0).

The package (`pip install -e '.[kernels]'`; `make` installs it where a wheel exists) ships GEMM, context and
generation attention, MoE and all-reduce timings measured per device (`systems/data/<system>/`) and per serving
backend (trtllm, vllm, sglang) and version. Tables `simengine profile` measured on a local device
(kernels/<system>/, backend `torch`, CSV in the same columns) are read the same way and come first. Each row is a
CUDA-graph replay of one op call on one layer, in milliseconds; GEMM shapes and attention heads are per tensor-
parallel rank; all-reduce messages count elements. We read the tables (never copy them) and price the step's ops
(cost/work.py) from them:

- GEMM (m tokens, n, k): linear in m between measured m. An (n, k) that was not measured takes the utilisation
  (roofline time / measured time) of the nearest measured shapes, inverse-distance weighted in log2(n, k) within
  two octaves. Beyond the largest measured m the last utilisation holds (time grows as the roofline's).
- decode attention (batch b, KV length s): linear in b and in s. Prefill attention (b sequences of s tokens):
  linear in b and in sqrt(time) along s (time grows as s^2), scaled by the chunks' query-key pairs over b s^2 / 2
  for cached prefixes, as the package's own model does. Cells beyond the measured staircase (large b x s) hold
  the utilisation of the longest measured length of that batch.
- MoE layer (tokens, model shape, tp, ep; the median over the routing distributions timed): linear in tokens. An
  expert shape that was not timed takes the utilisation (layer roofline / measured time) of the nearest timed
  shapes of its dtype at the same routed tokens per expert, inverse-distance weighted in log2(hidden, inter)
  within two octaves; where the backend timed neither, the nearest backend that did. All-reduce (elements, GPUs):
  linear in size, never below the smallest measurement.
- MLA (DeepSeek-V3's latent attention: 7,168 hidden, 128 heads, a 576-wide latent): the whole module of one
  layer (the q and kv low-rank projections, the attention kernel, the output projection), decode by (batch, KV
  length), prefill by (sequences, prompt length), at the rank's heads; the faster of the kernels the backend
  measured. The projections then leave the GEMM list. Prefill chunks after a cached prefix add their
  query-cached-key pairs at the roofline's attention rate.
- norms, activation, RoPE/KV write (no tables exist): the roofline's elementwise terms and kernel floors.

An op the tables do not cover (a device, dtype, head layout, MoE shape without timed neighbours or TP degree
without rows) is priced by the roofline; `MeasuredKernels.fallbacks` says which and why, and every step records
the seconds that came from measurements (`measured_s` in steps.csv).

Reading a table and shaping it (GEMM sites, attention grids) takes a few tenths of a second, which every new process
would pay; the shaped arrays are therefore kept on disk (`cached_arrays`: under $SIMENGINE_CACHE_DIR, else
$XDG_CACHE_HOME/simengine or ~/.cache/simengine; an empty SIMENGINE_CACHE_DIR turns it off), keyed by the table
file's path, size and modification time and by what was derived, and read back bit for bit."""

from __future__ import annotations

import bisect
import functools
import hashlib
import importlib.util
import itertools
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from simengine.config.dtypes import WeightFormat
from simengine.config.hardware import Hardware
from simengine.cost.roofline import DeviceTerms, RooflineKernels
from simengine.cost.work import StepWork

PACKAGE = "aiconfigurator_core"
MS = 1e-3
# our weight dtype -> the table's gemm_dtype / moe_dtype; KV dtype -> kv_cache_dtype
GEMM_DTYPES = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8", "fp4": "nvfp4", "nvfp4": "nvfp4",
               "int4": "int4_wo", "int8": "sq", "mxfp4": "bfloat16"}   # gpt-oss: only the experts are MXFP4
MOE_DTYPES = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8", "fp4": "nvfp4", "nvfp4": "nvfp4",
              "mxfp4": "w4a16_mxfp4", "int4": "int4_wo"}
KV_DTYPES = {2.0: "bfloat16", 1.0: "fp8"}
GEMM_PEAK = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8", "nvfp4": "fp4", "int4_wo": "bf16",
             "int8_wo": "bf16", "sq": "int8", "w4a16_mxfp4": "bf16"}
GEMM_ELEMENT_BYTES = {"bfloat16": 2.0, "fp8": 1.0, "fp8_block": 1.0, "nvfp4": 9 / 16, "int4_wo": 0.5,
                      "int8_wo": 1.0, "sq": 1.0, "w4a16_mxfp4": 4.25 / 8}
NEIGHBOUR_OCTAVES = 2.0     # an unmeasured GEMM shape borrows utilisation from shapes within this log2 distance
# routing skews the MoE tables time: uniform and two power laws (the package's default is power_law_1.2)
MOE_DISTRIBUTIONS = ("balanced", "power_law_1.01", "power_law_1.2")
# the MLA module tables time DeepSeek-V3's layer (deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168,
# num_attention_heads 128, kv_lora_rank 512 + qk_rope_head_dim 64); a model of other dimensions is not in them
MLA_MODULE_SHAPE = (7168, 576)
MLA_GEMM_TYPES = {"fp8": "fp8_block", "bf16": "bfloat16", "fp16": "bfloat16"}   # DeepSeek's FP8 is block-scaled
PROVENANCE = ("framework", "version", "device", "power", "power_limit")


# ---- the tables' files ----------------------------------------------------------------------------------
LOCAL_ROOT = Path(__file__).resolve().parents[2] / "kernels"   # `simengine profile` writes here
# an engine whose backend has no tables on a device takes the nearest that has: another serving stack's kernels
# first, a local torch profile last
BACKEND_ORDER = {"trtllm": ("trtllm", "vllm", "sglang", "torch"), "vllm": ("vllm", "sglang", "trtllm", "torch"),
                 "sglang": ("sglang", "vllm", "trtllm", "torch")}


@functools.cache
def data_root() -> Path | None:
    """systems/ of the installed aiconfigurator-core, or None when it is not installed (roofline only)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "systems"
    return root if (root / "data").is_dir() else None


def package_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("aiconfigurator-core")
    except PackageNotFoundError:
        return None


def version_key(v: str) -> tuple:
    """Sortable key of a version string such as 1.3.0rc20, 0.5.6.post2, 0.24.0 or 0.1.dev19262."""
    release = re.split(r"rc|\.post|\.dev", v)[0]
    nums = [int(x) for x in re.findall(r"\d+", release)][:4]
    pre = re.search(r"rc(\d+)", v)
    post = re.search(r"post(\d+)", v)
    final = 0 if pre is None and "dev" not in v else -1
    return (*nums, *([0] * (4 - len(nums))), final, int(pre.group(1)) if pre else 0, int(post.group(1)) if post else 0)


@functools.cache
def current_versions() -> dict[tuple[str, str], str]:
    """(system, backend) -> the version the package calls current (query_versions.yaml); ('*', backend) for the
    defaults."""
    from simengine.config.loader import load_yaml

    root = data_root()
    path = root / "query_versions.yaml" if root else None
    data = load_yaml(path) if path and path.exists() else {}
    out = {("*", b): str(v.get("current")) for b, v in (data.get("defaults") or {}).items()}
    for system, per in (data.get("overrides") or {}).items():
        for b, v in per.items():
            out[(system, b)] = str(v.get("current"))
    return out


def system_dir(system: str) -> Path | None:
    """A device's tables: a local profile (kernels/<system>) first, else the package's (systems/data/<system>)."""
    root = data_root()
    for base in (LOCAL_ROOT / system, root / "data" / system if root else None):
        if base is not None and base.is_dir():
            return base
    return None


def table_file(system: str, family: str, backend: str, filename: str) -> Path | None:
    """The table (`name.parquet`, or `name.csv` from a local profile) in the backend's current version, else in
    the newest older version that has it (the package's backward fill); None when no version has it."""
    sysdir = system_dir(system)
    base = sysdir / family / backend if sysdir else None
    if base is None or not base.is_dir():
        return None
    stem = filename.rsplit(".", 1)[0]

    def found(d: Path) -> Path | None:
        return next((d / f"{stem}{ext}" for ext in (".parquet", ".csv") if (d / f"{stem}{ext}").exists()), None)

    versions = sorted((d.name for d in base.iterdir() if found(d)), key=version_key)
    current = current_versions().get((system, backend)) or current_versions().get(("*", backend))
    if current:
        versions = [v for v in versions if version_key(v) <= version_key(current)] or versions
    return found(base / versions[-1]) if versions else None


def backend_for(system: str, wanted: str, family: str = "gemm", filename: str = "gemm_perf.parquet") -> str:
    """The backend whose tables price an engine of `wanted` kernels on `system` (its GEMM tables, or another table
    family's `filename`): its own where measured, else the nearest measured one (BACKEND_ORDER); `wanted` when none
    is."""
    for backend in BACKEND_ORDER.get(wanted, (wanted,)):
        if table_file(system, family, backend, filename) is not None:
            return backend
    return wanted


@functools.cache
def read_table(path: Path):
    """One parquet table without its provenance columns (cached per process)."""
    import pandas as pd

    df = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
    return df.drop(columns=[c for c in PROVENANCE if c in df.columns])


@functools.cache
def systems() -> tuple[str, ...]:
    """The devices with measured tables: local profiles and the installed package's."""
    root = data_root()
    dirs = [*(LOCAL_ROOT.iterdir() if LOCAL_ROOT.is_dir() else ()), *((root / "data").iterdir() if root else ())]
    return tuple(sorted({p.name for p in dirs if p.is_dir() and any(p.iterdir())}))


# ---- interpolation ----------------------------------------------------------------------------------------
def monotone(ys: np.ndarray) -> np.ndarray:
    """A curve over growing sizes made non-decreasing by the running minimum from its large end: a smaller problem
    never takes longer than a larger one (it could run padded), which removes collection noise (e.g. B200's vLLM FP8
    GEMM timed slower at m=1 than at m=8)."""
    return np.minimum.accumulate(ys[::-1])[::-1]


def interp_hold(x: np.ndarray, xs: np.ndarray, ys: np.ndarray, sol) -> np.ndarray:
    """ys(xs) linearly at x; below xs[0] the first value; beyond xs[-1] the last point's utilisation holds (time
    grows as the roofline time `sol(x)` does)."""
    y = np.interp(x, xs, ys)
    hi = x > xs[-1]
    if np.any(hi):
        y = np.where(hi, sol(x) * (ys[-1] / sol(xs[-1])), y)
    return y


class MoeShape(NamedTuple):
    """A MoE layer's expert shape as the tables key it."""

    hidden: int
    inter: int
    topk: int
    experts: int


def moe_dtypes(fmt: WeightFormat, hw: Hardware) -> tuple[str, ...]:
    """The tables' moe dtypes that time a weight format's experts, best first: FP8 experts also as the block-scaled
    rows (128 x 128 scales: DeepSeek-V3/R1's and Qwen3's FP8 checkpoints; the only FP8 rows SGLang's tables hold and
    the only ones of DeepSeek's shape in any: the same W8A8 grouped GEMM with a scale per block); MXFP4 experts on a
    device without FP4 math are 4-bit weights dequantised into 16-bit math, as the Marlin MoE kernels run them
    (vLLM's Ampere path for gpt-oss; its tables' W4A16 `int4_wo` rows are that kernel with integer weights)."""
    dtype = MOE_DTYPES.get(fmt.name)
    if dtype == "fp8":
        # on a device without FP8 math (Ampere) vLLM and SGLang run FP8 experts as W8A16 through the Marlin MoE
        # kernel too (marlin_utils_fp8), which the tables time only with 4-bit weights
        return ("fp8", "fp8_block") + (("int4_wo",) if fmt.compute_dtype not in hw.peak_flops else ())
    if dtype == "w4a16_mxfp4" and fmt.compute_dtype not in hw.peak_flops:
        return "w4a16_mxfp4", "int4_wo"
    return (dtype,) if dtype else ()


def _shape_rows(df, s: MoeShape):
    """A MoE table's rows of one expert shape."""
    return df[(df["hidden_size"] == s.hidden) & (df["inter_size"] == s.inter) & (df["topk"] == s.topk)
              & (df["num_experts"] == s.experts)]


def _moe_split_curve(shape, dtype: str, moe_tp: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(tokens, seconds) of one MoE layer whose experts are sliced `moe_tp` ways (one shape, EP and dtype of a
    table), or None where fewer than two token counts were timed. The other slicings measured in the same table
    bound it both ways: k times less sliced takes at most k times as long, since it could run as k launches of the
    finer slice (the H100 and H200 trtllm tables time Llama-4 Scout's experts at moe tp 2 at 4.6-6.6x twice their
    moe tp 4), and k times more sliced takes at most as long, since each rank's slice is a part of the coarser one's
    work (the H200 trtllm table times Mixtral-8x22B's experts at moe tp 8 at 3.0x its moe tp 4 for one token)."""
    rows = shape[shape["moe_dtype"] == dtype]
    sel = rows[rows["moe_tp_size"] == moe_tp]
    if sel["num_tokens"].nunique() < 2:
        return None
    xs, ys = _moe_median(sel)
    for other in sorted(t for t in set(rows["moe_tp_size"]) if t != moe_tp and max(t, moe_tp) % min(t, moe_tp) == 0):
        timed = rows[rows["moe_tp_size"] == other]
        if timed["num_tokens"].nunique() >= 2:
            ox, oy = _moe_median(timed)
            ys = np.minimum(ys, max(other // moe_tp, 1) * np.interp(xs, ox, oy, right=np.inf))
    return xs, monotone(ys)


def _moe_median(sel) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, seconds) of a MoE selection: the median over the routing distributions measured, so that one
    anomalous series cannot set it (the H200 trtllm table's fp8 power_law_1.2 series runs 5-8x its balanced and
    power_law_1.01 neighbours), made monotone."""
    by_dist = sel.pivot_table(index="num_tokens", columns="distribution", values="latency", aggfunc="min")
    return by_dist.index.to_numpy(float), monotone(np.nanmedian(by_dist.to_numpy(float), axis=1) * MS)


# ---- shaped tables kept on disk ------------------------------------------------------------------------
CACHE_FORMAT = 1   # bump when what a cached entry holds changes


def cache_root() -> Path | None:
    """Where shaped tables are kept (module docstring); None when caching is off."""
    env = os.environ.get("SIMENGINE_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "simengine"


def cached_arrays(kind: str, source: Path, key: tuple, build: Callable[[], dict[str, np.ndarray]]
                  ) -> dict[str, np.ndarray]:
    """`build()` (named arrays derived from the table file `source` and `key`), read from the disk cache when an
    entry for this file (path, size, modification time) and key exists, else built and stored (written aside, then
    renamed: a reader never sees half a file). Any failure to read or write the cache just builds."""
    root = cache_root()
    if root is None:
        return build()
    st = source.stat()
    ident = repr((CACHE_FORMAT, kind, str(source.resolve()), st.st_size, st.st_mtime_ns, key))
    path = root / "kernels" / f"{kind}-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except (OSError, ValueError, EOFError, KeyError):   # absent, or unreadable: build it
        pass
    arrays = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)
    except OSError:
        pass
    return arrays


@functools.cache
def gemm_sites(path: Path) -> dict[str, dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]]:
    """A GEMM table as per gemm dtype, (n, k) sites with their m-curves (m ascending, the first row of a repeated
    (m, n, k) kept, latency in seconds and made monotone); cached per process and on disk."""
    z = cached_arrays("gemm", path, (), lambda: _gemm_site_arrays(path))
    out = {}
    for i, dtype in enumerate(z["dtypes"].tolist()):
        n, k, bounds, m, lat = (z[f"n{i}"].tolist(), z[f"k{i}"].tolist(), z[f"bounds{i}"].tolist(), z[f"m{i}"],
                                z[f"lat{i}"])
        out[dtype] = {(n[j], k[j]): (m[bounds[j]:bounds[j + 1]], lat[bounds[j]:bounds[j + 1]])
                      for j in range(len(n))}
    return out


def _gemm_site_arrays(path: Path) -> dict[str, np.ndarray]:
    """gemm_sites flat: per dtype i its sites' n and k, the bounds of each site's rows, and the rows' m and
    latency."""
    df = read_table(path)
    dtypes = df["gemm_dtype"].to_numpy(str)
    n_all, k_all, m_all = (df[c].to_numpy(np.int64) for c in ("n", "k", "m"))
    lat_all = df["latency"].to_numpy(float) * MS
    names = list(dict.fromkeys(dtypes.tolist()))
    out = {"dtypes": np.array(names, dtype=str)}
    for i, dtype in enumerate(names):
        rows = np.flatnonzero(dtypes == dtype)
        n, k, m, lat = n_all[rows], k_all[rows], m_all[rows], lat_all[rows]
        order = np.lexsort((m, k, n))                 # stable: a repeat keeps its first row first
        n, k, m, lat = n[order], k[order], m[order], lat[order]
        new_site = np.r_[True, (n[1:] != n[:-1]) | (k[1:] != k[:-1])]
        keep = new_site | np.r_[True, m[1:] != m[:-1]]
        n, k, m, lat, new_site = n[keep], k[keep], m[keep], lat[keep], new_site[keep]
        starts = np.flatnonzero(new_site)
        bounds = np.r_[starts, len(n)]
        out[f"n{i}"], out[f"k{i}"], out[f"bounds{i}"], out[f"m{i}"] = n[starts], k[starts], bounds, m.astype(float)
        out[f"lat{i}"] = np.concatenate([monotone(lat[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
    return out


class GemmTable:
    """Measured GEMM times of one backend on one device: per gemm dtype, (n, k) sites with their m-curves."""

    def __init__(self, path: Path, hw: Hardware):
        self.hw = hw
        self.sites = gemm_sites(path)

    def sol(self, dtype: str, m, n: int, k: int):
        """Roofline seconds of an (m x k) by (k x n) GEMM at the datasheet rates: the utilisation's yardstick."""
        peaks = self.hw.peak_flops
        peak = peaks.get(GEMM_PEAK[dtype]) or peaks.get("bf16") or peaks["fp16"]
        eb = GEMM_ELEMENT_BYTES[dtype]
        return np.maximum(2.0 * m * n * k / peak, eb * (m * n + m * k + n * k) / self.hw.memory_bandwidth_bytes_s)

    def latency(self, dtype: str, n: int, k: int, m: np.ndarray) -> np.ndarray | None:
        """Seconds of the GEMM at each m, or None when no measured shape lies within reach."""
        sites = self.sites.get(dtype)
        if not sites or n < 1 or k < 1:
            return None
        if (n, k) in sites:
            xs, ys = sites[(n, k)]
            return interp_hold(m, xs, ys, lambda x: self.sol(dtype, x, n, k))
        ln, lk = math.log2(n), math.log2(k)
        near = sorted((math.hypot(math.log2(sn) - ln, math.log2(sk) - lk), (sn, sk)) for sn, sk in sites)
        near = [(d, s) for d, s in near[:4] if d <= NEIGHBOUR_OCTAVES]
        if not near:
            return None
        util = np.zeros(len(m))
        total = 0.0
        for d, (sn, sk) in near:
            xs, ys = sites[(sn, sk)]
            lat = interp_hold(m, xs, ys, lambda x, sn=sn, sk=sk: self.sol(dtype, x, sn, sk))
            util += self.sol(dtype, m, sn, sk) / lat / d
            total += 1.0 / d
        return self.sol(dtype, m, n, k) / (util / total)


class AttentionGrid:
    """One attention table slice (head layout, dtypes) as a full grid over (batch, length). `values` are seconds
    (decode) or sqrt(seconds) (prefill: `root` 2); cells beyond the measured staircase hold the utilisation against
    `sol` (same transform) of the longest measured length of their batch; holes inside are linear between
    neighbours."""

    def __init__(self, b: np.ndarray, s: np.ndarray, values: np.ndarray, sol, root: int = 1):
        self.root = root
        grid = values.copy()
        keep = []
        for i in range(len(b)):
            row = grid[i]
            ok = np.flatnonzero(np.isfinite(row))
            if not len(ok):
                continue
            keep.append(i)
            first, last = ok[0], ok[-1]
            row[:first] = row[first]
            util = sol(b[i], s[last]) / row[last]
            for j in range(last + 1, len(s)):
                row[j] = sol(b[i], s[j]) / util
            inside = np.isfinite(row[first:last + 1])
            row[first:last + 1] = np.interp(s[first:last + 1], s[first:last + 1][inside], row[first:last + 1][inside])
            grid[i] = monotone(row)
        grid = grid[keep]
        for j in range(grid.shape[1]):   # and along the batch
            grid[:, j] = monotone(grid[:, j])
        self.bs, self.ss, self.grid = b[keep], s, grid

    @classmethod
    def shaped(cls, bs: np.ndarray, ss: np.ndarray, grid: np.ndarray, root: int) -> AttentionGrid:
        """A grid already shaped (read back from the disk cache)."""
        self = cls.__new__(cls)
        self.root, self.bs, self.ss, self.grid = root, bs, ss, grid
        return self

    def row(self, b: int) -> list[float]:
        """The grid's curve over lengths for batch `b`: linear between measured batches; beyond the largest, the
        time in proportion to the batch (its root-th root when the grid holds roots)."""
        bs, grid = self.bs, self.grid
        if b <= bs[0]:
            r = grid[0]
        elif b >= bs[-1]:
            r = grid[-1] * (b / bs[-1]) ** (1.0 / self.root)
        else:
            i = int(np.searchsorted(bs, b))
            f = (b - bs[i - 1]) / (bs[i] - bs[i - 1])
            r = grid[i - 1] + f * (grid[i] - grid[i - 1])
        return r.tolist()


class QuantTable:
    """Measured time of a per-tensor FP8 activation quantisation step over (m tokens, k features): linear in m,
    and in k between measured k (the nearest k beyond them)."""

    def __init__(self, df):
        df = df.drop_duplicates(["m", "k"]).sort_values(["k", "m"])
        self.ks = sorted(int(k) for k in df["k"].unique())
        self.curves = {int(k): (g["m"].to_numpy(float), g["latency"].to_numpy(float) * MS)
                       for k, g in df.groupby("k", sort=False)}

    def latency(self, k: int, m: np.ndarray) -> np.ndarray:
        ks = self.ks
        i = bisect.bisect_left(ks, k)
        if i < len(ks) and ks[i] == k or i == 0 or i == len(ks):
            return np.interp(m, *self.curves[ks[min(i, len(ks) - 1)]])
        k0, k1 = ks[i - 1], ks[i]
        f = (k - k0) / (k1 - k0)
        return (1 - f) * np.interp(m, *self.curves[k0]) + f * np.interp(m, *self.curves[k1])


def _interp_row(xs: list[float], ys: list[float], x: float) -> float:
    """Scalar linear interpolation on a sorted grid, clamped at both ends: np.interp's arithmetic on one value
    (the same operations in the same order, so a step and its vectorised repeats give the same floats)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    return slope * (x - xs[i - 1]) + ys[i - 1]


class MeasuredKernels(RooflineKernels):
    """The op list priced from the measured tables of `system` for `backend`, the roofline where they miss."""

    def __init__(self, work: StepWork, terms: DeviceTerms, *, system: str, backend: str, custom_allreduce: bool):
        super().__init__(work, terms)
        self.system, self.backend = system, backend_for(system, backend)
        path = table_file(system, "gemm", self.backend, "gemm_perf.parquet")
        self.gemm = GemmTable(path, work.hw) if path else None
        # FP8 checkpoints carry static activation scales: the tables' fp8 rows include computing a dynamic scale,
        # which comes off, and for GEMMs whose input the previous kernel already wrote in FP8 (O after attention,
        # down after the fused activation) the quantisation too - the package's own `fp8_static` rule
        fp8 = GEMM_DTYPES.get(work.weight_format.name) == "fp8"
        self.quant = {name: QuantTable(read_table(p)) for name in ("computescale", "scale_matrix") if fp8
                      and (p := table_file(system, "quantize", self.backend, f"{name}_perf.parquet")) is not None}
        heads = max(1, work.model.num_heads // work.attention_tp)
        kv_heads = max(1, math.ceil(work.model.num_kv_heads / work.attention_tp))
        self.borrowed: dict[str, str] = {}   # ops priced from another backend's tables (this one has none)
        self.near_shapes: dict[str, str] = {}   # ops priced from measured shapes near the model's (which)
        self.mla_decode, self.mla_prefill = self._mla_grids(heads) if work.model.kv_latent_dim else (None, None)
        self.gemm_ops = self._gemm_ops()
        self.moe_curve = self._moe_curve() if work.model.num_moe_layers else None
        self.decode_grid = self._attention_grid("decode", heads, kv_heads)
        self.prefill_grid = self._attention_grid("prefill", heads, kv_heads)
        self.allreduce_curve = self._allreduce_curve(custom_allreduce) if work.num_allreduce else None
        self._decode_rows: dict[int, list[float]] = {}
        self._prefill_rows: dict[int, list[float]] = {}
        self._decode_xs = self.decode_grid.ss.tolist() if self.decode_grid else []
        self._prefill_xs = self.prefill_grid.ss.tolist() if self.prefill_grid else []
        self._mla_rows: dict[tuple[str, int], list[float]] = {}

    def describe(self) -> str:
        text = f"measured kernels ({self.system}, {self.backend})"
        if self.borrowed:
            text += "; " + "; ".join(f"{op} from {b}'s tables" for op, b in sorted(self.borrowed.items()))
        if self.near_shapes:
            text += "; near shapes for " + "; ".join(f"{op} ({how})" for op, how in sorted(self.near_shapes.items()))
        if self.fallbacks:
            text += "; roofline for " + "; ".join(f"{op} ({why})" for op, why in sorted(self.fallbacks.items()))
        return text

    # ---- loading ----------------------------------------------------------------------------------------
    def _gemm_ops(self) -> list[tuple[str, int, int, int, str | None]]:
        """The step's GEMMs other than the routed experts: (name, n, k, calls per step, gemm dtype)."""
        w = self.work
        m, tp, h = w.model, w.attention_tp, w.model.hidden_size
        dtype = GEMM_DTYPES.get(w.weight_format.name)
        heads = max(1, m.num_heads // tp)
        kv_heads = max(1, math.ceil(m.num_kv_heads / tp))
        dense = m.num_layers - m.num_moe_layers
        shared = m.shared_expert_params_per_moe_layer // (3 * h)
        ops = [("qkv", (heads + 2 * kv_heads) * m.head_dim, h, m.num_layers, dtype),
               ("attn_out", h, heads * m.v_head_dim, m.num_layers, dtype),
               ("mlp_up", (2 if m.gated_mlp else 1) * m.intermediate_size // tp, h, dense, dtype),
               ("mlp_down", h, m.intermediate_size // tp, dense, dtype),
               ("router", m.num_experts, h, m.num_moe_layers, "bfloat16"),
               ("shared_up", 2 * shared // tp, h, m.num_moe_layers if shared else 0, dtype),
               ("shared_down", h, shared // tp, m.num_moe_layers if shared else 0, dtype),
               ("lm_head", m.vocab_size // tp, h, 1, "bfloat16")]
        ops = [op for op in ops if op[3] > 0]
        if m.kv_latent_dim:   # MLA's projections are low-rank chains the GEMM tables do not time
            if self.mla_decode is None:
                self.fallbacks["qkv, attn_out"] = "MLA projections"
            ops = [op for op in ops if op[0] not in ("qkv", "attn_out")]
        if self.gemm is None:
            self.fallbacks["gemm"] = "no GEMM table"
        elif dtype is None or dtype not in self.gemm.sites:
            self.fallbacks["gemm"] = f"{w.weight_format.name} GEMMs not measured"
        return ops

    def _attention_grid(self, kind: str, heads: int, kv_heads: int) -> AttentionGrid | None:
        w = self.work
        m, hw = w.model, w.hw
        name = f"attn_{kind}"
        kv = KV_DTYPES.get(w.kv_elem_bytes)
        path = table_file(self.system, "attention", self.backend,
                          f"{'generation' if kind == 'decode' else 'context'}_attention_perf.parquet")
        if m.kv_latent_dim:
            if self.mla_decode is None:
                self.fallbacks[name] = "MLA attention"
            return None
        if path is None or kv is None:
            self.fallbacks[name] = ("no attention table" if path is None
                                    else f"a KV cache of {w.kv_elem_bytes:g} bytes per element")
            return None
        peak, bw, d, kvb = hw.peak(w.attn_dtype), hw.memory_bandwidth_bytes_s, m.head_dim, w.kv_elem_bytes
        root = 1 if kind == "decode" else 2

        def sol(bb, ss):   # decode: seconds; prefill: their square root (AttentionGrid's `root`)
            if kind == "decode":
                return max(4.0 * bb * heads * d * ss / peak,
                           bb * (4.0 * heads * d + 2.0 * kv_heads * ss * d * kvb) / bw)
            return math.sqrt(max(2.0 * bb * ss * ss * heads * d / peak,
                                 bb * ss * (4.0 * heads * d + 2.0 * kv_heads * d * kvb) / bw))

        def build() -> dict[str, np.ndarray]:
            df = read_table(path)
            sel = df[(df["num_heads"] == heads) & (df["num_key_value_heads"] == kv_heads) & (df["head_dim"] == d)
                     & (df["kv_cache_dtype"] == kv) & (df["attn_dtype"] == "bfloat16")]
            if "window_size" in sel.columns:
                sel = sel[sel["window_size"] == 0]
            if sel.empty:
                return {"bs": np.zeros(0), "ss": np.zeros(0), "grid": np.zeros((0, 0))}
            length = sel["isl"] + sel["step"] if kind == "decode" else sel["isl"]
            sel = sel.assign(length=length).drop_duplicates(["batch_size", "length"])
            piv = sel.pivot(index="batch_size", columns="length", values="latency").sort_index().sort_index(axis=1)
            lat = piv.to_numpy(float) * MS
            g = AttentionGrid(piv.index.to_numpy(float), piv.columns.to_numpy(float), lat if root == 1 else
                              np.sqrt(lat), sol, root=root)
            return {"bs": g.bs, "ss": g.ss, "grid": g.grid}

        z = cached_arrays(f"attention-{kind}", path, (heads, kv_heads, d, kv, peak, bw, kvb), build)
        if not z["bs"].size:
            self.fallbacks[name] = f"{heads} query / {kv_heads} KV heads of {d} not measured"
            return None
        return AttentionGrid.shaped(z["bs"], z["ss"], z["grid"], root)

    def _mla_grids(self, heads: int) -> tuple[AttentionGrid | None, AttentionGrid | None]:
        """(decode, prefill) grids of one MLA layer's module seconds at the rank's heads, or (None, None) where the
        backend has no module tables for the model's dimensions, weights and KV cache (fallbacks say why)."""
        w, m, hw = self.work, self.work.model, self.work.hw
        backend = backend_for(self.system, self.backend, "mla", "mla_generation_module_perf.parquet")
        gen, ctx = (table_file(self.system, "mla", backend, f"mla_{k}_module_perf.parquet")
                    for k in ("generation", "context"))
        if gen is not None and backend != self.backend:
            self.borrowed["mla"] = backend
        gemm, kv = MLA_GEMM_TYPES.get(w.weight_format.name), KV_DTYPES.get(w.kv_elem_bytes)
        why = ("no MLA module table" if gen is None or ctx is None
               else f"MLA of {m.hidden_size} hidden, {m.kv_latent_dim} latent"
               if (m.hidden_size, m.kv_latent_dim) != MLA_MODULE_SHAPE
               else f"{w.weight_format.name} MLA projections" if gemm is None
               else f"a KV cache of {w.kv_elem_bytes:g} bytes per element" if kv is None else "")
        if why:
            self.fallbacks["mla"] = why
            return None, None
        assert gen is not None and ctx is not None and gemm is not None and kv is not None
        peak, bw, kvb = hw.peak(w.attn_dtype) * self.sustained, hw.memory_bandwidth_bytes_s, w.kv_elem_bytes
        proj = m.attn_params_per_layer / w.attention_tp           # the layer's projection weights on a rank
        pbytes = proj * w.weight_format.bytes_per_param
        pair = w.attn_flops_per_pair

        def sol_decode(bb, ss):   # the module's roofline: projection weights and the latent cache read
            return max((2.0 * bb * proj + bb * ss * pair) / peak, (pbytes + bb * ss * m.kv_latent_dim * kvb) / bw)

        def sol_prefill(bb, ss):
            return max((2.0 * bb * ss * proj + bb * ss * ss / 2.0 * pair) / peak, pbytes / bw)

        grids = []
        for kind, path, length, sol in (("generation", gen, "step", sol_decode), ("context", ctx, "isl", sol_prefill)):
            def build(path=path, length=length, sol=sol) -> dict[str, np.ndarray]:
                df = read_table(path)
                sel = df[(df["num_heads"] == heads) & (df["gemm_type"] == gemm) & (df["kv_cache_dtype"] == kv)
                         & (df["mla_dtype"] == "bfloat16")]
                if sel.empty:
                    return {"bs": np.zeros(0), "ss": np.zeros(0), "grid": np.zeros((0, 0))}
                # the kernels the backend measured (FlashMLA, FlashAttention's MLA): it runs the faster
                piv = sel.pivot_table(index="batch_size", columns=length, values="latency", aggfunc="min")
                g = AttentionGrid(piv.index.to_numpy(float), piv.columns.to_numpy(float), piv.to_numpy(float) * MS,
                                  sol, root=1)
                return {"bs": g.bs, "ss": g.ss, "grid": g.grid}

            z = cached_arrays(f"mla-{kind}", path, (heads, gemm, kv, peak, bw, kvb, proj), build)
            if not z["bs"].size:
                self.fallbacks["mla"] = f"{heads} MLA heads a rank, {gemm} projections, {kv} KV not measured"
                return None, None
            grids.append(AttentionGrid.shaped(z["bs"], z["ss"], z["grid"], 1))
        return grids[0], grids[1]

    def _mla_row(self, kind: str, b: int) -> list[float]:
        grid = self.mla_decode if kind == "decode" else self.mla_prefill
        assert grid is not None
        row = self._mla_rows.get((kind, b))
        if row is None:
            row = self._mla_rows[(kind, b)] = grid.row(b)
        return row

    def _mla_decode_s(self, num_decode: int, context_tokens):
        """Measured seconds of the decodes' MLA modules over all layers (float, or array over contexts)."""
        grid = self.mla_decode
        assert grid is not None
        row, layers = self._mla_row("decode", num_decode), self.work.model.num_layers
        mean = context_tokens / num_decode
        if isinstance(mean, np.ndarray):
            return np.interp(mean, grid.ss, row) * layers
        return _interp_row(grid.ss.tolist(), row, mean) * layers

    def _mla_prefill_s(self, chunks: list[tuple[int, int]]) -> tuple[float, float]:
        """(measured seconds, compute seconds at efficiency 1) of the prefill chunks' MLA modules over all layers:
        the module of b prompts of their mean length, and the chunks' pairs with cached keys beyond its b s^2 / 2
        at the roofline's attention rate."""
        grid, w = self.mla_prefill, self.work
        assert grid is not None
        b = len(chunks)
        s = sum(c for c, _ in chunks) / b
        layers = w.model.num_layers
        sec = _interp_row(grid.ss.tolist(), self._mla_row("prefill", b), s) * layers / self.sustained
        pairs, _ = w.prefill_pairs(chunks)
        extra = max(pairs - b * s * s / 2.0, 0.0) * w.attn_flops_per_pair * layers / self.attn_peak
        return sec, extra

    def _moe_curve(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(tokens, seconds) of one MoE layer: the model's expert shape as the engine's backend timed it; else shapes
        near it in the same table, at the utilisation they reach with as many tokens per expert; else the same
        from the nearest backend that timed the experts' format on this device (fallbacks and borrowed say which)."""
        w, m = self.work, self.work.model
        dtypes = moe_dtypes(w.weight_format, w.hw)
        if not dtypes:
            self.fallbacks["moe"] = f"{w.weight_format.name} experts"
            return None
        inter = m.expert_params // (3 * m.hidden_size)
        ep = w.tp if w.expert_parallel else 1   # the tables key the group's tokens (attention DP: tp x the rank's)
        moe_tp = w.tp // ep
        backends = [b for b in BACKEND_ORDER.get(self.backend, (self.backend,))
                    if table_file(self.system, "moe", b, "moe_perf.parquet") is not None]
        if not backends:
            self.fallbacks["moe"] = "no MoE table"
            return None
        target = MoeShape(m.hidden_size, inter, m.experts_per_token, m.num_experts)
        wb = w.weight_format.bytes_per_param
        # a stand-in kernel whose weights are narrower or wider than the model's is never read as is: its own shape
        # too is a neighbour (distance 0), its utilisation carried to the model's bytes
        as_is = [d for d in dtypes if abs(GEMM_ELEMENT_BYTES[d] / wb - 1.0) <= 0.1]
        for backend in backends:
            df = read_table(table_file(self.system, "moe", backend, "moe_perf.parquet"))
            df = df[(df["moe_ep_size"] == ep) & df["distribution"].isin(MOE_DISTRIBUTIONS)]
            # near shapes only without expert parallelism: what the tables' EP rows time differs between collectors
            # (SGLang's A100 rows at EP 8 take as long as at EP 1 with 8,192 tokens, vLLM's and TensorRT-LLM's a
            # quarter to a fifth)
            near = dtypes if ep == 1 else ()
            for curve in itertools.chain((self._moe_exact(df, target, dtype, moe_tp) for dtype in as_is),
                                         (self._moe_near(df, target, dtype, moe_tp, wb, dtype not in as_is)
                                          for dtype in near)):
                if curve is not None:
                    if backend != self.backend:
                        self.borrowed["moe"] = backend
                    return curve
        self.fallbacks["moe"] = (f"experts {m.hidden_size}x{inter}, top-{m.experts_per_token} of {m.num_experts}, "
                                 f"tp {moe_tp} ep {ep} not measured")
        return None

    @staticmethod
    def _moe_exact(df, target: MoeShape, dtype: str, moe_tp: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The target shape's own curve in one table and dtype, capped by the bf16 curve of the shape."""
        shape = _shape_rows(df, target)
        curve = _moe_split_curve(shape, dtype, moe_tp)
        if curve is None:
            return None
        xs, ys = curve
        wide = _moe_split_curve(shape, "bfloat16", moe_tp) if dtype != "bfloat16" else None
        if wide is not None:
            # narrower experts move fewer bytes through the same grouped GEMM, so a quantised MoE layer is never
            # priced above the bf16 one of its shape (the H200 trtllm table times Llama-4 Scout's fp8 experts at
            # EP 4 at 3-6x its bf16 and fp8_block rows: 0.26 ms for one token, bf16 0.09, fp8_block 0.05)
            ys = monotone(np.minimum(ys, np.interp(xs, *wide, right=np.inf)))
        return xs, ys

    def _moe_near(self, df, target: MoeShape, dtype: str, moe_tp: int, weight_bytes: float,
                  with_target: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """The target's curve (experts of `weight_bytes` a parameter, no expert parallelism) from the (up to 4)
        nearest timed expert shapes of the dtype, hidden and intermediate sizes within NEIGHBOUR_OCTAVES (the
        target's own among them when `with_target`): each shape's utilisation against the layer's roofline
        (`_moe_sol`) at the same routed tokens per expert, averaged with weights 1 / distance, divides the
        target's roofline."""
        rows = df[df["moe_dtype"] == dtype]
        shapes = {MoeShape(*key) for key in rows[["hidden_size", "inter_size", "topk", "num_experts"]]
                  .drop_duplicates().itertuples(index=False, name=None)}
        near = sorted((math.hypot(math.log2(s.hidden / target.hidden), math.log2(s.inter / target.inter)), s)
                      for s in shapes if with_target or s != target)
        near = [(d, s) for d, s in near[:4] if d <= NEIGHBOUR_OCTAVES]
        curves, used = [], []
        for d, s in near:
            curve = _moe_split_curve(_shape_rows(rows, s), dtype, moe_tp)
            if curve is not None:
                xs, ys = curve
                util = self._moe_sol(s, dtype, xs, moe_tp, GEMM_ELEMENT_BYTES[dtype]) / ys
                # the same tokens per expert (tokens x top-k / experts) on the target
                curves.append((max(d, 0.25), xs * s.topk / s.experts * target.experts / target.topk, util))
                used.append(f"{s.hidden}x{s.inter}")
        if not curves:
            return None
        self.near_shapes["moe"] = (f"experts {target.hidden}x{target.inter}, top-{target.topk} of {target.experts} "
                                   f"from {', '.join(used)}")
        xs = np.unique(np.concatenate([c[1] for c in curves]))
        weights = np.array([1.0 / c[0] for c in curves])
        util = sum(wt * np.interp(xs, cx, cu) for wt, (_, cx, cu) in zip(weights, curves)) / weights.sum()
        return xs, monotone(self._moe_sol(target, dtype, xs, moe_tp, weight_bytes) / util)

    def _moe_sol(self, s: MoeShape, dtype: str, tokens: np.ndarray, moe_tp: int, weight_bytes: float) -> np.ndarray:
        """Roofline seconds of one MoE layer of shape `s` on a rank at the datasheet rates (the utilisation's
        yardstick): its gated experts' FLOPs, or the bytes of the experts the tokens touch (uniform routing)."""
        hw = self.work.hw
        peak = hw.peak_flops.get(GEMM_PEAK[dtype]) or hw.peak_flops.get("bf16") or hw.peak_flops["fp16"]
        per_expert = 3 * s.hidden * s.inter / moe_tp
        touched = s.experts * (1.0 - (1.0 - s.topk / s.experts) ** tokens)
        return np.maximum(2.0 * tokens * s.topk * per_expert / peak,
                          touched * per_expert * weight_bytes / hw.memory_bandwidth_bytes_s)

    def _allreduce_curve(self, custom: bool) -> tuple[np.ndarray, np.ndarray] | None:
        tp = self.work.tp
        if not self.work.hw.kernel_tables_comm:
            self.fallbacks["allreduce"] = "the tables' all-reduce times describe their host (kernel_tables_comm: false)"
            return None
        tables = []
        if custom:
            path = table_file(self.system, "comm", self.backend, "custom_allreduce_perf.parquet")
            if path is not None:
                df = read_table(path)
                graph = df[~df["kernel_source"].str.contains("eager", case=False)]
                tables.append(graph if len(graph) else df)   # an eager-only backend (Arc B60) times eager kernels
        sysdir = system_dir(self.system)
        for lib in ("nccl", "oneccl"):   # the collective library, newest version first
            for p in sorted((sysdir / "comm" / lib).glob(f"*/{lib}_perf.parquet") if sysdir else (),
                            key=lambda p: version_key(p.parent.name), reverse=True):
                df = read_table(p)
                dtype_col = "nccl_dtype" if "nccl_dtype" in df.columns else df.columns[0]
                tables.append(df[(df["op_name"] == "all_reduce") & (df[dtype_col] == "half")])
        for df in tables:
            sel = df[df["num_gpus"] == tp].drop_duplicates("message_size").sort_values("message_size")
            if len(sel) >= 2:
                return sel["message_size"].to_numpy(float), monotone(sel["latency"].to_numpy(float) * MS)
        self.fallbacks["allreduce"] = f"all-reduce over {tp} GPUs not measured"
        return None

    # ---- pricing ----------------------------------------------------------------------------------------
    def _gemm_s(self, op: tuple[str, int, int, int, str | None], tokens: np.ndarray) -> np.ndarray | None:
        name, n, k, _, dtype = op
        if self.gemm is None or dtype is None:
            return None
        m = np.maximum(tokens, 1.0)
        lat = self.gemm.latency(dtype, n, k, m)
        if lat is None:
            return None
        if dtype == "fp8" and "computescale" in self.quant:
            cut = self.quant["computescale"].latency(k, m)
            if name in ("attn_out", "mlp_down", "shared_down") and "scale_matrix" in self.quant:
                cut = cut + self.quant["scale_matrix"].latency(k, m)
            lat = np.maximum(lat - cut, self.gemm.sol(dtype, m, n, k))
        # a step streams every layer's weights from DRAM, while a table times one GEMM again and again with its
        # weights left in L2 where they fit (the L40S table's m = 1 GEMMs reach 1.27x its 864 GB/s, 96 MB of L2)
        return np.maximum(lat, GEMM_ELEMENT_BYTES[dtype] * n * k / self.work.hw.memory_bandwidth_bytes_s)

    def _measured(self, f: dict, seconds: np.ndarray, compute_bound) -> None:
        """Add measured seconds to the features, as compute- or memory-bound as the roofline classes the op; the
        tables time bursts, so a compute-bound op runs at the device's sustained rate."""
        f["meas_c"] = f["meas_c"] + seconds * compute_bound / self.sustained
        f["meas_m"] = f["meas_m"] + seconds * (1 - compute_bound)

    def token_features(self, tokens: np.ndarray) -> dict:
        """The roofline's features with every op the tables time moved to measured seconds."""
        w = self.work
        f = super().token_features(tokens)
        # the bytes the roofline counted for the layers' non-expert weights (gpt-oss: BF16 beside MXFP4 experts)
        db, g, mb = w.weight_format.dense_bytes_per_param, self.terms.g_linear, self.terms.memory_fraction
        for op in self.gemm_ops:
            name, n, k, calls, _ = op
            lat = None if name == "lm_head" else self._gemm_s(op, tokens)
            if lat is None:
                continue
            c, m = 2.0 * tokens * n * k * calls / self.linear_peak, n * k * db * calls / self.bandwidth
            self._measured(f, lat * calls, c / g >= m / mb)
            f["lin_c"], f["lin_m"] = f["lin_c"] - c, f["lin_m"] - m
            f["floors"] = f["floors"] - calls
        if self.moe_curve is not None:
            mm = w.model
            lat = mm.num_moe_layers * interp_hold(tokens * w.group_tokens_per_token, *self.moe_curve, lambda x: x)
            c = (2.0 * tokens * mm.num_moe_layers * mm.experts_per_token * mm.expert_params / w.attention_tp
                 / self.linear_peak)
            m = mm.num_moe_layers * w.experts_touched(tokens) * w.expert_bytes / self.bandwidth
            self._measured(f, lat, c / g >= m / mb)
            f["lin_c"], f["lin_m"] = f["lin_c"] - c, f["lin_m"] - m
            f["floors"] = f["floors"] - 2 * mm.num_moe_layers   # the expert GEMMs replace the MLP's two
        if self.mla_decode is not None:   # the MLA modules price the layers' projections (prefill, decode)
            mm = w.model
            proj = mm.num_layers * mm.attn_params_per_layer / w.attention_tp
            f["lin_c"] = f["lin_c"] - 2.0 * tokens * proj / self.linear_peak
            f["lin_m"] = f["lin_m"] - proj * db / self.bandwidth
            f["floors"] = f["floors"] - 2 * mm.num_layers   # the q/kv and output GEMMs
        # what the tables price leaves no linear work but rounding: clamp it away
        f["lin_c"], f["lin_m"] = np.maximum(f["lin_c"], 0.0), np.maximum(f["lin_m"], 0.0)
        if self.allreduce_curve is not None:
            xs, ys = self.allreduce_curve
            message = tokens * w.group_tokens_per_token * w.model.hidden_size
            f["meas_comm"] = w.num_allreduce * interp_hold(np.maximum(message, xs[0]), xs, ys, lambda x: x)
            f["ar_calls"], f["ar_link"] = 0.0 * tokens, 0.0 * tokens
        return f

    def logit_features(self, logits: np.ndarray) -> dict:
        f = super().logit_features(logits)
        lm = self.gemm_ops[-1]
        lat = self._gemm_s(lm, logits) if lm[0] == "lm_head" else None
        if lat is not None:
            t = self.terms
            self._measured(f, lat * (logits > 0), f["lm_c"] / t.g_lm_head >= f["lm_m"] / t.memory_fraction)
            f["lm_c"], f["lm_m"], f["floors"] = 0.0 * logits, 0.0 * logits, 0.0 * logits
        return f

    def attention_features(self, prefill_chunks, num_decode, context_tokens) -> dict:
        f = super().attention_features(prefill_chunks, num_decode, context_tokens)
        if self.mla_decode is not None:
            layers = self.work.model.num_layers
            for i, chunks in enumerate(prefill_chunks):
                f["pre_c"][i], f["pre_m"][i] = 0.0, 0.0
                if chunks:
                    table_s, f["pre_c"][i] = self._mla_prefill_s(chunks)
                    f["meas_c"][i] += table_s
                    f["floors"][i] -= layers
            f["meas_m"] = f["meas_m"] + self._by_batch(self._mla_decode_s, num_decode, context_tokens)
            f["floors"] = f["floors"] - self.attention_kernels * (num_decode > 0)
            f["dec_c"], f["dec_m"] = 0.0 * f["dec_c"], 0.0 * f["dec_m"]
            return f
        if self.prefill_grid is not None:
            for i, chunks in enumerate(prefill_chunks):
                if chunks:
                    f["meas_c"][i] += self._prefill_s(chunks)
                    f["floors"][i] -= self.work.model.num_layers
            f["pre_c"], f["pre_m"] = 0.0 * f["pre_c"], 0.0 * f["pre_m"]
        if self.decode_grid is not None:
            f["meas_m"] = f["meas_m"] + self._by_batch(self._decode_s, num_decode, context_tokens)
            f["floors"] = f["floors"] - self.work.model.num_layers * (num_decode > 0)
            f["dec_c"], f["dec_m"] = 0.0 * f["dec_c"], self._rereads_m(f["dec_m"])
        return f

    @staticmethod
    def _by_batch(seconds_of, num_decode: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        """Per step, `seconds_of(batch, contexts)` of its decodes, each batch size priced once over its steps'
        contexts (0 for a step without decodes)."""
        sec = np.zeros(len(num_decode))
        for b in np.unique(num_decode):
            if b > 0:
                sec[num_decode == b] = seconds_of(int(b), context_tokens[num_decode == b])
        return sec

    def _rereads_m(self, dec_m):
        """Memory seconds at fraction 1 of the decode KV reads beyond the first (StepWork.decode_kv_reads), which
        the tables' kernels, reading each KV head once, do not time: the roofline's bytes of them."""
        reads = self.work.decode_kv_reads
        return dec_m * ((reads - 1.0) / reads)

    def _prefill_s(self, chunks: list[tuple[int, int]]) -> float:
        """Seconds of the prefill chunks' attention over all layers: the tables' burst time at the device's
        sustained rate (prefill attention is compute-bound)."""
        grid, w = self.prefill_grid, self.work
        assert grid is not None   # callers check the table exists
        pairs, full = w.prefill_pairs(chunks)
        b = len(chunks)
        s = full / b
        row = self._prefill_rows.get(b)
        if row is None:
            row = self._prefill_rows[b] = grid.row(b)
        per_layer = _interp_row(self._prefill_xs, row, s) ** 2 * pairs / (b * s * s / 2.0)
        layers: float = w.full_layers
        if w.sliding_layers:   # a window caps the pairs each query sees
            layers = layers + w.sliding_layers * w.sliding_pairs(chunks) / pairs
        return per_layer * layers / self.sustained

    def _decode_s(self, num_decode: int, context_tokens):
        """Measured seconds of the decodes' attention over all layers (float, or array over contexts)."""
        grid, w = self.decode_grid, self.work
        assert grid is not None   # callers check the table exists
        row = self._decode_rows.get(num_decode)
        if row is None:
            row = self._decode_rows[num_decode] = grid.row(num_decode)
        mean = context_tokens / num_decode
        if isinstance(mean, np.ndarray):
            sec = np.interp(mean, self._decode_xs, row) * w.full_layers
            if w.sliding_layers:
                sec = sec + np.interp(np.minimum(mean, w.window), self._decode_xs, row) * w.sliding_layers
            return sec
        seconds = _interp_row(self._decode_xs, row, mean) * w.full_layers
        if w.sliding_layers:
            seconds += _interp_row(self._decode_xs, row, min(mean, w.window)) * w.sliding_layers
        return seconds

    def prefill(self, chunks: list[tuple[int, int]]):
        if self.mla_prefill is not None:
            sec, extra = self._mla_prefill_s(chunks)
            cs = extra / self.terms.g_attn
            return sec + cs, sec + cs, 0.0, sec
        if self.prefill_grid is None:
            return super().prefill(chunks)
        sec = self._prefill_s(chunks)
        return sec, sec, 0.0, sec

    def decode(self, num_decode, context_tokens, maximum=max):
        if self.mla_decode is not None:
            sec = self._mla_decode_s(num_decode, context_tokens)
            return sec, 0.0, sec, sec
        if self.decode_grid is None:
            return super().decode(num_decode, context_tokens, maximum)
        sec = self._decode_s(num_decode, context_tokens)
        if self.work.decode_kv_reads != 1.0:   # the re-reads the tables do not time, at the device's memory fraction
            extra = self._rereads_m(self._decode_work(num_decode, context_tokens)[1]) / self.terms.memory_fraction
            return sec + extra, 0.0, sec + extra, sec
        return sec, 0.0, sec, sec   # memory-bound: no compute part (a float broadcasts over the repeats' arrays)
