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


# ------------------------------------------------------------------ damaged checkpoints (issue 16, item 2)

def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    import hashlib
    import json

    store = CheckpointStore(tmp_path)
    path = _save(store, 2)
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert set(files) == {"server.pt", "driver.pt", "actors.pt", "clients/0.pt", "clients/1.pt"}
    for name, meta in files.items():
        data = (path / name).read_bytes()
        assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("damage", ["truncated server.pt", "garbage manifest", "missing client file", "flipped byte"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_older_complete_one(tmp_path, caplog, damage):
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 2, marker=1.0)
    newest = _save(store, 4, marker=2.0)
    if damage == "truncated server.pt":
        data = (newest / "server.pt").read_bytes()
        (newest / "server.pt").write_bytes(data[: len(data) // 2])
    elif damage == "garbage manifest":
        (newest / "manifest.json").write_bytes(b"\x00\xffnot json")
    elif damage == "missing client file":
        (newest / "clients" / "1.pt").unlink()
    else:  # same size, different content: only the checksum can tell
        data = bytearray((newest / "driver.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (newest / "driver.pt").write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="rayfed_proto"):
        ck = store.latest()
    assert ck.version == 2 and ck.server_state()["core"]["x"][0] == 1.0
    assert str(newest) in caplog.text and "damaged" in caplog.text


def test_no_usable_checkpoint_is_an_error_naming_the_folder(tmp_path):
    from rayfed_proto.runtime.checkpoint import CheckpointError

    store = CheckpointStore(tmp_path, keep=2)
    for v in (2, 4):
        (_save(store, v) / "server.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint under") as err:
        store.latest()
    assert str(tmp_path) in str(err.value) and "v000002" in str(err.value) and "v000004" in str(err.value)


class _RunsCode:
    """An object whose unpickling would run code (what a hostile checkpoint would hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_checkpoint_cannot_run_code_when_loaded(tmp_path):
    """torch.load(weights_only=True): a pickle that would call a function is refused, even with a
    manifest that matches it (someone rewrote the folder), and the function never runs."""
    import hashlib
    import json

    from rayfed_proto.runtime.checkpoint import CheckpointError

    store = CheckpointStore(tmp_path)
    path = _save(store, 2)
    marker = tmp_path / "pwned"
    torch.save({"core": _RunsCode(str(marker))}, path / "server.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "server.pt").read_bytes()
    manifest["files"]["server.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="server.pt") as refused:
        store.latest().server_state()
    assert not marker.exists()
    # worded for this project: what it holds, that nothing ran, what to do; never torch's advice
    # to load it with weights_only=False
    msg = str(refused.value)
    assert "pathlib" in msg and "nothing from it was run" in msg and "weights_only" not in msg
    with pytest.raises(CheckpointError, match="server.pt"):  # the scan before a resume starts anything
        store.latest().check_loadable()
    assert not marker.exists()


def test_a_crafted_client_file_is_found_by_the_scan_without_loading_it(tmp_path):
    import hashlib
    import json

    from rayfed_proto.runtime.checkpoint import CheckpointError

    store = CheckpointStore(tmp_path)
    path = _save(store, 2)
    store.latest().check_loadable()  # a real checkpoint passes
    marker = tmp_path / "pwned"
    torch.save({"w": _RunsCode(str(marker))}, path / "clients" / "1.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "clients" / "1.pt").read_bytes()
    manifest["files"]["clients/1.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"clients/1\.pt"):
        store.latest().check_loadable()
    assert not marker.exists()


def test_real_server_and_client_states_load_with_weights_only(tmp_path):
    """What a real checkpoint holds (a buffered ClientUpdate with numpy prototypes, numpy scalars,
    an optimizer state) loads under weights_only=True."""
    from rayfed_proto.messages import ClientUpdate, PrototypeSet

    update = ClientUpdate(client_id=1, base_version=3, num_samples=10,
                          prototypes=PrototypeSet(np.arange(2), np.ones((2, 4), np.float32), np.array([4, 6])),
                          extras={"logits": np.zeros((2, 3), np.float16)})
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    store = CheckpointStore(tmp_path)
    store.save(4, server={"core": {"buffer": [(update, 0.5)], "m": {1: (np.float64(0.2), np.float32(1.0))}}},
               clients=[(0, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "batch_rng": torch.Generator().get_state()})],
               actor_rng={0: torch.get_rng_state()},
               driver={"scheduler": {"rng": np.random.default_rng(0).bit_generator.state}}, run_id="r")
    ck = store.latest()
    (restored, w), = ck.server_state()["core"]["buffer"]
    assert isinstance(restored, ClientUpdate) and (restored.client_id, restored.base_version) == (1, 3)
    np.testing.assert_array_equal(restored.prototypes.vectors, update.prototypes.vectors)
    assert restored.extras["logits"].dtype == np.float16
    assert w == 0.5 and ck.server_state()["core"]["m"][1][0] == 0.2
    assert ck.client_state(0)["optimizer"]["state"][0]["momentum_buffer"].shape == (2, 3)
    assert ck.driver_state()["scheduler"]["rng"]["bit_generator"] == "PCG64"
    ck.check_loadable()  # everything a real checkpoint holds passes the scan


def test_a_checkpoint_written_before_checksums_still_loads(tmp_path):
    import json

    store = CheckpointStore(tmp_path)
    path = _save(store, 2, marker=3.0)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"], manifest["format"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert store.latest().server_state()["core"]["x"][0] == 3.0


def _rewrite_with_manifest(path, name: str, data: bytes) -> None:
    """Replace the file ``name`` of checkpoint ``path`` and its manifest entry (a crafted folder)."""
    import hashlib
    import json

    (path / name).write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_raw_pickle_client_file_is_refused_by_the_scan_in_this_projects_words(tmp_path):
    """Issue 40.2: a client state that is a raw pickle (not torch's zip format) is refused by the
    scan that runs before Ray starts, never loaded, and the message is this project's."""
    import pickle

    from rayfed_proto.runtime.checkpoint import CheckpointError

    store = CheckpointStore(tmp_path)
    path = _save(store, 2)
    marker = tmp_path / "pwned"
    _rewrite_with_manifest(path, "clients/0.pt", pickle.dumps({"w": _RunsCode(str(marker))}))
    with pytest.raises(CheckpointError, match=r"clients/0\.pt") as refused:
        store.latest().check_loadable()
    assert not marker.exists()
    msg = str(refused.value)
    assert "not a file rayfed-proto writes" in msg and "weights_only" not in msg and "older checkpoint" in msg


def test_a_client_states_checksum_is_verified_when_it_is_read(tmp_path):
    """Issue 39.3: the client states' checksums are not computed before the resume starts (the
    sizes are), but a state whose bytes differ from the manifest's SHA-256 is refused when read,
    naming the file and what to do; the other states and the scan are unaffected."""
    from rayfed_proto.runtime.checkpoint import CheckpointError

    store = CheckpointStore(tmp_path)
    path = _save(store, 2, marker=5.0)
    data = bytearray((path / "clients" / "0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content: only the checksum can tell
    (path / "clients" / "0.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="no usable checkpoint"):  # the full check (an actor recreated in a run)
        store.latest()
    ck = store.latest(client_states=False)  # a resume: the client states are checked as they are read
    assert ck.version == 2
    with pytest.raises(CheckpointError, match=r"clients/0\.pt does not match its checksum") as err:
        ck.client_state(0)
    assert f"deleting {path}" in str(err.value)
    assert torch.equal(ck.client_state(1)["w"], torch.zeros(2))


def test_latest_does_not_hash_client_states(tmp_path, monkeypatch):
    from rayfed_proto.runtime import checkpoint

    store = CheckpointStore(tmp_path)
    _save(store, 2)
    hashed = []
    real = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda p: hashed.append(p.name) or real(p))
    store.latest(client_states=False).check_loadable()
    assert sorted(hashed) == ["actors.pt", "driver.pt", "server.pt"]
