"""Mean and std over a group's runs per version, as metrics of the group's run: the seed group's
parent (``seeds/<metric>_mean``, ``seeds/<metric>_std``) and the ``compare`` run (one prefix per
compared group: ``fedsa/eval/head_acc_mean``), at step = server version, so that those runs can be
charted and sorted in the MLflow UI like any other; and the banded plot beside them.

Why these names: the UI makes one chart section per key prefix, so a group's mean and std of a
metric sit side by side (``seeds/eval``: ``head_acc_mean``, ``head_acc_std``), apart from the
run metrics of the same name. No Ray here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from rayfed_proto.tracking import metric_names as names

SERIES = (names.EVAL_HEAD_ACC, names.EVAL_PROTO_ACC, names.EVAL_GLOBAL_ACC, names.train_term("loss"))
SEEDS_PREFIX = "seeds"
Curve = tuple[np.ndarray, np.ndarray, np.ndarray]  # versions, mean, std


def group_metric(prefix: str, metric: str, stat: str) -> str:
    """``group_metric("seeds", "eval/head_acc", "mean") -> "seeds/eval/head_acc_mean"``."""
    return f"{prefix}/{metric}_{stat}"


def key_part(label: str) -> str:
    """A group label as a metric-key part: MLflow allows letters, digits, ``_ - . / :`` and spaces
    (``fedsa algorithm.lam=0.1`` -> ``fedsa algorithm.lam:0.1``; a ``/`` would open a section)."""
    return re.sub(r"[^A-Za-z0-9_\-.: ]", "_", label.replace("=", ":")).strip() or "group"


def mean_std_by_version(series: Sequence[tuple[np.ndarray, np.ndarray]]) -> Optional[Curve]:
    """(versions, mean, std) over the runs' ``(versions, values)`` at every version some run
    evaluated (the runs that have it); std 0 for one run. None without a finite point."""
    maps = [{int(v): float(y) for v, y in zip(vs, ys, strict=True) if np.isfinite(y)} for vs, ys in series]
    versions = sorted(set().union(*maps)) if maps else []
    if not versions:
        return None
    vals = np.array([[m.get(v, np.nan) for m in maps] for v in versions], float)
    return np.array(versions, float), np.nanmean(vals, 1), np.nanstd(vals, 1)


def curve_points(prefix: str, metric: str, curve: Curve) -> list[tuple[str, float, int]]:
    """(key, value, step) of a curve's mean and std."""
    xs, mean, std = curve
    return [(group_metric(prefix, metric, stat), float(v), int(x)) for stat, ys in (("mean", mean), ("std", std))
            for x, v in zip(xs, ys, strict=True) if np.isfinite(v)]


def seed_curves(histories: Sequence) -> dict[str, Curve]:
    """Per metric of :data:`SERIES` some seed's ``history.parquet`` frame holds: its curve over the seeds."""
    out: dict[str, Curve] = {}
    for metric in SERIES:
        runs = [(h[names.VERSION].to_numpy(), h[metric].to_numpy(float)) for h in histories if metric in h]
        curve = mean_std_by_version(runs) if runs else None
        if curve is not None:
            out[metric] = curve
    return out


def log_points(client, run_id: str, points: list[tuple[str, float, int]]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, s) for k, v, s in points]
    for i in range(0, len(metrics), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=metrics[i : i + 1000])


def log_seed_curves(client, run_id: str, histories: Sequence, out_dir: Path, title: str) -> Optional[Path]:
    """The seed parent's ``seeds/<metric>_mean`` / ``_std`` per version and the banded plot
    ``plots/seeds_mean_std.png`` (also written to ``out_dir``); the plot's path, None without data."""
    from rayfed_proto.tracking.plots import plot_mean_std

    curves = seed_curves(histories)
    if not curves:
        return None
    log_points(client, run_id, [p for metric, c in curves.items() for p in curve_points(SEEDS_PREFIX, metric, c)])
    plot = plot_mean_std(curves, out_dir / "seeds_mean_std.png", title=f"{title}: mean ± std over {len(histories)} seeds")
    client.log_artifact(run_id, str(plot), "plots")
    return plot
