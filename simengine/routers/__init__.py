"""Request routers across replicas, registered by name like engines (docs/cluster.md)."""

from simengine.routers import load  # noqa: F401, I001  (registration, in this order)
from simengine.routers import affinity, llmd, prefix  # noqa: F401
from simengine.routers.base import ROUTERS, ReplicaState, Router

__all__ = ["ROUTERS", "ReplicaState", "Router"]
