"""rayfed_proto: asynchronous, prototype-based federated learning on Ray actors."""

__version__ = "0.1.0"
