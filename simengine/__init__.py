"""simengine: a discrete-event simulator of LLM inference serving engines on many accelerators.

Public API: load_scenario, simulate (one engine, raw result), run_engine / compare (frames + summaries).
"""

from simengine.api import EngineResult, compare, run_engine
from simengine.config.scenario import Scenario, load_scenario
from simengine.sim.runner import simulate

__all__ = ["EngineResult", "Scenario", "compare", "load_scenario", "run_engine", "simulate"]
