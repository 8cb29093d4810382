"""User errors that used to end in a traceback, refused before Ray starts with the key or file
named and what to do (issue 40, items 3 and 5)."""

from __future__ import annotations

import json

import pytest

from rayfed_proto.config import InputError, TrackingConfig


@pytest.mark.parametrize("content", [b"", b"PAR1 not a parquet file at all", b"\x00" * 64])
def test_a_damaged_partition_is_refused_naming_the_file_and_what_to_do(tmp_path, content):
    from rayfed_proto.runtime.runfolder import load_partition

    (tmp_path / "partition.parquet").write_bytes(content)
    with pytest.raises(InputError) as err:
        load_partition(tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "partition.parquet") in msg and "start the run afresh" in msg
    assert f"rayfed-proto run {tmp_path / 'config.yaml'}" in msg


def test_a_damaged_partition_names_the_mlflow_copy(tmp_path):
    from rayfed_proto.runtime.runfolder import load_partition

    (tmp_path / "run.json").write_text(json.dumps({"run_id": "abc123", "tracking_uri": "sqlite:///x.db"}))
    with pytest.raises(InputError, match="mlflow artifacts download --run-id abc123 --artifact-path partition.parquet"):
        load_partition(tmp_path)  # missing altogether


def test_an_intact_partition_loads(tmp_path):
    from rayfed_proto.config import build_config
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.runtime.runfolder import load_partition

    cfg = build_config({"federation": {"num_clients": 4}})
    part = make_partition(load_dataset(cfg.data, 0), cfg.data.partition, 4, 0, cfg.data.test_fraction)
    part.save_parquet(tmp_path / "partition.parquet")
    assert len(load_partition(tmp_path).clients) == 4


@pytest.mark.parametrize("kind", ["a file", "below a file"])
def test_a_park_dir_that_is_not_a_writable_folder_is_refused_naming_the_key(tmp_path, kind):
    from rayfed_proto.runtime.parking import check_park_dir

    f = tmp_path / "f"
    f.write_text("x")
    where = f if kind == "a file" else f / "sub"
    with pytest.raises(PermissionError) as err:
        check_park_dir(str(where))
    assert "resources.park_dir" in str(err.value) and str(where) in str(err.value)
    assert "resources.park_to=memory" in str(err.value)


def test_a_writable_park_dir_passes(tmp_path):
    from rayfed_proto.runtime.parking import SUBDIR, check_park_dir

    assert check_park_dir(str(tmp_path / "new")) == tmp_path / "new" / SUBDIR


@pytest.mark.parametrize("uri", ["foo://bar", "s4://bucket/x", "htp://localhost:5000"])
def test_an_unknown_tracking_scheme_is_refused_naming_the_key(uri):
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

    with pytest.raises(InputError) as err:
        MlflowTracker(TrackingConfig(tracking_uri=uri, system_metrics=False))
    assert "tracking.tracking_uri" in str(err.value) and uri in str(err.value) and "sqlite" in str(err.value)


@pytest.mark.parametrize("uri", ["sqlite:///x.db", "http://localhost:5000", "https://h", "postgresql+psycopg2://u@h/db",
                                 "file:///tmp/x", "databricks"])
def test_known_tracking_schemes_pass(uri):
    from rayfed_proto.tracking.mlflow_tracker import check_store_scheme

    check_store_scheme(uri)
