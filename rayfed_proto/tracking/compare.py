"""Compare methods over seeds from what MLflow holds (``rayfed-proto compare``).

Reads the runs of one or more experiments (a local store or a tracking server), leaves out the
runs that cannot be compared (and says why), groups the rest by method and by the config keys
that differ between them, and reduces each group over its seeds: the final value (each run's last
evaluation) and the best value (over its evaluations) of a metric, as mean ± std. The result is a
table (CSV and Markdown), a plot of the metric against the server version (and against simulated
time when the runs ran on the virtual clock) with a mean line and a ± std band per group, and,
optionally, a *comparison run* in MLflow holding them, with one nested run per group whose
metrics are the group's mean over its seeds under the metric's own name (:func:`log_comparison`:
MLflow draws the groups in one chart).

Rules (docs/quickstart.md, "Comparing methods over seeds"):

* **Left out**, each with its reason: runs not ``FINISHED`` (running, failed with their
  ``failure_reason``, killed with where to resume), parent runs (a sweep's or a seeds group's: their
  nested runs are the ones compared), comparison runs, runs without the metric or without an
  ``algorithm.name`` param, and *superseded* runs: an earlier run of the same group and seed when a
  later one exists (a rerun, a Tune trial restarted as a new run). Nested seed runs and Tune
  trials are ordinary runs.
* **Superseded steps** (a resume redid versions, tag ``superseded_steps``): MLflow keeps both
  points of such a step; the later one is used.
* **Grouping keys**: ``algorithm.name`` plus every config param whose value differs between the
  runs compared (an ``algorithm.*`` option: between runs of the same method, since another
  method's options mean something else), except the operational ones (:data:`OPERATIONAL_PREFIXES`,
  :data:`OPERATIONAL_KEYS`): the seed, where outputs and data live, resources, checkpoints,
  reliability limits, fault injection, the evaluation interval, the resource plan, and values
  derived from the dataset.
* **Statistics**: mean and population standard deviation (numpy's ``std``, as in the bench/
  tables) over the seeds of a group; no std for a single seed. Final and best of a run are
  ``tracking.paper_metric.final_and_best``'s.
* **The paper metric** (``--metric paper``): each run is read at its method's paper metric
  (``tracking.paper_metric.paper_metric``: ``eval/proto_acc`` for FedSA, FedTGP and FedProto,
  ``eval/global_acc`` for FedSC and FedProtoKD, ...), and the table adds per group the metric
  used and the paper's statistic of it (best or final) as the "paper figure".

Nothing here imports Ray; MLflow and matplotlib are imported where they are used.
"""

from __future__ import annotations

import csv
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayfed_proto.config import InputError
from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking.paper_metric import PaperMetric, final_and_best, paper_metric
from rayfed_proto.tracking.parent_runs import PARENT_TAG, end_run, log_params, start_parent, start_run

DEFAULT_METRIC = names.EVAL_HEAD_ACC
PAPER = "paper"  # --metric paper: each method's paper metric (tracking.paper_metric)
DEFAULT_EXPERIMENT_NAME = "rayfed_proto_compare"
COMPARE_TAG = "rayfed_proto.compare"  # marks a comparison run (never compared itself)
ALGORITHM_KEY = "algorithm.name"

# params that never tell two groups apart: how and where a run ran, not what it computed
# client.*: what the partition gave each client (client.test_samples), which differs with the seed
OPERATIONAL_PREFIXES = ("tracking.", "resources.", "checkpoint.", "reliability.", "faults.", "plan.", "derived.", "client.")
OPERATIONAL_KEYS = frozenset({"seed", "data.root", "data.download", "federation.eval_every"})

CSV_NAME, MARKDOWN_NAME, LEFT_OUT_NAME = "comparison.csv", "comparison.md", "left_out.csv"
_ABSENT = ""  # a key a run does not have (an older config): an empty cell


def is_operational(key: str) -> bool:
    """Whether the param ``key`` is bookkeeping (never a grouping key)."""
    return key in OPERATIONAL_KEYS or key.startswith(OPERATIONAL_PREFIXES)


def extra_metrics_for(metric: str) -> tuple[str, ...]:
    """Metrics reported next to ``metric``: the prototype accuracy and the global model's accuracy
    on the global test set beside the head accuracy (each where a run logged it)."""
    return (names.EVAL_PROTO_ACC, names.EVAL_GLOBAL_ACC) if metric == names.EVAL_HEAD_ACC else ()


def is_accuracy(metric: str) -> bool:
    """Accuracies are fractions, shown in %; every paper metric is an accuracy."""
    return metric == PAPER or "acc" in metric.rsplit("/", 1)[-1]


# ------------------------------------------------------------------------------ data


@dataclass
class Series:
    """One metric of one run: one value per step (the later point of a superseded step)."""

    steps: np.ndarray
    values: np.ndarray
    superseded: int = 0  # points replaced by a later point of the same step

    @property
    def final(self) -> float:
        return final_and_best(self.values)[0]

    def best(self, mode: str) -> float:
        return final_and_best(self.values, mode)[1]


@dataclass
class RunSeries:
    run_id: str
    experiment: str
    run_name: str
    start_time: int
    params: dict[str, str]
    metric: Series
    extras: dict[str, Series] = field(default_factory=dict)
    sim_time: Optional[Series] = None
    metric_key: str = ""  # the key ``metric`` was read from (with --metric paper: the method's paper metric)

    @property
    def seed(self) -> Optional[str]:
        return self.params.get("seed")

    @property
    def algorithm(self) -> str:
        return self.params[ALGORITHM_KEY]


@dataclass
class LeftOut:
    run_id: str
    experiment: str
    run_name: str
    status: str
    reason: str

    def line(self) -> str:
        name = f" ({self.run_name})" if self.run_name else ""
        return f"run {self.run_id}{name} in {self.experiment!r}: {self.reason}"


@dataclass
class Stat:
    """Mean and std over seeds of one figure (NaN when no run has it; std NaN for one value)."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat:
        v = np.array([x for x in values if x is not None and math.isfinite(x)], float)
        if v.size == 0:
            return cls(math.nan, math.nan, 0)
        return cls(float(v.mean()), float(v.std()) if v.size > 1 else math.nan, int(v.size))


@dataclass
class Group:
    algorithm: str
    keys: dict[str, str]  # grouping key -> value (absent keys left out)
    runs: list[RunSeries]

    @property
    def label(self) -> str:
        return " ".join([self.algorithm, *(f"{k}={v}" for k, v in self.keys.items())])

    @property
    def seeds(self) -> list[str]:
        return [r.seed if r.seed is not None else "?" for r in self.runs]

    def final(self, metric: Optional[str] = None) -> Stat:
        return Stat.of(s.final for s in self._series(metric))

    def best(self, mode: str, metric: Optional[str] = None) -> Stat:
        return Stat.of(s.best(mode) for s in self._series(metric))

    @property
    def paper(self) -> PaperMetric:
        return paper_metric(self.algorithm)

    def paper_key(self) -> str:
        """The metric its runs were read at (--metric paper: the first paper-metric key they logged)."""
        return next((r.metric_key for r in self.runs if r.metric_key), self.paper.key)

    def paper_figure(self, mode: str = "max") -> Stat:
        """The paper's statistic (final or best) of the compared metric over the group's seeds."""
        return self.final() if self.paper.stat == "final" else self.best(mode)

    def last_versions(self) -> str:
        last = sorted({int(r.metric.steps[-1]) for r in self.runs})
        return str(last[0]) if len(last) == 1 else f"{last[0]}-{last[-1]}"

    def _series(self, metric: Optional[str]) -> list[Series]:
        if metric is None:
            return [r.metric for r in self.runs]
        return [r.extras[metric] for r in self.runs if metric in r.extras]


@dataclass
class Comparison:
    experiments: list[str]
    tracking_uri: str
    metric: str
    mode: str
    group_keys: list[str]
    groups: list[Group]
    left_out: list[LeftOut]
    notes: list[str]

    @property
    def extras(self) -> list[str]:
        """Extra metrics at least one compared run has."""
        return [m for m in extra_metrics_for(self.metric) if any(m in r.extras for g in self.groups for r in g.runs)]

    @property
    def has_sim_time(self) -> bool:
        return any(r.sim_time is not None for g in self.groups for r in g.runs)

    @property
    def num_runs(self) -> int:
        return sum(len(g.runs) for g in self.groups)

    # -------------------------------------------------------------------------- table
    def rows(self) -> list[dict[str, Any]]:
        """One row per group, raw numbers (the CSV)."""
        out = []
        for g in self.groups:
            row: dict[str, Any] = {"group": g.label, ALGORITHM_KEY: g.algorithm}
            row.update({k: g.keys.get(k, _ABSENT) for k in self.group_keys})
            row.update({"n_seeds": len(g.runs), "seeds": " ".join(g.seeds), "last_version": g.last_versions()})
            if self.metric == PAPER:
                figure = g.paper_figure(self.mode)
                row.update({"paper metric": g.paper.label(g.paper_key()), "paper figure mean": figure.mean,
                            "paper figure std": figure.std, "paper metric source": g.paper.source})
            for metric in (None, *self.extras):
                name = metric or self.metric
                final, best = g.final(metric), g.best(self.mode, metric)
                row.update({f"final {name} mean": final.mean, f"final {name} std": final.std,
                            f"best {name} mean": best.mean, f"best {name} std": best.std})
                if metric is not None:
                    row[f"{name} n"] = final.n
            row["run_ids"] = " ".join(r.run_id for r in g.runs)
            out.append(row)
        return out

    def markdown(self) -> str:
        pct = " (%)"
        head = ["group", "n seeds"] + (["paper metric", "paper figure (%)"] if self.metric == PAPER else [])
        for m in (self.metric, *self.extras):
            unit = pct if is_accuracy(m) else ""
            head += [f"final {m}{unit}", f"best {m}{unit}"]
        head.append("last version")
        lines = [
            f"{self.metric}: final = at each run's last evaluation, best = {self.mode} over its evaluations; "
            f"mean ± std over seeds (population std). Experiments: {', '.join(self.experiments)} "
            f"({self.num_runs} runs in {len(self.groups)} groups).",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for g in self.groups:
            cells = [g.label, f"{len(g.runs)} ({', '.join(g.seeds)})" if g.runs else "0"]
            if self.metric == PAPER:
                cells += [g.paper.label(g.paper_key()), format_stat(g.paper_figure(self.mode), True)]
            for metric in (None, *self.extras):
                name = metric or self.metric
                final, best = g.final(metric), g.best(self.mode, metric)
                suffix = f" [{final.n} of {len(g.runs)}]" if metric is not None and 0 < final.n < len(g.runs) else ""
                cells += [format_stat(final, is_accuracy(name)) + suffix, format_stat(best, is_accuracy(name)) + suffix]
            cells.append(g.last_versions())
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if self.left_out:
            lines += ["", f"Left out ({len(self.left_out)} run{'s' if len(self.left_out) != 1 else ''}):", ""]
            lines += [f"- {lo.line()}" for lo in self.left_out]
        if self.metric == PAPER:
            lines += ["", "Paper metrics (tracking/paper_metric.py):", ""]
            lines += [f"- {a}: {pm.label()}: {pm.source}" for a, pm in
                      {g.algorithm: g.paper for g in self.groups}.items()]
        if self.notes:
            lines += ["", "Notes:", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines)


def format_stat(s: Stat, percent: bool) -> str:
    """``97.3 ± 0.5`` (in % for an accuracy); the mean alone for one seed; ``n/a`` for none."""
    if s.n == 0:
        return "n/a"
    scale, fmt = (100.0, "{:.1f}") if percent else (1.0, "{:.4g}")
    text = fmt.format(scale * s.mean)
    return text if s.n == 1 or not math.isfinite(s.std) else f"{text} ± {fmt.format(scale * s.std)}"


# ------------------------------------------------------------------------------ reading MLflow


def _client(tracking_uri: Optional[str]):
    """An MlflowClient for an existing store (a missing sqlite file is an error, never created)."""
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tracking.mlflow_tracker import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if not db.is_file():
            raise InputError(f"no MLflow store at {db} (tracking URI {uri}); pass --tracking-uri with the store the runs "
                             "were logged to (tracking.tracking_uri, $MLFLOW_TRACKING_URI, or ./mlflow.db where they ran)")
    return MlflowClient(uri), uri


def _experiments(client, experiment_names: Sequence[str], uri: str) -> dict[str, str]:
    """Experiment name -> id; unknown names are an InputError listing the experiments there."""
    from mlflow.entities import LifecycleStage

    if not experiment_names:
        raise InputError("give at least one experiment name to compare")
    found, unknown = {}, []
    for name in dict.fromkeys(experiment_names):
        exp = client.get_experiment_by_name(name)
        if exp is None or exp.lifecycle_stage == LifecycleStage.DELETED:
            unknown.append(name)
        else:
            found[name] = exp.experiment_id
    if unknown:
        existing = sorted(e.name for e in _all_experiments(client))
        raise InputError(f"unknown experiment{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} at {uri}; "
                         f"experiments there: {', '.join(existing) if existing else '(none)'}")
    return found


def _all_experiments(client) -> list:
    out, token = [], None
    while True:
        page = client.search_experiments(page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def _all_runs(client, experiment_ids: list[str]) -> list:
    out, token = [], None
    while True:
        page = client.search_runs(experiment_ids, max_results=1000, page_token=token, order_by=["attributes.start_time ASC"])
        out += list(page)
        token = page.token
        if not token:
            return out


_OLD_NAME = {new: old for old, new in names.LEGACY.items()}


def _logged_key(run, metric: str) -> Optional[str]:
    """The key ``metric`` is logged under in ``run``: today's name, or the flat name of a run
    logged before the rename; None when it has neither."""
    if metric in run.data.metrics:
        return metric
    old = _OLD_NAME.get(metric)
    if old and run.data.tags.get(names.SCHEMA_TAG) != names.SCHEMA_VERSION and old in run.data.metrics:
        return old
    return None


def read_series(client, run_id: str, key: str) -> Optional[Series]:
    """The history of ``key`` in one run, one value per step: where a step was logged more than
    once (a resumed run redid it, tag ``superseded_steps``) the latest point wins. Non-finite
    values are dropped; None when nothing is left."""
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    last: dict[int, float] = {}
    for m in points:
        last[int(m.step)] = float(m.value)
    kept = {s: v for s, v in last.items() if math.isfinite(v)}
    if not kept:
        return None
    steps = np.array(sorted(kept), dtype=np.int64)
    return Series(steps, np.array([kept[int(s)] for s in steps], float), superseded=len(points) - len(last))


def _status_reason(run) -> Optional[str]:
    status, tags = run.info.status, run.data.tags
    if status == "FINISHED":
        return None
    if status in ("RUNNING", "SCHEDULED"):
        return f"unfinished (status {status}): still running, or left so by a driver that is gone"
    if status == "FAILED":
        why = tags.get("failure_reason")
        return "failed" + (f": {why.splitlines()[0][:300]}" if why else " (no failure_reason tag)")
    if status == "KILLED":
        why = tags.get("stopped") or tags.get("rayfed_proto.stopped")
        resume = tags.get("resume_from")
        return ("killed (stopped" + (f": {why}" if why else "") + ")"
                + (f"; resume with: rayfed-proto run --resume {resume}" if resume else ""))
    return f"status {status}"


def load_runs(client, experiments: dict[str, str], metric: str) -> tuple[list[RunSeries], list[LeftOut], list[str]]:
    """The comparable runs of ``experiments`` (name -> id) with their series, the runs left out
    with their reasons, and notes (superseded points used)."""
    exp_name = {i: n for n, i in experiments.items()}
    runs = _all_runs(client, list(experiments.values()))
    children: dict[str, int] = defaultdict(int)
    for r in runs:
        parent = r.data.tags.get(PARENT_TAG)
        if parent:
            children[parent] += 1
    kept: list[RunSeries] = []
    left: list[LeftOut] = []
    notes: list[str] = []

    def leave(r, reason: str) -> None:
        left.append(LeftOut(r.info.run_id, exp_name[r.info.experiment_id], r.info.run_name or "", r.info.status, reason))

    for r in runs:
        tags, key = r.data.tags, _run_metric_key(r, metric)
        if COMPARE_TAG in tags:
            leave(r, "a comparison run (rayfed-proto compare)")
            continue
        if r.info.run_id in children:
            own = "" if key is None else f" (its own {metric} is not counted)"
            leave(r, f"parent run of {children[r.info.run_id]} nested run{'s' if children[r.info.run_id] > 1 else ''}: "
                     f"they are compared, not it{own}")
            continue
        if (reason := _status_reason(r)) is not None:
            leave(r, reason)
            continue
        if key is None:
            sweep = " (a sweep's parent run)" if "rayfed_proto.sweep" in tags else ""
            what = ("paper metric (" + ", ".join(paper_metric(r.data.params.get(ALGORITHM_KEY, "")).keys) + ")"
                    if metric == PAPER else f"{metric} metric")
            leave(r, f"no {what}{sweep}")
            continue
        if ALGORITHM_KEY not in r.data.params:
            leave(r, f"no {ALGORITHM_KEY} param (not a rayfed-proto run)")
            continue
        series = read_series(client, r.info.run_id, key)
        if series is None:
            leave(r, f"no finite {metric} value")
            continue
        extras = {}
        for m in extra_metrics_for(metric):
            if (k := _logged_key(r, m)) is not None and (s := read_series(client, r.info.run_id, k)) is not None:
                extras[m] = s
        sim = None
        if (k := _logged_key(r, names.FEDERATION_SIM_TIME_S)) is not None:
            sim = read_series(client, r.info.run_id, k)
        if series.superseded:
            notes.append(f"run {r.info.run_id} ({r.info.run_name}): {series.superseded} superseded point"
                         f"{'s' if series.superseded > 1 else ''} of {metric} (tag superseded_steps="
                         f"{tags.get('superseded_steps', '?')}); the later value of each step is used")
        kept.append(RunSeries(r.info.run_id, exp_name[r.info.experiment_id], r.info.run_name or "",
                              int(r.info.start_time or 0), dict(r.data.params), series, extras, sim,
                              names.resolve(key, warn=False)))
    return kept, left, notes


def _run_metric_key(run, metric: str) -> Optional[str]:
    """The logged key of ``metric`` in ``run``; for :data:`PAPER`, of the first key of its method's
    paper metric that the run logged (None: none)."""
    if metric != PAPER:
        return _logged_key(run, metric)
    algorithm = run.data.params.get(ALGORITHM_KEY)
    if algorithm is None:
        return None
    return next((k for m in paper_metric(algorithm).keys if (k := _logged_key(run, m)) is not None), None)


# ------------------------------------------------------------------------------ grouping


def grouping_keys(runs: Sequence[RunSeries]) -> list[str]:
    """Config params (besides ``algorithm.name``) whose value differs between ``runs``; an
    ``algorithm.*`` option only when it differs between runs of the same method. A run without a
    key (an older config) is not a difference; operational params never are."""
    values: dict[str, set[str]] = defaultdict(set)
    per_method: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in runs:
        for k, v in r.params.items():
            if k == ALGORITHM_KEY or is_operational(k):
                continue
            if k.startswith("algorithm."):
                per_method[(k, r.algorithm)].add(v)
            else:
                values[k].add(v)
    keys = {k for k, vs in values.items() if len(vs) > 1} | {k for (k, _), vs in per_method.items() if len(vs) > 1}
    return sorted(keys)


def _natural(v: str):
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


def group_runs(runs: Sequence[RunSeries]) -> tuple[list[Group], list[str], list[LeftOut]]:
    """Groups (sorted by method, then key values), the grouping keys, and the runs superseded by a
    later run of the same group and seed."""
    keys = grouping_keys(runs)
    by_key: dict[tuple, list[RunSeries]] = defaultdict(list)
    for r in runs:
        by_key[(r.algorithm, tuple((k, r.params[k]) for k in keys if k in r.params))].append(r)
    groups, superseded = [], []
    for (algorithm, items), members in by_key.items():
        latest: dict[str, RunSeries] = {}
        unseeded = []
        for r in sorted(members, key=lambda r: r.start_time):
            if r.seed is None:
                unseeded.append(r)
                continue
            if r.seed in latest:
                old = latest[r.seed]
                superseded.append(LeftOut(old.run_id, old.experiment, old.run_name, "FINISHED",
                                          f"superseded by the later run {r.run_id} of the same group and seed {r.seed}"))
            latest[r.seed] = r
        kept = sorted(latest.values(), key=lambda r: _natural(r.seed or "")) + unseeded
        groups.append(Group(algorithm, dict(items), kept))
    groups.sort(key=lambda g: (g.algorithm, [_natural(g.keys.get(k, "")) for k in keys]))
    return groups, keys, superseded


def compare(experiments: Sequence[str], tracking_uri: Optional[str] = None, metric: str = DEFAULT_METRIC,
            mode: str = "max") -> Comparison:
    """Read and group the runs of ``experiments``. InputError (exit 2 in the CLI) for an unknown
    experiment, a bad mode, or experiments with nothing to compare (the reasons listed)."""
    if mode not in ("max", "min"):
        raise InputError(f"mode {mode!r}: allowed max (best = highest value) or min (best = lowest)")
    metric = metric if metric == PAPER else names.resolve(metric)
    client, uri = _client(tracking_uri)
    found = _experiments(client, experiments, uri)
    runs, left, notes = load_runs(client, found, metric)
    groups, keys, superseded = group_runs(runs)
    left += superseded
    if not groups:
        why = "\n".join(f"  - {lo.line()}" for lo in left) or "  (the experiments hold no runs)"
        hint = ""
        if any(lo.reason.startswith(f"no {metric}") for lo in left):
            logged = sorted({k for r in _all_runs(client, list(found.values())) for k in r.data.metrics
                             if not k.startswith(("zz_client/", "client/", "model/", "system/"))})
            if logged:
                hint = f"\nmetrics these runs have: {', '.join(logged[:40])}{' ...' if len(logged) > 40 else ''}"
        raise InputError(f"nothing to compare in {', '.join(map(repr, found))} for metric {metric!r}; every run is "
                         f"left out:\n{why}{hint}")
    return Comparison(list(found), uri, metric, mode, keys, groups, left, notes)


# ------------------------------------------------------------------------------ outputs


def _slug(metric: str) -> str:
    return metric.replace("/", "_")


def write_tables(comp: Comparison, out_dir: str | Path) -> dict[str, Path]:
    """``comparison.csv`` (raw numbers, one row per group), ``comparison.md`` (the formatted
    table, the runs left out and why) and ``left_out.csv``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = comp.rows()
    paths = {"csv": out / CSV_NAME, "markdown": out / MARKDOWN_NAME, "left_out": out / LEFT_OUT_NAME}
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()} for row in rows)
    paths["markdown"].write_text(comp.markdown() + "\n")
    with paths["left_out"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run_id", "experiment", "run_name", "status", "reason"])
        w.writerows([lo.run_id, lo.experiment, lo.run_name, lo.status, lo.reason] for lo in comp.left_out)
    return paths


def _mean_std_on(xs: list[np.ndarray], ys: list[np.ndarray], interpolate: bool) -> tuple[np.ndarray, ...]:
    """Mean and std over runs at common x: the points every run covers (interpolated linearly
    between a run's own points when ``interpolate``, else only x values every run has); when the
    runs share no such point, every point with the runs that have it."""
    if interpolate:
        lo, hi = max(x[0] for x in xs), min(x[-1] for x in xs)
        grid = np.unique(np.concatenate(xs))
        common = grid[(grid >= lo) & (grid <= hi)]
        if common.size:
            stack = np.stack([np.interp(common, x, y) for x, y in zip(xs, ys, strict=True)])
            return common, stack.mean(0), stack.std(0), np.full(common.size, len(xs))
        grid_vals = [[np.interp(g, x, y) if x[0] <= g <= x[-1] else np.nan for x, y in zip(xs, ys, strict=True)]
                     for g in grid]
    else:
        common = xs[0]
        for x in xs[1:]:
            common = np.intersect1d(common, x)
        grid = common if common.size else np.unique(np.concatenate(xs))
        maps = [dict(zip(x.tolist(), y.tolist(), strict=True)) for x, y in zip(xs, ys, strict=True)]
        grid_vals = [[m.get(g, np.nan) for m in maps] for g in grid.tolist()]
    vals = np.array(grid_vals, float).reshape(len(grid), len(xs))
    n = np.isfinite(vals).sum(1)
    with warnings.catch_warnings():  # a point no run has: NaN, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        return grid.astype(float), np.nanmean(vals, 1), np.nanstd(vals, 1), n


def group_curve(group: Group, x: str = "version", metric: Optional[str] = None,
                ) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(x, mean, std, runs per point) of the group's metric (or of the extra ``metric``, over the
    runs that have it) against the version, or against simulated time (``x="sim_time"``: each
    run's points paired with its ``federation/sim_time_s`` at the same version, interpolated onto
    common times); None when no run has the x axis."""
    xs, ys = [], []
    for r in group.runs:
        if x == "version":
            series = r.metric if metric is None else r.extras.get(metric)
            if series is not None:
                xs.append(series.steps.astype(float))
                ys.append(series.values)
            continue
        if r.sim_time is None:
            continue
        t = dict(zip(r.sim_time.steps.tolist(), r.sim_time.values.tolist(), strict=True))
        pairs = sorted((t[s], v) for s, v in zip(r.metric.steps.tolist(), r.metric.values.tolist(), strict=True) if s in t)
        if pairs:
            xs.append(np.array([p[0] for p in pairs]))
            ys.append(np.array([p[1] for p in pairs]))
    if not xs:
        return None
    return _mean_std_on(xs, ys, interpolate=(x != "version"))


def plot_comparison(comp: Comparison, path: str | Path, x: str = "version") -> Path:
    """The metric against the server version (or simulated time, ``x="sim_time"``): per group a
    mean line over its seeds and a ± std band (an error bar where there is one point)."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    from rayfed_proto.tracking.plots import _finish, _new_axes

    fig, ax = _new_axes(9.0, 5.2)
    percent = is_accuracy(comp.metric)
    has_data = False
    styles = ("-", "--", "-.", ":")
    absent = []
    for i, g in enumerate(comp.groups):  # a group keeps its colour in every plot
        curve = group_curve(g, x)
        if curve is None:
            absent.append(g.label)
            continue
        xs, mean, std, _ = curve
        color, style = f"C{i % 10}", styles[(i // 10) % len(styles)]
        label = f"{g.label} (n={len(g.runs)})"
        lo, hi = mean - np.nan_to_num(std), mean + np.nan_to_num(std)
        if percent:
            lo, hi = np.clip(lo, 0.0, 1.0), np.clip(hi, 0.0, 1.0)
        if xs.size == 1:
            ax.errorbar(xs, mean, yerr=[mean - lo, hi - mean], fmt="o", color=color, capsize=4, label=label)
        else:
            markers = x == "version" and xs.size <= 40  # against time the points are interpolated, not evaluations
            ax.plot(xs, mean, color=color, linestyle=style, linewidth=1.8, label=label,
                    marker="o" if markers else None, markersize=3)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        has_data = True
    if percent:
        ax.set_ylim(0.0, 1.01)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    if x == "version":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("server version (aggregations)")
    else:
        ax.set_xlabel("simulated time (s, virtual clock)")
    shown = "paper metric (each method's own, see the table)" if comp.metric == PAPER else comp.metric
    ax.set_ylabel(shown + (" (%)" if percent else ""))
    against = "server version" if x == "version" else "simulated time"
    ax.set_title(f"{shown} vs {against}: mean ± std over seeds")
    if absent and has_data:
        ax.text(0.99, 0.02, "no simulated time: " + ", ".join(absent), transform=ax.transAxes, ha="right", va="bottom",
                fontsize=8, color="0.4")
    if len(ax.get_legend_handles_labels()[0]) == 1:  # _finish draws a legend from two series on
        ax.legend(loc="best", fontsize=9)
    return _finish(fig, ax, path, has_data)


def write_outputs(comp: Comparison, out_dir: str | Path) -> dict[str, Path]:
    """The tables and the plots (``<metric>_vs_version.png``, and ``<metric>_vs_sim_time.png``
    when a compared run has ``federation/sim_time_s``) under ``out_dir``."""
    out = Path(out_dir)
    paths = write_tables(comp, out)
    paths["plot_version"] = plot_comparison(comp, out / f"{_slug(comp.metric)}_vs_version.png", "version")
    if comp.has_sim_time:
        paths["plot_sim_time"] = plot_comparison(comp, out / f"{_slug(comp.metric)}_vs_sim_time.png", "sim_time")
    return paths


PAPER_KEY = "eval/paper_metric"  # --metric paper: each group's mean of its own method's paper metric, one chart


def chart_key(comp: Comparison) -> str:
    """The key the compared metric is logged under in the comparison's runs: the metric itself
    (``eval/head_acc``), or :data:`PAPER_KEY` for ``--metric paper`` (each group's own key in its
    param ``paper_metric``)."""
    return PAPER_KEY if comp.metric == PAPER else comp.metric


def log_comparison(comp: Comparison, files: dict[str, Path], experiment_name: str = DEFAULT_EXPERIMENT_NAME) -> str:
    """A FINISHED parent run in ``experiment_name`` (same store) holding the tables and plots as
    artifacts (plots under ``plots/``), the table as ``tables/comparison.json`` and as the run's
    description, with one nested run per group (:func:`log_group_run`: the group's mean over its
    seeds per version under the metric's own name, so MLflow draws the groups in one chart). Every
    one is tagged :data:`COMPARE_TAG` so that a later compare leaves it out. Returns the parent's id."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tracking.mlflow_tracker import run_tags

    client = MlflowClient(comp.tracking_uri)
    exp_id = _experiment_id(client, experiment_name)
    tags = {**run_tags(), COMPARE_TAG: "1", "rayfed_proto.compare.experiments": ", ".join(comp.experiments)[:5000],
            "rayfed_proto.compare.metric": comp.metric}
    run_id = start_parent(client, exp_id, f"compare {' '.join(comp.experiments)}"[:250], tags)
    try:
        params = {"experiments": ", ".join(comp.experiments), "metric": comp.metric, "mode": comp.mode,
                  "group_keys": ", ".join([ALGORITHM_KEY, *comp.group_keys]), "groups": len(comp.groups),
                  "runs": comp.num_runs, "runs_left_out": len(comp.left_out), "tracking_uri": comp.tracking_uri}
        log_params(client, run_id, params)
        children = [log_group_run(client, exp_id, run_id, comp, g) for g in comp.groups]
        best = _best_group(comp)
        if best is not None:  # the run list sorts the comparisons by the best group's figure, nesting kept
            client.log_metric(run_id, chart_key(comp), best.final().mean, step=int(best.runs[0].metric.steps[-1]))
        client.set_tag(run_id, "mlflow.note.content", comparison_note(comp, exp_id, children)[:60000])
        for key, p in files.items():
            client.log_artifact(run_id, str(p), "plots" if key.startswith("plot") else None)
        client.log_table(run_id, pd.DataFrame(comp.rows()), "tables/comparison.json")
    except BaseException:
        end_run(client, run_id, "FAILED")
        raise
    end_run(client, run_id, "FINISHED")
    return run_id


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # created a moment ago by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _best_group(comp: Comparison) -> Optional[Group]:
    """The group with the best mean final value (highest, or lowest with mode min); None without one."""
    scored = [(g.final().mean, g) for g in comp.groups if math.isfinite(g.final().mean)]
    if not scored:
        return None
    pick = max if comp.mode == "max" else min
    return pick(scored, key=lambda item: item[0])[1]


def group_points(comp: Comparison, group: Group) -> list[tuple[str, float, int]]:
    """(key, value, step) of a group's curves: per version the mean over its seeds of the compared
    metric (under :func:`chart_key`) and of each extra metric under its own name, the std over
    seeds as ``<key>_seed_std`` (two seeds or more); the compared metric first."""
    from rayfed_proto.tracking.group_metrics import curve_points

    points = []
    for metric, key in ((None, chart_key(comp)), *((m, m) for m in comp.extras)):
        curve = group_curve(group, "version", metric)
        if curve is not None:
            points += curve_points(key, curve[:3], int(curve[3].max()))
    return points


def log_group_run(client, exp_id: str, parent_id: str, comp: Comparison, group: Group) -> str:
    """One compared group as a FINISHED run nested under the comparison run: named by its label
    (``fedsa``, ``fedsa algorithm.lam=0.1``), params ``algorithm.name``, its grouping keys, its
    seeds, and its curves (:func:`group_points`)."""
    from rayfed_proto.tracking.group_metrics import log_points
    from rayfed_proto.tracking.mlflow_tracker import run_tags

    tags = {**run_tags(), COMPARE_TAG: "1", "mlflow.note.content": _group_note(comp, group)}
    params = {ALGORITHM_KEY: group.algorithm, **group.keys, "seeds": ",".join(group.seeds), "n_seeds": len(group.runs),
              "run_ids": " ".join(r.run_id for r in group.runs)}
    if comp.metric == PAPER:
        params["paper_metric"] = group.paper.label(group.paper_key())
    run_id = start_run(client, exp_id, group.label[:250], tags, params, role="comparison", parent_run_id=parent_id)
    log_points(client, run_id, group_points(comp, group))
    end_run(client, run_id, "FINISHED")
    return run_id


def _group_note(comp: Comparison, group: Group) -> str:
    metric = chart_key(comp)
    shown = f"{metric} (= {group.paper.label(group.paper_key())})" if comp.metric == PAPER else metric
    final, best = group.final(), group.best(comp.mode)
    return (f"{group.label}: {len(group.runs)} runs (seeds {', '.join(group.seeds)}). `{metric}`: per version the mean "
            f"over the runs of {shown} at the versions every run evaluated, `{metric}_seed_std` the std (population). "
            f"Final (each run's last evaluation): {format_stat(final, is_accuracy(comp.metric))}; best ({comp.mode}): "
            f"{format_stat(best, is_accuracy(comp.metric))}.")


def comparison_note(comp: Comparison, exp_id: str, children: list[str]) -> str:
    """The comparison run's description: what its runs hold, a link to the Compare page of the
    groups' runs (``algorithm.name`` against the metric), the table."""
    from rayfed_proto.tracking.links import compare_url, relative

    key = chart_key(comp)
    lines = [f"One nested run per group: `{key}` is its mean over the seeds per version (`{key}_seed_std` the std), "
             "so the Chart view draws the groups in one chart; the banded plot is `plots/`. This run's own "
             f"`{key}` is the best group's mean final value ({comp.mode}), for sorting the comparisons."]
    if len(children) > 1:
        lines.append(f"[Compare the groups]({relative(compare_url('', exp_id, children))}) (MLflow's Compare page: "
                     f"the grouping keys against `{key}`).")
    return "\n\n".join([*lines, comp.markdown()])


def default_out_dir() -> Path:
    return Path.cwd() / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
