"""Run one experiment end to end: data -> partition -> actors -> scheduler -> MLflow.

Everything that can be checked without Ray (config, dataset presence, partition feasibility,
output folder) is checked before Ray starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayfed_proto.config import ExperimentConfig, InputError, clients_per_round
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.tracking import make_tracker

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


def _output_dir(cfg: ExperimentConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    out = Path(cfg.tracking.output_dir).resolve() / f"{stamp}-{cfg.algorithm.name}-{cfg.data.name}"
    try:
        out.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        raise PermissionError(f"cannot create the output folder {out} ({e}); set tracking.output_dir to a writable folder") from None
    return out


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


def run_experiment(
    cfg: ExperimentConfig,
    *,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    on_eval: Optional[Callable[[int, dict[str, Any]], None]] = None,
    on_version: Optional[Callable[[int], None]] = None,
    resume_dir: Optional[str | Path] = None,
) -> RunResult:
    """Run ``cfg``; ``on_eval(version, metrics)`` is called after each evaluation (Tune uses it),
    ``on_version(version)`` as soon as the driver learns of a new version.

    ``resume_dir``: the output folder of an interrupted run; it continues from its latest
    checkpoint with the same partition, version counter, sampling sequence and MLflow run.
    """
    from rayfed_proto.data import Partition

    ckpt = None
    if resume_dir is not None:
        out = Path(resume_dir).resolve()
        store = checkpoint_store(cfg, out)
        ckpt = store.latest()
        if ckpt is None:
            raise InputError(f"no complete checkpoint under {store.dir}; nothing to resume (start the run afresh)")
        partition = Partition.load_parquet(out / "partition.parquet")
        dataset = load_dataset(cfg.data, cfg.seed)
    else:
        try:
            dataset = load_dataset(cfg.data, cfg.seed)
            partition = make_partition(dataset, cfg.data.partition, cfg.federation.num_clients, cfg.seed, cfg.data.test_fraction,
                                       global_test_fraction=cfg.data.global_test_fraction, public_size=cfg.data.public_size,
                                       long_tail_ratio=cfg.data.long_tail_ratio)
        except (ValueError, KeyError) as e:  # infeasible data for this config: the user's to fix
            raise InputError(str(e)) from e
    # Everything that can refuse the run does so before anything is written: the tracking store,
    # the cluster's resources (GPUs requested that the cluster lacks), then the output folders.
    tracker = make_tracker(cfg.tracking)
    import ray

    from rayfed_proto.runtime.resources import assign_clients, plan_resources

    ensure_ray(cfg)
    total = ray.cluster_resources()
    plan = plan_resources(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0))
    if ckpt is None:
        out = _output_dir(cfg)  # only once the data is known to be usable: a refused run leaves nothing
        store = checkpoint_store(cfg, out)
        try:
            store.check_writable()
        except PermissionError:
            out.rmdir()
            raise
        (out / "config.yaml").write_text(cfg.to_yaml())
        partition.save_parquet(out / "partition.parquet")
    partition_path = out / "partition.parquet"
    label_counts = partition.label_counts()
    num_classes, channels, image_size = dataset.num_classes, dataset.channels, dataset.image_size
    class_names = list(dataset.class_names)
    from rayfed_proto.tracking.run_logging import RunLogging

    run_log = RunLogging(cfg, tracker, dataset, partition)  # datasets, input example, per-client series
    del dataset  # client actors load their own shards

    driver_state: dict[str, Any] = ckpt.driver_state() if ckpt is not None else {}
    if ckpt is not None:
        run_id = tracker.resume(ckpt.manifest["run_id"]) if ckpt.manifest.get("run_id") else tracker.start(cfg.flat())
        echo(f"resuming from {ckpt.path} (version {ckpt.version})")
    else:
        params = cfg.flat()
        params.update({"derived.num_classes": num_classes, "derived.channels": channels, "derived.image_size": image_size,
                       **{f"plan.{k}": v for k, v in plan.as_dict().items()}})  # resource plan: params, not metrics
        run_id = tracker.start(params, tags={"algorithm": cfg.algorithm.name, "dataset": cfg.data.name,
                                             "mode": cfg.federation.mode, "model_group": cfg.model.group})
    history: list[dict[str, Any]] = list(driver_state.get("history", []))
    status = "FAILED"
    handles: dict[str, Any] = {"actors": [], "server": None}
    scheduler = None
    restore_signals = lambda: None  # noqa: E731
    try:
        if ckpt is None:
            tracker.log_artifact(out / "config.yaml")
            tracker.log_artifact(partition_path)
            from rayfed_proto.tracking import plots

            heatmap = plots.plot_label_distribution(label_counts, out / "label_distribution.png", class_names=class_names,
                                                    title=f"{cfg.data.name}: {cfg.data.partition.name} partition")
            tracker.log_artifact(heatmap, "plots")
            run_log.started()

        from rayfed_proto.runtime.actors import ClientActor, ServerActor
        from rayfed_proto.runtime.scheduler import Scheduler, StopRequested

        cfg_dict = cfg.to_dict()
        fed = cfg.federation
        groups = assign_clients(fed.num_clients, plan.clients_per_actor)
        splits = partition.clients
        generation = {"server": 0, **{a: 0 for a in range(len(groups))}}

        def new_server():
            return ServerActor.options(num_cpus=plan.server_num_cpus, num_gpus=plan.server_num_gpus,
                                       name=f"rayfed:{out.name}:server:{generation['server']}").remote(
                cfg_dict, num_classes, channels, image_size, fed.buffer_size if fed.mode == "async" else None,
                max(1, plan.torch_threads), partition.global_test_idx, partition.public_idx)

        def new_client_actor(a: int):
            return ClientActor.options(num_cpus=plan.client_num_cpus, num_gpus=plan.client_num_gpus,
                                       name=f"rayfed:{out.name}:client:{a}:{generation[a]}").remote(
                cfg_dict, [splits[c] for c in groups[a]], plan.torch_threads, partition.public_idx)

        handles["server"] = new_server()
        handles["actors"] = [new_client_actor(a) for a in range(len(groups))]
        echo(f"starting {len(groups)} client actors ({fed.num_clients} clients) and 1 server actor; "
             f"per client actor: {plan.client_num_cpus:g} CPU, {plan.client_num_gpus:g} GPU; concurrency {plan.concurrency}")
        _wait_until_placed(handles["actors"], handles["server"], plan, total, cfg.resources.placement_timeout_s, progress)
        start_version = 0
        if ckpt is not None:
            start_version = ray.get(handles["server"].restore.remote(ckpt.server_state()))
            rngs = ckpt.actor_rng()
            saved = {c: ckpt.client_state(c) for c in range(fed.num_clients)}
            ray.get([actor.restore.remote({c: saved[c] for c in groups[a] if saved[c] is not None}, rngs.get(a))
                     for a, actor in enumerate(handles["actors"])])

        def restart_client_actor(a: int):
            generation[a] += 1
            actor = new_client_actor(a)
            latest = store.latest()
            states = {c: latest.client_state(c) for c in groups[a]} if latest is not None else {}
            states = {c: st for c, st in states.items() if st is not None}
            ray.get(actor.restore.remote(states))
            echo(f"client actor {a} recreated " + (f"from the checkpoint of version {latest.version}" if states
                                                   else "re-initialised (no checkpoint yet)"))
            tracker.log_metrics({"client_actor_restarts": scheduler.stats.client_failures}, step=scheduler.version)
            return actor

        def restart_server():
            generation["server"] += 1
            server = new_server()
            latest = store.latest()
            if latest is not None:
                version = ray.get(server.restore.remote(latest.server_state()))
            else:
                ray.get(server.info.remote())  # started; a fresh server is at version 0
                version = 0
            echo(f"server actor recreated at version {version} " + ("(from checkpoint)" if latest is not None else "(from scratch: no checkpoint yet)"))
            handles["server"] = server
            return server, version

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=fed.rounds, initial=start_version, desc=f"{cfg.algorithm.name} {fed.mode}", unit="version",
                       dynamic_ncols=True)

        def handle_eval(version: int, metrics: dict[str, Any]) -> None:
            metrics = run_log.on_eval(version, dict(metrics))  # logs and drops the per-client results
            metrics = {**metrics, **_reliability_metrics(scheduler)}
            history.append({"version": version, **metrics})
            tracker.log_metrics(metrics, step=version)
            if bar is not None:
                post = {"acc": f"{metrics['head_acc']:.3f}"}
                if "proto_acc" in metrics:
                    post["proto"] = f"{metrics['proto_acc']:.3f}"
                if "global_acc" in metrics:
                    post["global"] = f"{metrics['global_acc']:.3f}"
                post["wall"] = f"{metrics['wall_s']:.0f}s"
                bar.set_postfix(post, refresh=True)
            if on_eval is not None:
                on_eval(version, metrics)

        def handle_version(version: int) -> None:
            if bar is not None:
                bar.update(max(0, version - bar.n))
            if on_version is not None:
                on_version(version)

        def write_checkpoint(version: int, server_snap: dict[str, Any], actor_snaps: list) -> None:
            clients = ((c, st) for states, _ in actor_snaps for c, st in states.items())
            path = store.save(server_snap["core"]["version"], server=server_snap, clients=clients,
                              actor_rng={a: rng for a, (_, rng) in enumerate(actor_snaps)},
                              driver={"scheduler": scheduler.state_dict(), "history": list(history)}, run_id=run_id)
            log.info("checkpoint written: %s", path)

        scheduler = Scheduler(
            mode=fed.mode, buffer_size=fed.buffer_size, num_clients=fed.num_clients, rounds=fed.rounds, concurrency=plan.concurrency,
            clients_per_round=clients_per_round(cfg), eval_every=fed.eval_every, seed=cfg.seed,
            server=handles["server"], actors=handles["actors"], actor_clients=groups, on_eval=handle_eval,
            on_version=handle_version, checkpoint_every=cfg.checkpoint.every, on_checkpoint=write_checkpoint,
            restart_client_actor=restart_client_actor, restart_server=restart_server,
            max_client_failures=cfg.reliability.max_client_failures, max_server_failures=cfg.reliability.max_server_failures,
            drain_timeout_s=cfg.reliability.drain_timeout_s, stop_at_version=cfg.faults.stop_at_version,
            start_version=start_version, evaluate_start=not any(h["version"] == start_version for h in history))
        handles["actors"] = scheduler.actors  # the scheduler replaces dead actors in this list
        if "scheduler" in driver_state:
            scheduler.load_state_dict(driver_state["scheduler"])
        restore_signals = _install_stop_handlers(scheduler)
        try:
            final_version = scheduler.run()
        except StopRequested as stop:
            if bar is not None:
                bar.close()
            status = "KILLED"
            latest = store.latest()
            where = f"checkpoint of version {latest.version} in {latest.path}" if latest else "no checkpoint"
            tracker.set_tags({"stopped": stop.reason, "resume_from": str(out)})
            msg = (f"stopped ({stop.reason}); {where}.\nResume with: rayfed-proto run --resume {out}")
            raise RunInterrupted(msg, out, stop.version, stop.reason) from None
        tracker.log_metrics({"updates_withheld_after_end": scheduler.stats.withheld, **_reliability_metrics(scheduler)},
                            step=final_version)
        if bar is not None:
            bar.close()

        placements = _alive_infos(scheduler.actors + [scheduler.server])  # peak memory at the end
        clients_mem = placements[:-1]
        tracker.log_metrics({"peak_rss_mib_client_actor_max": float(np.nanmax([p["peak_rss_mib"] for p in clients_mem])),
                             "pss_mib_client_actor_max": float(np.nanmax([p["pss_mib"] for p in clients_mem])),
                             "pss_mib_client_actors_total": float(np.nansum([p["pss_mib"] for p in clients_mem])),
                             "peak_rss_mib_server": placements[-1]["peak_rss_mib"]}, step=final_version)
        run_log.actor_memory(placements, final_version)
        bank = ray.get(scheduler.server.guidance_bank.remote())
        _write_final_artifacts(out, tracker, history, bank, class_names, cfg)
        from rayfed_proto.tracking.report import format_summary_table

        summary = format_summary_table(history, extra={
            "algorithm": cfg.algorithm.name, "dataset": f"{cfg.data.name} ({cfg.data.partition.name})",
            "clients": f"{fed.num_clients} ({fed.mode}, concurrency {plan.concurrency})",
            "MLflow run": f"{run_id} @ {tracker.uri}" if run_id else "tracking disabled",
        })
        (out / "summary.txt").write_text(summary + "\n")
        tracker.log_artifact(out / "summary.txt")
        run_log.finish(final_version, summary, scheduler.server, scheduler.actors, groups, scheduler.global_ref)
        status = "FINISHED"
        return RunResult(run_id, tracker.uri, out, final_version, history, plan.as_dict(), placements, summary)
    except RunInterrupted:
        raise
    except (KeyboardInterrupt, SystemExit):  # SystemExit: a Tune trial told to stop, a stop and not a failure
        status = "KILLED"
        raise
    finally:
        restore_signals()
        tracker.end(status)
        if scheduler is not None:
            handles["actors"], handles["server"] = scheduler.actors, scheduler.server
        _shutdown_actors(list(handles["actors"]) + ([handles["server"]] if handles["server"] is not None else []))


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


def _reliability_metrics(scheduler) -> dict[str, float]:
    st = scheduler.stats
    return {"client_failures": st.client_failures, "updates_lost_client": st.updates_lost_client,
            "server_restarts": st.server_restarts, "updates_lost_server": st.updates_lost_server,
            "versions_redone": st.versions_redone, "evals_incomplete": st.evals_incomplete,
            "clients_excluded": len(st.excluded), "checkpoints_written": st.checkpoints}


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
        if scheduler.stop_reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        scheduler.request_stop(name)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def _wait_until_placed(actors: list, server, plan, cluster: dict, timeout: float, progress: bool) -> None:
    """Block until every actor has started; a request the cluster cannot place fails loudly."""
    import ray

    refs = [a.info.remote() for a in actors] + [server.info.remote()]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(refs), desc="starting actors", unit="actor", dynamic_ncols=True, leave=False)
    deadline = time.monotonic() + timeout
    pending = refs
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise InputError(
                    f"{len(pending)} of {len(refs)} actors were not placed within {timeout:.0f} s. Each client actor asks "
                    f"{plan.client_num_cpus:g} CPU and {plan.client_num_gpus:g} GPU, the server {plan.server_num_cpus:g} CPU "
                    f"and {plan.server_num_gpus:g} GPU; the cluster has {cluster.get('CPU', 0):g} CPU and "
                    f"{cluster.get('GPU', 0):g} GPU (other jobs may hold some). Lower resources.client_num_gpus / "
                    f"client_num_cpus, raise resources.clients_per_actor, or raise resources.placement_timeout_s.")
            ray.get(ready)  # re-raises an actor's constructor error
            if bar is not None:
                bar.update(len(ready))
    finally:
        if bar is not None:
            bar.close()


def _shutdown_actors(handles: list) -> None:
    if not handles:
        return
    import ray

    try:
        ray.get(handles[-1].stop.remote(), timeout=5)  # the server's training thread (last handle)
    except Exception:  # already dead or not a server: killing it below is enough
        pass
    for h in handles:
        try:
            ray.kill(h)
        except Exception:  # already dead: nothing to release
            pass


def _write_final_artifacts(out: Path, tracker, history, bank, class_names, cfg) -> None:
    from rayfed_proto.tracking import plots
    from rayfed_proto.tracking.metric_names import namespaced
    from rayfed_proto.tracking.report import history_to_frame

    frame = history_to_frame([namespaced(h) for h in history])  # the column names of the MLflow metrics
    frame.to_parquet(out / "history.parquet")
    frame.to_csv(out / "history.csv", index=False)
    tracker.log_artifact(out / "history.parquet")
    tracker.log_artifact(out / "history.csv")
    title = f"{cfg.algorithm.name} on {cfg.data.name} ({cfg.federation.mode})"
    for fn, name in ((plots.plot_accuracy_vs_version, "accuracy_vs_version.png"),
                     (plots.plot_accuracy_vs_wall_time, "accuracy_vs_wall_time.png")):
        tracker.log_artifact(fn(history, out / name, title=title), "plots")
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

