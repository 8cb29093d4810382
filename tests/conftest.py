"""Shared fixtures. Integration tests share one Ray instance (ray.init takes ~5 s)."""

import os

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


@pytest.fixture
def tracking(tmp_path):
    """Overrides that send MLflow and outputs into the test's own folder."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, [f"tracking.tracking_uri={uri}", f"tracking.output_dir={tmp_path / 'runs'}"]
