"""The lean runtime through real actors: packed workers give the unpacked result exactly, no
actor touches the dataset on disk (also when one is recreated), auto packing never makes more
workers than slots, and a 1,000-client cross-device run keeps no idle client materialised."""

import numpy as np
import pytest
import ray
from mlflow.tracking import MlflowClient

from rayfed_proto.config import build_config
from rayfed_proto.runtime import preparation
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.runtime.preparation import checkpoint_store

pytestmark = pytest.mark.integration

QUIET = {"progress": False, "echo": lambda s: None}
SMALL = ["algorithm.name=fedproto", "data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20",
         "model.group=small_hetero", "model.feature_dim=32", "federation.num_clients=4", "federation.eval_every=1",
         "resources.torch_threads=1"]
KEYS = ("eval/head_acc", "eval/head_acc_std", "eval/proto_acc", "train/loss", "train/align", "server/proto_margin_mean",
        "federation/updates_accepted")


def _comparable(history):
    return [{k: ("nan" if isinstance(h.get(k), float) and h[k] != h[k] else h.get(k)) for k in KEYS} for h in history]


def _workers(result):
    return [p for p in result.placements[:-1] if not p.get("dead")]  # the last placement is the server


def test_packed_sync_run_equals_one_actor_per_client_exactly(ray_session, tracking):
    _, track = tracking
    common = SMALL + track + ["federation.mode=sync", "federation.rounds=3", "federation.participation=0.75"]
    runs = {per: run_experiment(build_config({}, common + [f"resources.clients_per_actor={per}"]), **QUIET)
            for per in ("auto", "1", "3")}
    assert runs["auto"].resource_plan["num_actors"] == 2  # the shared instance declares 2 CPUs: 2 workers
    assert runs["1"].resource_plan["num_actors"] == 4 and runs["3"].resource_plan["num_actors"] == 2
    assert sorted(len(w["clients"]) for w in _workers(runs["auto"])) == [2, 2]
    reference = _comparable(runs["1"].history)
    assert len(reference) == 4 and reference[-1]["eval/head_acc"] > 0
    # exact equality: each client owns its model, optimizer, batch stream and torch RNG stream
    # wherever it is hosted, and a round is aggregated in client order
    assert _comparable(runs["auto"].history) == reference
    assert _comparable(runs["3"].history) == reference


@pytest.mark.parametrize("cpus_declared", [2])
def test_auto_packing_creates_no_more_workers_than_slots(ray_session, tracking, cpus_declared):
    _, track = tracking
    cfg = build_config({}, SMALL + track + ["federation.num_clients=9", "federation.mode=async", "federation.rounds=2",
                                            "federation.buffer_size=2"])
    result = run_experiment(cfg, **QUIET)
    workers = _workers(result)
    assert len(workers) == result.resource_plan["num_actors"] <= cpus_declared
    assert sorted(c for w in workers for c in w["clients"]) == list(range(9))  # every client hosted once
    assert all(w["live_clients"] == len(w["clients"]) for w in workers)  # 9 clients: nothing parked
    # CPU processes leave out what they never run (the CUDA build's Triton, torch.optim's dynamo import)
    processes = workers + [result.placements[-1]]
    assert [(p["device"], p["triton_loaded"], p["dynamo_loaded"]) for p in processes] == [("cpu", False, False)] * 3


def test_no_actor_reads_the_dataset_from_disk_even_when_recreated(ray_session, tracking, tmp_path, monkeypatch):
    uri, track = tracking
    rng = np.random.default_rng(0)
    path = tmp_path / "digits_like.npz"
    labels = np.arange(400) % 4
    images = (rng.random((400, 1, 8, 8)) * 60 + labels[:, None, None, None] * 45).astype(np.uint8)
    np.savez(path, images=images, labels=labels)
    real_load = preparation.load_dataset

    def load_then_delete(data_cfg, seed):  # the driver reads the file; afterwards it is gone
        dataset = real_load(data_cfg, seed)
        path.unlink()
        return dataset

    monkeypatch.setattr(preparation, "load_dataset", load_then_delete)
    killed: list[int] = []

    def kill(version, metrics):  # kill worker 0 once, at version 2: it is recreated and set up again
        if version == 2 and not killed:
            names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors()]
            name = sorted(n for n in names if n.startswith("rayfed:") and ":client:0:" in n)[-1]
            ray.kill(ray.get_actor(name), no_restart=True)
            killed.append(version)

    cfg = build_config({}, SMALL + track + ["data.name=npz", f"data.path={path}", "data.image_size=8",
                                            "data.partition.min_samples=10", "federation.mode=sync", "federation.rounds=4",
                                            "checkpoint.every=1"])
    result = run_experiment(cfg, on_eval=kill, **QUIET)
    assert not path.exists() and killed == [2]
    assert result.final_version == 4
    assert MlflowClient(uri).get_run(result.run_id).info.status == "FINISHED"
    assert result.history[-1]["reliability/client_failures"] == 1  # recreated from the object store, not from disk


def test_thousand_clients_keep_only_the_training_ones_materialised(ray_session, tracking):
    _, track = tracking
    cfg = build_config({}, track + [
        "algorithm.name=fedproto", "data.name=synthetic", "data.num_samples=30000", "data.image_size=8",
        "data.partition.name=iid", "model.group=HtFE1", "model.feature_dim=16", "federation.num_clients=1000",
        "federation.mode=sync", "federation.participation=0.05", "federation.rounds=2", "federation.eval_every=2",
        "checkpoint.every=1", "resources.torch_threads=1"])
    assert cfg.resources.parks_clients(cfg.federation.num_clients)  # auto: parked above 100 clients
    result = run_experiment(cfg, **QUIET)
    assert result.final_version == 2
    workers = _workers(result)
    assert len(workers) == 2 and sum(len(w["clients"]) for w in workers) == 1000
    assert all(w["live_clients"] == 0 for w in workers)  # nobody is training now: no live model anywhere
    # only clients that trained have a state to keep: 2 rounds x 50 sampled clients at most
    ckpt = checkpoint_store(cfg, result.output_dir).latest()
    assert 50 <= len(ckpt.manifest["clients"]) <= 100
    assert result.history[-1]["eval/head_acc"] > 0
    assert ray.is_initialized()


def test_batched_clients_run_gives_the_one_after_another_accuracies(ray_session, tracking):
    """resources.batch_clients on: each worker's two clients (one architecture) step as one
    vmapped model; the run's accuracies equal the one-after-another run's within 0.2 points."""
    _, track = tracking
    common = [s for s in SMALL if not s.startswith("model.group")] + track + [
        "model.group=HtFE1", "data.image_size=8", "training.lr=0.05", "federation.mode=sync", "federation.rounds=2",
        "federation.participation=1.0"]
    runs = {mode: run_experiment(build_config({}, common + [f"resources.batch_clients={mode}"]), **QUIET)
            for mode in ("off", "on")}
    assert sorted(len(w["clients"]) for w in _workers(runs["on"])) == [2, 2]  # groups of two to batch
    off, auto = runs["off"].history, runs["on"].history
    assert len(off) == len(auto) == 3 and off[-1]["eval/head_acc"] > 0.3
    for a, b in zip(off, auto, strict=True):
        assert abs(a["eval/head_acc"] - b["eval/head_acc"]) <= 0.002  # 0.2 points
        assert a["federation/updates_accepted"] == b["federation/updates_accepted"]
