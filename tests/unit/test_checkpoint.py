"""The checkpoint store: atomic, complete-only, pruned; a crash while writing never yields a
checkpoint that would be loaded."""

import numpy as np
import pytest
import torch
import yaml

from rayfed_proto.runtime.checkpoint import CheckpointStore


def _save(store, version, marker=0.0):
    return store.save(version, server={"core": {"version": version, "x": np.full(3, marker)}},
                      clients=[(0, {"w": torch.full((2,), marker)}), (1, {"w": torch.zeros(2)})],
                      actor_rng={0: torch.get_rng_state()}, driver={"history": [{"version": version}]}, run_id="r1")


def test_round_trip_of_every_part(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 4, marker=7.0)
    ck = store.latest()
    assert ck.version == 4 and ck.manifest["run_id"] == "r1" and ck.manifest["clients"] == [0, 1]
    np.testing.assert_array_equal(ck.server_state()["core"]["x"], [7.0, 7.0, 7.0])
    assert torch.equal(ck.client_state(0)["w"], torch.full((2,), 7.0))
    assert ck.client_state(5) is None  # a client without a saved state: re-initialised by the caller
    assert torch.equal(ck.actor_rng()[0], torch.get_rng_state())
    assert ck.driver_state()["history"] == [{"version": 4}]


def test_only_the_newest_keep_checkpoints_remain(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for v in (2, 4, 6):
        _save(store, v)
    assert [p.name for p in store.complete()] == ["v000004", "v000006"]
    assert store.latest().version == 6


def test_half_written_checkpoints_are_never_loaded(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    _save(store, 2, marker=1.0)
    # a crash during writing: the temporary folder is left behind ...
    (tmp_path / ".tmp-v000004-1-1" / "clients").mkdir(parents=True)
    (tmp_path / ".tmp-v000004-1-1" / "server.pt").write_bytes(b"partial")
    # ... or a folder got its name but not its manifest (written last)
    (tmp_path / "v000006").mkdir()
    assert store.latest().version == 2
    _save(store, 8)
    assert not list(tmp_path.glob(".tmp-*"))  # the next save clears leftovers
    assert store.latest().version == 8


def test_saving_the_same_version_twice_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 3, marker=1.0)
    _save(store, 3, marker=2.0)
    assert store.latest().server_state()["core"]["x"][0] == 2.0


def test_unwritable_folder_is_reported_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a folder cannot be created under a file (holds for root too)
    with pytest.raises(PermissionError, match="checkpoint.dir") as err:
        CheckpointStore(blocker / "ckpt").check_writable()
    assert str(blocker / "ckpt") in str(err.value)


def test_unwritable_tracking_store_is_a_clear_error(tmp_path):
    from rayfed_proto.config import TrackingConfig
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match="tracking.tracking_uri"):
        MlflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{blocker / 'sub' / 'mlflow.db'}"))


def test_resume_refuses_a_set_that_would_change_what_the_run_is(tmp_path, capsys):
    """``run --resume --set training.lr=...`` would be silently ignored (the restored optimizer
    keeps its saved lr): refused, naming the key, the value and what may be set, before Ray starts."""
    from rayfed_proto.cli import main

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"data": {"name": "digits"}, "algorithm": {"name": "fedproto"}}))
    code = main(["run", "--resume", str(tmp_path), "--set", "training.lr=0.5", "--set", "algorithm.lam=2",
                 "--set", "federation.rounds=50"])
    err = capsys.readouterr().err
    assert code == 2
    assert "training.lr" in err and "0.5" in err and "algorithm.lam" in err
    assert "federation.rounds" in err.split("only how the run goes on:")[1]  # listed as allowed, not as refused
    assert err.count("with --resume only how the run goes on") == 2
