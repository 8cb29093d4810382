"""tracking/parent_runs.py, the one home of MLflow parent runs (issue 48, item 4), against a real
sqlite store: created with the role tag and batched params cut to MLflow's limit, reopened without
the stale tags, ended with tags and a status, a store that is gone warned about, not raised."""

from __future__ import annotations

import logging

import pytest

from rayfed_proto.tracking import parent_runs as pr
from rayfed_proto.tracking.mlflow_tracker import ROLE_TAG


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, client, client.create_experiment("parents")


def test_start_parent_tags_it_and_logs_every_param_in_batches(store):
    _, client, exp = store
    params = {f"p{i:03d}": i for i in range(250)} | {"long": "x" * 7000, "none": None}
    run_id = pr.start_parent(client, exp, "group", {"k": "v"}, params)
    run = client.get_run(run_id)
    assert run.info.run_name == "group" and run.info.status == "RUNNING"
    assert run.data.tags["k"] == "v" and run.data.tags[ROLE_TAG] == "parent"
    assert pr.PARENT_TAG not in run.data.tags
    assert len(run.data.params) == 252  # more than one batch of 100
    assert run.data.params["p249"] == "249" and run.data.params["none"] == "None"
    assert run.data.params["long"] == "x" * 6000


def test_start_run_nests_under_a_parent_with_its_own_role(store):
    _, client, exp = store
    parent = pr.start_parent(client, exp, "parent", {})
    child = pr.start_run(client, exp, "child", {"a": "1"}, {"seed": 0}, role="comparison", parent_run_id=parent)
    tags = client.get_run(child).data.tags
    assert tags[ROLE_TAG] == "comparison" and tags[pr.PARENT_TAG] == parent and tags["a"] == "1"
    assert [r.info.run_id for r in pr.children(client, [exp], parent)] == [child]
    assert pr.children(client, [exp], parent, where="tags.a = '2'") == []


def test_reopen_deletes_the_stale_tags_and_sets_running(store):
    _, client, exp = store
    run_id = pr.start_parent(client, exp, "group", {"keep": "1"})
    pr.end_parent(client, run_id, "KILLED", {"stopped": "by Ctrl-C", "resume_from": "/g"})
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["stopped"] == "by Ctrl-C" and run.data.tags["resume_from"] == "/g"
    pr.reopen_parent(client, run_id, ("stopped", "resume_from", "failure_reason"))
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert "stopped" not in run.data.tags and "resume_from" not in run.data.tags and run.data.tags["keep"] == "1"


def test_reopen_of_a_run_not_in_the_store_raises(store):
    from mlflow.exceptions import MlflowException

    _, client, _ = store
    with pytest.raises(MlflowException):
        pr.reopen_parent(client, "0" * 32)


def test_end_with_a_uri_sets_tags_and_status(store):
    uri, client, exp = store
    run_id = pr.start_parent(client, exp, "group", {})
    pr.end_parent(uri, run_id, "FAILED", {"failure_reason": "seed 1: boom"})
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"] == "seed 1: boom"


def test_end_of_a_deleted_run_warns_and_does_not_raise(store, caplog):
    _, client, exp = store
    run_id = pr.start_parent(client, exp, "group", {})
    client.delete_run(run_id)
    with caplog.at_level(logging.WARNING, logger="rayfed_proto"):
        pr.end_parent(client, run_id, "FINISHED", what=f"the seed group's MLflow run {run_id}")
    assert f"could not end the seed group's MLflow run {run_id}: " in caplog.text


def test_end_on_an_unreachable_store_warns_and_does_not_raise(caplog):
    with caplog.at_level(logging.WARNING, logger="rayfed_proto"):
        pr.end_parent("sqlite:////nonexistent-dir/sub/mlflow.db", "abc", "KILLED", {"stopped": "x"})
    assert "could not end MLflow run abc: " in caplog.text


def test_end_stopped_marks_a_child_killed_with_the_reason(store):
    _, client, exp = store
    run_id = pr.start_run(client, exp, "trial", {}, role="child")
    pr.end_stopped(client, run_id, "by the scheduler")
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags[pr.STOPPED_TAG] == "by the scheduler"


def test_store_may_fail_passes_other_errors_through_only_as_warnings(caplog):
    with caplog.at_level(logging.WARNING, logger="rayfed_proto"):
        with pr.store_may_fail("log the table to MLflow run r"):
            raise OSError("gone")
    assert "could not log the table to MLflow run r: gone" in caplog.text
    with pytest.raises(KeyboardInterrupt), pr.store_may_fail("x"):  # a stop is not a store failure
        raise KeyboardInterrupt
