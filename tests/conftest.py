"""Shared fixtures. Integration tests share one Ray instance (ray.init takes ~5 s)."""

import os
import shutil

import pytest

# 2 logical GPUs on a CPU-only machine: fractional placement is exercised, compute falls back to CPU
RAY_NUM_CPUS = 2
RAY_NUM_GPUS = 2


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    if not ray.is_initialized():
        ray.init(num_cpus=RAY_NUM_CPUS, num_gpus=RAY_NUM_GPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory):
    """An MLflow sqlite store with its tables made, once per session: MLflow builds a new store by
    running its schema migrations, which takes seconds each time (more on a loaded machine)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("empty_mlflow_store") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def tracking(tmp_path, empty_mlflow_store):
    """Overrides that send MLflow and outputs into the test's own folder. The store is a copy of
    ``empty_mlflow_store``: the test's own, as empty as a new one, without the migrations. (A run
    creating its store from nothing is still tested where a run writes to a path of its own:
    test_multinode.py's job, test_tune.py's interrupted sweep (the server its CLI starts),
    tests/unit/test_run_guards.py.)"""
    shutil.copyfile(empty_mlflow_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, [f"tracking.tracking_uri={uri}", f"tracking.output_dir={tmp_path / 'runs'}"]
