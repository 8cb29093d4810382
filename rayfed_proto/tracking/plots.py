"""Run figures as PNG files: accuracy curves, per-client label skew, prototype margins, a 2-D prototype map.

Why: the tracking layer uploads these next to the metrics, so each function renders exactly one
figure to ``path`` (parent folders created) and returns that path; nothing here imports Ray or MLflow.

Figures are built as :class:`matplotlib.figure.Figure` objects on an explicit Agg canvas instead of
through ``pyplot``: rendering works without a display, never switches the process-wide backend (a
notebook importing this keeps its own), is safe from a background thread, and no figure stays
registered anywhere once a function returns, so there is nothing to leak or close.

Inputs are taken as a run produces them: missing keys, ``None`` and NaN are gaps, a single
evaluation is drawn as markers, and a plot with nothing to draw carries a "no data" note.
Accuracies are fractions in [0, 1] and are shown as percentages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking.report import History, metric_series

DPI = 120
BAND_LABEL = "per-client mean ± std"
_MARKERS_UP_TO = 40  # points per line; beyond this, markers only clutter the curve
_ANNOTATE_UP_TO = 20  # heatmap rows and columns up to which every cell shows its count
_MAX_TICKS = 25


def _new_axes(width: float, height: float) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, format="png")
    return out


def _finish(fig: Figure, ax: Axes, path: str | Path, has_data: bool, note: str = "no data") -> Path:
    """Grid, a legend when more than one series is labelled, the empty-plot note; then write the PNG."""
    ax.grid(True, alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(loc="best", fontsize=9)
    if not has_data:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=14, color="0.4")
    return _save(fig, path)


def _finite_sorted(x: np.ndarray, *ys: np.ndarray) -> tuple[np.ndarray, ...]:
    """The points where ``x`` and every ``ys`` are finite, ordered by ``x``."""
    ok = np.isfinite(x)
    for y in ys:
        ok &= np.isfinite(y)
    order = np.argsort(x[ok], kind="stable")
    return (x[ok][order], *(y[ok][order] for y in ys))


def _line(ax: Axes, x: np.ndarray, y: np.ndarray, label: str, color: str) -> bool:
    xs, ys = _finite_sorted(x, y)
    if xs.size == 0:
        return False
    marker = "o" if xs.size <= _MARKERS_UP_TO else None
    ax.plot(xs, ys, color=color, marker=marker, markersize=4, linewidth=1.8, label=label)
    return True


def _band(ax: Axes, x: np.ndarray, mean: np.ndarray, std: np.ndarray, color: str) -> bool:
    """Mean ± std across clients, light and clipped to [0, 1]; an error bar when there is one point."""
    xs, m, s = _finite_sorted(x, mean, std)
    if xs.size == 0:
        return False
    lo, hi = np.clip(m - s, 0.0, 1.0), np.clip(m + s, 0.0, 1.0)
    if xs.size == 1:
        ax.errorbar(xs, m, yerr=[m - lo, hi - m], fmt="s", color=color, alpha=0.4, capsize=4, label=BAND_LABEL)
    else:
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0, label=BAND_LABEL)
        ax.plot(xs, m, color=color, alpha=0.5, linewidth=1.0, linestyle="--")
    return True


def _plot_accuracy(history: History, x_key: str, xlabel: str, path: str | Path, title: str,
                   target: float | None = None) -> Path:
    x = metric_series(history, x_key)
    fig, ax = _new_axes(8.0, 4.8)
    has_data = _band(ax, x, metric_series(history, names.EVAL_HEAD_ACC_MEAN),
                     metric_series(history, names.EVAL_HEAD_ACC_STD), "C0")
    has_data |= _line(ax, x, metric_series(history, names.EVAL_HEAD_ACC), "head accuracy (sample-weighted)", "C0")
    has_data |= _line(ax, x, metric_series(history, names.EVAL_PROTO_ACC), "prototype accuracy (sample-weighted)", "C1")
    if target is not None:
        ax.axhline(target, color="0.4", linestyle=":", linewidth=1.0, label=f"target {100 * target:.0f}%")
    ax.set_ylim(0.0, 1.01)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    return _finish(fig, ax, path, has_data)


def plot_accuracy_vs_version(history: History, path: str | Path, title: str | None = None) -> Path:
    """Head and prototype accuracy (sample-weighted) against server version, with the per-client mean ± std band."""
    return _plot_accuracy(history, names.VERSION, "server version (aggregations)", path,
                          title or "Test accuracy vs server version")


def plot_accuracy_vs_wall_time(history: History, path: str | Path, title: str | None = None) -> Path:
    """The same curves as :func:`plot_accuracy_vs_version` against wall-clock time since the run started."""
    return _plot_accuracy(history, names.FEDERATION_WALL_S, "wall time (s)", path, title or "Test accuracy vs wall time")


def plot_accuracy_vs_sim_time(history: History, path: str | Path, title: str | None = None,
                              target: float | None = None) -> Path:
    """The same curves against simulated time (virtual clock), with the target accuracy as a line."""
    return _plot_accuracy(history, names.FEDERATION_SIM_TIME_S, "simulated time (s)", path, title or "Test accuracy vs simulated time",
                          target=target)


def plot_client_updates(frame, path: str | Path, title: str | None = None) -> Path:
    """Local updates per client; with simulated speeds (virtual clock) against each client's
    compute time, where slow clients' smaller share shows."""
    fig, ax = _new_axes(8.0, 4.8)
    has_data = len(frame) > 0
    if "compute_s" in frame:
        ax.scatter(frame["compute_s"], frame["updates"], s=18, color="C0")
        ax.set_xscale("log")
        ax.set_xlabel("simulated compute time of one local update (s, log scale)")
    else:
        ax.bar(frame["client_id"], frame["updates"], color="C0")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # client ids: no 2.5
        ax.set_xlabel("client id")
    ax.set_ylabel("local updates dispatched")
    ax.set_title(title or "Participation per client")
    return _finish(fig, ax, path, has_data)


def plot_client_series(frame, path: str | Path, series: str = "head_acc", title: str | None = None) -> Path:
    """Every client's ``series`` (``client_history.parquet``: one row per version and client)
    against the server version in one chart: a thin line per client and their mean in bold. What
    ``tracking.per_client_metrics: true`` would show as one MLflow chart per client."""
    fig, ax = _new_axes(8.0, 4.8)
    has_data = series in frame and bool(np.isfinite(frame[series].to_numpy(float)).any())
    if has_data:
        wide = frame.pivot_table(index=names.VERSION, columns="client_id", values=series)
        x = wide.index.to_numpy(float)
        for c in wide.columns:
            xs, ys = _finite_sorted(x, wide[c].to_numpy(float))
            ax.plot(xs, ys, color="C0", alpha=max(0.08, min(0.6, 6.0 / max(1, len(wide.columns)))), linewidth=0.8)
        _line(ax, x, wide.mean(axis=1).to_numpy(float), f"mean over {len(wide.columns)} clients", "C3")
        ax.plot([], [], color="C0", alpha=0.6, linewidth=0.8, label="one client")
    if series.endswith("_acc"):
        ax.set_ylim(0.0, 1.01)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("server version (aggregations)")
    ax.set_ylabel(series.replace("_", " "))
    ax.set_title(title or f"Per-client {series.replace('_', ' ')} vs server version")
    return _finish(fig, ax, path, has_data)


def plot_client_heatmap(frame, path: str | Path, series: str = "head_acc", title: str | None = None) -> Path:
    """Clients (rows) x evaluated versions (columns), coloured by ``series``: who learns, who
    never does, at a glance for any number of clients."""
    has_data = series in frame and bool(np.isfinite(frame[series].to_numpy(float)).any())
    wide = frame.pivot_table(index="client_id", columns=names.VERSION, values=series) if has_data else None
    n_clients, n_versions = (wide.shape if wide is not None else (0, 0))
    fig, ax = _new_axes(min(14.0, max(6.0, 0.3 * n_versions + 3.0)), min(11.0, max(3.5, 0.3 * n_clients + 1.5)))
    ax.set_title(title or f"Per-client {series.replace('_', ' ')} ({n_clients} clients x {n_versions} evaluations)")
    ax.set_xlabel("server version (aggregations)")
    ax.set_ylabel("client id")
    if wide is None:
        return _finish(fig, ax, path, has_data=False)
    accuracy = series.endswith("_acc")
    image = ax.imshow(wide.to_numpy(float), aspect="auto", interpolation="nearest", cmap="viridis",
                      vmin=0.0 if accuracy else None, vmax=1.0 if accuracy else None)
    fig.colorbar(image, ax=ax).set_label(series.replace("_", " "))
    cols, rows = _tick_indices(n_versions), _tick_indices(n_clients)
    ax.set_xticks(cols, [str(int(wide.columns[j])) for j in cols], fontsize=8)
    ax.set_yticks(rows, [str(int(wide.index[i])) for i in rows], fontsize=8)
    return _save(fig, path)


def plot_mean_std(curves: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]], path: str | Path,
                  title: str | None = None) -> Path:
    """Each metric's mean over runs against the server version, with a ± std band: accuracies
    (``*_acc``) on the left axis in %, any other metric (a loss) on a right axis."""
    fig, ax = _new_axes(8.0, 4.8)
    other = None
    has_data = False
    for i, (metric, (x, mean, std)) in enumerate(curves.items()):
        accuracy = metric.split("/")[-1].endswith("acc")
        if not accuracy and other is None:
            other = ax.twinx()
            other.set_ylabel(", ".join(m for m in curves if not m.split("/")[-1].endswith("acc")))
        target, color = (ax if accuracy else other), f"C{i % 10}"
        xs, m, s = _finite_sorted(np.asarray(x, float), np.asarray(mean, float), np.asarray(std, float))
        if xs.size == 0:
            continue
        lo, hi = (np.clip(m - s, 0.0, 1.0), np.clip(m + s, 0.0, 1.0)) if accuracy else (m - s, m + s)
        target.plot(xs, m, color=color, linewidth=1.8, marker="o" if xs.size <= _MARKERS_UP_TO else None,
                    markersize=3, label=f"{metric} (mean ± std)")
        target.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        has_data = True
    if other is not None:
        handles, labels = other.get_legend_handles_labels()
        for h, label in zip(handles, labels, strict=True):
            ax.plot([], [], color=h.get_color(), label=label)
    ax.set_ylim(0.0, 1.01)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("server version (aggregations)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title or "Mean ± std over runs vs server version")
    return _finish(fig, ax, path, has_data)


def plot_prototype_margin(history: History, path: str | Path, title: str | None = None) -> Path:
    """Min and mean distance from each global guidance prototype to its nearest other-class prototype, per version."""
    v = metric_series(history, "version")
    fig, ax = _new_axes(8.0, 4.8)
    has_data = _line(ax, v, metric_series(history, names.SERVER_PROTO_MARGIN_MIN), "min margin", "C3")
    has_data |= _line(ax, v, metric_series(history, names.SERVER_PROTO_MARGIN_MEAN), "mean margin", "C2")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("server version (aggregations)")
    ax.set_ylabel("distance to nearest other class (L2, feature units)")
    ax.set_title(title or "Global prototype margin vs server version")
    return _finish(fig, ax, path, has_data)


def _tick_indices(n: int) -> np.ndarray:
    """Every index up to ``_MAX_TICKS`` items, else a round step (1, 2, 5 x 10^k) that keeps at most that many."""
    if n <= _MAX_TICKS:
        return np.arange(n)
    exponent = 10 ** math.floor(math.log10(n / _MAX_TICKS))
    step = next(m * exponent for m in (1, 2, 5, 10) if n / (m * exponent) <= _MAX_TICKS)
    return np.arange(0, n, step)


def plot_label_distribution(counts: np.ndarray, path: str | Path, class_names: Sequence[str] | None = None,
                            title: str | None = None) -> Path:
    """Heatmap of training samples per (client, class): clients on y, classes on x, cell counts when <= 20 x 20.

    ``class_names[j]`` names column ``j``. Large matrices (1000 clients x 100 classes) are drawn
    without annotations and with thinned, round-numbered ticks.
    """
    matrix = np.asarray(counts, dtype=float)
    if matrix.ndim != 2:
        raise ValueError(f"counts must be (num_clients, num_classes), got shape {matrix.shape}")
    if class_names is not None and len(class_names) != matrix.shape[1]:
        raise ValueError(f"{len(class_names)} class names for {matrix.shape[1]} classes")
    n_clients, n_classes = matrix.shape
    fig, ax = _new_axes(min(14.0, max(6.0, 0.55 * n_classes + 2.5)), min(11.0, max(3.5, 0.4 * n_clients + 1.5)))
    ax.set_title(title or f"Label distribution ({n_clients} clients x {n_classes} classes, "
                          f"{np.nansum(matrix):.0f} samples)")
    ax.set_xlabel("class")
    ax.set_ylabel("client id")
    if matrix.size == 0:
        return _finish(fig, ax, path, has_data=False)

    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax).set_label("samples")
    cols, rows = _tick_indices(n_classes), _tick_indices(n_clients)
    ax.set_xticks(cols, [class_names[j] for j in cols] if class_names is not None else [str(j) for j in cols],
                  rotation=90 if class_names is not None and n_classes > 10 else 0, fontsize=8)
    ax.set_yticks(rows, [str(i) for i in rows], fontsize=8)
    if n_clients <= _ANNOTATE_UP_TO and n_classes <= _ANNOTATE_UP_TO:
        lo, hi = np.nanmin(matrix), np.nanmax(matrix)
        middle = (lo + hi) / 2
        for (i, j), value in np.ndenumerate(matrix):
            ax.text(j, i, f"{value:.0f}" if np.isfinite(value) else "", ha="center", va="center", fontsize=8,
                    color="white" if value < middle or hi == lo else "black")
    return _save(fig, path)  # no grid: its lines would cut through the cells


def _project_2d(vectors: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """PCA by SVD of the centred vectors: ``(n, 2)`` coordinates and each axis's share of the variance."""
    centred = vectors - vectors.mean(axis=0)
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    coords = np.zeros((len(vectors), 2))
    k = min(2, vt.shape[0])
    coords[:, :k] = centred @ vt[:k].T
    variance = singular**2
    total = variance.sum()
    shares = [float(variance[a] / total) if a < k and total > 0 else 0.0 for a in range(2)]
    return coords, shares


def plot_prototypes_2d(class_ids: Sequence[int] | np.ndarray, vectors: Any, path: str | Path,
                       class_names: Sequence[str] | Mapping[int, str] | None = None, title: str | None = None) -> Path:
    """The final global prototypes projected to 2-D by PCA, one labelled point per class.

    ``vectors`` is ``(n, feature_dim)`` (array-like, a CPU tensor works) aligned with ``class_ids``;
    ``class_names[c]`` names class id ``c``. One prototype sits at the origin (no PCA); none gives a
    "no prototypes" figure; rows with non-finite entries are left out.
    """
    ids = np.asarray(class_ids, dtype=int).reshape(-1)
    vecs = np.asarray(vectors, dtype=float)
    if vecs.ndim == 1:  # a single prototype, or none
        vecs = vecs.reshape(len(ids), -1) if len(ids) else vecs.reshape(0, 0)
    if vecs.ndim != 2 or vecs.shape[0] != len(ids):
        raise ValueError(f"{len(ids)} class ids for vectors of shape {np.shape(vectors)}")
    keep = np.isfinite(vecs).all(axis=1)
    ids, vecs = ids[keep], vecs[keep]

    fig, ax = _new_axes(7.0, 6.0)
    ax.set_title(title or f"Global prototypes, 2-D PCA ({len(ids)} class{'' if len(ids) == 1 else 'es'})")
    if len(ids) == 0:
        ax.set_xlabel("PC1 (feature units)")
        ax.set_ylabel("PC2 (feature units)")
        return _finish(fig, ax, path, has_data=False, note="no prototypes")

    if len(ids) == 1:
        coords, shares = np.zeros((1, 2)), [0.0, 0.0]
    else:
        coords, shares = _project_2d(vecs)
    palette = colormaps["tab10" if ids.max(initial=0) < 10 else "tab20"]
    ax.scatter(coords[:, 0], coords[:, 1], c=[palette(c % palette.N) for c in ids], s=60, edgecolors="black",
               linewidths=0.5, zorder=3)
    for (x, y), c in zip(coords, ids, strict=True):
        name = class_names[c] if class_names is not None else f"class {c}"
        ax.annotate(name, (x, y), xytext=(5, 5), textcoords="offset points", fontsize=8 if len(ids) <= 30 else 6)
    ax.axhline(0.0, color="0.7", linewidth=0.8)
    ax.axvline(0.0, color="0.7", linewidth=0.8)
    ax.set_aspect("equal", adjustable="datalim")  # keep distances comparable along both axes
    for axis, setter, share in ((1, ax.set_xlabel, shares[0]), (2, ax.set_ylabel, shares[1])):
        setter(f"PC{axis} (feature units, {share:.0%} of variance)" if share > 0 else f"PC{axis} (feature units)")
    return _finish(fig, ax, path, has_data=True)
