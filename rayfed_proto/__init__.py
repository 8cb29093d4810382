"""rayfed_proto: asynchronous, prototype-based federated learning on Ray actors."""

__version__ = "0.1.0"

# rayfed_proto.config imports neither rayfed_proto.data nor rayfed_proto.system: they register
# their config checks (dataset and partitioner names, system profiles) with
# config.register_check when imported. Python runs this file before any rayfed_proto.* module,
# so importing them here puts the checks in place wherever a config is validated (CLI, driver,
# actors, Tune trials, a direct build_config/load_config).
import rayfed_proto.data  # noqa: E402,F401
import rayfed_proto.system  # noqa: E402,F401

__all__ = ["__version__", "load_config", "run"]


def __getattr__(name: str):
    """``run`` and ``load_config`` (rayfed_proto.api), imported on first use: ``import rayfed_proto``
    stays cheap (no Ray, PyTorch, MLflow or pandas until a run starts)."""
    if name in ("run", "load_config"):
        from rayfed_proto import api

        return getattr(api, name)
    raise AttributeError(f"module 'rayfed_proto' has no attribute {name!r}")
