"""The end of a run as the user reads it: the summary table's rows, the final artifacts (history,
plots, prototypes), who took part, time to target, and the progress bar's figures. No Ray here:
the driver hands over plain data (the history, the scheduler's counters, the policy's rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking import plots, round_metrics
from rayfed_proto.tracking.report import format_summary_table, history_to_frame, time_to_target


def bar_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """The progress bar's figures of an evaluation: accuracies, wall and simulated seconds."""
    post = {"acc": f"{metrics[names.EVAL_HEAD_ACC]:.3f}"}
    for key, name in ((names.EVAL_PROTO_ACC, "proto"), (names.EVAL_GLOBAL_ACC, "global")):
        if key in metrics:
            post[name] = f"{metrics[key]:.3f}"
    post["wall"] = f"{metrics[names.FEDERATION_WALL_S]:.0f}s"
    if names.FEDERATION_SIM_TIME_S in metrics:
        post["sim"] = f"{metrics[names.FEDERATION_SIM_TIME_S]:.0f}s"
    return post


def summary(history: list[dict[str, Any]], cfg, *, clients: str, startup: Optional[float], checkpoints: Optional[str],
            policy_rows: dict[str, str], mlflow_run: str) -> str:
    """The run's summary table (summary.txt, the console, MLflow): the history's figures and the
    run's own rows (``clients``: the federation in words; ``policy_rows``: the policy's counters)."""
    return format_summary_table(history, target_accuracy=cfg.tracking.target_accuracy, extra={
        "algorithm": cfg.algorithm.name, "dataset": f"{cfg.data.name} ({cfg.data.partition.name})",
        "clients": clients,
        **({"startup (run start to first update)": f"{startup:.1f} s"} if startup is not None else {}),
        **({"checkpoints": checkpoints} if checkpoints is not None else {}),
        **policy_rows,
        "MLflow run": mlflow_run,
    })


def checkpoint_summary(stats, store) -> str:
    """The summary's checkpoint row: how many were written, how many failed, the newest usable."""
    try:
        latest = store.latest()
    except Exception:  # a damaged store: the row still says what the run counted
        latest = None
    newest = f"newest: version {latest.version}" if latest is not None else "none usable"
    failed = (f", {stats.checkpoints_failed} FAILED (each time the previous one stood; see the log)"
              if stats.checkpoints_failed else "")
    return f"{stats.checkpoints} written{failed}; {newest}"


def write_participation(out: Path, tracker, num_clients: int, stats, system) -> None:
    """Local updates per client (with its simulated speed and compute time under a virtual
    clock, ``system``): a CSV and a plot, since who contributes is what system heterogeneity changes."""
    counts = stats.client_updates
    frame = pd.DataFrame({"client_id": range(num_clients), "updates": [counts.get(c, 0) for c in range(num_clients)]})
    if system is not None:
        frame["speed"], frame["compute_s"] = system.speeds, system.compute_s
        # of its dispatched updates (``updates``), those never submitted:
        for column, dropped in (("dropped_offline", stats.client_dropped_offline),  # lost offline
                                ("dropped_deadline", stats.client_dropped_deadline),  # sync: after the deadline
                                ("dropped_over_selection", stats.client_dropped_over_selection)):  # after the first K
            frame[column] = [dropped.get(c, 0) for c in range(num_clients)]
    frame.to_csv(out / "client_updates.csv", index=False)
    tracker.log_artifact(out / "client_updates.csv")
    tracker.log_artifact(plots.plot_client_updates(frame, out / "client_updates.png"), "plots")


def time_to_target_metrics(history: list[dict[str, Any]], target: Optional[float]) -> dict[str, float]:
    """``tracking.target_accuracy``: simulated and wall seconds to the first evaluation that
    reached it, as metrics (comparable across runs in the MLflow UI); none when not reached."""
    if target is None:
        return {}
    out = {}
    for key, time_key in ((names.FEDERATION_TIME_TO_TARGET_SIM_S, names.FEDERATION_SIM_TIME_S),
                          (names.FEDERATION_TIME_TO_TARGET_WALL_S, names.FEDERATION_WALL_S)):
        hit = time_to_target(history, target, time_key=time_key)
        if hit is not None:
            out[key] = hit[0]
    return out


def actor_memory_metrics(placements: list[dict[str, Any]]) -> dict[str, float]:
    """Peak and proportional memory of the client actors (all but the last placement) and the server's."""
    clients = placements[:-1]
    return {names.SYSTEM_CLIENT_PEAK_RSS_MIB_MAX: float(np.nanmax([p["peak_rss_mib"] for p in clients])),
            names.SYSTEM_CLIENT_PSS_MIB_MAX: float(np.nanmax([p["pss_mib"] for p in clients])),
            names.SYSTEM_CLIENT_PSS_MIB_TOTAL: float(np.nansum([p["pss_mib"] for p in clients])),
            names.SYSTEM_SERVER_PEAK_RSS_MIB: placements[-1]["peak_rss_mib"]}


def log_end_counters(tracker, stats, history: list[dict[str, Any]], final_version: int, startup_s: Optional[float],
                     target: Optional[float]) -> None:
    """At the final version: the run's end counters (``stats``: the scheduler's; each evaluation's
    as of its version), its startup (run start to first update) and, with
    ``tracking.target_accuracy``, the time it took to reach it."""
    tracker.log_metrics(round_metrics.end_counters(stats, history, final_version)
                        | ({names.FEDERATION_STARTUP_S: startup_s} if startup_s is not None else {}), step=final_version)
    if target_metrics := time_to_target_metrics(history, target):
        tracker.log_metrics(target_metrics, step=final_version)


def write_end(out: Path, tracker, history, cfg, *, bank, class_names, stats, system, summary_text: str) -> None:
    """The run's end on disk and in MLflow: the history, plots and final prototypes
    (:func:`write_final_artifacts`), who took part (:func:`write_participation`) and summary.txt."""
    write_final_artifacts(out, tracker, history, bank, class_names, cfg)
    write_participation(out, tracker, cfg.federation.num_clients, stats, system)
    (out / "summary.txt").write_text(summary_text + "\n")
    tracker.log_artifact(out / "summary.txt")


def write_final_artifacts(out: Path, tracker, history, bank, class_names, cfg) -> None:
    """history.parquet/.csv, the accuracy and margin plots, and the final global prototypes."""
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
        import pyarrow as pa  # here: only a method with prototypes writes them
        import pyarrow.parquet as pq

        np.savez(out / "global_prototypes.npz", class_ids=bank.class_ids, vectors=bank.vectors)
        pq.write_table(pa.table({"class_id": bank.class_ids, "class_name": [class_names[c] for c in bank.class_ids],
                                 "vector": list(bank.vectors)}), out / "global_prototypes.parquet")
        tracker.log_artifact(out / "global_prototypes.npz", "prototypes")
        tracker.log_artifact(out / "global_prototypes.parquet", "prototypes")
        tracker.log_artifact(plots.plot_prototypes_2d(bank.class_ids, bank.vectors, out / "global_prototypes_pca.png",
                                                      class_names=class_names), "plots")
