"""Run one experiment end to end: data -> partition -> actors -> scheduler -> MLflow.

A run is a sequence of named steps on a :class:`~rayfed_proto.runtime.run_state.RunState`:

1. ``_prepare``: everything that can refuse the run does so before Ray starts
   (:mod:`rayfed_proto.runtime.preparation`: the checkpoint to resume, data, partition,
   availability, the output folder); then Ray, the resource plan and the worker processes;
2. ``_track``: the MLflow run, new or resumed;
3. ``_start`` and ``_restore``: the server and the workers placed and given their data, then
   the checkpoint's states when resuming;
4. ``_make_scheduler`` and ``_loop``: the event loop (:mod:`rayfed_proto.runtime.scheduler`),
   wired to MLflow, the progress bar, checkpoints and restarts;
5. ``_finish``: the end counters, artifacts and summary (:mod:`rayfed_proto.tracking.run_end`).

Signals during start-up and during the loop: :mod:`rayfed_proto.runtime.signals`.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rayfed_proto.config import ExperimentConfig
from rayfed_proto.runtime import preparation, runfolder, signals
from rayfed_proto.runtime.evaluations import eval_sample
from rayfed_proto.runtime.outcome import refused_unless_resumable, run_outcome
from rayfed_proto.runtime.policies import make_policy
from rayfed_proto.runtime.preparation import checkpoint_store, ensure_ray  # noqa: F401  (checkpoint_store: seeds.py imports it here)
from rayfed_proto.runtime.progress import NoProgressError, ProgressWatch
from rayfed_proto.runtime.resources import assign_clients
from rayfed_proto.runtime.run_state import RunResult, RunState
from rayfed_proto.runtime.signals import RunInterrupted, StartupSignals, StartupStopped
from rayfed_proto.tracking import make_tracker
from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking import round_metrics as counters

if TYPE_CHECKING:
    from rayfed_proto.runtime.scheduler import Scheduler

log = logging.getLogger("rayfed_proto")
_RUNS_STARTED = 0  # runs started in this process: the first one's startup includes the process's


def run_experiment(cfg: ExperimentConfig, **kwargs: Any) -> RunResult:
    """Run ``cfg``; ``on_eval(version, metrics)`` is called after each evaluation (Tune uses it),
    ``on_version(version)`` as soon as the driver learns of a new version.

    ``resume_dir``: the output folder of an interrupted run; it continues from its latest
    checkpoint with the same partition, version counter, sampling sequence and MLflow run.
    The run folder is locked for as long as this call runs (a second driver is refused).
    """
    global _RUNS_STARTED
    started = preparation.process_start_unix() if _RUNS_STARTED == 0 else time.time()
    _RUNS_STARTED += 1
    with ExitStack() as folder_locks:
        return _run_experiment(cfg, folder_locks=folder_locks, started_unix=started, **kwargs)


def _run_experiment(cfg: ExperimentConfig, *, folder_locks, progress: bool = True, echo: Callable[[str], None] = print,
                    on_eval: Optional[Callable[[int, dict[str, Any]], None]] = None,
                    on_version: Optional[Callable[[int], None]] = None,
                    resume_dir: Optional[str | Path] = None, started_unix: Optional[float] = None) -> RunResult:
    run = RunState(cfg, echo, progress, started_unix=started_unix if started_unix is not None else time.time())
    startup = StartupSignals().install()  # until the scheduler's handlers: a signal is acted on at safe points
    try:
        try:
            _prepare(run, folder_locks, resume_dir, startup)  # data, resources, partition, output folder: refuses before writing
            startup.enter("MLflow run")
            _track(run)  # the MLflow run, new or resumed
        except StartupStopped as stop:  # nothing in MLflow yet: the workers released, a new run's folder removed
            msg, version = signals.stopped_before_tracking(run, stop)
            raise RunInterrupted(msg, run.out, version, stop.signal_name) from None
        return _run_tracked(run, startup, on_eval, on_version)
    finally:
        startup.restore()


def _run_tracked(run: RunState, startup: StartupSignals, on_eval, on_version) -> RunResult:
    """The run once its MLflow run exists: actors, restore, the event loop, the end; the MLflow
    run ends FINISHED, KILLED (a stop) or FAILED (:func:`~rayfed_proto.runtime.outcome.run_outcome`),
    and the actors are released, however it ends."""
    restore_signals = lambda: None  # noqa: E731
    outcome = None
    try:
        with run_outcome(run) as outcome:
            startup.enter("actors starting")
            _start(run)  # server and workers built, placed and given their data
            startup.enter("restore")
            with refused_unless_resumable(run):  # a resume that cannot go on leaves its run as it was
                _restore(run)  # from the checkpoint, when resuming
                startup.enter("first version")
                scheduler = run.scheduler = _make_scheduler(run, on_eval, on_version)  # with the checkpoint's evaluation log
            restore_signals = signals.install_stop_handlers(scheduler)
            startup.check()  # a signal between the last safe point and the scheduler's handlers
            final_version = _loop(run)  # the event loop; a requested stop ends in RunInterrupted
            result = _finish(run, final_version)  # final counters, artifacts, summary
            outcome.status = "FINISHED"
            return result
    finally:
        restore_signals()
        if run.bar is not None:
            run.bar.close()
        try:
            run.tracker.end(outcome.status if outcome is not None else "FAILED")
        finally:  # MLflow unreachable at the end: the actors and the autoscaler request are released all the same
            _release_actors(run)
            run.store.release_cache()  # a remote checkpoint store's staging copy in the temp folder


def _release_actors(run: RunState) -> None:
    """Kill the actors (the scheduler's current handles: restarts replace them), free the placement group; once."""
    if run.scheduler is not None:
        run.fleet.handles["actors"], run.fleet.handles["server"] = run.scheduler.actors, run.scheduler.server
    run.fleet.shutdown()


# ----------------------------------------------------------------------------- the steps of a run


def _prepare(run: RunState, folder_locks: ExitStack, resume_dir, startup: StartupSignals) -> None:
    """Everything that can refuse the run does so before Ray starts or anything is written: the
    checkpoint to resume, the dataset, the partition, the simulated clients' availability, the
    output and checkpoint folders; then, with Ray, the tracking store and the cluster's resources
    (a refusal there removes the fresh, still empty output folder). The run's files are written
    once the worker processes are starting."""
    cfg = run.cfg
    if resume_dir is not None:  # refused (before Ray starts) when there is nothing to resume
        run.out, run.store, run.ckpt, run.partition = preparation.resumed_folder(cfg, resume_dir, folder_locks)
    dataset = preparation.load_data(cfg)  # only the driver ever reads the data (actors take it from the object store)
    if run.partition is None:
        run.partition = preparation.partition_for(cfg, dataset)
    run.shape = (dataset.num_classes, dataset.channels, dataset.image_size)
    run.class_names = list(dataset.class_names)
    system = preparation.system_model(cfg, run.partition, *run.shape)
    preparation.check_availability(cfg, system, run.ckpt.version if run.ckpt is not None else 0)
    if cfg.resources.address is None and cfg.resources.parks_clients(cfg.federation.num_clients) \
            and cfg.resources.parks_on_disk(cfg.federation.num_clients):  # a local Ray: the workers' folder is this node's
        # here: it imports torch, which the other checks need not wait for
        from rayfed_proto.runtime.parking import check_park_dir

        check_park_dir(cfg.resources.park_dir)
    if run.ckpt is None:
        run.out, run.store = preparation.new_output_folder(cfg, folder_locks)
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


def _start_ray_and_workers(run: RunState) -> None:
    """The tracking store, Ray, the resource plan (which can still refuse the run) and the
    worker processes, which start (import torch) while the driver writes the run's files."""
    # here: these import Ray, which the checks before Ray starts need not wait for
    from rayfed_proto.runtime.autoscale import capacity  # plan against the cluster that will exist (autoscaling)
    from rayfed_proto.runtime.fleet import ActorFleet
    from rayfed_proto.runtime.resources import plan_resources

    cfg = run.cfg
    run.tracker = make_tracker(cfg.tracking)
    with signals.ray_keeps_our_handlers():  # a SIGTERM is the start-up's to handle (signals.py), not a sys.exit inside Ray
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


def _hand_out(run: RunState, dataset, system) -> None:
    """The new run's files; the data into the object store; clients grouped onto the workers;
    the federation policy; the checkpoint's driver state and history when resuming."""
    import ray  # here: Ray is started by now (_start_ray_and_workers)

    # here: it imports pandas, which the checks need not wait for
    from rayfed_proto.tracking.run_logging import RunLogging

    cfg, fed = run.cfg, run.cfg.federation
    if run.ckpt is None:
        preparation.write_run_files(run.out, cfg, run.partition, run.echo)
    run.fleet.data_ref = ray.put(dataset)  # once: every actor maps these arrays (zero-copy), none loads them
    run.run_log = RunLogging(cfg, run.tracker, dataset, run.partition)  # datasets, input example, per-client series
    run.groups = assign_clients(fed.num_clients, run.plan.clients_per_actor, num_actors=run.plan.num_actors,
                                work=[float(len(s.train_idx)) for s in run.partition.clients])
    run.policy = make_policy(fed, system, seed=cfg.seed, real_slots=run.plan.concurrency)
    run.fleet.assign(run.groups, run.partition, *run.shape, run.policy.needs)
    run.driver_state = run.ckpt.driver_state() if run.ckpt is not None else {}
    run.history = names.upgrade_history(run.driver_state.get("history", []))  # a checkpoint of 0.1.x: flat keys, renamed once


def _track(run: RunState) -> None:
    """Start the MLflow run (params, tags), or resume the checkpoint's run."""
    cfg, tracker, ckpt = run.cfg, run.tracker, run.ckpt
    driver = runfolder.driver_tags(run.out)  # host, pid, start time: a later start can tell when this driver is gone
    try:
        if ckpt is not None:
            run.run_id = runfolder.resume_tracking(tracker, ckpt, run.out, run.history, run.cfg, driver, run.echo)
        else:
            derived = dict(zip(("derived.num_classes", "derived.channels", "derived.image_size"), run.shape, strict=True))
            params = {**cfg.flat(), **derived, **{f"plan.{k}": v for k, v in run.plan.as_dict().items()}}  # plan: params
            run.run_id = tracker.start(params, tags={"algorithm": cfg.algorithm.name, "dataset": cfg.data.name,
                                                     "mode": cfg.federation.mode, "model_group": cfg.model.group, **driver})
            runfolder.write_run_info(run.out, run.run_id, tracker.uri)  # before any checkpoint: a resume can name the run
        # after the folder pass (write_run_files): runs left RUNNING by gone drivers of this host, in any folder
        for line in runfolder.settle_orphaned_store_runs(tracker.uri, exclude={run.run_id}):
            run.echo(line)
    except BaseException:
        run.fleet.shutdown()
        raise


def _start(run: RunState) -> None:
    """Server and workers get their data through the object store; the first artifacts are
    logged while they start; returns once every actor is placed and set up."""
    cfg, fed, plan = run.cfg, run.cfg.federation, run.plan
    run.fleet.new_server()
    run.fleet.setup_workers()
    run.echo(f"starting {len(run.groups)} client actors ({fed.num_clients} clients, up to {plan.clients_per_actor} per "
             f"actor) and 1 server actor; per client actor: {plan.client_num_cpus:g} CPU, {plan.client_num_gpus:g} GPU; "
             f"{run.policy.start_label(plan.concurrency)}")
    if run.ckpt is None:
        run.run_log.new_run(run.out, eval_sample(fed.eval_clients, fed.num_clients, cfg.seed))
    run.fleet.wait_started(cfg.resources.placement_timeout_s, run.progress)


def _restore(run: RunState) -> None:
    if run.ckpt is not None:
        run.start_version = run.fleet.restore(run.ckpt)


def _make_scheduler(run: RunState, on_eval, on_version) -> Scheduler:
    """The event loop, wired to MLflow (evaluations), the progress bar, checkpoints and restarts."""
    # here: the scheduler imports Ray (see _start_ray_and_workers), run_end pandas (see _hand_out)
    from rayfed_proto.runtime.scheduler import Hooks, Limits, Scheduler
    from rayfed_proto.tracking.run_end import bar_postfix

    cfg, fed, fleet, tracker = run.cfg, run.cfg.federation, run.fleet, run.tracker
    if run.progress:
        from tqdm.auto import tqdm  # here: only a run that shows progress needs it

        run.bar = tqdm(total=fed.rounds, initial=run.start_version, desc=f"{cfg.algorithm.name} {fed.mode}",
                       unit="version", dynamic_ncols=True)

    def handle_eval(version: int, metrics: dict[str, Any]) -> None:
        metrics = run.run_log.on_eval(version, dict(metrics))  # logs and drops the per-client results
        metrics = {**metrics, **counters.reliability_counters(run.scheduler.stats)}
        run.history.append({"version": version, **metrics})
        tracker.log_metrics(metrics, step=version)
        if run.bar is not None:
            run.bar.set_postfix(bar_postfix(metrics), refresh=True)
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
        tracker.log_metrics(counters.client_restart_counters(run.scheduler.stats), step=run.scheduler.version)
        return actor

    limits = Limits.for_run(cfg, run.plan.concurrency, run.start_version, {h["version"] for h in run.history},
                            eval_sample(fed.eval_clients, fed.num_clients, cfg.seed))
    hooks = Hooks(on_eval=handle_eval, on_version=handle_version, on_checkpoint=write_checkpoint,
                  restart_client_actor=restart_worker, restart_server=lambda: fleet.restart_server(run.echo))
    scheduler = Scheduler(run.policy, fleet.handles["server"], fleet.handles["actors"], run.groups, limits,
                          hooks, ProgressWatch(cfg.reliability.max_consecutive_refusals, cfg.reliability.no_progress_timeout_s),
                          batch_clients=cfg.resources.batch_clients != "off")
    fleet.handles["actors"] = scheduler.actors  # the scheduler replaces dead actors in this list
    if "scheduler" in run.driver_state:
        scheduler.load_state_dict(run.driver_state["scheduler"])
    return scheduler


def _loop(run: RunState) -> int:
    """Run the scheduler to the last version; a requested stop (signal, fault injection) ends in
    :class:`RunInterrupted` naming where to resume, a run without progress in a FAILED run."""
    from rayfed_proto.runtime.scheduler import StopRequested  # here: it imports Ray (see _start_ray_and_workers)

    try:
        return run.scheduler.run()
    except StopRequested as stop:
        latest = run.store.latest()
        where = f"checkpoint of version {latest.version} in {latest.path}" if latest else "no checkpoint"
        run.tracker.set_tags({"stopped": stop.reason, "resume_from": str(run.out)})
        msg = f"stopped ({stop.reason}); {where}.\nResume with: rayfed-proto run --resume {run.out}"
        raise RunInterrupted(msg, run.out, stop.version, stop.reason) from None
    except NoProgressError as e:
        _record_failure(run, str(e))  # the run ends FAILED
        raise


def _finish(run: RunState, final_version: int) -> RunResult:
    """End counters, a last checkpoint, actors' memory, artifacts and the summary."""
    import ray  # here: Ray is started by now (_start_ray_and_workers)

    from rayfed_proto.runtime.fleet import actor_infos  # here: it imports Ray (see _start_ray_and_workers)
    from rayfed_proto.tracking import run_end  # here: it imports pandas (see _hand_out)

    cfg, scheduler, tracker = run.cfg, run.scheduler, run.tracker
    startup = scheduler.first_update_unix - run.started_unix if scheduler.first_update_unix is not None else None
    if cfg.checkpoint.every:  # at the end version, so that the run can be continued with more rounds
        scheduler.checkpoint()  # before the counters: a failure here is counted too
    tracker.log_metrics(counters.end_counters(scheduler.stats, run.history, final_version)  # each evaluation: as of its version
                        | ({names.FEDERATION_STARTUP_S: startup} if startup is not None else {}), step=final_version)
    if run.bar is not None:
        run.bar.close()
        run.bar = None
    if target_metrics := run_end.time_to_target_metrics(run.history, cfg.tracking.target_accuracy):
        tracker.log_metrics(target_metrics, step=final_version)
    placements = actor_infos(scheduler.actors + [scheduler.server])  # peak memory at the end
    run.run_log.actor_memory(placements, final_version)
    bank = ray.get(scheduler.server.guidance_bank.remote())
    models = run.run_log.collect_models(scheduler.server, scheduler.actors, run.groups, scheduler.global_ref,
                                        updates=dict(scheduler.stats.client_updates))
    _release_actors(run)  # done with them: their memory is free before the artifacts, plots and models are written
    run_end.write_final_artifacts(run.out, tracker, run.history, bank, run.class_names, cfg)
    policy = scheduler.policy
    run_end.write_participation(run.out, tracker, cfg.federation.num_clients, scheduler.stats,
                                policy.clock.system if policy.clock is not None else None)
    summary = run_end.summary(
        run.history, cfg, startup=startup, policy_rows=policy.summary_rows(scheduler.stats),
        clients=f"{cfg.federation.num_clients} ({cfg.federation.mode}, {policy.concurrency_label()}, "
                f"{run.plan.num_actors} client actors)",
        checkpoints=run_end.checkpoint_summary(scheduler.stats, run.store) if cfg.checkpoint.every else None,
        mlflow_run=f"{run.run_id} @ {tracker.uri}" if run.run_id else "tracking disabled")
    (run.out / "summary.txt").write_text(summary + "\n")
    tracker.log_artifact(run.out / "summary.txt")
    run.run_log.finish(final_version, summary, models, out=run.out)
    runfolder.mark_finished(run.out, final_version, run.run_id)
    tracker.delete_tags(("stopped", "resume_from", "failure_reason"))  # left by an earlier stop: no longer true
    return RunResult(run.run_id, tracker.uri, run.out, final_version, run.history, run.plan.as_dict(), placements, summary,
                     dict(sorted(scheduler.stats.client_updates.items())))


def _record_failure(run: RunState, reason: str) -> None:
    """A run that fails: its counters (also the server's refusals, logged otherwise only at
    evaluations) at the version it reached, the reason as a tag, the history so far on disk."""
    import ray  # here: Ray is started by now (_start_ray_and_workers)

    scheduler = run.scheduler
    try:
        server = ray.get(scheduler.server.stats.remote(), timeout=30)
    except Exception as e:  # the server is gone: the scheduler's own counters still go out
        log.warning("server counters unavailable at failure: %s", e)
        server = None
    run.tracker.log_metrics(counters.failure_counters(scheduler.stats, server), step=scheduler.version)
    run.tracker.set_tags({"failure_reason": reason[:5000]})
    if run.history:
        from rayfed_proto.tracking.report import history_to_frame  # here: it imports pandas (see _hand_out)

        history_to_frame(run.history).to_parquet(run.out / "history.parquet")
