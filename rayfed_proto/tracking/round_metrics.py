"""The metrics of one evaluated version, assembled from the clients' evaluation results, the
server's counters and the scheduler's counters read when the version was produced. No Ray here.

Every key is born with its final name from :mod:`rayfed_proto.tracking.metric_names`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rayfed_proto.tracking import metric_names as names


def version_metrics(results: list[dict], server: dict, stats, wall: float, sim_time: float, slots: int) -> dict[str, Any]:
    """``stats``: the scheduler's counters at the version; ``wall``/``sim_time``: real and
    simulated seconds at the version (``sim_time`` NaN without a virtual clock); ``slots``: the
    real execution slots (for utilisation)."""
    # client order, not arrival order: float means must not depend on which actor answered first
    results = sorted((r for r in results if r["n"] > 0), key=lambda r: r["client_id"])  # no test samples: no accuracy
    n = np.array([r["n"] for r in results], float)
    head = np.array([r["head_correct"] for r in results], float)
    m: dict[str, Any] = {
        names.EVAL_HEAD_ACC: float(head.sum() / n.sum()),
        names.EVAL_HEAD_ACC_MEAN: float(np.mean(head / n)),
        names.EVAL_HEAD_ACC_STD: float(np.std(head / n)),
    }
    if all(r["proto_correct"] is not None for r in results):
        proto = np.array([r["proto_correct"] for r in results], float)
        m[names.EVAL_PROTO_ACC] = float(proto.sum() / n.sum())
        m[names.EVAL_PROTO_ACC_MEAN] = float(np.mean(proto / n))
        m[names.EVAL_PROTO_ACC_STD] = float(np.std(proto / n))
    # every term a method reports from local training (loss, its parts, pseudo-label counts ...):
    # the mean over clients of each one's latest update, as train/<term>
    for key in sorted({k for terms in stats.last_terms.values() for k in terms}):
        values = [t[key] for _, t in sorted(stats.last_terms.items()) if key in t and math.isfinite(t[key])]
        m[names.train_term(key)] = float(np.mean(values)) if values else float("nan")
    m[names.RELIABILITY_CLIENTS_NONFINITE] = sum(1 for r in results if r.get("nonfinite"))  # models that produce NaN/inf features
    silhouettes = [r["silhouette"] for r in results if r.get("silhouette") is not None]
    if silhouettes:
        m[names.EVAL_SILHOUETTE_MEAN] = float(np.mean(silhouettes))
    margin_min, margin_mean = server["margin"]
    m.update({
        names.SERVER_PROTO_MARGIN_MIN: margin_min, names.SERVER_PROTO_MARGIN_MEAN: margin_mean,
        names.FEDERATION_BYTES_UP: stats.bytes_up, names.FEDERATION_BYTES_DOWN: stats.bytes_down,
        names.FEDERATION_STALENESS_MEAN: server["staleness_mean"], names.FEDERATION_STALENESS_MAX: server["staleness_max"],
        **server_counters(server), names.FEDERATION_UPDATES_LATE: server["late"],
        **dispatch_counters(stats),
        names.FEDERATION_CLIENT_BUSY_S: stats.busy_s, names.SERVER_TRAIN_S: server["server_train_s"],
        names.FEDERATION_WALL_S: wall,
        names.FEDERATION_SLOT_UTILISATION: stats.busy_s / (slots * wall) if wall > 0 else float("nan"),
    })
    if not math.isnan(sim_time):
        m[names.FEDERATION_SIM_TIME_S] = float(sim_time)
    # the server step's own figures (an algorithm's aggregate, the global-test evaluation): server/... and
    # eval/global_acc..., so that an aggregate "train_loss" (server/train_loss) never meets the clients' train/loss
    for k, v in server.get("server_metrics", {}).items():
        m[names.server_metric(k)] = v
    m[names.PER_CLIENT] = results  # taken out by the driver (tracking.clients: zz_client/<series>/client_<id>)
    return m


# ----------------------------------------------------------------------------- counters
# Each counter's metric is made in one of these, from the object that counts it: an evaluation
# reports them as of its version (above), the driver at a failure and at the end of the run.


def server_counters(server: dict) -> dict[str, float]:
    """The server's intake counters (``ServerCore.stats()``): what it accepted, refused, dropped as
    stale, and the versions it rolled back."""
    return {names.FEDERATION_UPDATES_ACCEPTED: server["accepted"], names.FEDERATION_UPDATES_DROPPED: server["dropped_stale"],
            names.FEDERATION_UPDATES_REFUSED: server["refused"], names.SERVER_VERSIONS_ROLLED_BACK: server["rolled_back"]}


def dispatch_counters(stats) -> dict[str, float]:
    """The scheduler's local updates dispatched, and of those the ones never submitted (client
    offline, after a sync round's deadline, beyond its first K with over-selection)."""
    return {names.FEDERATION_UPDATES_DISPATCHED: stats.dispatched,
            names.FEDERATION_UPDATES_DROPPED_OFFLINE: stats.updates_dropped_offline,
            names.FEDERATION_UPDATES_DROPPED_DEADLINE: stats.updates_dropped_deadline,
            names.FEDERATION_UPDATES_DROPPED_OVER_SELECTION: stats.updates_dropped_over_selection}


def reliability_counters(stats) -> dict[str, float]:
    """The failures the run survived so far, and its checkpoints (``SchedulerStats``)."""
    return {names.RELIABILITY_CLIENT_FAILURES: stats.client_failures,
            names.RELIABILITY_UPDATES_LOST_CLIENT: stats.updates_lost_client,
            names.RELIABILITY_SERVER_RESTARTS: stats.server_restarts,
            names.RELIABILITY_UPDATES_LOST_SERVER: stats.updates_lost_server,
            names.RELIABILITY_VERSIONS_REDONE: stats.versions_redone,
            names.RELIABILITY_EVALS_INCOMPLETE: stats.evals_incomplete,
            names.RELIABILITY_CLIENTS_EXCLUDED: len(stats.excluded),
            names.RELIABILITY_CHECKPOINTS_WRITTEN: stats.checkpoints,
            names.FEDERATION_VERSIONS_EMPTY: stats.versions_empty,
            names.RELIABILITY_CHECKPOINTS_FAILED: stats.checkpoints_failed}


def client_restart_counters(stats) -> dict[str, float]:
    """Logged when a client actor is restarted: the restarts so far."""
    return {names.RELIABILITY_CLIENT_ACTOR_RESTARTS: stats.client_failures}


def end_counters(stats, history: list[dict[str, Any]], final_version: int) -> dict[str, Any]:
    """The counters to log at the end: those the final version's evaluation did not already log
    with the same value (each step gets one point per metric unless a counter moved since)."""
    counters = {names.FEDERATION_UPDATES_WITHHELD_AFTER_END: stats.withheld, **dispatch_counters(stats),
                **reliability_counters(stats)}
    last = next((h for h in reversed(history) if h.get("version") == final_version), {})
    return {k: v for k, v in counters.items() if k not in last or last[k] != v}


def failure_counters(stats, server: dict | None) -> dict[str, float]:
    """A failed run's counters at the version it reached (``server`` None: the server is gone)."""
    return {**reliability_counters(stats), **(server_counters(server) if server is not None else {}),
            **dispatch_counters(stats)}
