"""Signals during start-up, a file-system fault mid-run, a client state refused at the restore
(issue 40, items 1, 2 and 6), through the command line or the driver."""

from __future__ import annotations

import errno
import signal

import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.config import build_config
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.runtime.preparation import checkpoint_store
from rayfed_proto.runtime.signals import RunInterrupted, signal_cli_at_stage

pytestmark = pytest.mark.integration

SMALL = ["algorithm.name=fedproto", "data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20",
         "model.group=small_hetero", "model.feature_dim=32", "federation.num_clients=4", "federation.eval_every=1",
         "tracking.system_metrics=false"]
QUIET = {"progress": False, "echo": lambda s: None}


def _runs(uri: str):
    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.parametrize("stage,sig,own_ray", [("actors starting", signal.SIGTERM, True),
                                               ("first version", signal.SIGINT, False)])
def test_a_signal_during_start_up_stops_the_run_cleanly(ray_session, tracking, tmp_path, stage, sig, own_ray):
    """The SIGTERM of the probe (while the actors start) killed the driver by SIGABRT with its
    MLflow run RUNNING and Ray's processes alive; a SIGINT was lost. Now: 130 / 143, no traceback,
    the MLflow run FAILED with the reason (or KILLED once the scheduler runs), nothing left."""
    import ray

    uri, track = tracking
    sets = SMALL + track + ["federation.rounds=3", "checkpoint.every=1"]
    if not own_ray:
        sets.append(f"resources.address={ray.get_runtime_context().gcs_address}")
    done = signal_cli_at_stage(["run", "--no-progress", *[x for s in sets for x in ("--set", s)]], stage, sig, tmp_path,
                               timeout=300)
    code, output, alive = done.returncode, done.output, done.alive
    assert done.sent, f"stage {stage!r} never began:\n" + output[-5000:]
    assert code == (143 if sig == signal.SIGTERM else 130), output[-3000:]
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    assert alive == [], output[-2000:]
    runs = _runs(uri)
    assert len(runs) <= 1 and all(r.info.status in ("FAILED", "KILLED") for r in runs), [r.info for r in runs]
    for r in runs:
        if r.info.status == "FAILED":
            assert "while the run was starting" in r.data.tags["failure_reason"]


def test_a_disk_fault_mid_run_fails_the_run_with_exit_1_naming_the_folder(ray_session, tracking, monkeypatch):
    """Issue 40.6: an OSError while the run goes on (here: the final artifacts on a full disk) is a
    RunFault, not bad input: MLflow FAILED with a failure_reason naming the folder and what was kept."""
    from rayfed_proto.runtime.runfolder import RunFault
    from rayfed_proto.tracking import run_end

    uri, track = tracking

    def full(out, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "history.parquet"))

    monkeypatch.setattr(run_end, "write_final_artifacts", full)
    with pytest.raises(RunFault) as fault:
        run_experiment(build_config({}, SMALL + track + ["federation.mode=sync", "federation.rounds=2",
                                                         "checkpoint.every=1"]), **QUIET)
    (run,) = _runs(uri)
    assert run.info.status == "FAILED"
    reason = run.data.tags["failure_reason"]
    assert "No space left on device" in reason and "history.parquet" in reason and "checkpoint of version 2" in reason
    assert str(fault.value) == reason


def test_a_client_state_refused_at_the_restore_leaves_the_run_killed(ray_session, tracking, tmp_path):
    """Issue 40.2 with 39.3: a client state damaged after the scan (its checksum is verified when it
    is read) is refused with exit 2's error, and the stopped run stays KILLED. The workers park on
    disk, so they are offered the checkpoint's files first: the damaged one is declined there and
    refused by the driver, which reads it."""
    from rayfed_proto.runtime.checkpoint import CheckpointError

    uri, track = tracking
    disk = ["resources.park_idle_clients=true", "resources.park_to=disk", f"resources.park_dir={tmp_path}"]
    common = SMALL + track + disk + ["federation.mode=sync", "federation.rounds=3", "checkpoint.every=1"]
    with pytest.raises(RunInterrupted) as stopped:
        run_experiment(build_config({}, common + ["faults.stop_at_version=1"]), **QUIET)
    out = stopped.value.output_dir
    ckpt = checkpoint_store(build_config({}, common), out).latest()
    client = sorted((ckpt.path / "clients").glob("*.pt"))[0]
    data = bytearray(client.read_bytes())
    data[len(data) // 2] ^= 0xFF
    client.write_bytes(bytes(data))
    run_id = ckpt.manifest["run_id"]
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        run_experiment(build_config({}, common), resume_dir=out, **QUIET)
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"
