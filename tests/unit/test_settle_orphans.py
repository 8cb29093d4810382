"""Runs left RUNNING by a driver that is gone are settled at the next start, whichever output
folder that start uses (issue 25, item 2).

No Ray: an MLflow sqlite store in the test's folder, runs created with ``MlflowClient`` and
tagged as a driver tags its run (host, pid, process start time, pid namespace, output folder),
a dead driver being a short subprocess that has exited.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.runtime import runfolder
from rayfed_proto.runtime.checkpoint import CheckpointStore


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """An MLflow sqlite store with its tables made once (that takes seconds), copied by each test."""
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def store(tmp_path, empty_store):
    shutil.copyfile(empty_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    return SimpleNamespace(uri=uri, client=client, exp=client.create_experiment("orphans"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # exited and reaped: no process has this pid now (a reuse would have another start time)
    return proc.pid


def _driver_run(store, folder, *, checkpoint: bool, pid=None, started=None, host=None) -> str:
    """A run RUNNING in ``store``, tagged as the driver of ``folder`` tags it, this process being
    the driver unless ``pid``, ``started`` or ``host`` say otherwise; ``run.json`` written as a driver does."""
    me = psutil.Process()
    tags = {"rayfed_proto.driver_host": host or socket.gethostname(), "rayfed_proto.driver_pid": str(pid or me.pid),
            "rayfed_proto.driver_started": f"{started or me.create_time():.3f}",
            "rayfed_proto.driver_pid_ns": os.readlink("/proc/self/ns/pid"), "rayfed_proto.output_dir": str(folder.resolve())}
    run_id = store.client.create_run(store.exp, tags=tags).info.run_id
    folder.mkdir(parents=True)
    runfolder.write_run_info(folder, run_id, store.uri)
    if checkpoint:
        CheckpointStore(folder / "checkpoints").save(
            3, server={"core": {"version": 3}}, clients=[], actor_rng={}, driver={"history": []}, run_id=run_id)
    return run_id


def _status(store, run_id) -> str:
    return store.client.get_run(run_id).info.status


def test_a_run_of_a_dead_driver_in_another_folder_is_marked_killed_with_where_to_resume(store, tmp_path):
    """(a) The new run's folder is under runs/, the dead driver's under elsewhere/: the folder
    pass (settle_orphaned_runs(runs/)) cannot see it; the store pass settles it."""
    old = tmp_path / "elsewhere" / "run-a"
    run_id = _driver_run(store, old, checkpoint=True, pid=_dead_pid())
    (tmp_path / "runs").mkdir()
    assert runfolder.settle_orphaned_runs(tmp_path / "runs") == []
    assert _status(store, run_id) == "RUNNING"

    lines = runfolder.settle_orphaned_store_runs(store.uri)
    run = store.client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["resume_from"] == str(old.resolve()) and "stopped" in run.data.tags
    assert lines == [f"MLflow run {run_id} of {old.resolve()} was left RUNNING by a driver that is gone: marked KILLED; "
                     f"resume with: rayfed-proto run --resume {old.resolve()}"]
    assert runfolder.settle_orphaned_store_runs(store.uri) == []  # settled once


def test_a_run_of_a_dead_driver_without_a_checkpoint_is_marked_failed(store, tmp_path):
    """(b)"""
    run_id = _driver_run(store, tmp_path / "elsewhere" / "run-b", checkpoint=False, pid=_dead_pid())
    lines = runfolder.settle_orphaned_store_runs(store.uri)
    run = store.client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["failure_reason"] == "the driver ended before its first checkpoint"
    assert len(lines) == 1 and "marked FAILED" in lines[0] and run_id in lines[0]


def test_a_run_whose_driver_lives_is_left_running(store, tmp_path):
    """(c) This process as its driver: same host, pid and start time."""
    run_id = _driver_run(store, tmp_path / "elsewhere" / "run-c", checkpoint=True)
    assert runfolder.settle_orphaned_store_runs(store.uri) == []
    assert _status(store, run_id) == "RUNNING"


def test_a_run_whose_pid_now_belongs_to_another_process_is_settled(store, tmp_path):
    """(d) The pid exists (this process) but started at another time: the driver's pid was reused."""
    started = psutil.Process().create_time() - 1000
    run_id = _driver_run(store, tmp_path / "elsewhere" / "run-d", checkpoint=True, pid=os.getpid(), started=started)
    assert len(runfolder.settle_orphaned_store_runs(store.uri)) == 1
    assert _status(store, run_id) == "KILLED"


def test_a_run_of_another_host_is_left_alone(store, tmp_path):
    """(e) Whether a process of another host lives cannot be told from here."""
    run_id = _driver_run(store, tmp_path / "elsewhere" / "run-e", checkpoint=True, pid=_dead_pid(),
                         host=f"not-{socket.gethostname()}")
    assert runfolder.settle_orphaned_store_runs(store.uri) == []
    assert _status(store, run_id) == "RUNNING"


def test_the_current_run_a_locked_folder_and_untagged_runs_are_left_alone(store, tmp_path):
    dead = _dead_pid()
    current = _driver_run(store, tmp_path / "runs" / "current", checkpoint=False, pid=dead)
    locked = _driver_run(store, tmp_path / "runs" / "locked", checkpoint=True, pid=dead)
    untagged = store.client.create_run(store.exp).info.run_id  # a run of a version that did not tag its driver
    with runfolder.RunFolderLock(tmp_path / "runs" / "locked"):  # held by a driver that does not tag its runs
        assert runfolder.settle_orphaned_store_runs(store.uri, exclude={current}) == []
    assert {_status(store, r) for r in (current, locked, untagged)} == {"RUNNING"}


def test_the_folder_pass_and_the_store_pass_settle_a_run_once(store, tmp_path):
    """A tagged run under the new run's own root is settled by the folder pass; the store pass
    then finds it no longer RUNNING and says nothing more."""
    run_id = _driver_run(store, tmp_path / "runs" / "old", checkpoint=True, pid=_dead_pid())
    lines = runfolder.settle_orphaned_runs(tmp_path / "runs") + runfolder.settle_orphaned_store_runs(store.uri)
    assert len(lines) == 1 and run_id in lines[0]
    assert _status(store, run_id) == "KILLED"


def test_a_store_that_cannot_be_searched_is_a_warning_not_a_failure(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="rayfed_proto"):
        assert runfolder.settle_orphaned_store_runs(f"sqlite:///{blocker / 'sub' / 'mlflow.db'}") == []
    assert "could not look for runs left RUNNING in the MLflow store" in caplog.text
    assert runfolder.settle_orphaned_store_runs(None) == []  # tracking disabled


# ------------------------------------------------------------------ through the driver

def _track_in(tmp_path, uri, out, ckpt=None):
    """The driver's _track step on a folder (resumed with ``ckpt``): its tracker, the run id, what it echoed."""
    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import _track
    from rayfed_proto.runtime.run_state import RunFolder
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

    cfg = build_config({}, [f"tracking.tracking_uri={uri}", "tracking.experiment_name=orphans",
                            "tracking.system_metrics=false", f"tracking.output_dir={tmp_path / 'runs'}"])
    echoed: list[str] = []
    tracker = MlflowTracker(cfg.tracking)
    fed = SimpleNamespace(tracker=tracker, shape=(10, 1, 28), plan=SimpleNamespace(as_dict=dict),
                          fleet=SimpleNamespace(shutdown=lambda: None), history=[])
    try:
        run_id = _track(cfg, RunFolder(out, store=None, ckpt=ckpt), fed, echoed.append)
    except BaseException:
        tracker.end()
        raise
    return tracker, run_id, echoed


def test_a_new_run_is_tagged_with_its_driver_and_settles_a_dead_drivers_run_of_another_folder(store, tmp_path):
    """(a) through the driver: a new run under runs/ settles the run left RUNNING under
    elsewhere/ (before, only runs under runs/ were settled) and names its own driver."""
    orphan = _driver_run(store, tmp_path / "elsewhere" / "old", checkpoint=True, pid=_dead_pid())
    out = tmp_path / "runs" / "new"
    out.mkdir(parents=True)
    tracker, run_id, echoed = _track_in(tmp_path, store.uri, out)
    tracker.end()
    assert _status(store, orphan) == "KILLED"
    assert len(echoed) == 1 and orphan in echoed[0] and "--resume" in echoed[0]
    tags = store.client.get_run(run_id).data.tags
    assert tags["rayfed_proto.driver_host"] == socket.gethostname() and tags["rayfed_proto.driver_pid"] == str(os.getpid())
    assert abs(float(tags["rayfed_proto.driver_started"]) - psutil.Process().create_time()) < 1
    assert tags["rayfed_proto.output_dir"] == str(out.resolve())


def test_a_resumed_run_takes_the_new_drivers_tags_and_is_not_settled_itself(store, tmp_path):
    dead = _dead_pid()
    folder = tmp_path / "runs" / "resumed"
    resumed = _driver_run(store, folder, checkpoint=True, pid=dead)
    other = _driver_run(store, tmp_path / "elsewhere" / "other", checkpoint=False, pid=dead)
    ckpt = CheckpointStore(folder / "checkpoints").latest()
    tracker, run_id, echoed = _track_in(tmp_path, store.uri, folder, ckpt=ckpt)
    try:
        assert _status(store, resumed) == "RUNNING"
    finally:
        tracker.end()
    assert run_id == resumed
    tags = store.client.get_run(resumed).data.tags
    assert tags["rayfed_proto.driver_pid"] == str(os.getpid()) and "stopped" not in tags
    assert _status(store, other) == "FAILED" and any(other in line for line in echoed)
