"""Federated methods. Each is plain PyTorch (no Ray) and registers itself in ``ALGORITHMS``."""

from rayfed_proto.registry import Registry

ALGORITHMS: Registry = Registry("algorithm")

from rayfed_proto.algorithms import fedavg, fedproto, fedtgp  # noqa: E402,F401  (register)
from rayfed_proto.algorithms.base import (  # noqa: E402
    Algorithm,
    ClientAlgorithm,
    FederationSpec,
    Options,
    ServerAlgorithm,
)

__all__ = ["ALGORITHMS", "Algorithm", "ClientAlgorithm", "ServerAlgorithm", "FederationSpec", "Options"]
