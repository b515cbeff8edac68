"""simengine: a discrete-event simulator of LLM inference serving engines on many accelerators.

Public API (docs/api.md): simulate (a scenario's engines side by side: summaries, frames, files, figures),
load_scenario, compare and run_engine.
"""

from simengine.api import EngineResult, Simulation, compare, run_engine, simulate
from simengine.config.scenario import Scenario, load_scenario

__all__ = ["EngineResult", "Scenario", "Simulation", "compare", "load_scenario", "run_engine", "simulate"]
