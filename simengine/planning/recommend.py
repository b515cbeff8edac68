"""Engine recommendation from simulated evidence: every engine that runs on the scenario's device (and the knob
variants the scenario lists) is run at the scenario's own rate and put through a capacity search, then ranked by
a priority, each with the figures that decided it and a line of why from the runs themselves."""

from __future__ import annotations

from dataclasses import dataclass

from simengine.config.scenario import EngineEntry, Scenario
from simengine.errors import InputError
from simengine.planning.capacity import Capacity, StatLimit, search

PRIORITIES = ("throughput", "latency", "cost", "balanced")

# Figures that tell engines apart by mechanism, compared between the winner and the runner-up: (summary key,
# words, format, higher is better, smallest difference worth a word).
# (summary key, words, format, higher is better, least relative difference, least absolute difference)
EVIDENCE = (
    ("prefix_cache_hit_rate", "prefix hit", "{:.0%}", True, 0.10, 0.01),
    ("kv_capacity_tokens", "KV pool", "{:,.0f} tokens", True, 0.15, 0.0),
    ("mean_batch_size", "mean batch", "{:.1f}", True, 0.15, 0.0),
    ("p99_ttft_ms", "p99 TTFT", "{:.0f} ms", False, 0.20, 0.0),
    ("p99_tpot_ms", "p99 TPOT", "{:.1f} ms", False, 0.15, 0.0),
    ("preemptions", "preemptions", "{:.0f}", False, 0.5, 0.0),
    ("failed", "failed requests", "{:.0f}", False, 0.5, 0.0),
)


@dataclass
class Ranked:
    label: str
    engine: str
    capacity: Capacity
    at_rate: dict           # summary.json of the run at the scenario's own rate
    score: float            # the priority's figure (higher ranks first)
    price: float | None

    @property
    def cost(self) -> float | None:
        return self.capacity.cost_per_1m_output_tokens(self.price)

    @property
    def latency_ms(self) -> float | None:
        """p99 TTFT at the scenario's rate; None when that run was overloaded or no request completed."""
        s = self.at_rate
        return None if s["overloaded"] or s.get("p99_ttft_ms") is None else s["p99_ttft_ms"]


def candidates(scenario: Scenario, dep) -> list[EngineEntry]:
    """The scenario's engine entries, and every other registered engine that runs on its device with its defaults
    (research baselines, static batching, Orca and Sarathi-Serve, only when the scenario lists them)."""
    from simengine.engines import ENGINES

    listed = list(scenario.engines)
    names = {e.engine for e in listed}
    hw = dep.hardware
    for name in ENGINES.names():
        cls = ENGINES.get(name)
        if name in names or name == "generic" or cls.research_baseline:
            continue
        if cls.runs_on(hw):
            listed.append(EngineEntry(engine=name))
    return listed


def _scores(ranked: list[Ranked], priority: str) -> None:
    best_cap = max((r.capacity.rate_per_device for r in ranked), default=0.0) or 1.0
    lat = [r.latency_ms for r in ranked if r.latency_ms]
    best_lat = min(lat) if lat else 1.0
    costs = [r.cost for r in ranked if r.cost]
    best_cost = min(costs) if costs else 1.0
    for r in ranked:
        thr = r.capacity.rate_per_device / best_cap
        fast = best_lat / r.latency_ms if r.latency_ms else 0.0
        cheap = best_cost / r.cost if r.cost else 0.0
        r.score = {"throughput": thr, "latency": fast, "cost": cheap,
                   "balanced": (thr * fast * cheap) ** (1 / 3)}[priority]


def _versus(words: str, a: float, b: float, fmt: str, higher: bool, unit: str = "") -> str:
    worse = "" if (a >= b) == higher else " (worse, outweighed)"
    return f"{words} {fmt.format(a)} against {fmt.format(b)}{unit}{worse}"


def why(first: Ranked, second: Ranked, priority: str = "balanced") -> str:
    """The priority's own figures (capacity per GPU, p99 TTFT at the scenario's rate, cost), then the figures where
    the winner and the runner-up differ most in their runs at the scenario's rate; a figure on which the winner is
    worse says so."""
    head = []
    if priority in ("throughput", "balanced"):
        head.append(_versus("capacity", first.capacity.rate_per_device, second.capacity.rate_per_device,
                            "{:.3g}", True, " req/s per GPU"))
    if priority in ("latency", "balanced") and first.latency_ms is not None and second.latency_ms is not None:
        head.append(_versus("p99 TTFT", first.latency_ms, second.latency_ms, "{:.0f} ms", False))
    if priority == "cost" and first.cost is not None and second.cost is not None:
        head.append(_versus("cost", first.cost, second.cost, "${:.3f}", False, " per 1M output tokens"))
    if not head:   # a latency or cost figure missing (an overloaded run, no price): capacity decides the order
        head.append(_versus("capacity", first.capacity.rate_per_device, second.capacity.rate_per_device,
                            "{:.3g}", True, " req/s per GPU"))
    out = []
    for key, words, fmt, higher, least, least_abs in EVIDENCE:
        a, b = first.at_rate.get(key), second.at_rate.get(key)
        if a is None or b is None or any(key == "p99_ttft_ms" and h.startswith("p99 TTFT") for h in head):
            continue
        scale = max(abs(a), abs(b))
        if scale == 0 or abs(a - b) / scale < least or abs(a - b) < least_abs:
            continue
        out.append((abs(a - b) / scale, _versus(words, a, b, fmt, higher)))
    top = [text for _, text in sorted(out, key=lambda x: -x[0])[:3]]
    return (f"{first.label} over {second.label}: {'; '.join(head)}"
            + ("; " + "; ".join(top) if top else "; no mechanism figure differs by much"))


# the metric families (validate/accuracy.py) whose error bears on each priority's figure: capacity and cost follow
# the throughput predictions, latency the TTFT ones, the balanced score both
PRIORITY_FAMILIES = {"throughput": ("throughput",), "cost": ("throughput",), "latency": ("TTFT",),
                     "balanced": ("throughput", "TTFT")}


def margin_and_error(first: Ranked, second: Ranked, priority: str, hardware: str) -> tuple[float, dict[str, float]]:
    """The winner's lead, 1 - the runner-up's score over the winner's, and the simulator's median |error| on
    published measurements of each of the two engines in the priority's metric families (validate/accuracy.py
    median_abs_error; an engine without such rows is left out)."""
    from simengine.validate.accuracy import median_abs_error
    lead = 1.0 - second.score / first.score if first.score > 0 else 0.0
    errors = {}
    for r in (first, second):
        e = median_abs_error(r.engine, hardware, PRIORITY_FAMILIES[priority])
        if e is not None:
            errors[r.engine] = round(e, 1)
    return lead, errors


def margin_line(first: Ranked, second: Ranked, priority: str, hardware: str) -> tuple[str, bool | None]:
    """A sentence comparing the winner's lead with the simulator's error on these engines, and whether the lead is
    within it (None when neither engine was validated)."""
    lead, errors = margin_and_error(first, second, priority, hardware)
    head = f"lead {lead:.0%} over {second.label}"
    if not errors:
        return f"{head}; neither engine was validated on published measurements", None
    within = lead * 100 <= max(errors.values())
    parts = ", ".join(f"{e} {v:.0f}%" for e, v in errors.items())
    return (f"{head}; the simulator's median |error| on published measurements of these engines: {parts}"
            f"{': a tie within that error' if within else ''}", within)


def recommend(scenario: Scenario, limits: list[StatLimit], *, priority: str = "balanced", attainment: float = 0.99,
              tolerance: float = 0.02, engines: list[EngineEntry] | None = None, price: float | None = None,
              progress=None) -> list[Ranked]:
    """Every candidate engine ranked by `priority` (see the module's docstring)."""
    from simengine.api import run_engine
    from simengine.sim.build import build_deployment, plan_pools

    if priority not in PRIORITIES:
        raise InputError(f"'{priority}' is not a priority; use one of {', '.join(PRIORITIES)}", field="--priority")
    dep = build_deployment(scenario)
    ranked = []
    for entry in engines or candidates(scenario, dep):
        try:
            plan_pools(scenario, entry)
        except InputError as exc:
            if progress:
                progress(entry.display, f"left out: {exc}")
            continue
        at_rate = run_engine(scenario, entry).summary
        cap = search(scenario, entry, limits, attainment=attainment, tolerance=tolerance)
        ranked.append(Ranked(entry.display, entry.engine, cap, at_rate, 0.0, price))
        if progress:
            progress(entry.display, f"{cap.rate:.3g} req/s")
    if not ranked:
        raise InputError(f"no engine runs on {dep.hardware.name} with this model", field="engines")
    _scores(ranked, priority)
    ranked.sort(key=lambda r: (-r.score, r.label))
    return ranked
