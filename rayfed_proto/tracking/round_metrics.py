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
        names.FEDERATION_UPDATES_ACCEPTED: server["accepted"], names.FEDERATION_UPDATES_DROPPED: server["dropped_stale"],
        names.FEDERATION_UPDATES_LATE: server["late"], names.SERVER_VERSIONS_ROLLED_BACK: server["rolled_back"],
        names.FEDERATION_UPDATES_REFUSED: server["refused"], names.FEDERATION_UPDATES_DISPATCHED: stats.dispatched,
        names.FEDERATION_UPDATES_DROPPED_OFFLINE: getattr(stats, "updates_dropped_offline", 0),
        names.FEDERATION_UPDATES_DROPPED_DEADLINE: getattr(stats, "updates_dropped_deadline", 0),
        names.FEDERATION_UPDATES_DROPPED_OVER_SELECTION: getattr(stats, "updates_dropped_over_selection", 0),
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
