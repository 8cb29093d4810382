"""Run one experiment end to end: data -> partition -> actors -> scheduler -> MLflow.

A run is a sequence of named steps, each taking what it uses and returning what it made
(:mod:`rayfed_proto.runtime.run_state`):

1. ``preparation.resumed_folder`` / ``read_data`` / ``new_output_folder``: everything that can
   refuse the run does so before Ray starts (:mod:`rayfed_proto.runtime.preparation`) ->
   the :class:`RunFolder` and the :class:`RunData`;
2. ``_start_federation``: Ray, the resource plan, the worker processes, the data handed out, the
   policy -> the :class:`Federation`;
3. ``_track``: the MLflow run, new or resumed -> its id;
4. ``_start`` and ``_restore``: the server and the workers placed and given their data, then the
   checkpoint's states when resuming -> the start version;
5. ``_make_scheduler`` and ``_loop``: the event loop (:mod:`rayfed_proto.runtime.scheduler`),
   wired to MLflow, the progress bar, checkpoints and restarts -> the final version;
6. ``_finish``: the end counters, artifacts and summary (:mod:`rayfed_proto.tracking.run_end`)
   -> the :class:`RunResult`.

How a tracked run ends (FINISHED, KILLED, FAILED): :mod:`rayfed_proto.runtime.outcome`; signals
during start-up and during the loop: :mod:`rayfed_proto.runtime.signals`.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rayfed_proto.config import ExperimentConfig
from rayfed_proto.runtime import preparation, runfolder, signals
from rayfed_proto.runtime.evaluations import eval_sample
from rayfed_proto.runtime.outcome import refused_unless_resumable, run_outcome
from rayfed_proto.runtime.policies import make_policy
from rayfed_proto.runtime.preparation import ensure_ray
from rayfed_proto.runtime.progress import NoProgressError, ProgressBar, ProgressWatch
from rayfed_proto.runtime.resources import assign_clients
from rayfed_proto.runtime.run_state import Federation, Listeners, RunData, RunFolder, RunResult
from rayfed_proto.runtime.signals import RunInterrupted, StartupSignals, StartupStopped
from rayfed_proto.tracking import make_tracker
from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking import round_metrics as counters

if TYPE_CHECKING:
    from rayfed_proto.runtime.fleet import ActorFleet
    from rayfed_proto.runtime.scheduler import Scheduler

log = logging.getLogger("rayfed_proto")


def run_experiment(cfg: ExperimentConfig, *, resume_dir: Optional[str | Path] = None, **listeners: Any) -> RunResult:
    """Run ``cfg``; ``on_eval(version, metrics)`` is called after each evaluation (Tune uses it),
    ``on_version(version)`` as soon as the driver learns of a new version; ``echo`` prints the
    run's lines, ``progress`` shows a progress bar (:class:`Listeners`).

    ``resume_dir``: the output folder of an interrupted run; it continues from its latest
    checkpoint with the same partition, version counter, sampling sequence and MLflow run.
    The run folder is locked for as long as this call runs (a second driver is refused).
    """
    started_unix = preparation.run_start_unix()
    listen = Listeners(**listeners)
    startup = StartupSignals().install()  # until the scheduler's handlers: a signal is acted on at safe points
    folder: Optional[RunFolder] = None
    fed: Optional[Federation] = None
    try:
        with ExitStack() as folder_locks:
            try:  # refused before anything is written: the resumed folder, the data, the partition
                partition = None
                if resume_dir is not None:  # refused (before Ray starts) when there is nothing to resume
                    folder, partition = preparation.resumed_folder(cfg, resume_dir, folder_locks)
                data = preparation.read_data(cfg, partition, folder.ckpt.version if folder is not None else 0)
                folder = folder or preparation.new_output_folder(cfg, folder_locks)
                fed = _start_federation(cfg, folder, data, startup, listen.echo)
                startup.enter("MLflow run")
                run_id = _track(cfg, folder, fed, listen.echo)  # the MLflow run, new or resumed
            except StartupStopped as stop:  # nothing in MLflow yet: the workers released, a new run's folder removed
                msg, version = signals.stopped_before_tracking(folder, fed.fleet if fed is not None else None, stop)
                raise RunInterrupted(msg, folder.out if folder is not None else None, version, stop.signal_name) from None
            return _run_tracked(cfg, folder, fed, run_id, startup, listen, started_unix)
    finally:
        startup.restore()


def _run_tracked(cfg: ExperimentConfig, folder: RunFolder, fed: Federation, run_id: Optional[str],
                 startup: StartupSignals, listen: Listeners, started_unix: float) -> RunResult:
    """The run once its MLflow run exists: actors, restore, the event loop, the end; the MLflow
    run ends FINISHED, KILLED (a stop) or FAILED (:func:`~rayfed_proto.runtime.outcome.run_outcome`),
    and the actors are released, however it ends."""
    restore_signals = lambda: None  # noqa: E731
    outcome, scheduler = None, None
    bar = ProgressBar(False, 0, 0, "")
    try:
        with run_outcome(folder, fed.tracker) as outcome:
            startup.enter("actors starting")
            _start(cfg, folder, fed, listen)  # server and workers built, placed and given their data
            startup.enter("restore")
            with refused_unless_resumable(folder):  # a resume that cannot go on leaves its run as it was
                start_version = _restore(folder, fed)  # from the checkpoint, when resuming
                startup.enter("first version")
                bar = ProgressBar(listen.progress, cfg.federation.rounds, start_version,
                                  f"{cfg.algorithm.name} {cfg.federation.mode}")
                scheduler = _make_scheduler(cfg, fed, run_id, start_version, bar, listen)  # with the evaluation log
            restore_signals = signals.install_stop_handlers(scheduler)
            startup.check()  # a signal between the last safe point and the scheduler's handlers
            final_version = _loop(folder, fed, scheduler)  # the event loop; a requested stop ends in RunInterrupted
            result = _finish(cfg, folder, fed, run_id, scheduler, bar, final_version, started_unix)  # counters, artifacts
            outcome.status = "FINISHED"
            return result
    finally:
        restore_signals()
        bar.close()
        try:
            fed.tracker.end(outcome.status if outcome is not None else "FAILED")
        finally:  # MLflow unreachable at the end: the actors and the autoscaler request are released all the same
            _release_actors(fed.fleet, scheduler)
            folder.store.release_cache()  # a remote checkpoint store's staging copy in the temp folder


def _release_actors(fleet: ActorFleet, scheduler: Optional[Scheduler]) -> None:
    """Kill the actors (the scheduler's current handles: restarts replace them), free the placement group; once."""
    if scheduler is not None:
        fleet.handles["actors"], fleet.handles["server"] = scheduler.actors, scheduler.server
    fleet.shutdown()


# ----------------------------------------------------------------------------- the steps of a run


def _start_federation(cfg: ExperimentConfig, folder: RunFolder, data: RunData, startup: StartupSignals,
                      echo) -> Federation:
    """With the run's folder and data: the tracking store, Ray and the cluster's resources (a
    refusal there removes a new run's still empty folder), the worker processes, then the data
    handed out (:func:`_hand_out`). The workers are released if anything here fails."""
    startup.enter("Ray starting")
    try:
        tracker, plan, fleet = _start_ray_and_workers(cfg, folder)
    except BaseException:
        if not folder.resumed:  # refused before its files were written: leave nothing behind
            shutil.rmtree(folder.out, ignore_errors=True)
        raise
    try:
        startup.enter("workers starting")
        return _hand_out(cfg, folder, data, tracker, plan, fleet, echo)
    except BaseException:
        fleet.shutdown()
        raise


def _start_ray_and_workers(cfg: ExperimentConfig, folder: RunFolder):
    """The tracking store, Ray, the resource plan (which can still refuse the run) and the
    worker processes, which start (import torch) while the driver writes the run's files."""
    # here: these import Ray, which the checks before Ray starts need not wait for
    from rayfed_proto.runtime.autoscale import capacity  # plan against the cluster that will exist (autoscaling)
    from rayfed_proto.runtime.fleet import ActorFleet
    from rayfed_proto.runtime.resources import plan_resources

    tracker = make_tracker(cfg.tracking)
    with signals.ray_keeps_our_handlers():  # a SIGTERM is the start-up's to handle (signals.py), not a sys.exit inside Ray
        ensure_ray(cfg)
    cap = capacity(cfg.resources)
    total = cap.totals()
    # per node: each bundle must fit on one node of those the cluster has or will have (refused in seconds if not)
    plan = plan_resources(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0), nodes=cap.planning_nodes)
    fleet = ActorFleet(cfg.to_dict(), plan, cfg.federation, name=f"{uuid.uuid4().hex[:8]}", cluster=total)
    fleet.store, fleet.run_dir = folder.store, folder.out
    try:
        fleet.start_workers()
    except BaseException:
        fleet.shutdown()
        raise
    return tracker, plan, fleet


def _hand_out(cfg: ExperimentConfig, folder: RunFolder, data: RunData, tracker, plan, fleet: ActorFleet,
              echo) -> Federation:
    """The new run's files; the data into the object store; clients grouped onto the workers;
    the federation policy; the checkpoint's driver state and history when resuming."""
    import ray  # here: Ray is started by now (_start_ray_and_workers)

    # here: it imports pandas, which the checks need not wait for
    from rayfed_proto.tracking.run_logging import RunLogging

    fed = cfg.federation
    if not folder.resumed:
        preparation.write_run_files(folder.out, cfg, data.partition, echo)
    fleet.data_ref = ray.put(data.dataset)  # once: every actor maps these arrays (zero-copy), none loads them
    groups = assign_clients(fed.num_clients, plan.clients_per_actor, num_actors=plan.num_actors,
                            work=[float(len(s.train_idx)) for s in data.partition.clients])
    policy = make_policy(fed, data.system, seed=cfg.seed, real_slots=plan.concurrency)
    fleet.assign(groups, data.partition, *data.shape, policy.needs)
    driver_state = folder.ckpt.driver_state() if folder.resumed else {}
    history = names.upgrade_history(driver_state.get("history", []))  # a checkpoint of 0.1.x: flat keys, renamed once
    run_log = RunLogging(cfg, tracker, data.dataset, data.partition, history)  # datasets, input example, client series
    return Federation(tracker, plan, fleet, groups, policy, run_log, data.shape, list(data.dataset.class_names),
                      driver_state.get("scheduler", {}))


def _track(cfg: ExperimentConfig, folder: RunFolder, fed: Federation, echo) -> Optional[str]:
    """Start the MLflow run (params, tags), or resume the checkpoint's run; its id."""
    tracker = fed.tracker
    driver = runfolder.driver_tags(folder.out)  # host, pid, start time: a later start can tell when this driver is gone
    try:
        if folder.resumed:
            run_id = runfolder.resume_tracking(tracker, folder.ckpt, folder.out, fed.history, cfg, driver, echo)
        else:
            derived = dict(zip(("derived.num_classes", "derived.channels", "derived.image_size"), fed.shape, strict=True))
            params = {**cfg.flat(), **derived, **{f"plan.{k}": v for k, v in fed.plan.as_dict().items()}}  # plan: params
            run_id = tracker.start(params, tags={"algorithm": cfg.algorithm.name, "dataset": cfg.data.name,
                                                 "mode": cfg.federation.mode, "model_group": cfg.model.group, **driver})
            runfolder.write_run_info(folder.out, run_id, tracker.uri)  # before any checkpoint: a resume can name the run
        # after the folder pass (write_run_files): runs left RUNNING by gone drivers of this host, in any folder
        for line in runfolder.settle_orphaned_store_runs(tracker.uri, exclude={run_id}):
            echo(line)
    except BaseException:
        fed.fleet.shutdown()
        raise
    return run_id


def _start(cfg: ExperimentConfig, folder: RunFolder, fed: Federation, listen: Listeners) -> None:
    """Server and workers get their data through the object store; the first artifacts are
    logged while they start; returns once every actor is placed and set up."""
    plan = fed.plan
    fed.fleet.new_server()
    fed.fleet.setup_workers()
    listen.echo(f"starting {len(fed.groups)} client actors ({cfg.federation.num_clients} clients, up to {plan.clients_per_actor} "
         f"per actor) and 1 server actor; per client actor: {plan.client_num_cpus:g} CPU, {plan.client_num_gpus:g} GPU; "
         f"{fed.policy.start_label(plan.concurrency)}")
    if not folder.resumed:
        fed.run_log.new_run(folder.out, eval_sample(cfg.federation.eval_clients, cfg.federation.num_clients, cfg.seed))
    fed.fleet.wait_started(cfg.resources.placement_timeout_s, listen.progress)


def _restore(folder: RunFolder, fed: Federation) -> int:
    """The checkpoint's states into the server and workers, when resuming; the version the run starts at."""
    return fed.fleet.restore(folder.ckpt) if folder.resumed else 0


def _make_scheduler(cfg: ExperimentConfig, fed: Federation, run_id: Optional[str], start_version: int,
                    bar: ProgressBar, listen: Listeners) -> Scheduler:
    """The event loop, wired to MLflow (each evaluation recorded by the run's logging, with the
    reliability counters as of it), the progress bar, checkpoints (with the scheduler's state and
    the history) and restarts."""
    # here: the scheduler imports Ray (see _start_ray_and_workers)
    from rayfed_proto.runtime.scheduler import Hooks, Limits, Scheduler

    fleet, tracker, federation = fed.fleet, fed.tracker, cfg.federation
    scheduler: Optional[Scheduler] = None  # the hooks run once it exists

    def evaluated(version: int, metrics: dict[str, Any]) -> None:
        metrics = fed.run_log.record_eval(version, metrics, counters.reliability_counters(scheduler.stats))
        bar.evaluated(metrics)
        if listen.on_eval is not None:
            listen.on_eval(version, metrics)

    def reached(version: int) -> None:
        bar.reached(version)
        if listen.on_version is not None:
            listen.on_version(version)

    def write_checkpoint(version: int, server_snap: dict[str, Any], actor_snaps: list) -> bool:
        """Whether it was written (retried; on failure the previous one stands and the run goes on)."""
        driver_state = {"scheduler": scheduler.state_dict(), "history": list(fed.history)}
        return fleet.save_checkpoint(server_snap, actor_snaps, driver_state, run_id) is not None

    def restart_worker(a: int):
        actor = fleet.restart_worker(a, listen.echo)
        tracker.log_metrics(counters.client_restart_counters(scheduler.stats), step=scheduler.version)
        return actor

    limits = Limits.for_run(cfg, fed.plan.concurrency, start_version, {h["version"] for h in fed.history},
                            eval_sample(federation.eval_clients, federation.num_clients, cfg.seed))
    hooks = Hooks(on_eval=evaluated, on_version=reached, on_checkpoint=write_checkpoint,
                  restart_client_actor=restart_worker, restart_server=lambda: fleet.restart_server(listen.echo))
    scheduler = Scheduler(fed.policy, fleet.handles["server"], fleet.handles["actors"], fed.groups, limits,
                          hooks, ProgressWatch(cfg.reliability.max_consecutive_refusals, cfg.reliability.no_progress_timeout_s),
                          batch_clients=cfg.resources.batch_clients != "off")
    fleet.handles["actors"] = scheduler.actors  # the scheduler replaces dead actors in this list
    if fed.scheduler_state:
        scheduler.load_state_dict(fed.scheduler_state)
    return scheduler


def _loop(folder: RunFolder, fed: Federation, scheduler: Scheduler) -> int:
    """Run the scheduler to the last version; a requested stop (signal, fault injection) ends in
    :class:`RunInterrupted` naming where to resume, a run without progress in a FAILED run."""
    from rayfed_proto.runtime.scheduler import StopRequested  # here: it imports Ray (see _start_ray_and_workers)

    try:
        return scheduler.run()
    except StopRequested as stop:
        latest = folder.store.latest()
        where = f"checkpoint of version {latest.version} in {latest.path}" if latest else "no checkpoint"
        fed.tracker.set_tags({"stopped": stop.reason, "resume_from": str(folder.out)})
        msg = f"stopped ({stop.reason}); {where}.\nResume with: rayfed-proto run --resume {folder.out}"
        raise RunInterrupted(msg, folder.out, stop.version, stop.reason) from None
    except NoProgressError as e:
        _record_failure(scheduler, fed.tracker, fed.history, folder.out, str(e))  # the run ends FAILED
        raise


def _finish(cfg: ExperimentConfig, folder: RunFolder, fed: Federation, run_id: Optional[str], scheduler: Scheduler,
            bar: ProgressBar, final_version: int, started_unix: float) -> RunResult:
    """A last checkpoint and the end counters; what the actors hold (memory, the guidance bank,
    the models), then the actors released; the artifacts and summary (:mod:`rayfed_proto.tracking.
    run_end`); the folder marked finished."""
    import ray  # here: Ray is started by now (_start_ray_and_workers)

    from rayfed_proto.runtime.fleet import actor_infos  # here: it imports Ray (see _start_ray_and_workers)
    from rayfed_proto.tracking import run_end  # here: it imports pandas (see _hand_out)

    tracker, stats, policy, history = fed.tracker, scheduler.stats, scheduler.policy, fed.history
    startup_s = scheduler.first_update_unix - started_unix if scheduler.first_update_unix is not None else None
    if cfg.checkpoint.every:  # at the end version, so that the run can be continued with more rounds
        scheduler.checkpoint()  # before the counters: a failure here is counted too
    run_end.log_end_counters(tracker, stats, history, final_version, startup_s, cfg.tracking.target_accuracy)
    bar.close()
    placements = actor_infos(scheduler.actors + [scheduler.server])  # peak memory at the end
    fed.run_log.actor_memory(placements, final_version)
    bank = ray.get(scheduler.server.guidance_bank.remote())
    models = fed.run_log.collect_models(scheduler.server, scheduler.actors, fed.groups, scheduler.global_ref,
                                        updates=dict(stats.client_updates))
    _release_actors(fed.fleet, scheduler)  # done with them: their memory is free before the artifacts are written
    summary = run_end.summary(
        history, cfg, startup=startup_s, policy_rows=policy.summary_rows(stats),
        clients=f"{cfg.federation.num_clients} ({cfg.federation.mode}, {policy.concurrency_label()}, "
                f"{fed.plan.num_actors} client actors)",
        checkpoints=run_end.checkpoint_summary(stats, folder.store) if cfg.checkpoint.every else None,
        mlflow_run=f"{run_id} @ {tracker.uri}" if run_id else "tracking disabled")
    run_end.write_end(folder.out, tracker, history, cfg, bank=bank, class_names=fed.class_names, stats=stats,
                      system=policy.clock.system if policy.clock is not None else None, summary_text=summary)
    fed.run_log.finish(final_version, summary, models, out=folder.out)
    runfolder.mark_finished(folder.out, final_version, run_id)
    tracker.delete_tags(("stopped", "resume_from", "failure_reason"))  # left by an earlier stop: no longer true
    return RunResult(run_id, tracker.uri, folder.out, final_version, history, fed.plan.as_dict(), placements, summary,
                     dict(sorted(stats.client_updates.items())))


def _record_failure(scheduler, tracker, history: list[dict[str, Any]], out: Path, reason: str) -> None:
    """A run that fails: its counters (also the server's refusals, logged otherwise only at
    evaluations) at the version it reached, the reason as a tag, the history so far on disk."""
    import ray  # here: Ray is started by now (_start_ray_and_workers)

    try:
        server = ray.get(scheduler.server.stats.remote(), timeout=30)
    except Exception as e:  # the server is gone: the scheduler's own counters still go out
        log.warning("server counters unavailable at failure: %s", e)
        server = None
    tracker.log_metrics(counters.failure_counters(scheduler.stats, server), step=scheduler.version)
    tracker.set_tags({"failure_reason": reason[:5000]})
    if history:
        from rayfed_proto.tracking.report import history_to_frame  # here: it imports pandas (see _hand_out)

        history_to_frame(history).to_parquet(out / "history.parquet")
