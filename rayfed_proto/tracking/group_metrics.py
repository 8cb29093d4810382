"""Mean and std over a group's runs per version, as metrics of the group's run: the seed group's
parent and each compared group's run under a ``compare`` run, at step = server version; and the
banded plot beside them.

Why these names (issue 49): the mean over the seeds is logged under **the metric's own name**
(``eval/head_acc``) and the std beside it as ``eval/head_acc_seed_std``, so that MLflow draws a
group's mean in the same chart as its seed runs and as the other groups (one chart per key in the
experiment's Chart view), and a parent sorts by ``eval/head_acc`` among the runs. ``_seed_std``,
not ``_std``: ``eval/head_acc_std`` is a run's std across its *clients*. No Ray here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from rayfed_proto.tracking import metric_names as names

SERIES = (names.EVAL_HEAD_ACC, names.EVAL_PROTO_ACC, names.EVAL_GLOBAL_ACC, names.train_term("loss"))
Curve = tuple[np.ndarray, np.ndarray, np.ndarray]  # versions, mean, std
SEED_STD = "_seed_std"


def seed_std(metric: str) -> str:
    """The key of the std over a group's seeds: ``seed_std("eval/head_acc") -> "eval/head_acc_seed_std"``."""
    return f"{metric}{SEED_STD}"


def mean_std_by_version(series: Sequence[tuple[np.ndarray, np.ndarray]]) -> Optional[Curve]:
    """(versions, mean, std) over the runs' ``(versions, values)`` at every version some run
    evaluated (the runs that have it); std 0 for one run. None without a finite point."""
    maps = [{int(v): float(y) for v, y in zip(vs, ys, strict=True) if np.isfinite(y)} for vs, ys in series]
    versions = sorted(set().union(*maps)) if maps else []
    if not versions:
        return None
    vals = np.array([[m.get(v, np.nan) for m in maps] for v in versions], float)
    return np.array(versions, float), np.nanmean(vals, 1), np.nanstd(vals, 1)


def curve_points(metric: str, curve: Curve, runs: int) -> list[tuple[str, float, int]]:
    """(key, value, step) of a curve: the mean as ``metric``, the std as :func:`seed_std` (only over
    two runs or more: one run's std is a flat 0, no chart)."""
    xs, mean, std = curve
    stats = ((metric, mean), (seed_std(metric), std)) if runs > 1 else ((metric, mean),)
    return [(key, float(v), int(x)) for key, ys in stats for x, v in zip(xs, ys, strict=True) if np.isfinite(v)]


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
    """The seed parent's ``<metric>`` (the mean) and ``<metric>_seed_std`` per version and the banded plot
    ``plots/seeds_mean_std.png`` (also written to ``out_dir``); the plot's path, None without data."""
    from rayfed_proto.tracking.plots import plot_mean_std

    curves = seed_curves(histories)
    if not curves:
        return None
    log_points(client, run_id, [p for metric, c in curves.items() for p in curve_points(metric, c, len(histories))])
    plot = plot_mean_std(curves, out_dir / "seeds_mean_std.png", title=f"{title}: mean ± std over {len(histories)} seeds")
    client.log_artifact(run_id, str(plot), "plots")
    return plot
