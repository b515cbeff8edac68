"""One small generic registry for plugins (engines, cost models): register by decorator, look up by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from simengine.errors import unknown_name

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> class. Unknown names fail with the list of valid ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._items:
                raise RuntimeError(f"{self.kind} '{name}' registered twice")
            self._items[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls
        return deco

    def get(self, name: str, *, field: str | None = None) -> type[T]:
        if name in self._items:
            return self._items[name]
        raise unknown_name(self.kind, name, self._items, field=field)

    def names(self) -> list[str]:
        return list(self._items)
