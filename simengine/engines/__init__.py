"""Engine policies, one scheduler module each (with its config and helper modules); importing this package registers
every module's engine in ENGINES."""

import importlib
import pkgutil

from simengine.engines.base import ENGINES, EnginePolicy

_SHARED = {"base", "memory", "devices"}
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod not in _SHARED and not _mod.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["ENGINES", "EnginePolicy"]
