"""Files at a URI (pyarrow.fs): atomic writes, listing, deletion; checkpoints written to an object
store (pyarrow's in-memory filesystem stands in for S3) and to file:// URIs, resumed on "another
node" (an empty local cache), verified against their checksums."""

import shutil
import tempfile

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from rayfed_proto.runtime import storage
from rayfed_proto.runtime.checkpoint import MANIFEST, CheckpointStore


@pytest.fixture(autouse=True)
def own_temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def _save(store, version, marker=0.0):
    return store.save(version, server={"core": {"version": version, "x": np.full(3, marker)}},
                      clients=[(0, {"w": torch.full((2,), marker)})], actor_rng={0: torch.get_rng_state()},
                      driver={"history": [{"version": version}]}, run_id="r1")


def _new_node(uri):
    """What another node sees: nothing cached locally."""
    shutil.rmtree(storage.cache_dir(uri), ignore_errors=True)


@pytest.mark.parametrize("kind", ["path", "memory"])
def test_location_writes_reads_lists_and_deletes(tmp_path, kind):
    loc = storage.Location(str(tmp_path / "here")) if kind == "path" else storage.Location("mem://b/x", pafs._MockFileSystem())
    loc.write_bytes("a/one.bin", b"1")
    loc.write_bytes("a/one.bin", b"11")  # replaced whole
    loc.write_bytes("two.bin", b"2")
    assert loc.read_bytes("a/one.bin") == b"11" and loc.exists("a") and not loc.exists("nope")
    assert loc.list() == ["a", "two.bin"] and loc.list("absent") == []
    loc.delete("a")
    loc.delete("absent")
    assert loc.list() == ["two.bin"]
    if kind == "path":  # the temporary file was renamed over the target: nothing left beside it
        assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["two.bin"]


def test_a_folder_is_uploaded_with_its_marker_last(tmp_path, monkeypatch):
    src = tmp_path / "v1"
    (src / "clients").mkdir(parents=True)
    for name in (MANIFEST, "server.pt", "clients/0.pt", "z.pt"):
        (src / name).write_bytes(name.encode())
    loc = storage.Location("mem://b/ck", pafs._MockFileSystem())
    order = []
    real = storage.Location.write_bytes
    monkeypatch.setattr(storage.Location, "write_bytes", lambda self, rel, data: (order.append(rel), real(self, rel, data)))
    loc.upload_dir(src, "v1", last=MANIFEST)
    assert order[-1] == f"v1/{MANIFEST}" and len(order) == 4
    loc.download_dir("v1", tmp_path / "copy")
    assert (tmp_path / "copy" / "clients" / "0.pt").read_bytes() == b"clients/0.pt"


def test_checkpoints_in_an_object_store_resume_on_another_node():
    fs = pafs._MockFileSystem()
    uri = "mem://bucket/runs/r1/checkpoints"
    store = CheckpointStore(uri, keep=2, filesystem=fs)
    store.check_writable()
    for v in (2, 4, 6):
        _save(store, v, marker=float(v))
    remote = storage.Location(uri, fs)
    assert remote.list() == ["v000004", "v000006"]  # pruned there too
    _new_node(uri)
    ck = CheckpointStore(uri, keep=2, filesystem=fs).latest()  # downloaded, then verified
    assert ck.version == 6 and np.array_equal(ck.server_state()["core"]["x"], [6.0] * 3)
    assert not str(ck.path).startswith("mem:")


def test_a_remote_store_leaves_no_copy_in_the_temp_folder(tmp_path):
    uri = (tmp_path / "shared" / "ckpt").as_uri()  # file://: a mounted shared folder
    store = CheckpointStore(uri, keep=2)
    store.check_writable()
    _save(store, 2, marker=2.0)
    cache = storage.cache_dir(uri)
    assert not any(cache.glob("v*"))  # uploaded, not kept beside the remote copy
    assert store.latest().version == 2  # fetched again when needed (a restart, a resume)
    store.release_cache()  # the end of the run
    assert not cache.exists()
    assert sorted(p.name for p in (tmp_path / "shared" / "ckpt").iterdir()) == ["v000002"]


def test_a_damaged_or_half_uploaded_remote_checkpoint_is_never_used(caplog):
    fs = pafs._MockFileSystem()
    uri = "mem://bucket/ck"
    store = CheckpointStore(uri, keep=3, filesystem=fs)
    _save(store, 2, marker=2.0)
    _save(store, 4, marker=4.0)
    remote = storage.Location(uri, fs)
    remote.write_bytes("v000004/server.pt", b"garbage")  # damaged after upload
    remote.write_bytes("v000008/server.pt", b"partial")  # an upload cut before its manifest
    _new_node(uri)
    ck = CheckpointStore(uri, keep=3, filesystem=fs).latest()
    assert ck.version == 2 and "damaged" in caplog.text


def test_file_uri_round_trip(tmp_path):
    uri = f"file://{tmp_path / 'shared' / 'ck'}"
    _save(CheckpointStore(uri, keep=2), 3, marker=3.0)
    assert (tmp_path / "shared" / "ck" / "v000003" / MANIFEST).is_file()
    _new_node(uri)
    assert CheckpointStore(uri).latest().version == 3


def test_unwritable_uri_is_reported_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match="checkpoint.dir") as err:
        CheckpointStore(f"file://{blocker}/ck").check_writable()
    assert f"file://{blocker}/ck" in str(err.value)
