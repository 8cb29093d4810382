"""Tracking under load (issue 25, item 8): a sqlite store locked by another process past MLflow's
own 20 s wait (``database is locked``) is waited out by the run's writes instead of failing the
run; nothing about the lock reaches the user but one warning; the run still ends FINISHED; MLflow's
system-metrics thread, which stops at such an error, is started again. Measured under load by
``bench/tracking_load.py``."""

import logging
import subprocess
import sys
import threading

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient

from rayfed_proto.config import TrackingConfig
from rayfed_proto.tracking import mlflow_tracker
from rayfed_proto.tracking.mlflow_tracker import MlflowTracker, StoreBusyError

LOCKED = "(sqlite3.OperationalError) database is locked\n[SQL: SELECT runs.run_uuid FROM runs WHERE runs.run_uuid = ?]"


def _locked() -> MlflowException:
    """What MLflow's sqlite store raises when the lock stays taken past its wait, after logging it
    itself (mlflow/store/db/utils.py)."""
    logging.getLogger("mlflow.store.db.utils").error(
        "SQLAlchemy database error. The following exception is caught.\n%s", LOCKED)
    return MlflowException(LOCKED, error_code=TEMPORARILY_UNAVAILABLE)


class _Failing:
    """``tracker.mlflow`` whose ``name`` raises ``errors`` (in turn) before it does what mlflow does."""

    def __init__(self, mlflow, name, errors):
        self._mlflow, self._name, self._errors, self.calls = mlflow, name, list(errors), 0

    def __getattr__(self, attr):
        real = getattr(self._mlflow, attr)
        if attr != self._name:
            return real

        def call(*args, **kwargs):
            self.calls += 1
            if self._errors:
                raise self._errors.pop(0)()
            return real(*args, **kwargs)

        return call


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(mlflow_tracker, "_sleep", slept.append)
    t = MlflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_name="load",
                                     system_metrics=False))
    t.start({"a": 1})
    t.slept = slept
    yield t
    import mlflow

    t.mlflow = mlflow  # the test's failing stand-in, if any, goes
    t.end()


def _steps(t, key):
    return [m.step for m in MlflowClient(t.uri).get_metric_history(t.run_id, key)]


def test_a_locked_store_is_waited_out_and_each_point_is_logged_once(tracker, capsys, caplog):
    import mlflow

    tracker.log_metrics({"eval/head_acc": 0.5}, step=0)
    tracker.mlflow = failing = _Failing(mlflow, "log_metrics", [_locked, _locked])
    with caplog.at_level(logging.WARNING, logger="rayfed_proto"):
        tracker.log_metrics({"eval/head_acc": 0.6, "eval/proto_acc": 0.4}, step=1)  # raised before the fix

    assert failing.calls == 3 and tracker.retries == 2 and len(tracker.slept) == 2
    assert _steps(tracker, "eval/head_acc") == [0, 1] and _steps(tracker, "eval/proto_acc") == [1]  # once each
    assert "database is locked" not in capsys.readouterr().err  # MLflow's own traceback of it is not shown
    said = [r.getMessage() for r in caplog.records if r.name == "rayfed_proto"]
    assert len(said) == 2 and all(tracker.uri in s and "another process holds its lock" in s for s in said)


def test_a_store_locked_past_the_retries_fails_naming_the_store_and_the_way_out(tracker, monkeypatch):
    import mlflow

    now = [0.0]
    monkeypatch.setattr(mlflow_tracker, "_clock", lambda: now[0])
    monkeypatch.setattr(mlflow_tracker, "_sleep", lambda s: now.__setitem__(0, now[0] + 20 + s))  # MLflow's 20 s wait
    tracker.busy_retry_s = 100.0
    tracker.mlflow = failing = _Failing(mlflow, "set_tags", [_locked] * 50)
    with pytest.raises(StoreBusyError, match="stayed locked by another process") as e:
        tracker.set_tags({"stopped": "x"})
    assert tracker.uri in str(e.value) and "mlflow server" in str(e.value) and "set_tags" in str(e.value)
    assert 3 <= failing.calls <= 6  # 100 s at 20 s a try plus the backoff
    assert "database is locked" in str(e.value.__cause__)

    def refused():  # not a lock: raised at once, never retried
        return MlflowException("INVALID_PARAMETER_VALUE: Metric value must be a number")

    failing, retries = _Failing(mlflow, "log_metrics", [refused]), tracker.retries
    tracker.mlflow = failing
    with pytest.raises(MlflowException, match="INVALID_PARAMETER_VALUE"):
        tracker.log_metrics({"eval/head_acc": 0.5}, step=0)
    assert failing.calls == 1 and tracker.retries == retries


def test_a_run_whose_end_met_a_locked_store_still_ends_finished(tmp_path, monkeypatch):
    """mlflow.end_run takes the run off its stack, then writes the end: a lock there left the run
    RUNNING for good and the error failed a run that had done all its work."""
    import mlflow

    monkeypatch.setattr(mlflow_tracker, "_sleep", lambda s: None)
    t = MlflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_name="load",
                                     system_metrics=False))
    run_id = t.start({})
    real = MlflowClient.set_terminated
    errors = [_locked]

    def set_terminated(self, *args, **kwargs):
        if errors:
            raise errors.pop()()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "set_terminated", set_terminated)
    t.end("FINISHED")  # raised before the fix, and the run stayed RUNNING
    assert mlflow.active_run() is None
    assert MlflowClient(t.uri).get_run(run_id).info.status == "FINISHED" and t.retries >= 1


def test_system_metrics_stopped_by_a_locked_store_are_started_again(tracker, monkeypatch, caplog):
    from mlflow.tracking import fluent

    class Monitor:  # MLflow's SystemMetricsMonitor after its thread met the lock and returned
        def __init__(self):
            self._shutdown_event = threading.Event()
            self._process = threading.Thread(target=lambda: None)
            self._process.start()
            self._process.join()
            self.started = 0

        def start(self):
            self.started += 1

        def finish(self):  # mlflow.end_run's call
            self._shutdown_event.set()

    monitor = Monitor()
    monkeypatch.setitem(fluent.run_id_to_system_metrics_monitor, tracker.run_id, monitor)
    tracker.system_metrics = True
    with caplog.at_level(logging.WARNING, logger="rayfed_proto"):
        tracker.log_metrics({"eval/head_acc": 0.5}, step=0)
    assert monitor.started == 1 and tracker.system_metrics_restarts == 1
    assert any("system metrics" in r.getMessage() and "restarted" in r.getMessage() for r in caplog.records)
    monitor._shutdown_event.set()  # ended with its run: left alone
    tracker.log_metrics({"eval/head_acc": 0.6}, step=1)
    assert monitor.started == 1


HOLD = ("import sqlite3, sys, time\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)\n"
        "c.execute('BEGIN EXCLUSIVE')\n"
        "print('held', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
        "c.execute('COMMIT')\n")


@pytest.mark.integration  # ~25 s: MLflow waits 20 s for the lock before it raises
def test_a_store_held_by_another_process_past_mlflows_wait_does_not_fail_the_write(tmp_path, capsys, caplog):
    db = tmp_path / "mlflow.db"
    t = MlflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{db}", experiment_name="load", system_metrics=False))
    t.start({})
    t.log_metrics({"eval/head_acc": 0.5}, step=0)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(db), "23"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING, logger="rayfed_proto"):
            t.log_metrics({"eval/head_acc": 0.6}, step=1)  # raised 'database is locked' after 20 s before the fix
    finally:
        holder.wait(timeout=120)
    t.end()
    assert _steps(t, "eval/head_acc") == [0, 1] and t.retries >= 1
    assert MlflowClient(t.uri).get_run(t.run_id).info.status == "FINISHED"
    assert "database is locked" not in capsys.readouterr().err
    assert any("another process holds its lock" in r.getMessage() for r in caplog.records)
