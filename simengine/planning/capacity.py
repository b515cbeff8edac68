"""Capacity under an SLO: the highest request rate an engine serves while meeting latency limits, found by a
bracketing search over the scenario's arrival rate (simulations at each rate probed; nothing extrapolated).

Every probe sends the same requests (the scenario's num_requests, or what its rate sends in horizon_s) at the rate
probed, so probes differ by the rate alone. A rate is feasible when the run is not overloaded (finishes kept up
with arrivals and nothing was refused or left: docs/metrics.md), every statistic limit holds (`--slo`, e.g. p99
TTFT <= 500 ms, over completed requests) and, where the scenario gives per-request objectives (`slo:`), the share
of all requests meeting every one of them (failed and unfinished ones miss) is at least `attainment`.

The search runs the workload offline for a first upper bracket (raised 1.5x while it still meets the SLO: an
offline batch's ramp and tail can put its throughput below the sustained rate), checks a low rate (if that fails
the SLO cannot be met at any load) and bisects until the bracket is within `tolerance`. Every run keeps the
scenario's seed (the same random draws at every rate, so the statistics move smoothly with the rate and a looser
SLO never gives a lower capacity); `repeats` adds runs with the next seeds, and a rate must then be feasible on
their averaged statistics and pooled attainment.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from simengine.config.scenario import EngineEntry, Scenario
from simengine.errors import InputError

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = {"mean": "mean", "median": "median", "p50": "median", "p90": "p90", "p99": "p99"}
RATED = ("poisson", "gamma", "constant")
LOW_FRACTION = 0.02          # the low bracket: this share of the saturated throughput
OFFLINE_MAX_REQUESTS = 4000  # requests of the offline run that sets the upper bracket
MIN_REQUESTS = 500           # fewer per probe measure a burst's transient, not a sustained rate
NO_HORIZON_S = 1e9           # with num_requests set, a horizon this long only means "until all are sent"
RAISE, MAX_RAISES = 1.5, 6   # an upper bracket that meets the SLO moves up by this factor, at most this often


@dataclass(frozen=True)
class StatLimit:
    """One statistic limit: `<metric>_<stat>_ms=<value>` (ttft_p99_ms=500: the p99 of TTFT at most 500 ms)."""

    metric: str
    stat: str
    limit_ms: float

    @property
    def key(self) -> str:
        return f"{self.stat}_{self.metric}_ms"     # summary.json's key

    def __str__(self) -> str:
        return f"{self.metric}_{self.stat}_ms<={self.limit_ms:g}"


def parse_slo(text: str | None) -> list[StatLimit]:
    """`ttft_p99_ms=500,tpot_mean_ms=40` -> limits (InputError naming --slo on anything else)."""
    if not text:
        return []
    limits = []
    for item in (t.strip() for t in text.split(",")):
        name, eq, value = item.partition("=")
        parts = name.split("_")
        if not eq or len(parts) != 3 or parts[0] not in METRICS or parts[1] not in STATS or parts[2] != "ms":
            raise InputError(f"'{item}' is not METRIC_STAT_ms=VALUE with METRIC one of {', '.join(METRICS)} and "
                             f"STAT one of {', '.join(STATS)} (e.g. ttft_p99_ms=500)", field="--slo")
        try:
            limit = float(value)
        except ValueError:
            raise InputError(f"'{value}' in '{item}' is not a number of milliseconds", field="--slo") from None
        if not 0 < limit < 1e9:
            raise InputError(f"'{item}': the limit must be > 0 ms", field="--slo")
        limits.append(StatLimit(parts[0], STATS[parts[1]], limit))
    return limits


@dataclass
class Point:
    """The runs at one rate: averaged statistics, pooled attainment, and whether it is feasible (and why not)."""

    rate: float
    summaries: list[dict]
    attainment: float | None
    feasible: bool
    why: str

    def stat(self, key: str) -> float | None:
        values = [s[key] for s in self.summaries if s.get(key) is not None]
        return float(np.mean(values)) if values else None


@dataclass
class Capacity:
    """One engine's capacity and the runs that found it."""

    label: str
    rate: float                   # req/s of the whole deployment; 0 when even the low bracket fails the SLO
    offline_rate: float           # the offline run's request throughput (the first upper bracket)
    replicas: int
    devices_per_replica: int
    points: list[Point] = field(default_factory=list)
    runs: int = 0
    why_not_higher: str = ""
    requests_per_run: int = 0

    @property
    def rate_per_replica(self) -> float:
        return self.rate / self.replicas

    @property
    def rate_per_device(self) -> float:
        return self.rate / (self.replicas * self.devices_per_replica)

    def devices_for(self, target_rate: float) -> int | None:
        """Devices to serve `target_rate` at this capacity (whole replicas)."""
        if self.rate_per_replica <= 0:
            return None
        return math.ceil(target_rate / self.rate_per_replica - 1e-9) * self.devices_per_replica

    @property
    def operating_point(self) -> Point | None:
        feasible = [p for p in self.points if p.feasible]
        return max(feasible, key=lambda p: p.rate) if feasible else None

    def cost_per_1m_output_tokens(self, price_usd_per_hour: float | None) -> float | None:
        """At the capacity's operating point: device-hours over output tokens (None without a price)."""
        p = self.operating_point
        if p is None or price_usd_per_hour is None:
            return None
        costs = [price_usd_per_hour * s["_devices"] * s["duration"] / 3600.0 / s["total_output_tokens"] * 1e6
                 for s in p.summaries if s["total_output_tokens"]]
        return float(np.mean(costs)) if costs else None


def rated(scenario: Scenario) -> None:
    """InputError unless the scenario's requests arrive at a rate the search can vary."""
    wl = scenario.workload
    if wl.trace is not None or wl.sessions is not None or wl.arrival.process not in RATED:
        kind = "a trace replay" if wl.trace is not None else "sessions" if wl.sessions is not None \
            else f"{wl.arrival.process} arrivals"
        raise InputError(f"capacity varies workload.arrival.rate, which {kind} do not have; use a scenario with "
                         f"{', '.join(RATED)} arrivals (e.g. --set 'workload.arrival={{process: poisson, rate: 1}}')",
                         field="workload.arrival")


def requests_per_run(scenario: Scenario) -> int:
    """Every probe sends the same requests: the scenario's num_requests, else what its rate sends in horizon_s."""
    wl = scenario.workload
    n = wl.num_requests or round(wl.arrival.rate_req_s * scenario.horizon_s)
    if n < MIN_REQUESTS:
        raise InputError(f"a capacity probe of {n} requests says little about the tail; give at least "
                         f"{MIN_REQUESTS} (workload.num_requests, or a longer horizon_s)",
                         field="workload.num_requests")
    return n


def at_rate(scenario: Scenario, rate: float, seed: int) -> Scenario:
    """The scenario's requests sent at `rate` (however long that takes: no horizon cuts them)."""
    wl = scenario.workload
    return dataclasses.replace(scenario, seed=seed, horizon_s=NO_HORIZON_S, workload=dataclasses.replace(
        wl, num_requests=requests_per_run(scenario), arrival=dataclasses.replace(wl.arrival, rate=rate)))


def offline(scenario: Scenario) -> Scenario:
    """The workload sent all at once: what the engine serves when saturated (within the scenario's drain_s: what
    is left then counts as not served, so an engine that stalls cannot stretch the run)."""
    wl = scenario.workload
    return dataclasses.replace(scenario, horizon_s=0.0, workload=dataclasses.replace(
        wl, num_requests=min(requests_per_run(scenario), OFFLINE_MAX_REQUESTS),
        arrival=dataclasses.replace(wl.arrival, process="offline")))


def judge(summaries: list[dict], attainment_values: list[float | None], limits: list[StatLimit],
          attainment: float) -> tuple[bool, str, float | None]:
    """(feasible, why not, pooled attainment) of the runs at one rate."""
    pooled = None
    known = [a for a in attainment_values if a is not None]
    if known:
        total = sum(s["num_requests"] for s in summaries)
        pooled = sum(a * s["num_requests"] for a, s in zip(attainment_values, summaries)) / max(total, 1)
    if any(s["overloaded"] for s in summaries):
        return False, "overloaded (finishes fell behind arrivals, a backlog was left, or requests were refused)", \
            pooled
    for lim in limits:
        values = [s[lim.key] for s in summaries if s.get(lim.key) is not None]
        if not values:
            return False, f"no request gives {lim.metric} (e.g. one-token outputs have no TPOT)", pooled
        value = float(np.mean(values))
        if value > lim.limit_ms:
            return False, f"{lim.metric} {lim.stat} {value:.1f} ms > {lim.limit_ms:g} ms", pooled
    if pooled is not None and pooled < attainment:
        return False, f"SLO attainment {100 * pooled:.1f}% < {100 * attainment:g}%", pooled
    return True, "", pooled


def scaling_unit(pools) -> tuple[int, int]:
    """(replicas, devices per replica) the deployment grows by: one pool's replicas, or, for several pools (prefill
    and decode pools, a mixed fleet), the whole deployment as one replica of all their devices."""
    if len(pools) == 1:
        return pools[0].count, pools[0].dep.num_devices
    return 1, sum(p.num_devices for p in pools)


def search(scenario: Scenario, entry: EngineEntry, limits: list[StatLimit], *, attainment: float = 0.99,
           tolerance: float = 0.02, repeats: int = 1, progress=None) -> Capacity:
    """The capacity of one engine (see the module's docstring)."""
    from simengine.api import run_engine
    from simengine.metrics.summary import slo_attainment
    from simengine.sim.build import plan_pools

    rated(scenario)
    requests_per_run(scenario)
    if not limits and not scenario.slo.any:
        raise InputError("give a latency limit: --slo (e.g. ttft_p99_ms=500) or per-request objectives in the "
                         "scenario's slo: section", field="--slo")
    if not 0 < attainment <= 1:
        raise InputError(f"must be a share in (0, 1], got {attainment:g}", field="--attainment")
    if not 0.001 <= tolerance <= 0.5:
        raise InputError(f"must be a relative bracket between 0.001 and 0.5, got {tolerance:g}", field="--tolerance")
    if not 1 <= repeats <= 100:
        raise InputError(f"must be between 1 and 100 runs per rate, got {repeats}", field="--repeats")
    pools = plan_pools(scenario, entry)
    cap = Capacity(entry.display, 0.0, 0.0, *scaling_unit(pools), requests_per_run=requests_per_run(scenario))

    def run(sc: Scenario) -> tuple[dict, float | None]:
        r = run_engine(sc, entry)
        cap.runs += 1
        summary = {**r.summary, "_devices": sum(p.num_devices for p in pools)}
        return summary, slo_attainment(r.recorder, sc.slo)

    def probe(rate: float) -> Point:
        runs = [run(at_rate(scenario, rate, scenario.seed + k)) for k in range(repeats)]
        summaries = [s for s, _ in runs]
        ok, why, pooled = judge(summaries, [a for _, a in runs], limits, attainment)
        point = Point(rate, summaries, pooled, ok, why)
        cap.points.append(point)
        if progress:
            progress(cap.label, point)
        return point

    saturated, _ = run(offline(scenario))
    cap.offline_rate = hi = float(saturated["request_throughput"])
    if hi <= 0:
        cap.why_not_higher = "the engine completes no request of this workload even offline"
        return cap
    lo_point = probe(LOW_FRACTION * hi)
    if not lo_point.feasible:
        cap.why_not_higher = f"at {lo_point.rate:.3g} req/s (2% of saturation): {lo_point.why}"
        return cap
    lo = lo_point.rate
    for _ in range(MAX_RAISES):
        top = probe(hi)
        if not top.feasible:
            why_hi = top.why
            break
        lo, hi = hi, RAISE * hi
    else:
        cap.rate = lo
        cap.why_not_higher = f"none found: every rate up to {lo:.4g} req/s met it ({MAX_RAISES} raises)"
        cap.points.sort(key=lambda p: p.rate)
        return cap
    while hi - lo > tolerance * hi:
        mid = 0.5 * (lo + hi)
        p = probe(mid)
        if p.feasible:
            lo = mid
        else:
            hi, why_hi = mid, p.why
    cap.rate = lo
    cap.why_not_higher = f"at {hi:.4g} req/s: {why_hi}"
    cap.points.sort(key=lambda p: p.rate)
    return cap
