"""Run one experiment end to end: data -> partition -> actors -> scheduler -> MLflow.

Everything that can be checked without Ray (config, dataset presence, partition feasibility,
output folder) is checked before Ray starts.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayfed_proto.config import ExperimentConfig, InputError
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.tracking import make_tracker
from rayfed_proto.tracking import metric_names as names

log = logging.getLogger("rayfed_proto")


@dataclass
class RunResult:
    run_id: Optional[str]
    tracking_uri: Optional[str]
    output_dir: Path
    final_version: int
    history: list[dict[str, Any]] = field(default_factory=list)
    resource_plan: dict[str, Any] = field(default_factory=dict)
    placements: list[dict[str, Any]] = field(default_factory=list)
    summary: str = ""
    client_updates: dict[int, int] = field(default_factory=dict)  # client -> local updates dispatched to it


def _output_dir(cfg: ExperimentConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    out = Path(cfg.tracking.output_dir).resolve() / f"{stamp}-{cfg.algorithm.name}-{cfg.data.name}"
    try:
        out.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        raise PermissionError(f"cannot create the output folder {out} ({e}); set tracking.output_dir to a writable folder") from None
    return out


def resume_point(cfg: ExperimentConfig, out: Path, store):
    """The checkpoint ``run --resume out`` continues from, or an :class:`InputError` saying why
    there is nothing to resume; decided before Ray starts.

    A finished run is continued only when ``federation.rounds`` was raised above its final
    version, from the checkpoint written at its end; when that one is damaged or missing, from
    the newest usable older one, redoing the versions after it (``CheckpointStore.latest``
    skips a damaged checkpoint). Every file of the checkpoint is scanned for code before
    anything starts (``Checkpoint.check_loadable``). A folder whose driver died before its
    first checkpoint has its MLflow run, left RUNNING, marked FAILED."""
    from rayfed_proto.runtime import runfolder
    from rayfed_proto.runtime.checkpoint import CheckpointError

    rounds = cfg.federation.rounds
    done = runfolder.finished_version(out)
    if done is not None and rounds <= done:
        raise InputError(f"run {out} already finished at version {done} (federation.rounds={rounds}): nothing to resume. "
                         f"To continue it, raise federation.rounds: rayfed-proto run --resume {out} --set federation.rounds=N "
                         f"with N > {done}")
    try:
        ckpt = store.latest(client_states=False)  # each client state's checksum: verified when the restore reads it
    except CheckpointError as e:
        raise InputError(str(e)) from None
    if ckpt is None:
        marked = _fail_orphaned_mlflow_run(out, "the driver ended before its first checkpoint; nothing to resume")
        raise InputError(f"no complete checkpoint under {store.dir}: the driver ended before its first checkpoint, so "
                         f"there is nothing to resume{marked}. Start the run afresh: rayfed-proto run {out / 'config.yaml'}")
    try:  # scanned (and the small parts loaded) now: a refused checkpoint leaves the run's MLflow status alone
        ckpt.check_loadable()
    except CheckpointError as e:
        raise InputError(str(e)) from None
    if done is not None and ckpt.version < done:  # the final checkpoint is damaged or was never written
        log.warning("run %s finished at version %d, but its newest usable checkpoint is version %d: continuing from "
                    "it redoes versions %d..%d (MLflow keeps the earlier points, tagged superseded_steps)",
                    out, done, ckpt.version, ckpt.version + 1, done)
    if ckpt.version >= rounds:
        raise InputError(f"the checkpoint {ckpt.path} is at version {ckpt.version} and federation.rounds={rounds}: nothing "
                         f"left to run. Raise federation.rounds above {ckpt.version} (--set federation.rounds=N)")
    return ckpt


def _fail_orphaned_mlflow_run(out: Path, reason: str) -> str:
    """Mark the MLflow run that ``out`` records (run.json) FAILED when a dead driver left it
    RUNNING; returns a phrase for the message ('' when there was nothing to mark)."""
    from rayfed_proto.runtime import runfolder

    info = runfolder.read_run_info(out) or {}
    if not info.get("run_id") or not info.get("tracking_uri"):
        return ""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(info["tracking_uri"])
        if client.get_run(info["run_id"]).info.status != "RUNNING":
            return ""
        client.set_tag(info["run_id"], "failure_reason", reason)
        client.set_terminated(info["run_id"], "FAILED")
    except Exception as e:  # the store is gone or unreachable: say so, do not hide the real message
        log.warning("could not mark MLflow run %s FAILED: %s", info["run_id"], e)
        return ""
    return f"; its MLflow run {info['run_id']}, left RUNNING, is now marked FAILED"


def ensure_ray(cfg: ExperimentConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if cfg.resources.address:
        ray.init(address=cfg.resources.address, **kwargs)
    else:
        ray.init(num_cpus=cfg.resources.num_cpus, num_gpus=cfg.resources.num_gpus, **kwargs)


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM (or ``faults.stop_at_version``) after a clean drain; the
    message says how to resume. A KeyboardInterrupt, so callers that only know Ctrl-C still stop."""

    def __init__(self, message: str, output_dir: Path, version: int, signal_name: str):
        super().__init__(message)
        self.output_dir, self.version, self.signal_name = output_dir, version, signal_name


def checkpoint_store(cfg: ExperimentConfig, out: Path):
    from rayfed_proto.runtime.checkpoint import CheckpointStore

    return CheckpointStore(cfg.checkpoint.dir or (out / "checkpoints"), keep=cfg.checkpoint.keep)


def run_experiment(cfg: ExperimentConfig, **kwargs: Any) -> RunResult:
    """Run ``cfg``; ``on_eval(version, metrics)`` is called after each evaluation (Tune uses it),
    ``on_version(version)`` as soon as the driver learns of a new version.

    ``resume_dir``: the output folder of an interrupted run; it continues from its latest
    checkpoint with the same partition, version counter, sampling sequence and MLflow run.
    The run folder is locked for as long as this call runs (a second driver is refused).
    """
    from contextlib import ExitStack

    global _RUNS_STARTED
    started = _process_start_unix() if _RUNS_STARTED == 0 else time.time()
    _RUNS_STARTED += 1
    with ExitStack() as folder_locks:
        return _run_experiment(cfg, folder_locks=folder_locks, started_unix=started, **kwargs)


_RUNS_STARTED = 0  # runs started in this process: the first one's startup includes the process's


def _process_start_unix() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil or no /proc: from this call on
        return time.time()


@dataclass
class _Run:
    """What the steps of one run share (filled in step by step)."""

    cfg: ExperimentConfig
    echo: Callable[[str], None]
    progress: bool
    out: Optional[Path] = None
    store: Any = None
    ckpt: Any = None  # the checkpoint a resume continues from
    partition: Any = None
    shape: tuple[int, int, int] = (0, 0, 0)  # classes, channels, image size
    class_names: list[str] = field(default_factory=list)
    plan: Any = None
    fleet: Any = None
    groups: list[list[int]] = field(default_factory=list)
    tracker: Any = None
    run_log: Any = None
    run_id: Optional[str] = None
    driver_state: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    start_version: int = 0
    bar: Any = None
    scheduler: Any = None
    policy: Any = None  # the federation policy (runtime.policies): the mode as one object
    started_unix: float = 0.0  # when the run started (startup_s)


def _run_experiment(cfg: ExperimentConfig, *, folder_locks, progress: bool = True, echo: Callable[[str], None] = print,
                    on_eval: Optional[Callable[[int, dict[str, Any]], None]] = None,
                    on_version: Optional[Callable[[int], None]] = None,
                    resume_dir: Optional[str | Path] = None, started_unix: Optional[float] = None) -> RunResult:
    from rayfed_proto.runtime.signals import StartupSignals, StartupStopped, stopped_before_tracking

    run = _Run(cfg, echo, progress, started_unix=started_unix if started_unix is not None else time.time())
    startup = StartupSignals().install()  # until the scheduler's handlers: a signal is acted on at safe points
    try:
        try:
            _prepare(run, folder_locks, resume_dir, startup)  # data, resources, partition, output folder: refuses before writing
            startup.enter("MLflow run")
            _track(run)  # the MLflow run, new or resumed
        except StartupStopped as stop:  # nothing in MLflow yet: the workers released, a new run's folder removed
            msg, version = stopped_before_tracking(run, stop)
            raise RunInterrupted(msg, run.out, version, stop.signal_name) from None
        return _run_tracked(run, startup, on_eval, on_version)
    finally:
        startup.restore()


def _run_tracked(run: _Run, startup, on_eval, on_version) -> RunResult:
    """The run once its MLflow run exists: actors, restore, the event loop, the end; the MLflow
    run ends FINISHED, KILLED (a stop) or FAILED, and the actors are released, however it ends."""
    from rayfed_proto.runtime import runfolder
    from rayfed_proto.runtime.checkpoint import CheckpointError
    from rayfed_proto.runtime.signals import StartupStopped, stopped_in_startup

    status = "FAILED"
    restore_signals = lambda: None  # noqa: E731
    try:
        startup.enter("actors starting")
        _start(run)  # server and workers built, placed and given their data
        startup.enter("restore")
        _restore(run)  # from the checkpoint, when resuming
        startup.enter("first version")
        scheduler = run.scheduler = _make_scheduler(run, on_eval, on_version)
        restore_signals = _install_stop_handlers(scheduler)
        startup.check()  # a signal between the last safe point and the scheduler's handlers
        final_version = _loop(run)  # the event loop; a requested stop ends in RunInterrupted
        result = _finish(run, final_version)  # final counters, artifacts, summary
        status = "FINISHED"
        return result
    except StartupStopped as stop:  # a resumed run KILLED (its checkpoint stands), a new one FAILED with the reason
        status, msg, version = stopped_in_startup(run, stop)
        raise RunInterrupted(msg, run.out, version, stop.signal_name) from None
    except CheckpointError:  # a client state damaged since the scan (its checksum, at the restore): refused as input,
        status = getattr(run.tracker, "resumed_status", None) or "FAILED"  # the run's status left as it was
        raise
    except OSError as e:  # a disk that filled, a folder made unwritable: a fault (exit 1), named, with what was kept
        fault = runfolder.RunFault.during_run(e, run.out, run.store)
        run.tracker.set_tags({"failure_reason": str(fault)[:5000]})
        raise fault from None
    except RunInterrupted:
        status = "KILLED"
        raise
    except (KeyboardInterrupt, SystemExit) as e:  # SystemExit: a Tune trial told to stop, a stop and not a failure
        status = "KILLED"
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C: stopped at once, no drain
            raise _stopped_at_once(run.store, run.out, run.tracker) from None
        raise
    finally:
        restore_signals()
        if run.bar is not None:
            run.bar.close()
        try:
            run.tracker.end(status)
        finally:  # MLflow unreachable at the end: the actors and the autoscaler request are released all the same
            _release_actors(run)
            run.store.release_cache()  # a remote checkpoint store's staging copy in the temp folder


def _release_actors(run: _Run) -> None:
    """Kill the worker and server actors (the scheduler's current handles: restarts replace
    them) and free the placement group; a second call does nothing."""
    if run.scheduler is not None:
        run.fleet.handles["actors"], run.fleet.handles["server"] = run.scheduler.actors, run.scheduler.server
    run.fleet.shutdown()


# ----------------------------------------------------------------------------- the steps of a run


def _prepare(run: _Run, folder_locks, resume_dir, startup) -> None:
    """Everything that can refuse the run does so before Ray starts or anything is written: the
    checkpoint to resume, the dataset, the partition, the simulated clients' availability, the
    output and checkpoint folders; then, with Ray, the tracking store and the cluster's resources
    (a refusal there removes the fresh, still empty output folder). The run's files are written
    once the worker processes are starting."""
    from rayfed_proto.data.datasets import dataset_warnings
    from rayfed_proto.runtime.parking import check_park_dir

    cfg = run.cfg
    if resume_dir is not None:
        from rayfed_proto.runtime import runfolder

        run.out = Path(resume_dir).resolve()
        folder_locks.enter_context(runfolder.RunFolderLock(run.out))  # first: a second driver is refused at once
        run.store = checkpoint_store(cfg, run.out)
        run.ckpt = resume_point(cfg, run.out, run.store)  # refuses (before Ray starts) when there is nothing to resume
        run.partition = runfolder.load_partition(run.out)  # a damaged file: refused, naming it and what to do
    try:  # only the driver ever reads the data (actors take it from the object store)
        dataset = load_dataset(cfg.data, cfg.seed)
    except (ValueError, KeyError) as e:  # infeasible data for this config: the user's to fix
        raise InputError(str(e)) from e
    for warning in dataset_warnings(dataset):
        log.warning(warning)
    if run.partition is None:
        run.partition = _partition(cfg, dataset)
    run.shape = (dataset.num_classes, dataset.channels, dataset.image_size)
    run.class_names = list(dataset.class_names)
    system = _system_model(cfg, run.partition, *run.shape)
    _check_availability(cfg, system, run.ckpt.version if run.ckpt is not None else 0)
    if cfg.resources.address is None and cfg.resources.parks_clients(cfg.federation.num_clients) \
            and cfg.resources.parks_on_disk(cfg.federation.num_clients):  # a local Ray: the workers' folder is this node's
        check_park_dir(cfg.resources.park_dir)
    if run.ckpt is None:
        _new_output_folder(run, folder_locks)
    try:
        startup.enter("Ray starting")
        _start_ray_and_workers(run)
        startup.enter("workers starting")
    except BaseException:
        if run.ckpt is None:  # refused before its files were written: leave nothing behind
            shutil.rmtree(run.out, ignore_errors=True)
        raise
    try:
        _hand_out(run, dataset, system)
    except BaseException:
        run.fleet.shutdown()
        raise


def _hand_out(run: _Run, dataset, system) -> None:
    """The new run's files; the data into the object store; clients grouped onto the workers;
    the federation policy; the checkpoint's driver state and history when resuming."""
    import ray

    from rayfed_proto.runtime.policies import make_policy
    from rayfed_proto.runtime.resources import assign_clients
    from rayfed_proto.tracking.run_logging import RunLogging

    cfg, fed = run.cfg, run.cfg.federation
    if run.ckpt is None:
        _write_run_files(run)
    run.fleet.data_ref = ray.put(dataset)  # once: every actor maps these arrays (zero-copy), none loads them
    run.run_log = RunLogging(cfg, run.tracker, dataset, run.partition)  # datasets, input example, per-client series
    run.groups = assign_clients(fed.num_clients, run.plan.clients_per_actor, num_actors=run.plan.num_actors,
                                work=[float(len(s.train_idx)) for s in run.partition.clients])
    run.policy = make_policy(fed, system, seed=cfg.seed, real_slots=run.plan.concurrency)
    run.fleet.assign(run.groups, run.partition, *run.shape, run.policy.needs)
    run.driver_state = run.ckpt.driver_state() if run.ckpt is not None else {}
    run.history = names.upgrade_history(run.driver_state.get("history", []))  # a checkpoint of 0.1.x: flat keys, renamed once


def _start_ray_and_workers(run: _Run) -> None:
    """The tracking store, Ray, the resource plan (which can still refuse the run) and the
    worker processes, which start (import torch) while the driver writes the run's files."""
    from rayfed_proto.runtime.autoscale import capacity  # plan against the cluster that will exist (autoscaling)
    from rayfed_proto.runtime.fleet import ActorFleet
    from rayfed_proto.runtime.resources import plan_resources

    cfg = run.cfg
    from rayfed_proto.runtime.signals import ray_keeps_our_handlers

    run.tracker = make_tracker(cfg.tracking)
    with ray_keeps_our_handlers():  # a SIGTERM is the start-up's to handle (signals.py), not a sys.exit inside Ray
        ensure_ray(cfg)
    cap = capacity(cfg.resources)
    total = cap.totals()
    # per node: each bundle must fit on one node of those the cluster has or will have (refused in seconds if not)
    run.plan = plan_resources(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0), nodes=cap.planning_nodes)
    run.fleet = ActorFleet(cfg.to_dict(), run.plan, cfg.federation, name=f"{uuid.uuid4().hex[:8]}", cluster=total)
    run.fleet.store, run.fleet.run_dir = run.store, run.out
    try:
        run.fleet.start_workers()
    except BaseException:
        run.fleet.shutdown()
        raise


def _check_availability(cfg: ExperimentConfig, system, start_version: int = 0) -> None:
    """Availability windows (``system.availability: csv``) that cannot hold the updates the run
    needs: refused before Ray starts. A sound bound, not a simulation: each version needs at
    least ``policies.min_update_starts`` local updates to start inside some window, and a client
    starts at most one per ``compute_s`` of window (``SystemModel.max_update_starts``)."""
    if system is None:
        return
    from rayfed_proto.runtime.policies import min_update_starts

    need, most = min_update_starts(cfg.federation, start_version), system.max_update_starts()
    if most < need:
        raise InputError(
            f"system.availability: the windows in {cfg.system.availability.path} let at most {most:g} local updates "
            f"start (a client starts at most one per its simulated compute time inside its windows), but reaching "
            f"federation.rounds={cfg.federation.rounds} needs at least {need}; extend the windows or lower "
            "federation.rounds")


def _partition(cfg: ExperimentConfig, dataset):
    d = cfg.data
    try:
        return make_partition(dataset, d.partition, cfg.federation.num_clients, cfg.seed, d.test_fraction,
                              global_test_fraction=d.global_test_fraction, public_size=d.public_size,
                              long_tail_ratio=d.long_tail_ratio)
    except (ValueError, KeyError) as e:
        raise InputError(str(e)) from e


def _new_output_folder(run: _Run, folder_locks) -> None:
    """The run's folder, created, checked writable (with the checkpoint store) and locked; only
    once the data and partition are known to be usable, and before Ray starts."""
    from rayfed_proto.runtime import runfolder

    run.out = out = _output_dir(run.cfg)
    run.store = checkpoint_store(run.cfg, out)
    try:
        run.store.check_writable()
    except PermissionError:
        shutil.rmtree(out, ignore_errors=True)
        raise
    folder_locks.enter_context(runfolder.RunFolderLock(out))


def _write_run_files(run: _Run) -> None:
    """A new run's config and partition, written once nothing can refuse it any more."""
    from rayfed_proto.runtime import runfolder

    out = run.out
    for line in runfolder.settle_orphaned_runs(out.parent):  # runs left RUNNING by drivers that are gone
        run.echo(line)
    (out / "config.yaml").write_text(run.cfg.to_yaml())
    run.partition.save_parquet(out / "partition.parquet")


def _track(run: _Run) -> None:
    """Start the MLflow run (params, tags), or resume the checkpoint's run."""
    from rayfed_proto.runtime import runfolder

    cfg, tracker, ckpt = run.cfg, run.tracker, run.ckpt
    driver = runfolder.driver_tags(run.out)  # host, pid, start time: a later start can tell when this driver is gone
    try:
        if ckpt is not None:
            run.run_id = (tracker.resume(ckpt.manifest["run_id"], tags=driver) if ckpt.manifest.get("run_id")
                          else tracker.start(cfg.flat(), tags=driver))
            run.echo(f"resuming from {ckpt.path} (version {ckpt.version})")
            # logged by the earlier driver after the checkpoint (and the checkpoint's own version when its
            # history lacks it): evaluated again now
            evaluated = {h["version"] for h in run.history}
            redone = tracker.note_superseded_steps(ckpt.version if ckpt.version in evaluated else ckpt.version - 1)
            if redone:
                run.echo(f"versions {redone[0]}..{redone[-1]} were logged after that checkpoint and are redone: MLflow "
                         "keeps both points (the later is valid; tag superseded_steps); history.parquet holds only the "
                         "valid ones")
            runfolder.clear_finished(run.out)  # continued: it is not finished until it finishes again
            for line in runfolder.settle_orphaned_store_runs(tracker.uri, exclude={run.run_id}):  # any folder
                run.echo(line)
            return
        num_classes, channels, image_size = run.shape
        params = cfg.flat()
        params.update({"derived.num_classes": num_classes, "derived.channels": channels, "derived.image_size": image_size,
                       **{f"plan.{k}": v for k, v in run.plan.as_dict().items()}})  # resource plan: params, not metrics
        run.run_id = tracker.start(params, tags={"algorithm": cfg.algorithm.name, "dataset": cfg.data.name,
                                                 "mode": cfg.federation.mode, "model_group": cfg.model.group, **driver})
        runfolder.write_run_info(run.out, run.run_id, tracker.uri)  # before any checkpoint: a resume can name the run
        # after the folder pass (_write_run_files): runs left RUNNING by gone drivers of this host, in any folder
        for line in runfolder.settle_orphaned_store_runs(tracker.uri, exclude={run.run_id}):
            run.echo(line)
    except BaseException:
        run.fleet.shutdown()
        raise


def _start(run: _Run) -> None:
    """Server and workers get their data through the object store; the first artifacts are
    logged while they start; returns once every actor is placed and set up."""
    cfg, fed, plan = run.cfg, run.cfg.federation, run.plan
    run.fleet.new_server()
    run.fleet.setup_workers()
    concurrency = (f"concurrency {plan.concurrency}" if run.policy.clock is None else
                   f"virtual clock: {run.policy.concurrency} clients at once simulated on {plan.concurrency} real slots")
    run.echo(f"starting {len(run.groups)} client actors ({fed.num_clients} clients, up to {plan.clients_per_actor} per "
             f"actor) and 1 server actor; per client actor: {plan.client_num_cpus:g} CPU, {plan.client_num_gpus:g} GPU; "
             f"{concurrency}")
    if run.ckpt is None:
        from rayfed_proto.runtime.evaluations import eval_sample
        from rayfed_proto.tracking import plots

        run.tracker.log_artifact(run.out / "config.yaml")
        run.tracker.log_artifact(run.out / "partition.parquet")
        heatmap = plots.plot_label_distribution(run.partition.label_counts(), run.out / "label_distribution.png",
                                                class_names=run.class_names,
                                                title=f"{cfg.data.name}: {cfg.data.partition.name} partition")
        run.tracker.log_artifact(heatmap, "plots")
        if (sample := eval_sample(fed.eval_clients, fed.num_clients, cfg.seed)) is not None:  # the evaluated clients
            (run.out / "eval_clients.txt").write_text("".join(f"{c}\n" for c in sample))
            run.tracker.log_artifact(run.out / "eval_clients.txt")
        run.run_log.started()
    run.fleet.wait_started(cfg.resources.placement_timeout_s, run.progress)


def _restore(run: _Run) -> None:
    if run.ckpt is not None:
        run.start_version = run.fleet.restore(run.ckpt)


def _make_scheduler(run: _Run, on_eval, on_version):
    """The event loop, wired to MLflow (evaluations), the progress bar, checkpoints and restarts."""
    from rayfed_proto.runtime.evaluations import eval_sample
    from rayfed_proto.runtime.progress import ProgressWatch
    from rayfed_proto.runtime.scheduler import Hooks, Limits, Scheduler

    cfg, fed, fleet, tracker = run.cfg, run.cfg.federation, run.fleet, run.tracker
    if run.progress:
        from tqdm.auto import tqdm

        run.bar = tqdm(total=fed.rounds, initial=run.start_version, desc=f"{cfg.algorithm.name} {fed.mode}",
                       unit="version", dynamic_ncols=True)

    def handle_eval(version: int, metrics: dict[str, Any]) -> None:
        metrics = run.run_log.on_eval(version, dict(metrics))  # logs and drops the per-client results
        metrics = {**metrics, **_reliability_metrics(run.scheduler)}
        run.history.append({"version": version, **metrics})
        tracker.log_metrics(metrics, step=version)
        if run.bar is not None:
            run.bar.set_postfix(_bar_postfix(metrics), refresh=True)
        if on_eval is not None:
            on_eval(version, metrics)

    def handle_version(version: int) -> None:
        if run.bar is not None:
            run.bar.update(max(0, version - run.bar.n))
        if on_version is not None:
            on_version(version)

    def write_checkpoint(version: int, server_snap: dict[str, Any], actor_snaps: list) -> bool:
        """Whether it was written (retried; on failure the previous one stands and the run goes on)."""
        return fleet.save_checkpoint(server_snap, actor_snaps, {"scheduler": run.scheduler.state_dict(),
                                                                "history": list(run.history)}, run.run_id) is not None

    def restart_worker(a: int):
        actor = fleet.restart_worker(a, run.echo)
        tracker.log_metrics(_client_actor_restarts(run.scheduler), step=run.scheduler.version)
        return actor

    limits = Limits(
        rounds=fed.rounds, eval_every=fed.eval_every, real_slots=run.plan.concurrency, checkpoint_every=cfg.checkpoint.every,
        max_client_failures=cfg.reliability.max_client_failures, max_server_failures=cfg.reliability.max_server_failures,
        drain_timeout_s=cfg.reliability.drain_timeout_s, stop_at_version=_stop_at(cfg, run.start_version),
        start_version=run.start_version, evaluate_start=not any(h["version"] == run.start_version for h in run.history),
        eval_clients=eval_sample(fed.eval_clients, fed.num_clients, cfg.seed))
    hooks = Hooks(on_eval=handle_eval, on_version=handle_version, on_checkpoint=write_checkpoint,
                  restart_client_actor=restart_worker, restart_server=lambda: fleet.restart_server(run.echo))
    scheduler = Scheduler(run.policy, fleet.handles["server"], fleet.handles["actors"], run.groups, limits, hooks,
                          ProgressWatch(cfg.reliability.max_consecutive_refusals, cfg.reliability.no_progress_timeout_s),
                          batch_clients=cfg.resources.batch_clients != "off")
    fleet.handles["actors"] = scheduler.actors  # the scheduler replaces dead actors in this list
    if "scheduler" in run.driver_state:
        scheduler.load_state_dict(run.driver_state["scheduler"])
    return scheduler


def _stop_at(cfg: ExperimentConfig, start_version: int) -> Optional[int]:
    """``faults.stop_at_version``, unless a resume already starts at or after it: the stop it
    asked for has happened (the run's config.yaml keeps the key, so a resume would stop again)."""
    stop = cfg.faults.stop_at_version
    return stop if stop is not None and stop > start_version else None


def _bar_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    post = {"acc": f"{metrics[names.EVAL_HEAD_ACC]:.3f}"}
    for key, name in ((names.EVAL_PROTO_ACC, "proto"), (names.EVAL_GLOBAL_ACC, "global")):
        if key in metrics:
            post[name] = f"{metrics[key]:.3f}"
    post["wall"] = f"{metrics[names.FEDERATION_WALL_S]:.0f}s"
    if names.FEDERATION_SIM_TIME_S in metrics:
        post["sim"] = f"{metrics[names.FEDERATION_SIM_TIME_S]:.0f}s"
    return post


def _loop(run: _Run) -> int:
    """Run the scheduler to the last version; a requested stop (signal, fault injection) ends in
    :class:`RunInterrupted` naming where to resume, a run without progress in a FAILED run."""
    from rayfed_proto.runtime.progress import NoProgressError
    from rayfed_proto.runtime.scheduler import StopRequested

    try:
        return run.scheduler.run()
    except StopRequested as stop:
        latest = run.store.latest()
        where = f"checkpoint of version {latest.version} in {latest.path}" if latest else "no checkpoint"
        run.tracker.set_tags({"stopped": stop.reason, "resume_from": str(run.out)})
        msg = f"stopped ({stop.reason}); {where}.\nResume with: rayfed-proto run --resume {run.out}"
        raise RunInterrupted(msg, run.out, stop.version, stop.reason) from None
    except NoProgressError as e:
        _record_failure(run.tracker, run.scheduler, run.history, run.out, str(e))  # the run ends FAILED
        raise


def _finish(run: _Run, final_version: int) -> RunResult:
    """End counters, a last checkpoint, actors' memory, artifacts and the summary."""
    import ray

    from rayfed_proto.runtime import runfolder
    from rayfed_proto.tracking.report import format_summary_table

    cfg, fed, scheduler, tracker = run.cfg, run.cfg.federation, run.scheduler, run.tracker
    startup = _startup_s(scheduler, run.started_unix)
    if cfg.checkpoint.every:  # at the end version, so that the run can be continued with more rounds
        scheduler.recovery.checkpoint()  # before the counters: a failure here is counted too
    tracker.log_metrics(_end_counters(run.history, final_version,
                                      {names.FEDERATION_UPDATES_WITHHELD_AFTER_END: scheduler.stats.withheld,
                                       # at each evaluation they are the counts as of that version (round_metrics)
                                       **_drop_counters(scheduler.stats),
                                       **_reliability_metrics(scheduler)})
                        | ({names.FEDERATION_STARTUP_S: startup} if startup is not None else {}), step=final_version)
    if run.bar is not None:
        run.bar.close()
        run.bar = None
    _log_time_to_target(run, final_version)
    placements = _log_actor_memory(run, final_version)
    bank = ray.get(scheduler.server.guidance_bank.remote())
    models = run.run_log.collect_models(scheduler.server, scheduler.actors, run.groups, scheduler.global_ref,
                                        updates=dict(scheduler.stats.client_updates))
    _release_actors(run)  # done with them: their memory is free before the artifacts, plots and models are written
    _write_final_artifacts(run.out, tracker, run.history, bank, run.class_names, cfg)
    _write_participation(run)
    concurrency = f"concurrency {scheduler.policy.concurrency}" + (" simulated" if scheduler.policy.clock is not None else "")
    summary = format_summary_table(run.history, target_accuracy=cfg.tracking.target_accuracy, extra={
        "algorithm": cfg.algorithm.name, "dataset": f"{cfg.data.name} ({cfg.data.partition.name})",
        "clients": f"{fed.num_clients} ({fed.mode}, {concurrency}, {run.plan.num_actors} client actors)",
        **({"startup (run start to first update)": f"{startup:.1f} s"} if startup is not None else {}),
        **({"checkpoints": _checkpoint_summary(scheduler.stats, run.store)} if cfg.checkpoint.every else {}),
        **({"updates dropped offline": f"{scheduler.stats.updates_dropped_offline} of {scheduler.stats.dispatched} "
                                       "dispatched (client offline before the update finished)"}
           if scheduler.policy.clock is not None else {}),
        **_round_drops_row(scheduler.policy, scheduler.stats),
        "MLflow run": f"{run.run_id} @ {tracker.uri}" if run.run_id else "tracking disabled",
    })
    (run.out / "summary.txt").write_text(summary + "\n")
    tracker.log_artifact(run.out / "summary.txt")
    run.run_log.finish(final_version, summary, models, out=run.out)
    runfolder.mark_finished(run.out, final_version, run.run_id)
    tracker.delete_tags(("stopped", "resume_from", "failure_reason"))  # left by an earlier stop: no longer true
    return RunResult(run.run_id, tracker.uri, run.out, final_version, run.history, run.plan.as_dict(), placements, summary,
                     dict(sorted(scheduler.stats.client_updates.items())))


def _write_participation(run: _Run) -> None:
    """Local updates per client (with its simulated speed and compute time under a virtual
    clock): a CSV and a plot, since who contributes is what system heterogeneity changes."""
    import pandas as pd

    from rayfed_proto.tracking import plots

    n = run.cfg.federation.num_clients
    counts = run.scheduler.stats.client_updates
    frame = pd.DataFrame({"client_id": range(n), "updates": [counts.get(c, 0) for c in range(n)]})
    system = run.scheduler.policy.clock.system if run.scheduler.policy.clock is not None else None
    if system is not None:
        frame["speed"], frame["compute_s"] = system.speeds, system.compute_s
        stats = run.scheduler.stats  # of its dispatched updates (``updates``), those never submitted:
        for column, dropped in (("dropped_offline", stats.client_dropped_offline),  # lost offline
                                ("dropped_deadline", stats.client_dropped_deadline),  # sync: after the deadline
                                ("dropped_over_selection", stats.client_dropped_over_selection)):  # after the first K
            frame[column] = [dropped.get(c, 0) for c in range(n)]
    frame.to_csv(run.out / "client_updates.csv", index=False)
    run.tracker.log_artifact(run.out / "client_updates.csv")
    run.tracker.log_artifact(plots.plot_client_updates(frame, run.out / "client_updates.png"), "plots")


def _log_time_to_target(run: _Run, step: int) -> None:
    """``tracking.target_accuracy``: simulated and wall seconds to the first evaluation that
    reached it, as metrics (comparable across runs in the MLflow UI); nothing when not reached."""
    from rayfed_proto.tracking.report import time_to_target

    target = run.cfg.tracking.target_accuracy
    if target is None:
        return
    out = {}
    for key, time_key in ((names.FEDERATION_TIME_TO_TARGET_SIM_S, names.FEDERATION_SIM_TIME_S),
                          (names.FEDERATION_TIME_TO_TARGET_WALL_S, names.FEDERATION_WALL_S)):
        hit = time_to_target(run.history, target, time_key=time_key)
        if hit is not None:
            out[key] = hit[0]
    if out:
        run.tracker.log_metrics(out, step=step)


def _log_actor_memory(run: _Run, step: int) -> list[dict[str, Any]]:
    placements = _alive_infos(run.scheduler.actors + [run.scheduler.server])  # peak memory at the end
    clients_mem = placements[:-1]
    run.tracker.log_metrics({names.SYSTEM_CLIENT_PEAK_RSS_MIB_MAX: float(np.nanmax([p["peak_rss_mib"] for p in clients_mem])),
                             names.SYSTEM_CLIENT_PSS_MIB_MAX: float(np.nanmax([p["pss_mib"] for p in clients_mem])),
                             names.SYSTEM_CLIENT_PSS_MIB_TOTAL: float(np.nansum([p["pss_mib"] for p in clients_mem])),
                             names.SYSTEM_SERVER_PEAK_RSS_MIB: placements[-1]["peak_rss_mib"]}, step=step)
    run.run_log.actor_memory(placements, step)
    return placements


def _system_model(cfg: ExperimentConfig, partition, num_classes: int, channels: int, image_size: int):
    """The clients' system profiles (virtual clock), or None for wall-clock mode (``system: null``)."""
    if getattr(cfg, "system", None) is None:
        return None
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.algorithms.base import ServerSizes, UpdateSizes
    from rayfed_proto.system import SystemModel

    # the work one local update declares (the run's method, whichever it is), per client
    method, options = ALGORITHMS.get(cfg.algorithm.name), cfg.algorithm_options()
    counts = [np.bincount(partition.labels[s.train_idx], minlength=num_classes) for s in partition.clients]
    work = [method.Client.update_work(options, UpdateSizes(
        train=len(s.train_idx), local_epochs=cfg.training.local_epochs, batch_size=cfg.training.batch_size,
        unlabelled=len(s.unlabelled_idx), public=len(partition.public_idx),
        train_class_counts=tuple(int(n) for n in counts[c]))) for c, s in enumerate(partition.clients)]
    # and the work of one server step, for the updates it aggregates and the clients that have uploaded
    classes = float(np.mean([np.count_nonzero(n) for n in counts])) if counts else 0.0

    def server_work(updates: int, uploaders: int) -> list:
        return method.Server.server_work(options, ServerSizes(updates, num_classes, cfg.model.feature_dim,
                                                              len(partition.public_idx), classes, uploaders))

    return SystemModel.from_config(cfg, [len(s.train_idx) for s in partition.clients], channels, image_size, num_classes,
                                   work=work, server_work=server_work)


def _alive_infos(handles: list) -> list[dict[str, Any]]:
    """Placement and memory of each actor; one that died after the last version reports NaNs."""
    import ray
    from ray.exceptions import RayActorError

    out = []
    for h in handles:
        try:
            out.append(ray.get(h.info.remote()))
        except RayActorError:
            out.append({"dead": True, "peak_rss_mib": float("nan"), "pss_mib": float("nan")})
    return out


def _record_failure(tracker, scheduler, history: list[dict[str, Any]], out: Path, reason: str) -> None:
    """A run that fails: its counters (also the server's refusals, logged otherwise only at
    evaluations) at the version it reached, the reason as a tag, the history so far on disk."""
    import ray

    counters: dict[str, Any] = dict(_reliability_metrics(scheduler))
    try:
        server = ray.get(scheduler.server.stats.remote(), timeout=30)
        counters.update({names.FEDERATION_UPDATES_REFUSED: server["refused"],
                         names.FEDERATION_UPDATES_ACCEPTED: server["accepted"],
                         names.FEDERATION_UPDATES_DROPPED: server["dropped_stale"],
                         names.SERVER_VERSIONS_ROLLED_BACK: server["rolled_back"]})
    except Exception as e:  # the server is gone: the scheduler's own counters still go out
        log.warning("server counters unavailable at failure: %s", e)
    counters[names.FEDERATION_UPDATES_DISPATCHED] = scheduler.stats.dispatched
    counters.update(_drop_counters(scheduler.stats))
    tracker.log_metrics(counters, step=scheduler.version)
    tracker.set_tags({"failure_reason": reason[:5000]})
    if history:
        from rayfed_proto.tracking.report import history_to_frame

        history_to_frame(history).to_parquet(out / "history.parquet")


def _stopped_at_once(store, out: Path, tracker) -> RunInterrupted:
    """A second Ctrl-C abandoned the running updates: say where the run can resume from."""
    try:
        latest = store.latest()
    except Exception:  # a damaged store: the resume will say more
        latest = None
    if latest is not None:
        tracker.set_tags({"stopped": "SIGINT (at once)", "resume_from": str(out)})
        msg = (f"stopped at once (second Ctrl-C); the running updates were abandoned; checkpoint of version "
               f"{latest.version} in {latest.path}.\nResume with: rayfed-proto run --resume {out}")
    else:
        msg = (f"stopped at once (second Ctrl-C) before the first checkpoint: nothing to resume. "
               f"Start again with: rayfed-proto run {out / 'config.yaml'}")
    return RunInterrupted(msg, out, latest.version if latest is not None else 0, "SIGINT")


def _end_counters(history: list[dict[str, Any]], final_version: int, counters: dict[str, Any]) -> dict[str, Any]:
    """The counters to log at the end: those the final version's evaluation did not already log
    with the same value (each step gets one point per metric unless a counter moved since)."""
    last = next((h for h in reversed(history) if h.get("version") == final_version), {})
    return {k: v for k, v in counters.items() if k not in last or last[k] != v}


def _drop_counters(stats) -> dict[str, int]:
    """The scheduler's counts of updates dispatched but never submitted (offline, deadline, over-selection)."""
    return {names.FEDERATION_UPDATES_DROPPED_OFFLINE: getattr(stats, "updates_dropped_offline", 0),
            names.FEDERATION_UPDATES_DROPPED_DEADLINE: getattr(stats, "updates_dropped_deadline", 0),
            names.FEDERATION_UPDATES_DROPPED_OVER_SELECTION: getattr(stats, "updates_dropped_over_selection", 0)}


def _round_drops_row(policy, stats) -> dict[str, str]:
    """The summary's row for sync rounds with a deadline or over-selection (none otherwise): the
    updates the rounds dropped, of those dispatched, by reason (each counted once, offline first:
    those are in the "updates dropped offline" row)."""
    if not getattr(policy, "selective", False):
        return {}
    reasons = []
    if np.isfinite(policy.deadline_s):
        reasons.append(f"{stats.updates_dropped_deadline} after the deadline ({policy.deadline_s:g} s from the round start)")
    if policy.selected > policy.per_round:
        reasons.append(f"{stats.updates_dropped_over_selection} beyond the first {policy.per_round} to finish "
                       f"({policy.selected} selected per round)")
    total = stats.updates_dropped_deadline + stats.updates_dropped_over_selection
    return {"updates dropped by the round": f"{total} of {stats.dispatched} dispatched: " + ", ".join(reasons)}


def _checkpoint_summary(stats, store) -> str:
    """The summary's checkpoint row: how many were written, how many failed, the newest usable."""
    try:
        latest = store.latest()
    except Exception:  # a damaged store: the row still says what the run counted
        latest = None
    newest = f"newest: version {latest.version}" if latest is not None else "none usable"
    failed = (f", {stats.checkpoints_failed} FAILED (each time the previous one stood; see the log)"
              if stats.checkpoints_failed else "")
    return f"{stats.checkpoints} written{failed}; {newest}"


def _startup_s(scheduler, started_unix: float) -> Optional[float]:
    """Seconds from the run's start to the first local update returned (what a user waits before
    training shows): for the first run of a process (``rayfed-proto run``) from the process's
    start (imports, Ray start included), for a later run of the same process (a benchmark, a
    notebook) from its ``run_experiment`` call; None when no update came back."""
    if scheduler.first_update_unix is None:
        return None
    return scheduler.first_update_unix - started_unix


def _reliability_metrics(scheduler) -> dict[str, float]:
    st = scheduler.stats
    return {names.RELIABILITY_CLIENT_FAILURES: st.client_failures,
            names.RELIABILITY_UPDATES_LOST_CLIENT: st.updates_lost_client,
            names.RELIABILITY_SERVER_RESTARTS: st.server_restarts,
            names.RELIABILITY_UPDATES_LOST_SERVER: st.updates_lost_server,
            names.RELIABILITY_VERSIONS_REDONE: st.versions_redone,
            names.RELIABILITY_EVALS_INCOMPLETE: st.evals_incomplete,
            names.RELIABILITY_CLIENTS_EXCLUDED: len(st.excluded),
            names.RELIABILITY_CHECKPOINTS_WRITTEN: st.checkpoints,
            names.FEDERATION_VERSIONS_EMPTY: st.versions_empty,
            names.RELIABILITY_CHECKPOINTS_FAILED: st.checkpoints_failed}


def _client_actor_restarts(scheduler) -> dict[str, float]:
    """Logged when a client actor is restarted (the restarts so far)."""
    return {names.RELIABILITY_CLIENT_ACTOR_RESTARTS: scheduler.stats.client_failures}


def _install_stop_handlers(scheduler) -> Callable[[], None]:
    """SIGINT/SIGTERM: the first asks the scheduler to drain, checkpoint and stop; a second
    SIGINT stops at once (KeyboardInterrupt). Only possible in the main thread (not in a Tune
    trial's thread, where Tune handles stopping)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if scheduler.recovery.stop_reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        scheduler.recovery.request_stop(name)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def _write_final_artifacts(out: Path, tracker, history, bank, class_names, cfg) -> None:
    from rayfed_proto.tracking import plots
    from rayfed_proto.tracking.report import history_to_frame

    frame = history_to_frame(history)  # the metrics' names (those of MLflow) as column names
    frame.to_parquet(out / "history.parquet")
    frame.to_csv(out / "history.csv", index=False)
    tracker.log_artifact(out / "history.parquet")
    tracker.log_artifact(out / "history.csv")
    title = f"{cfg.algorithm.name} on {cfg.data.name} ({cfg.federation.mode})"
    for fn, name in ((plots.plot_accuracy_vs_version, "accuracy_vs_version.png"),
                     (plots.plot_accuracy_vs_wall_time, "accuracy_vs_wall_time.png")):
        tracker.log_artifact(fn(history, out / name, title=title), "plots")
    if any(names.FEDERATION_SIM_TIME_S in h for h in history):  # virtual clock: accuracy against simulated time
        tracker.log_artifact(plots.plot_accuracy_vs_sim_time(history, out / "accuracy_vs_sim_time.png", title=title,
                                                             target=cfg.tracking.target_accuracy), "plots")
    tracker.log_artifact(plots.plot_prototype_margin(history, out / "prototype_margin.png"), "plots")
    if bank is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        np.savez(out / "global_prototypes.npz", class_ids=bank.class_ids, vectors=bank.vectors)
        pq.write_table(pa.table({"class_id": bank.class_ids, "class_name": [class_names[c] for c in bank.class_ids],
                                 "vector": list(bank.vectors)}), out / "global_prototypes.parquet")
        tracker.log_artifact(out / "global_prototypes.npz", "prototypes")
        tracker.log_artifact(out / "global_prototypes.parquet", "prototypes")
        tracker.log_artifact(plots.plot_prototypes_2d(bank.class_ids, bank.vectors, out / "global_prototypes_pca.png",
                                                      class_names=class_names), "plots")

