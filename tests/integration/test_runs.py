"""Real runs: Ray actors on the shared instance, metrics read back from MLflow."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.config import build_config
from rayfed_proto.runtime.driver import run_experiment

pytestmark = pytest.mark.integration

SMALL = ["data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20", "model.group=small_hetero",
         "model.feature_dim=64", "federation.num_clients=4"]


def metric_steps(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def artifact_paths(client, run_id, path=None):
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(artifact_paths(client, run_id, f.path) if f.is_dir else [f.path])
    return out


def test_async_fedtgp_run_writes_metrics_params_and_artifacts(ray_session, tracking):
    uri, track = tracking
    cfg = build_config({}, SMALL + track + ["algorithm.server_epochs=5", "federation.mode=async", "federation.rounds=6",
                                            "federation.eval_every=2", "federation.buffer_size=1", "federation.concurrency=2"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    assert result.final_version == 6
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    acc = metric_steps(client, result.run_id, "eval/head_acc")
    assert [s for s, _ in acc] == [0, 2, 4, 6]
    assert all(0.0 <= v <= 1.0 for _, v in acc)
    assert [s for s, _ in metric_steps(client, result.run_id, "eval/proto_acc")] == [2, 4, 6]  # no bank at version 0
    up = metric_steps(client, result.run_id, "federation/bytes_up")
    assert up[-1][1] > up[1][1] > 0  # cumulative bytes grow
    assert not metric_steps(client, result.run_id, "federation/updates_refused")  # a counter is logged from its first non-zero value
    # the whole resolved config is logged, flattened
    assert run.data.params["federation.mode"] == "async" and run.data.params["algorithm.name"] == "fedtgp"
    assert run.data.params["data.partition.beta"] == "0.5"
    arts = set(artifact_paths(client, result.run_id))
    for expected in ("config.yaml", "partition.parquet", "history.parquet", "summary.txt",
                     "plots/accuracy_vs_version.png", "plots/accuracy_vs_wall_time.png",
                     "plots/label_distribution.png", "plots/prototype_margin.png",
                     "prototypes/global_prototypes.npz", "prototypes/global_prototypes.parquet"):
        assert expected in arts, f"missing artifact {expected}: {sorted(arts)}"
    bank = np.load(result.output_dir / "global_prototypes.npz")
    assert bank["vectors"].shape[1] == 64 and np.isfinite(bank["vectors"]).all()


def test_async_every_version_is_evaluated_even_when_versions_come_fast(ray_session, tracking):
    # buffer 1 and tiny updates: versions appear faster than evaluations return, and receipts can
    # be handled out of order; each version must still be evaluated once, against its own state
    uri, track = tracking
    cfg = build_config({}, SMALL + track + ["algorithm.name=fedproto", "federation.mode=async", "federation.rounds=8",
                                            "federation.eval_every=1", "federation.buffer_size=1", "federation.concurrency=3"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    assert sorted(h["version"] for h in result.history) == list(range(9))
    steps = [s for s, _ in metric_steps(MlflowClient(uri), result.run_id, "federation/updates_accepted")]
    assert sorted(steps) == list(range(9))


@pytest.fixture(scope="module")
def sync_quarter_gpu_run(ray_session, tmp_path_factory, empty_mlflow_store):
    """One sync FedProto run read by two tests: half the clients train each round (participation
    0.5), in the papers' layout (an actor per client) with a quarter of a logical GPU per actor,
    the server's included. Neither test's checks depend on what the other one's settings add."""
    tmp = tmp_path_factory.mktemp("sync_quarter_gpu")
    shutil.copyfile(empty_mlflow_store, tmp / "mlflow.db")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cfg = build_config({}, SMALL + [f"tracking.tracking_uri={uri}", f"tracking.output_dir={tmp / 'runs'}",
                                    "algorithm.name=fedproto", "federation.mode=sync", "federation.rounds=3",
                                    "federation.eval_every=1", "federation.participation=0.5",
                                    "resources.client_num_gpus=0.25", "resources.server_num_gpus=0.25",
                                    "resources.clients_per_actor=1"])  # the papers' layout: an actor per client
    return uri, run_experiment(cfg, progress=False, echo=lambda s: None)


def test_sync_fedproto_partial_participation(sync_quarter_gpu_run):
    uri, result = sync_quarter_gpu_run
    client = MlflowClient(uri)
    assert [s for s, _ in metric_steps(client, result.run_id, "eval/head_acc")] == [0, 1, 2, 3]
    last = result.history[-1]
    # 2 of 4 clients per round, 3 rounds, all fresh
    assert last["federation/updates_accepted"] == 6 and last["federation/updates_dispatched"] == 6
    assert last["federation/staleness_max"] == 0 and last["federation/updates_dropped"] == 0


# FedAvg with homogeneous models, sync, 2 rounds (it reaches version 2, logs no prototype accuracy, its
# MLflow run ends FINISHED): test_methods.py's fedavg case runs that experiment (with feature_dim 32 and
# two clients per actor) and checks all three.


def test_four_clients_with_quarter_gpu_shares_are_placed(sync_quarter_gpu_run):
    _, result = sync_quarter_gpu_run
    clients, server = result.placements[:-1], result.placements[-1]
    assert len(clients) == 4
    for p in clients:
        assert p["assigned"].get("GPU") == pytest.approx(0.25)
        assert len(p["gpu_ids"]) == 1  # Ray assigned a (logical) GPU to the actor
        assert p["device"] == ("cuda" if p["cuda_available"] else "cpu")  # CPU fallback without CUDA
    assert server["assigned"].get("GPU") == pytest.approx(0.25)


def test_cli_default_run_with_lowered_round_count(ray_session, tracking):
    from rayfed_proto.cli import main

    _, track = tracking
    args = ["run", "--no-progress", "--set", "federation.rounds=2", "--set", "federation.eval_every=1"]
    for t in track:
        args += ["--set", t]
    assert main(args) == 0


def test_cli_bad_config_exits_2_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rayfed_proto.cli", "run", "--set", "federation.participation=1.5",
                           "--set", "algorithm.name=fedfoo"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "federation.participation = 1.5" in proc.stderr and "(0, 1]" in proc.stderr
    assert "algorithm.name = 'fedfoo'" in proc.stderr and "fedtgp" in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything was started or written


def test_cli_validate_and_list_do_not_start_ray(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("federation: {mode: sync, rounds: 3, eval_every: 1}\nalgorithm: {name: fedproto}\n")
    ok = subprocess.run([sys.executable, "-m", "rayfed_proto.cli", "validate", str(cfg)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "config OK" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "rayfed_proto.cli", "validate", str(cfg), "--set", "federation.buffer_size=0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "federation.buffer_size" in bad.stderr
    listing = subprocess.run([sys.executable, "-m", "rayfed_proto.cli", "list"], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0
    for name in ("fedtgp", "fedproto", "fedavg", "digits", "cifar100", "dirichlet", "nway_kshot", "HtFE8", "small_hetero"):
        assert name in listing.stdout


def test_sync_runs_with_the_same_seed_are_identical(ray_session, tracking):
    # arrival order varies between runs; the server aggregates a round in client order, local
    # training, sampling and server training are seeded: the metrics must match exactly
    _, track = tracking
    overrides = SMALL + track + ["algorithm.server_epochs=5", "federation.mode=sync", "federation.rounds=3",
                                 "federation.eval_every=1", "federation.participation=0.75"]
    runs = [run_experiment(build_config({}, overrides), progress=False, echo=lambda s: None) for _ in range(2)]
    keys = ("eval/head_acc", "eval/proto_acc", "train/loss", "server/proto_margin_mean", "server/loss")
    def comparable(v):  # NaN (no bank yet at version 0) must compare equal to NaN
        return "nan" if isinstance(v, float) and v != v else v

    first, second = ([{k: comparable(h.get(k)) for k in keys} for h in r.history] for r in runs)
    assert first == second
    assert len(first) == 4 and first[-1]["eval/head_acc"] is not None
