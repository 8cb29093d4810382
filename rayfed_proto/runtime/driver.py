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


def run_experiment(
    cfg: ExperimentConfig,
    *,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    on_eval: Optional[Callable[[int, dict[str, Any]], None]] = None,
) -> RunResult:
    """Run ``cfg``; ``on_eval(version, metrics)`` is called after each evaluation (Tune uses it)."""
    try:
        dataset = load_dataset(cfg.data, cfg.seed)
        partition = make_partition(dataset, cfg.data.partition, cfg.federation.num_clients, cfg.seed, cfg.data.test_fraction)
    except (ValueError, KeyError) as e:  # infeasible data for this config: the user's to fix
        raise InputError(str(e)) from e
    out = _output_dir(cfg)  # only once the data is known to be usable: a refused run leaves nothing
    (out / "config.yaml").write_text(cfg.to_yaml())
    partition_path = out / "partition.parquet"
    partition.save_parquet(partition_path)
    label_counts = partition.label_counts()
    num_classes, channels, image_size = dataset.num_classes, dataset.channels, dataset.image_size
    class_names = list(dataset.class_names)
    del dataset  # client actors load their own shards

    tracker = make_tracker(cfg.tracking)
    params = cfg.flat()
    params.update({"derived.num_classes": num_classes, "derived.channels": channels, "derived.image_size": image_size})
    run_id = tracker.start(params, tags={"algorithm": cfg.algorithm.name, "dataset": cfg.data.name,
                                         "mode": cfg.federation.mode, "model_group": cfg.model.group})
    history: list[dict[str, Any]] = []
    status = "FAILED"
    actors: list = []
    server = None
    try:
        tracker.log_artifact(out / "config.yaml")
        tracker.log_artifact(partition_path)
        from rayfed_proto.tracking import plots

        heatmap = plots.plot_label_distribution(label_counts, out / "label_distribution.png", class_names=class_names,
                                                title=f"{cfg.data.name}: {cfg.data.partition.name} partition")
        tracker.log_artifact(heatmap, "plots")

        import ray

        from rayfed_proto.runtime.actors import ClientActor, ServerActor
        from rayfed_proto.runtime.resources import assign_clients, plan_resources
        from rayfed_proto.runtime.scheduler import Scheduler

        ensure_ray(cfg)
        total = ray.cluster_resources()
        plan = plan_resources(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0))
        tracker.log_metrics({f"resources.{k}": v for k, v in plan.as_dict().items()}, step=0)
        cfg_dict = cfg.to_dict()
        fed = cfg.federation
        server = ServerActor.options(num_cpus=plan.server_num_cpus, num_gpus=plan.server_num_gpus).remote(
            cfg_dict, num_classes, channels, image_size, fed.buffer_size if fed.mode == "async" else None,
            max(1, plan.torch_threads))
        groups = assign_clients(fed.num_clients, plan.clients_per_actor)
        splits = partition.clients
        actors = [ClientActor.options(num_cpus=plan.client_num_cpus, num_gpus=plan.client_num_gpus).remote(
            cfg_dict, [splits[c] for c in group], plan.torch_threads) for group in groups]
        echo(f"starting {len(actors)} client actors ({fed.num_clients} clients) and 1 server actor; "
             f"per client actor: {plan.client_num_cpus:g} CPU, {plan.client_num_gpus:g} GPU; concurrency {plan.concurrency}")
        _wait_until_placed(actors, server, plan, total, cfg.resources.placement_timeout_s, progress)

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=fed.rounds, desc=f"{cfg.algorithm.name} {fed.mode}", unit="version", dynamic_ncols=True)

        def handle_eval(version: int, metrics: dict[str, Any]) -> None:
            history.append({"version": version, **metrics})
            tracker.log_metrics(metrics, step=version)
            if bar is not None:
                post = {"acc": f"{metrics['head_acc']:.3f}"}
                if "proto_acc" in metrics:
                    post["proto"] = f"{metrics['proto_acc']:.3f}"
                post["wall"] = f"{metrics['wall_s']:.0f}s"
                bar.set_postfix(post, refresh=True)
            if on_eval is not None:
                on_eval(version, metrics)

        def handle_version(version: int) -> None:
            if bar is not None:
                bar.update(version - bar.n)

        scheduler = Scheduler(
            mode=fed.mode, buffer_size=fed.buffer_size, num_clients=fed.num_clients, rounds=fed.rounds, concurrency=plan.concurrency,
            clients_per_round=clients_per_round(cfg), eval_every=fed.eval_every, seed=cfg.seed,
            server=server, actors=actors, actor_clients=groups, on_eval=handle_eval, on_version=handle_version)
        final_version = scheduler.run()
        tracker.log_metrics({"updates_withheld_after_end": scheduler.stats.withheld}, step=final_version)
        if bar is not None:
            bar.close()

        placements = ray.get([a.info.remote() for a in actors] + [server.info.remote()])  # peak memory at the end
        tracker.log_metrics({"peak_rss_mib_client_actor_max": max(p["peak_rss_mib"] for p in placements[:-1]),
                             "pss_mib_client_actor_max": max(p["pss_mib"] for p in placements[:-1]),
                             "pss_mib_client_actors_total": sum(p["pss_mib"] for p in placements[:-1]),
                             "peak_rss_mib_server": placements[-1]["peak_rss_mib"]}, step=final_version)
        bank = ray.get(server.guidance_bank.remote())
        _write_final_artifacts(out, tracker, history, bank, class_names, cfg)
        from rayfed_proto.tracking.report import format_summary_table

        summary = format_summary_table(history, extra={
            "algorithm": cfg.algorithm.name, "dataset": f"{cfg.data.name} ({cfg.data.partition.name})",
            "clients": f"{fed.num_clients} ({fed.mode}, concurrency {plan.concurrency})",
            "MLflow run": f"{run_id} @ {tracker.uri}" if run_id else "tracking disabled",
        })
        (out / "summary.txt").write_text(summary + "\n")
        tracker.log_artifact(out / "summary.txt")
        status = "FINISHED"
        return RunResult(run_id, tracker.uri, out, final_version, history, plan.as_dict(), placements, summary)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.end(status)
        _shutdown_actors(actors + ([server] if server is not None else []))


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
    from rayfed_proto.tracking.report import history_to_frame

    frame = history_to_frame(history)
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

