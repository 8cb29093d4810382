"""Federated methods. Each is plain PyTorch (no Ray) and registers itself in ``ALGORITHMS``."""

from rayfed_proto.registry import Registry

ALGORITHMS: Registry = Registry("algorithm")

from rayfed_proto.algorithms import fedavg, fedproto, fedtgp  # noqa: E402,F401  (register)


def _load_plugins() -> None:
    """Methods from other packages: an entry point in group ``rayfed_proto.algorithms`` whose
    module registers itself on import. Entry points are seen by every process that imports
    this package, Ray actors included, which a registration in a user's script is not."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="rayfed_proto.algorithms"):
        ep.load()


_load_plugins()
from rayfed_proto.algorithms.base import (  # noqa: E402
    Algorithm,
    ClientAlgorithm,
    FederationSpec,
    Options,
    ServerAlgorithm,
)

__all__ = ["ALGORITHMS", "Algorithm", "ClientAlgorithm", "ServerAlgorithm", "FederationSpec", "Options"]
