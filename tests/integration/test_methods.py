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
    fields = ALGORITHMS.get(name).Options.model_fields
    for epochs in ("server_epochs", "generator_epochs"):
        if epochs in fields:
            extra.append(f"algorithm.{epochs}=3")
    if "server_arch" in fields:
        extra.append("algorithm.server_arch=cnn")  # the default ResNet34 is for GPUs
    if "data.public_size" in ALGORITHMS.get(name).config_defaults:
        extra.append("data.public_size=200")  # the default 2,500 exceeds the embedded digits' share
    return extra


@pytest.mark.parametrize("method", ALGORITHMS.names())
def test_method_runs_through_actors_and_logs_to_mlflow(ray_session, tracking, method):
    uri, track = tracking
    cfg = build_config({}, track + _method_overrides(method) + [
        f"algorithm.name={method}", "data.partition.beta=0.5", "data.partition.min_samples=20",
        "model.feature_dim=32", "federation.num_clients=4", "resources.clients_per_actor=2",
        # every client every round, whatever a method's own default (fedsc's variant code: 0.5)
        "federation.participation=1.0", "federation.mode=sync", "federation.rounds=2", "federation.eval_every=1"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm.name"] == method
    steps = sorted(m.step for m in client.get_metric_history(result.run_id, "eval/head_acc"))
    assert steps == [0, 1, 2]
    assert result.final_version == 2
    last = result.history[-1]
    assert last["federation/updates_accepted"] == 8 and last["federation/updates_refused"] == 0
    assert np.isfinite(last["train/loss"])
    if method == "fedavg":  # homogeneous models, sync (was test_runs.py's test_sync_fedavg_homogeneous, the same run)
        assert "eval/proto_acc" not in last  # FedAvg has no prototype inference
    if "eval/silhouette_mean" in last:
        assert -1.0 <= last["eval/silhouette_mean"] <= 1.0
    bank = result.output_dir / "global_prototypes.npz"
    if bank.exists():
        assert np.isfinite(np.load(bank)["vectors"]).all()
    if cfg.data.global_test_fraction > 0:  # a method with a server-held model: its global accuracy per evaluation
        assert sorted(m.step for m in client.get_metric_history(result.run_id, "eval/global_acc")) == [0, 1, 2]
        assert 0.0 <= last["eval/global_acc"] <= 1.0


def test_fedlsa_on_domain_skewed_data_logs_accuracy_per_domain(ray_session, tracking):
    uri, track = tracking
    cfg = build_config({}, track + [
        "algorithm.name=fedlsa", "algorithm.server_epochs=5", "data.name=digits_domains",
        "data.domains=[original,inverted,tinted]", "data.partition.name=by_domain",
        "data.partition.clients_per_domain=[1,2,1]", "model.group=HtFE1", "model.feature_dim=32",
        "federation.num_clients=4", "resources.clients_per_actor=2", "federation.mode=sync",
        "federation.rounds=2", "federation.eval_every=1"])
    assert cfg.model.normalize_features and cfg.model.projector == "mlp"  # FedLSA's config defaults
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    client = MlflowClient(uri)
    last = result.history[-1]
    per_domain = [last[f"eval/global_acc_{d}"] for d in ("original", "inverted", "tinted")]
    assert last["eval/global_acc_domain_mean"] == sum(per_domain) / 3
    for d in ("original", "inverted", "tinted"):
        assert [m.step for m in client.get_metric_history(result.run_id, f"eval/global_acc_{d}")] == [0, 1, 2]
    assert "eval/global_acc_rotated" not in last  # a domain that was not selected
    # nearest-anchor inference: FedLSA's anchors are the inference bank
    assert 0.0 <= last["eval/proto_acc"] <= 1.0


def test_fedsap_semi_supervised_logs_pseudo_labels_per_version(ray_session, tracking):
    uri, track = tracking
    cfg = build_config({}, track + [
        "algorithm.name=fedsap", "algorithm.semi_supervised.unlabelled_fraction=0.5",
        "algorithm.semi_supervised.supervised_versions=1", "algorithm.alignment_schedule=null",
        "data.partition.beta=0.5", "data.partition.min_samples=40", "model.feature_dim=32",
        "federation.num_clients=4", "resources.clients_per_actor=2", "federation.mode=sync",
        "federation.rounds=3", "federation.eval_every=1"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    history = MlflowClient(uri).get_metric_history(result.run_id, "train/pseudo_candidates")
    assert history and max(m.value for m in history) > 0  # the semi-supervised phase ran and was logged
    last = result.history[-1]
    assert "train/pseudo_accepted" in last and last["train/pseudo_accepted"] >= 0
