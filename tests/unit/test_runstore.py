"""A run's files beside its checkpoints at a URI, and the run folder rebuilt from them (issue 27,
item 4); the whole resume after the folder is gone: tests/integration/test_multinode.py::TestRayJobShape."""

import json

import pytest

from rayfed_proto.config import InputError
from rayfed_proto.runtime.checkpoint import CheckpointStore
from rayfed_proto.runtime.runstore import rebuild_run_folder, store_run_files


def _run_folder(tmp_path):
    out = tmp_path / "runs" / "20250101-000000-000000-fedtgp-digits"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(f"tracking:\n  output_dir: {tmp_path / 'elsewhere'}\n")
    (out / "partition.parquet").write_bytes(b"PAR1 partition")
    (out / "run.json").write_text(json.dumps({"run_id": "abc", "tracking_uri": "http://old-head:5000"}))
    (out / "history.csv").write_text("not needed for a resume")
    return out


def test_the_run_folder_is_rebuilt_from_the_store_alone(tmp_path):
    out = _run_folder(tmp_path)
    uri = f"file://{tmp_path / 'bucket' / 'run-1'}"
    assert store_run_files(CheckpointStore(uri), out)
    assert sorted(p.name for p in (tmp_path / "bucket" / "run-1" / "run").iterdir()) == [
        "config.yaml", "folder.json", "partition.parquet", "run.json"]
    # after `ray down`: the folder is gone; rebuilt under the saved config's output_dir, named as before
    rebuilt = rebuild_run_folder(uri)
    assert rebuilt == tmp_path / "elsewhere" / out.name
    assert sorted(p.name for p in rebuilt.iterdir()) == ["config.yaml", "partition.parquet", "run.json"]
    assert (rebuilt / "partition.parquet").read_bytes() == b"PAR1 partition"
    # --set tracking.output_dir wins; a folder still there is used as it is
    assert rebuild_run_folder(uri, tmp_path / "runs") == out and (out / "history.csv").is_file()
    # a local store keeps the run folder itself: nothing to copy
    assert store_run_files(CheckpointStore(tmp_path / "local"), out) and not (tmp_path / "local").exists()


def test_a_uri_without_a_run_says_what_is_missing(tmp_path):
    with pytest.raises(InputError, match="nothing a run wrote is there"):
        rebuild_run_folder(f"file://{tmp_path / 'empty'}")
    (tmp_path / "old" / "v000003").mkdir(parents=True)
    with pytest.raises(InputError, match=r"holds checkpoints \(v000003\) but not run/config.yaml"):
        rebuild_run_folder(f"file://{tmp_path / 'old'}")
