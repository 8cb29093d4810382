"""The end of a sweep: ranked trials, the best config as a runnable YAML, the comparison plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import yaml

from rayfed_proto.config import ExperimentConfig, build_config, set_dotted
from rayfed_proto.tracking.links import compare_url, relative, run_url
from rayfed_proto.tuning.spec import Distribution, SweepSpec


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def rank_trials(rows: list[dict[str, Any]], metric: str, mode: str) -> list[dict[str, Any]]:
    """Rows sorted best first by ``<metric>`` (the last reported value); trials without a
    value (errored before their first evaluation) last. Adds ``rank`` (1-based)."""
    sign = -1.0 if mode == "max" else 1.0

    def key(row):
        v = row.get(metric)
        return (0, sign * float(v)) if _is_number(v) else (1, 0.0)

    ranked = sorted(rows, key=key)
    for i, row in enumerate(ranked, 1):
        row["rank"] = i
    return ranked


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def format_table(ranked: list[dict[str, Any]], swept: list[str], metric: str) -> str:
    cols = ["rank", "trial", *swept, metric, f"{metric}_best", "version", "status", "mlflow_run_id"]
    cells = [[_fmt(r.get(c)) for c in cols] for r in ranked]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def best_config(spec: SweepSpec, values: dict[str, Any], tracking_uri: Optional[str]) -> ExperimentConfig:
    """The base config with the best trial's values: resources as in the base (not the trial's
    placement-group shares) and tracking to the sweep's store, with no parent run."""
    raw = spec.trial_raw(values)
    if tracking_uri is not None:
        set_dotted(raw, "tracking.tracking_uri", tracking_uri)
    for key in ("tracking.parent_run_id", "tracking.run_name"):
        set_dotted(raw, key, None)
    return build_config(raw, source=f"{spec.source} (best trial)")


def write_best_yaml(path: Path, cfg: ExperimentConfig, spec: SweepSpec, best: dict[str, Any], metric: str) -> Path:
    swept = ", ".join(f"{k}={best.get(k)!r}" for k in spec.space)
    header = (f"# Best trial of sweep {spec.name} ({spec.source}): {metric} = {_fmt(best.get(metric))} at version "
              f"{_fmt(best.get('version'))}\n# swept: {swept}\n# run it: rayfed-proto run {path.name}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def log_axis(dist: Distribution, values: list[float]) -> bool:
    """Whether a swept key is drawn on a log axis: a log distribution, or positive values (the
    trials' and a grid's or choice's) spanning a decade or more (``grid: [0.1, 1, 10]``: on a
    linear axis 0.1 and 1 crowd together)."""
    if dist.is_log:
        return True
    xs = [float(v) for v in values if _is_number(v)]
    if dist.kind in ("choice", "grid"):
        xs += [float(a) for a in dist.args if _is_number(a)]
    return bool(xs) and min(xs) > 0 and max(xs) / min(xs) >= 10


def parent_description(sweep: str, metric: str, mode: str, ranked: list[dict[str, Any]], space: list[str],
                       experiment_id: Optional[str] = None) -> str:
    """The sweep parent run's description (markdown): the best child by name, run id and link,
    its swept values and score, the trials ranked (a fixed-width table in a code block: the MLflow
    UI draws a markdown table without cell padding, so its columns ran together) and the plots."""
    scored = [r for r in ranked if _is_number(r.get(metric))]
    lines = [f"Sweep **{sweep}**: {len(ranked)} trials ranked by `{metric}` (last evaluation, {mode}); this parent's own "
             f"`{metric}` is the best trial's, so the run list sorts it among its trials."]
    if scored:
        best = scored[0]
        rid = best.get("mlflow_run_id")
        link = f"[{rid}]({relative(run_url('', experiment_id, rid))})" if rid and experiment_id else f"`{rid}`"
        swept = ", ".join(f"`{k}` = {best.get(k)!r}" for k in space)
        lines += ["", f"**Best child run: {link}** (trial {best.get('trial')}): {swept}; `{metric}` = "
                      f"{_fmt(best.get(metric))}. Its config: the artifact `best.yaml`."]
    else:
        lines += ["", "No trial reported the metric: no best child."]
    run_ids = [str(r["mlflow_run_id"]) for r in ranked if r.get("mlflow_run_id")]
    if experiment_id and len(run_ids) > 1:
        lines += ["", f"[Compare the trials]({relative(compare_url('', experiment_id, run_ids[:50]))}) (MLflow's "
                      "Compare page: parallel coordinates, scatter and box plots of the trials' params and metrics)."]
    cols = ["rank", "trial", *space, metric, "status", "mlflow_run_id"]
    lines += ["", "```", text_table(ranked[:50], cols), "```", "",
              f"Plots (artifacts): `plots/parallel_coordinates.png` (the swept parameters against `{metric}`, one "
              f"line per trial) and `plots/{metric.replace('/', '_')}_vs_params.png`. All trials: `trials.csv`."]
    return "\n".join(lines)


def text_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """``rows`` as a fixed-width text table, two spaces between columns."""
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def plot_parallel_coordinates(ranked: list[dict[str, Any]], space: dict[str, Distribution], metric: str, path: Path,
                              title: str = "") -> Path:
    """One vertical axis per swept key and one for ``metric`` (last evaluation), a line per trial
    coloured by ``metric``: what the MLflow UI's parallel coordinates would show, drawn here
    because that chart opens on whichever parameters and metric sort first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = [*space, metric]
    fig, ax = plt.subplots(figsize=(max(5.0, 2.2 * len(keys)), 4.2))
    columns, labels = [], []
    for key in keys:
        values = [r.get(key) for r in ranked]
        if key != metric and not all(_is_number(v) for v in values):  # a choice of names: evenly spaced
            names = [str(a) for a in space[key].args] if space[key].kind in ("choice", "grid") else sorted({str(v) for v in values})
            pos = np.array([names.index(str(v)) if str(v) in names else np.nan for v in values], float)
            columns.append(pos / max(1, len(names) - 1))
            labels.append((key, [(i / max(1, len(names) - 1), n) for i, n in enumerate(names)]))
            continue
        x = np.array([float(v) if _is_number(v) else np.nan for v in values], float)
        log = key != metric and log_axis(space[key], [v for v in x if np.isfinite(v)])
        t = np.log10(x) if log else x
        lo, hi = (np.nanmin(t), np.nanmax(t)) if np.isfinite(t).any() else (0.0, 1.0)
        columns.append((t - lo) / (hi - lo) if hi > lo else np.full_like(t, 0.5))
        ticks = np.linspace(lo, hi, 3) if hi > lo else np.array([lo])
        labels.append((key, [((v - lo) / (hi - lo) if hi > lo else 0.5, _fmt(float(10 ** v if log else v)))
                             for v in ticks]))
    score = np.array([float(r[metric]) if _is_number(r.get(metric)) else np.nan for r in ranked], float)
    cmap = plt.get_cmap("viridis")
    finite = score[np.isfinite(score)]
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    for i, r in enumerate(ranked):
        ys = [c[i] for c in columns]
        color = cmap((score[i] - lo) / (hi - lo) if np.isfinite(score[i]) and hi > lo else 0.5) \
            if np.isfinite(score[i]) else "0.7"
        ax.plot(range(len(keys)), ys, color=color, linewidth=1.6, marker="o", markersize=4,
                linestyle="-" if np.isfinite(score[i]) else ":", label=str(r.get("trial")) if len(ranked) <= 8 else None)
    for j, (_key, ticks) in enumerate(labels):
        ax.axvline(j, color="0.3", linewidth=0.8)
        for y, text in ticks:
            ax.text(j + 0.03, y, text, fontsize=7, va="center", color="0.25")
    ax.set_xticks(range(len(keys)), [k for k, _ in labels], fontsize=9)
    ax.set_yticks([])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlim(-0.1, len(keys) - 0.6)
    if finite.size:
        mappable = matplotlib.cm.ScalarMappable(norm=matplotlib.colors.Normalize(lo, hi), cmap=cmap)
        fig.colorbar(mappable, ax=ax).set_label(metric)
    if len(ranked) <= 8:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.12), ncol=4, frameon=False)
    ax.set_title(title or f"Swept parameters vs {metric}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_metric_vs_params(ranked: list[dict[str, Any]], space: dict[str, Distribution], metric: str, path: Path,
                          title: str = "") -> Path:
    """One panel per swept key: each trial's final ``metric`` (filled) and its best (hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(space)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        dist = space[key]
        xs = [r.get(key) for r in ranked]
        numeric = all(_is_number(x) for x in xs) and (
            dist.kind not in ("choice", "grid") or all(_is_number(a) for a in dist.args))
        if numeric:
            pos = [float(x) for x in xs]
        else:
            labels = [str(a) for a in dist.args] if dist.kind in ("choice", "grid") else sorted({str(x) for x in xs})
            pos = [labels.index(str(x)) if str(x) in labels else -1 for x in xs]
            ax.set_xticks(range(len(labels)), labels, rotation=30)
        last = [r.get(metric) if _is_number(r.get(metric)) else float("nan") for r in ranked]
        best = [r.get(f"{metric}_best") if _is_number(r.get(f"{metric}_best")) else float("nan") for r in ranked]
        # the best value is often the last one: a small filled dot for the last, drawn under a larger
        # hollow ring for the best, so both stay visible where they coincide
        ax.scatter(pos, last, s=18, label=f"{metric} (last)", zorder=3)
        ax.scatter(pos, best, s=90, facecolors="none", edgecolors="C1", linewidths=1.5, label=f"{metric} (best)",
                   zorder=4)
        if numeric and log_axis(dist, pos):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
