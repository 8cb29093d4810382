"""Federated methods. Each is plain PyTorch (no Ray) and registers itself in ``ALGORITHMS``."""

from rayfed_proto.registry import Registry, load_plugins

ALGORITHMS: Registry = Registry("algorithm")


def _load_builtin() -> None:
    """Import every method module of this package (each registers itself): a new method is a
    new file here, with no list to edit."""
    import importlib
    import pkgutil

    shared = {"async_weights", "base", "common", "schedules"}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name not in shared and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def _load_plugins() -> None:
    """Methods from other packages: an entry point in group ``rayfed_proto.algorithms`` whose
    module registers itself on import (``registry.load_plugins``; a broken one warns and is skipped)."""
    load_plugins("rayfed_proto.algorithms", "algorithm")


from rayfed_proto.algorithms.base import (  # noqa: E402
    Algorithm,
    ClientAlgorithm,
    FederationSpec,
    Options,
    ServerAlgorithm,
)

_load_builtin()
_load_plugins()  # after the interface imports above, so plug-ins can import them from here

__all__ = ["ALGORITHMS", "Algorithm", "ClientAlgorithm", "ServerAlgorithm", "FederationSpec", "Options"]
