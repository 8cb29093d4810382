"""Fault injection through real actors on the shared Ray instance: interrupt and resume, a client
actor killed, the server actor killed, clients that upload garbage. Each test asserts that the run
finished, what was counted, and that nothing non-finite reached the global state."""

import numpy as np
import pytest
import ray
from mlflow.tracking import MlflowClient

from rayfed_proto.config import build_config
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.runtime.preparation import checkpoint_store
from rayfed_proto.runtime.signals import RunInterrupted

pytestmark = pytest.mark.integration

SMALL = ["algorithm.name=fedproto", "data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20",
         "model.group=small_hetero", "model.feature_dim=32", "federation.num_clients=4", "federation.eval_every=1"]
QUIET = {"progress": False, "echo": lambda s: None}


def _named(part: str) -> str:
    """The current Ray name of one of this run's actors (``client:0``, ``server``)."""
    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors()]
    matches = sorted(n for n in names if n.startswith("rayfed:") and f":{part}:" in n)
    assert matches, f"no live actor named *:{part}:* among {names}"
    return matches[-1]


def _killer(part: str, at_versions: set[int], first_at_or_after: bool = False):
    """An on_eval hook that kills this run's ``part`` actor once at each version in ``at_versions``
    (or, with ``first_at_or_after``, once at the first evaluation at or after min(at_versions));
    returns (hook, versions at which it killed)."""
    done: list[int] = []

    def hook(version, metrics):
        due = (not done and version >= min(at_versions)) if first_at_or_after else (version in at_versions and version not in done)
        if due:
            ray.kill(ray.get_actor(_named(part)), no_restart=True)
            done.append(version)

    return hook, done


def _history(client, run_id, name):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]


def _assert_finite_bank(result):
    bank = np.load(result.output_dir / "global_prototypes.npz")
    assert np.isfinite(bank["vectors"]).all()


def test_sync_run_stopped_and_resumed_matches_an_uninterrupted_run(ray_session, tracking):
    uri, track = tracking
    common = SMALL + track + ["federation.mode=sync", "federation.rounds=4", "checkpoint.every=2",
                              "federation.participation=0.5", "resources.clients_per_actor=2"]
    straight = run_experiment(build_config({}, common), **QUIET)

    with pytest.raises(RunInterrupted) as stopped:
        run_experiment(build_config({}, common + ["faults.stop_at_version=3"]), **QUIET)
    out = stopped.value.output_dir
    assert "rayfed-proto run --resume" in str(stopped.value)
    cfg_stopped = build_config({}, common + ["faults.stop_at_version=3"])
    ckpt = checkpoint_store(cfg_stopped, out).latest()
    assert ckpt.version == 3  # the stop wrote its own checkpoint at a round boundary (periodic one was at 2)
    client = MlflowClient(uri)
    assert client.get_run(ckpt.manifest["run_id"]).info.status == "KILLED"

    resumed = run_experiment(build_config({}, common), resume_dir=out, **QUIET)
    assert resumed.run_id == ckpt.manifest["run_id"] and resumed.final_version == 4
    assert client.get_run(resumed.run_id).info.status == "FINISHED"
    # the same MLflow run, every version logged once before and after the resume
    assert [s for s, _ in _history(client, resumed.run_id, "eval/head_acc")] == [0, 1, 2, 3, 4]
    # Exactly equal, not within a tolerance: every random stream (client sampling, each client's
    # batches, each actor's torch RNG), every optimizer and the server state are restored, and sync
    # rounds are aggregated in client order, so the float operations are the same ones.
    for key in ("eval/head_acc", "eval/proto_acc", "train/loss", "server/proto_margin_mean"):
        assert resumed.history[-1][key] == straight.history[-1][key], key
    _assert_finite_bank(resumed)


def test_killed_client_actor_is_recreated_and_the_run_finishes(ray_session, tracking):
    uri, track = tracking
    kill_once, killed = _killer("client:0", {2})
    cfg = build_config({}, SMALL + track + ["federation.mode=async", "federation.rounds=8", "federation.buffer_size=1",
                                            "federation.concurrency=2", "checkpoint.every=2"])
    result = run_experiment(cfg, on_eval=kill_once, **QUIET)
    assert killed and result.final_version == 8
    last = result.history[-1]
    assert last["reliability/client_failures"] == 1
    assert last["reliability/updates_lost_client"] <= 1  # the update in flight on the dead actor, if there was one
    assert last["reliability/clients_excluded"] == 0
    client = MlflowClient(uri)
    assert _history(client, result.run_id, "reliability/client_failures")[-1][1] == 1
    assert client.get_run(result.run_id).info.status == "FINISHED"
    _assert_finite_bank(result)


def test_client_actor_dead_when_its_checkpoint_snapshot_is_taken(ray_session, tracking):
    # killed right after version 2 exists, before that version's checkpoint: the snapshot call finds
    # it dead; it is recreated (from the checkpoint before, or re-initialised) and snapshotted again
    _, track = tracking
    killed = []

    def kill_at_version_two(version):
        if version == 2 and not killed:
            ray.kill(ray.get_actor(_named("client:0")), no_restart=True)
            killed.append(version)

    cfg = build_config({}, SMALL + track + ["federation.mode=sync", "federation.rounds=4", "checkpoint.every=2",
                                            "checkpoint.keep=3"])
    result = run_experiment(cfg, on_version=kill_at_version_two, **QUIET)
    assert killed and result.final_version == 4
    assert result.history[-1]["reliability/client_failures"] == 1
    from rayfed_proto.runtime.checkpoint import verify

    store = checkpoint_store(cfg, result.output_dir)  # v2, and v4 written at the end
    assert verify(store.dir / "v000002")["clients"] == [0, 1, 2, 3]  # written, with every client
    _assert_finite_bank(result)


def test_client_failing_beyond_the_limit_is_excluded_not_fatal(ray_session, tracking):
    _, track = tracking
    kill_client_zero_each_time, kills = _killer("client:0", {1, 2})
    # sync mode: client 0 is in every round (participation 1), so each kill costs its update; one
    # client per actor, so that a kill counts against client 0 alone (a packed worker's death counts
    # against every client it hosts)
    cfg = build_config({}, SMALL + track + ["federation.mode=sync", "federation.rounds=5", "resources.clients_per_actor=1",
                                            "reliability.max_client_failures=1", "checkpoint.every=0"])
    result = run_experiment(cfg, on_eval=kill_client_zero_each_time, **QUIET)
    assert result.final_version == 5 and len(kills) == 2
    last = result.history[-1]
    assert last["reliability/client_failures"] == 2 and last["reliability/clients_excluded"] == 1
    _assert_finite_bank(result)


def test_killed_server_actor_is_recreated_from_the_checkpoint(ray_session, tracking):
    uri, track = tracking
    kill_on_eval, killed = _killer("server", {3})

    def kill_server_once(version):  # as soon as version 3 exists (evaluations now run after the next round)
        kill_on_eval(version, {})

    cfg = build_config({}, SMALL + track + ["federation.mode=sync", "federation.rounds=6", "checkpoint.every=2"])
    result = run_experiment(cfg, on_version=kill_server_once, **QUIET)
    assert killed and result.final_version == 6
    last = result.history[-1]
    assert last["reliability/server_restarts"] == 1
    assert last["reliability/versions_redone"] >= 1  # version 3 existed only on the dead server: redone from the checkpoint of 2
    # at most one round's updates (4 clients) die with the server: in flight, submitted or buffered
    assert last["reliability/updates_lost_server"] <= 4
    versions = [h["version"] for h in result.history]
    assert versions[-1] == 6 and set(range(7)) <= set(versions)
    assert MlflowClient(uri).get_run(result.run_id).info.status == "FINISHED"
    _assert_finite_bank(result)


@pytest.mark.parametrize("kind", ["nan", "inf", "shape", "unknown_class", "future_version"])
def test_garbage_uploads_are_refused_and_counted(ray_session, tracking, kind):
    _, track = tracking
    cfg = build_config({}, SMALL + track + ["federation.mode=sync", "federation.rounds=3", "checkpoint.every=0",
                                            "faults.corrupt_clients=[1]", f"faults.corrupt_kind={kind}"])
    result = run_experiment(cfg, **QUIET)
    last = result.history[-1]
    assert result.final_version == 3
    assert last["federation/updates_refused"] == 3  # client 1, once per round
    assert last["federation/updates_accepted"] == 9  # the other three clients, every round
    _assert_finite_bank(result)


def _cli(args, env_address, tmp_path, **popen):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "rayfed_proto.cli", "run", "--no-progress", *args, "--set", f"resources.address={env_address}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env, **popen)


def _wait_for_checkpoint(runs, version, proc, timeout=300):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(runs.glob(f"*/checkpoints/v{version:06d}/manifest.json"))
        if found:
            return found[0].parent.parent.parent
        assert proc.poll() is None, f"run ended before checkpoint {version}: {proc.stdout.read()}"
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint of version {version} within {timeout} s")


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_driver_stopped_or_killed_then_resumed_from_the_command_line(ray_session, tracking, tmp_path, monkeypatch, how):
    """SIGTERM: the driver drains, checkpoints, ends the MLflow run KILLED and exits 143 saying how to
    resume. SIGKILL (the driver dies): nothing runs on exit, the last periodic checkpoint is the
    resume point. Either way ``run --resume`` finishes the same MLflow run."""
    import signal

    from rayfed_proto.cli import main

    uri, track = tracking
    address = ray.get_runtime_context().gcs_address
    sets = [x for o in SMALL + track + ["federation.mode=sync", "federation.rounds=6", "checkpoint.every=1"]
            for x in ("--set", o)]
    proc = _cli(sets, address, tmp_path)
    out = _wait_for_checkpoint(tmp_path / "runs", 2, proc)
    proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    run_id = checkpoint_store(build_config({}, SMALL + track), out).latest().manifest["run_id"]
    client = MlflowClient(uri)
    if how == "SIGTERM":
        assert proc.returncode == 143, output
        assert f"rayfed-proto run --resume {out}" in output
        assert client.get_run(run_id).info.status == "KILLED"
    else:
        assert proc.returncode == -signal.SIGKILL
        assert client.get_run(run_id).info.status == "RUNNING"  # nobody could end it: resume takes it over

    # `rayfed-proto run --resume` through the CLI's entry point in this process (which never held the
    # run: the stopped or killed driver was the subprocess), from the same folder: no second interpreter
    # to start and import torch, Ray and MLflow
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--no-progress", "--resume", str(out), "--set", f"resources.address={address}"]) == 0
    assert client.get_run(run_id).info.status == "FINISHED"
    steps = sorted({m.step for m in client.get_metric_history(run_id, "eval/head_acc")})
    assert steps == list(range(7))  # every version logged in the one run, before and after


def test_async_run_stopped_and_resumed_continues_the_same_run(ray_session, tracking):
    # async: no exact-equality promise (arrival order depends on timing), but the stop drains the
    # running updates before its checkpoint, so nothing in flight is lost and the versions continue
    uri, track = tracking
    common = SMALL + track + ["federation.mode=async", "federation.rounds=6", "federation.buffer_size=2",
                              "federation.concurrency=2", "checkpoint.every=0"]
    with pytest.raises(RunInterrupted) as stopped:
        run_experiment(build_config({}, common + ["faults.stop_at_version=3"]), **QUIET)
    out = stopped.value.output_dir
    ckpt = checkpoint_store(build_config({}, common), out).latest()
    assert ckpt is not None and ckpt.version >= 3  # written on the stop although periodic checkpoints are off
    resumed = run_experiment(build_config({}, common), resume_dir=out, **QUIET)
    assert resumed.final_version == 6 and resumed.run_id == ckpt.manifest["run_id"]
    steps = sorted({m.step for m in MlflowClient(uri).get_metric_history(resumed.run_id, "eval/head_acc")})
    assert steps == list(range(7))
    last = resumed.history[-1]
    assert last["reliability/updates_lost_client"] == 0 and last["reliability/updates_lost_server"] == 0
    _assert_finite_bank(resumed)


def test_async_server_killed_is_recreated_and_the_run_finishes(ray_session, tracking):
    _, track = tracking
    kill_server_once, killed = _killer("server", {3}, first_at_or_after=True)
    cfg = build_config({}, SMALL + track + ["federation.mode=async", "federation.rounds=8", "federation.buffer_size=1",
                                            "federation.concurrency=2", "checkpoint.every=2"])
    result = run_experiment(cfg, on_eval=kill_server_once, **QUIET)
    assert killed and result.final_version == 8
    assert result.history[-1]["reliability/server_restarts"] == 1
    _assert_finite_bank(result)


def test_server_and_a_client_killed_together_the_run_still_finishes(ray_session, tracking):
    # the client's update in flight was trained against the dead server: lost once, counted once,
    # and the abandoned round's bookkeeping must not stall the next round
    _, track = tracking
    killed = []

    def kill_both(version, metrics):
        if version == 3 and not killed:
            ray.kill(ray.get_actor(_named("server")), no_restart=True)
            ray.kill(ray.get_actor(_named("client:0")), no_restart=True)
            killed.append(version)

    cfg = build_config({}, SMALL + track + ["federation.mode=sync", "federation.rounds=5", "checkpoint.every=2"])
    result = run_experiment(cfg, on_eval=kill_both, **QUIET)
    assert killed and result.final_version == 5
    last = result.history[-1]
    assert last["reliability/server_restarts"] == 1 and last["reliability/client_failures"] == 1
    assert last["reliability/updates_lost_client"] + last["reliability/updates_lost_server"] <= 4  # at most the one round in flight
    _assert_finite_bank(result)
