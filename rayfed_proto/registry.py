"""Name -> object registries for algorithms, datasets, partitioners and model groups.

A registry is how new pieces plug in: a module registers itself with a decorator and the
config validator, the CLI's ``list`` and the runtime look names up here, never importing a
concrete implementation by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised when a name is not registered; the message lists what is."""

    def __init__(self, kind: str, name: object, allowed: list[str]):
        self.kind, self.name, self.allowed = kind, name, allowed
        super().__init__(f"unknown {kind} {name!r}; allowed: {', '.join(allowed)}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            self.add(name, obj, help)
            return obj

        return decorator

    def add(self, name: str, obj: T, help: str = "") -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        doc = help or (getattr(obj, "__doc__", None) or "").strip().splitlines()[:1]
        self._help[name] = doc if isinstance(doc, str) else (doc[0] if doc else "")

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def describe(self, name: str) -> str:
        return self._help.get(name, "")

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
