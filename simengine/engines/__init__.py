"""Engine policies, one module each; importing this package registers them all in ENGINES."""

from simengine.engines import vllm  # noqa: F401  (registers)
from simengine.engines.base import ENGINES, EnginePolicy

__all__ = ["ENGINES", "EnginePolicy"]
