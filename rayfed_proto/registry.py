"""Name -> object registries for algorithms, datasets, partitioners and model groups.

A registry is how new pieces plug in: a module registers itself with a decorator and the
config validator, the CLI's ``list`` and the runtime look names up here, never importing a
concrete implementation by name.

Other packages plug in through entry points (:func:`load_plugins`): the registry's package
imports every module of its group (``rayfed_proto.algorithms``, ``rayfed_proto.datasets``,
``rayfed_proto.models``) once its built-ins are registered, and each module registers itself.
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


PLUGIN_GROUPS = ("rayfed_proto.algorithms", "rayfed_proto.datasets", "rayfed_proto.models", "rayfed_proto.policies")
"""The entry-point groups whose modules register algorithms, dataset loaders, architectures /
model groups, and federation policies (``federation.mode``)."""


def load_plugins(group: str, kind: str) -> list[str]:
    """Import every module declared as an entry point of ``group``; return the names of those loaded.

    Each module registers its pieces when imported. Entry points come from the metadata of the
    installed distributions (``importlib.metadata``), so every process that imports the
    registry's package sees them, Ray actors included, which a registration in a user's script
    is not. A plug-in that fails to import, or registers a name already taken, is reported with
    a warning naming it (``kind``: what the group holds, for the message) and skipped: the
    built-ins and the other plug-ins stay usable.
    """
    import warnings
    from importlib.metadata import entry_points

    if group not in PLUGIN_GROUPS:
        raise ValueError(f"plug-in group {group!r}: one of {', '.join(PLUGIN_GROUPS)}")
    loaded = []
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        try:
            ep.load()
        except Exception as e:  # a broken plug-in must not take the built-ins down with it
            warnings.warn(f"rayfed_proto: {kind} plug-in {ep.name!r} ({ep.value}, entry point group {group}) failed "
                          f"to load and is skipped: {e!r}", stacklevel=2)
        else:
            loaded.append(ep.name)
    return loaded
