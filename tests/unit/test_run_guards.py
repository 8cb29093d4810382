"""Issue 16: bad inputs refused before Ray starts with a message naming the file and what is
expected; run folders locked; a run that makes no progress stops; resume decisions."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from rayfed_proto.cli import main
from rayfed_proto.config import InputError, build_config


def _run_cli(args, capsys):
    code = main(args)
    return code, capsys.readouterr().err


def _npz(tmp_path, name="data.npz", n=40, **overrides):
    rng = np.random.default_rng(0)
    arrays = {"images": rng.random((n, 8, 8)).astype(np.float32), "labels": np.arange(n) % 4}
    arrays.update(overrides)
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _npz_run_args(tmp_path, path):
    return ["run", "--no-progress", "--set", "data.name=npz", "--set", f"data.path={path}",
            "--set", "federation.num_clients=2", "--set", f"tracking.output_dir={tmp_path / 'runs'}",
            "--set", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]


# ------------------------------------------------------------------ data (items 1 and 8)

def test_nan_images_are_refused_before_ray_starts(tmp_path, capsys):
    import ray

    ray_before = ray.is_initialized()
    images = np.random.default_rng(0).random((40, 8, 8)).astype(np.float32)
    images[7, 2, 3] = np.nan
    images[9, 0, 0] = np.inf
    path = _npz(tmp_path, images=images)
    code, err = _run_cli(_npz_run_args(tmp_path, path), capsys)
    assert code == 2
    assert str(path) in err and "NaN/inf" in err and "2 values in 2 images" in err and "first at index 7" in err
    assert ray.is_initialized() == ray_before  # refused before ray.init
    assert not (tmp_path / "runs").exists()  # nothing written for a refused run


def test_a_truncated_npz_is_named_not_a_traceback(tmp_path, capsys):
    path = _npz(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, err = _run_cli(_npz_run_args(tmp_path, path), capsys)
    assert code == 2 and str(path) in err and "not a readable .npz archive" in err and "numpy.savez" in err
    assert "Traceback" not in err


def test_fractional_labels_say_whole_numbers(tmp_path):
    from rayfed_proto.data import load_dataset

    labels = (np.arange(40) % 4).astype(np.float64)
    labels[5] = 0.5
    path = _npz(tmp_path, labels=labels)
    with pytest.raises(ValueError, match=r"'labels' must be whole numbers .*found 0\.5 at index 5"):
        load_dataset(build_config({}, ["data.name=npz", f"data.path={path}"]).data)


def test_a_one_class_dataset_gets_a_warning(tmp_path):
    from rayfed_proto.data import load_dataset
    from rayfed_proto.data.datasets import dataset_warnings

    one = load_dataset(build_config({}, ["data.name=npz", f"data.path={_npz(tmp_path, labels=np.zeros(40, int))}"]).data)
    assert any("single class" in w for w in dataset_warnings(one))
    two = load_dataset(build_config({}, ["data.name=npz", f"data.path={_npz(tmp_path, name='b.npz')}"]).data)
    assert dataset_warnings(two) == []


# ------------------------------------------------------------------ config files (item 8)

def test_a_binary_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    code, err = _run_cli(["validate", str(path)], capsys)
    assert code == 2 and str(path) in err and "UTF-8" in err and "Traceback" not in err


def test_tune_names_a_binary_sweep_file_and_a_binary_base_file(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    code, err = _run_cli(["tune", str(sweep), "--check"], capsys)
    assert code == 2 and str(sweep) in err and "UTF-8" in err and "Traceback" not in err
    base = tmp_path / "base.yaml"
    base.write_bytes(b"\xff\xfe\x00binary")
    sweep.write_text("base: base.yaml\nsearch_space:\n  algorithm.lam: {choice: [1, 10]}\n")
    code, err = _run_cli(["tune", str(sweep), "--check"], capsys)
    assert code == 2 and "base" in err and str(base) in err and "UTF-8" in err and "Traceback" not in err


def test_a_directory_is_not_a_config(tmp_path, capsys):
    code, err = _run_cli(["validate", str(tmp_path)], capsys)
    assert code == 2 and "directory, not a config" in err and "--resume" in err


def test_a_mistyped_preset_lists_the_presets(capsys):
    code, err = _run_cli(["validate", "fedsa_digit"], capsys)
    assert code == 2 and "did you mean fedsa_digits" in err and "fedproto" not in err.split("presets:")[0]
    assert "fedsc_cifar10" in err.split("presets:")[1]


# ------------------------------------------------------------------ run folder lock (item 3)

def test_a_second_lock_on_a_run_folder_is_refused_naming_the_holder(tmp_path):
    from rayfed_proto.runtime.runfolder import RunFolderBusy, RunFolderLock

    with RunFolderLock(tmp_path):
        with pytest.raises(RunFolderBusy) as err:
            RunFolderLock(tmp_path).acquire()
        assert f"pid {os.getpid()}" in str(err.value) and socket.gethostname() in str(err.value)
    RunFolderLock(tmp_path).acquire().release()  # released: free again


def test_the_lock_of_a_killed_driver_is_free(tmp_path):
    from rayfed_proto.runtime.runfolder import RunFolderBusy, RunFolderLock, is_locked

    code = ("import sys, time; from rayfed_proto.runtime.runfolder import RunFolderLock; "
            f"RunFolderLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert is_locked(tmp_path)
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid} "):
            RunFolderLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert not is_locked(tmp_path)
    RunFolderLock(tmp_path).acquire().release()


def test_resume_of_a_folder_in_use_is_refused_before_ray_starts(tmp_path):
    import ray

    ray_before = ray.is_initialized()
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.runfolder import RunFolderBusy, RunFolderLock

    cfg = build_config({}, [f"tracking.output_dir={tmp_path}"])
    with RunFolderLock(tmp_path):
        with pytest.raises(RunFolderBusy, match="in use by another driver"):
            run_experiment(cfg, resume_dir=tmp_path, progress=False, echo=lambda s: None)
    assert ray.is_initialized() == ray_before  # refused before ray.init


# ------------------------------------------------------------------ resume decisions (items 2, 3, 4, 8)

def _fake_checkpoint(folder, version):
    from rayfed_proto.runtime.checkpoint import CheckpointStore

    return CheckpointStore(folder / "checkpoints").save(
        version, server={"core": {"version": version}}, clients=[], actor_rng={}, driver={"history": []}, run_id="r")


def test_resuming_a_finished_run_says_so_unless_rounds_are_raised(tmp_path):
    from rayfed_proto.runtime.preparation import checkpoint_store, resume_point
    from rayfed_proto.runtime.runfolder import mark_finished

    _fake_checkpoint(tmp_path, 6)
    mark_finished(tmp_path, 6, "r")
    cfg = build_config({}, ["federation.rounds=6"])
    with pytest.raises(InputError, match=r"already finished at version 6 .*federation.rounds=N with N > 6"):
        resume_point(cfg, tmp_path, checkpoint_store(cfg, tmp_path))
    more = build_config({}, ["federation.rounds=9"])
    assert resume_point(more, tmp_path, checkpoint_store(more, tmp_path)).version == 6


def test_resume_with_rounds_at_or_below_the_checkpoint_says_nothing_is_left(tmp_path):
    from rayfed_proto.runtime.preparation import checkpoint_store, resume_point

    _fake_checkpoint(tmp_path, 16)
    cfg = build_config({}, ["federation.rounds=10"])
    with pytest.raises(InputError, match=r"version 16 and federation.rounds=10: nothing left to run"):
        resume_point(cfg, tmp_path, checkpoint_store(cfg, tmp_path))


def test_resume_with_every_checkpoint_damaged_is_an_input_error_naming_the_folder(tmp_path, capsys):
    import ray

    ray_before = ray.is_initialized()
    path = _fake_checkpoint(tmp_path, 4)
    (path / "server.pt").write_bytes(b"\x00")
    (tmp_path / "config.yaml").write_text(build_config({}, [f"tracking.output_dir={tmp_path}"]).to_yaml())
    code, err = _run_cli(["run", "--resume", str(tmp_path)], capsys)
    assert code == 2 and f"no usable checkpoint under {tmp_path / 'checkpoints'}" in err and "v000004" in err
    assert ray.is_initialized() == ray_before  # refused before ray.init


def test_driver_dead_before_its_first_checkpoint_its_mlflow_run_is_marked_failed(tmp_path):
    from mlflow.tracking import MlflowClient

    from rayfed_proto.runtime.preparation import checkpoint_store, resume_point
    from rayfed_proto.runtime.runfolder import write_run_info

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    run_id = client.create_run(exp).info.run_id  # RUNNING, as a SIGKILLed driver leaves it
    write_run_info(tmp_path, run_id, uri)
    cfg = build_config({})
    with pytest.raises(InputError, match=f"before its first checkpoint.*MLflow run {run_id}, left RUNNING, is now marked FAILED"):
        resume_point(cfg, tmp_path, checkpoint_store(cfg, tmp_path))
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and "first checkpoint" in run.data.tags["failure_reason"]


# ------------------------------------------------------------------ no progress (item 1)

def test_consecutive_refusals_stop_the_run_and_an_accept_resets_the_count():
    from rayfed_proto.runtime.progress import NoProgressError, ProgressWatch

    watch = ProgressWatch(max_consecutive_refusals=3)
    refused = {"accepted": False, "client_id": 1, "reason": "prototypes contain NaN/inf"}
    watch.on_receipt(refused, 0)
    watch.on_receipt(refused, 0)
    watch.on_receipt({"accepted": True}, 0)
    watch.on_receipt({"accepted": False, "reason": "run finished"}, 0)  # late, not a refusal
    watch.on_receipt(refused, 1)
    watch.on_receipt(refused, 1)
    with pytest.raises(NoProgressError, match=r"last 3 submitted updates were all refused .*max_consecutive_refusals=3.*NaN"):
        watch.on_receipt(refused, 1)


def test_no_new_version_for_the_timeout_stops_the_run_and_drains_do_not_count():
    from rayfed_proto.runtime.progress import NoProgressError, ProgressWatch

    now = [0.0]
    watch = ProgressWatch(no_progress_timeout_s=10, clock=lambda: now[0])
    now[0] = 9.0
    watch.check(0)
    watch.on_version(1)
    now[0] = 18.0
    watch.check(1)
    watch.pause()  # a checkpoint drain
    now[0] = 27.0
    watch.check(1)
    now[0] = 40.0
    with pytest.raises(NoProgressError, match=r"no new server version for 22 s .*no_progress_timeout_s=10"):
        watch.check(1)
    ProgressWatch(clock=lambda: 1e9).check(0)  # limits off by default (0)


def test_an_empty_version_is_warned_about(caplog):
    from rayfed_proto.runtime.progress import ProgressWatch

    watch = ProgressWatch()
    with caplog.at_level("WARNING", logger="rayfed_proto"):
        watch.on_version(3, aggregated=0)
    assert "version 3 aggregated NO update" in caplog.text


def test_no_progress_limits_are_validated_config_keys():
    from rayfed_proto.config import ConfigError

    cfg = build_config({}, ["reliability.max_consecutive_refusals=5", "reliability.no_progress_timeout_s=60"])
    assert cfg.reliability.max_consecutive_refusals == 5 and cfg.reliability.no_progress_timeout_s == 60
    with pytest.raises(ConfigError, match="reliability.max_consecutive_refusals"):
        build_config({}, ["reliability.max_consecutive_refusals=-1"])


# ------------------------------------------------------------------ end of a run (item 8)

def test_counters_are_not_logged_twice_at_the_final_step():
    from rayfed_proto.runtime.scheduler import SchedulerStats
    from rayfed_proto.tracking import metric_names as names
    from rayfed_proto.tracking.round_metrics import end_counters

    failures, written, withheld = (names.RELIABILITY_CLIENT_FAILURES, names.RELIABILITY_CHECKPOINTS_WRITTEN,
                                   names.FEDERATION_UPDATES_WITHHELD_AFTER_END)
    stats = SchedulerStats(client_failures=1, checkpoints=2, withheld=3)
    at_five = end_counters(stats, [], 5)  # every counter, as at a step without an evaluation
    history = [{"version": 5, **at_five, withheld: 0}]
    assert end_counters(stats, history, 5) == {withheld: 3}  # the rest were logged with the same value
    stats.client_failures = 2
    assert end_counters(stats, history, 5) == {withheld: 3, failures: 2}  # moved since: logged
    assert end_counters(stats, history, 6) == at_five | {failures: 2}  # no evaluation at the end
    assert at_five[written] == 2 and at_five[withheld] == 3


def test_a_second_ctrl_c_says_where_to_resume(tmp_path):
    from rayfed_proto.runtime.checkpoint import CheckpointStore
    from rayfed_proto.runtime.signals import stopped_at_once as _stopped_at_once
    from rayfed_proto.tracking.mlflow_tracker import NullTracker

    store = CheckpointStore(tmp_path / "checkpoints")
    e = _stopped_at_once(store, tmp_path, NullTracker())
    assert "before the first checkpoint" in str(e) and f"rayfed-proto run {tmp_path / 'config.yaml'}" in str(e)
    _fake_checkpoint(tmp_path, 4)
    e = _stopped_at_once(store, tmp_path, NullTracker())
    assert "checkpoint of version 4" in str(e) and f"rayfed-proto run --resume {tmp_path}" in str(e)


def test_a_double_ctrl_c_exit_prints_the_resume_command(monkeypatch, capsys, tmp_path):
    from rayfed_proto.runtime import driver
    from rayfed_proto.runtime.signals import RunInterrupted

    def interrupted(*a, **k):
        raise RunInterrupted("stopped at once (second Ctrl-C); checkpoint of version 4 in X.\n"
                                    f"Resume with: rayfed-proto run --resume {tmp_path}", tmp_path, 4, "SIGINT")

    monkeypatch.setattr(driver, "run_experiment", interrupted)
    code, err = _run_cli(["run", "--no-progress"], capsys)
    assert code == 130 and f"rayfed-proto run --resume {tmp_path}" in err


# ------------------------------------------------------------------ checkpoint write failures (item 6)

def test_a_failed_checkpoint_write_is_retried_then_the_run_goes_on(tmp_path, monkeypatch, caplog):
    import torch

    from rayfed_proto.runtime import checkpoint

    store = checkpoint.CheckpointStore(tmp_path, keep=3)
    parts = dict(server={"core": {}}, clients=iter([(0, {"w": torch.zeros(1)})]), actor_rng={}, driver={}, run_id="r")
    assert store.save_or_warn(2, delay_s=0, **dict(parts, clients=iter([(0, {"w": torch.zeros(1)})]))) is not None

    real_save, calls = checkpoint._save, []

    def flaky(obj, path):
        calls.append(path)
        if len(calls) <= 1:
            raise OSError(28, "No space left on device")
        real_save(obj, path)

    monkeypatch.setattr(checkpoint, "_save", flaky)
    path = store.save_or_warn(4, delay_s=0, **parts)  # the generator of clients survives the retry
    assert path is not None and (path / "clients" / "0.pt").is_file()

    def broken(obj, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_save", broken)
    with caplog.at_level("WARNING", logger="rayfed_proto"):
        assert store.save_or_warn(6, attempts=2, delay_s=0, **parts) is None
    assert "could NOT be written" in caplog.text and "v000004 still stands" in caplog.text
    assert store.latest().version == 4 and not list(tmp_path.glob(".tmp-*"))


# ------------------------------------------------------------------ MLflow store and re-done steps (items 5 and 7)

def test_steps_redone_after_a_resume_are_recorded_as_superseded(tmp_path):
    from mlflow.tracking import MlflowClient

    from rayfed_proto.config import TrackingConfig
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(TrackingConfig(tracking_uri=uri, experiment_name="e"))
    run_id = tracker.start({})
    for step in range(6):  # the dead driver logged versions 0..5, its last checkpoint was version 3
        tracker.log_metrics({"eval/head_acc": 0.1 * step}, step=step)
    assert tracker.note_superseded_steps(3) == [4, 5]
    assert tracker.note_superseded_steps(5) == []
    assert MlflowClient(uri).get_run(run_id).data.tags["superseded_steps"] == "4-5"
    tracker.end()


def test_a_fresh_store_created_by_two_runs_at_once_is_retried(tmp_path, monkeypatch):
    """The race itself is timing-dependent; this reproduces what the loser sees (sqlite's "table
    experiments already exists" while the winner migrates) and checks that the tracker retries
    instead of crashing, before any output folder exists."""
    import sqlalchemy.exc
    from mlflow.tracking import MlflowClient

    from rayfed_proto.config import TrackingConfig
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

    real, calls = MlflowClient.search_experiments, []

    def racing(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise sqlalchemy.exc.OperationalError("CREATE TABLE experiments", {}, Exception("table experiments already exists"))
        return real(self, *a, **k)

    monkeypatch.setattr(MlflowClient, "search_experiments", racing)
    MlflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"))
    assert len(calls) == 2


def test_two_trackers_on_a_fresh_store_at_the_same_moment_both_start(tmp_path):
    code = ("import sys; from rayfed_proto.config import TrackingConfig; "
            "from rayfed_proto.tracking.mlflow_tracker import MlflowTracker; "
            f"t = MlflowTracker(TrackingConfig(tracking_uri='sqlite:///{tmp_path / 'mlflow.db'}', experiment_name='e')); "
            "t.start({}); t.end(); print('ok')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]


def test_runs_left_running_by_dead_drivers_are_settled_at_the_next_start(tmp_path):
    """Item 4: a SIGKILLed driver leaves its MLflow run RUNNING; the next run started in the same
    output folder marks it KILLED (resumable: it has a checkpoint) or FAILED (no checkpoint), and
    leaves alone a run whose driver is alive (lock held) or that finished."""
    from mlflow.tracking import MlflowClient

    from rayfed_proto.runtime.runfolder import RunFolderLock, mark_finished, settle_orphaned_runs, write_run_info

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    runs = {}
    for name in ("with_checkpoint", "without_checkpoint", "alive", "finished"):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        runs[name] = client.create_run(exp).info.run_id
        write_run_info(folder, runs[name], uri)
    _fake_checkpoint(tmp_path / "runs" / "with_checkpoint", 2)
    mark_finished(tmp_path / "runs" / "finished", 4, runs["finished"])
    with RunFolderLock(tmp_path / "runs" / "alive"):
        lines = settle_orphaned_runs(tmp_path / "runs")
    status = {k: client.get_run(r).info.status for k, r in runs.items()}
    assert status == {"with_checkpoint": "KILLED", "without_checkpoint": "FAILED", "alive": "RUNNING", "finished": "RUNNING"}
    assert client.get_run(runs["with_checkpoint"]).data.tags["resume_from"] == str(tmp_path / "runs" / "with_checkpoint")
    assert len(lines) == 2 and any("--resume" in line for line in lines)


# ------------------------------------------------------------------ refused before Ray starts (issue 25, items 3 and 7)

@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the driver gets as far as starting Ray."""
    from rayfed_proto.runtime import driver

    def started(cfg):
        raise AssertionError("Ray was started before the run was refused")

    monkeypatch.setattr(driver, "ensure_ray", started)


def _small(tmp_path, *extra):
    return build_config({}, ["data.name=digits", "federation.num_clients=4", "federation.rounds=2", "federation.eval_every=1",
                             f"tracking.output_dir={tmp_path / 'runs'}", "tracking.tracking_uri=", *extra])


def test_an_infeasible_partition_is_refused_before_ray_and_leaves_no_folder(tmp_path, no_ray):
    from rayfed_proto.config import InputError
    from rayfed_proto.runtime.driver import run_experiment

    cfg = _small(tmp_path, "data.partition.name=nway_kshot", "data.partition.n_way=11")
    with pytest.raises(InputError, match="n_way"):
        run_experiment(cfg, progress=False, echo=lambda s: None)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_an_unwritable_checkpoint_folder_is_refused_before_ray(tmp_path, no_ray):
    from rayfed_proto.runtime.driver import run_experiment

    blocked = tmp_path / "file"
    blocked.write_text("a file where the checkpoint folder should be")
    with pytest.raises(PermissionError, match="cannot write checkpoints"):
        run_experiment(_small(tmp_path, f"checkpoint.dir={blocked / 'ckpt'}", "checkpoint.every=1"),
                       progress=False, echo=lambda s: None)
    assert not any((tmp_path / "runs").iterdir())  # the fresh output folder is gone again


def test_availability_windows_too_short_for_the_run_are_refused_before_ray(tmp_path, no_ray):
    from rayfed_proto.config import InputError
    from rayfed_proto.runtime.driver import run_experiment

    windows = tmp_path / "online.csv"
    windows.write_text("client_id,start_s,end_s\n" + "".join(f"{c},0,1e-9\n" for c in range(4)))
    cfg = _small(tmp_path, "federation.mode=async", "federation.buffer_size=2", "federation.concurrency=2",
                 "federation.rounds=3", "system.availability.kind=csv", f"system.availability.path={windows}")
    # each window is shorter than any update: 4 clients x 1 start < 3 versions x 2 updates
    with pytest.raises(InputError, match=r"system.availability: .* at most 4 local updates .* needs at least 6"):
        run_experiment(cfg, progress=False, echo=lambda s: None)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
