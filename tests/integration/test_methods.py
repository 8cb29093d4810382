"""Every registered method through real actors, writing to MLflow (new methods are covered
automatically: the list comes from the registry)."""

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.config import build_config
from rayfed_proto.runtime.driver import run_experiment

pytestmark = pytest.mark.integration


def _method_overrides(name: str) -> list[str]:
    extra = []
    if ALGORITHMS.get(name).requires_homogeneous_models:
        extra.append("model.group=HtFE1")
    if "server_epochs" in ALGORITHMS.get(name).Options.model_fields:
        extra.append("algorithm.server_epochs=3")
    return extra


@pytest.mark.parametrize("method", ALGORITHMS.names())
def test_method_runs_through_actors_and_logs_to_mlflow(ray_session, tracking, method):
    uri, track = tracking
    cfg = build_config({}, track + _method_overrides(method) + [
        f"algorithm.name={method}", "data.partition.beta=0.5", "data.partition.min_samples=20",
        "model.feature_dim=32", "federation.num_clients=4", "resources.clients_per_actor=2",
        "federation.mode=sync", "federation.rounds=2", "federation.eval_every=1"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm.name"] == method
    steps = sorted(m.step for m in client.get_metric_history(result.run_id, "head_acc"))
    assert steps == [0, 1, 2]
    last = result.history[-1]
    assert last["updates_accepted"] == 8 and last["updates_refused"] == 0
    assert np.isfinite(last["train_loss"])
    if "silhouette_mean" in last:
        assert -1.0 <= last["silhouette_mean"] <= 1.0
    bank = result.output_dir / "global_prototypes.npz"
    if bank.exists():
        assert np.isfinite(np.load(bank)["vectors"]).all()


def test_fedsap_semi_supervised_logs_pseudo_labels_per_version(ray_session, tracking):
    uri, track = tracking
    cfg = build_config({}, track + [
        "algorithm.name=fedsap", "algorithm.semi_supervised.unlabelled_fraction=0.5",
        "algorithm.semi_supervised.supervised_versions=1", "algorithm.alignment_schedule=null",
        "data.partition.beta=0.5", "data.partition.min_samples=40", "model.feature_dim=32",
        "federation.num_clients=4", "resources.clients_per_actor=2", "federation.mode=sync",
        "federation.rounds=3", "federation.eval_every=1"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    history = MlflowClient(uri).get_metric_history(result.run_id, "train_pseudo_candidates")
    assert history and max(m.value for m in history) > 0  # the semi-supervised phase ran and was logged
    last = result.history[-1]
    assert "train_pseudo_accepted" in last and last["train_pseudo_accepted"] >= 0
