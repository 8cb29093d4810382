"""``rayfed-proto reproduce PAPER [TABLE]``: plan the runs of a published table, run them as seed
groups under one MLflow parent run, and set our mean ± std beside the paper's numbers.

* :func:`make_plan` checks the paper, table, scale, columns and seeds and builds every run's
  config (no Ray): what ``--dry-run`` prints;
* :func:`execute` runs each (setting, method) once per seed (``runtime.seeds.run_seeds``, each
  group nested under the reproduction's parent run) and reads each seed's history for the paper's
  metric;
* :func:`result_rows`, :func:`format_markdown` and :func:`write_outputs` make the table: one line
  per (column, published row), the paper's number, ours and the difference in points.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import ConfigError, ConfigIssue, ExperimentConfig
from rayfed_proto.reproduce.metrics import domain_metric, history_value, paper_metric
from rayfed_proto.reproduce.published import PAPERS
from rayfed_proto.reproduce.settings import DEFAULT_SEEDS, MAIN_TABLE, REPRODUCTIONS, SCALES, Method, Reproduction

PAPER_TAG = "rayfed_proto.reproduce"  # the parent run's "<paper>/<table>/<scale>"
CSV_NAME, MD_NAME = "reproduce.csv", "reproduce.md"


def available() -> list[tuple[str, str]]:
    """Every (paper, table) that can be reproduced, papers in order, main table first."""
    return sorted(REPRODUCTIONS, key=lambda k: (list(PAPERS).index(k[0]), k[1] != MAIN_TABLE[k[0]], k[1]))


def list_text() -> str:
    """What ``reproduce --list`` prints: every table, its columns, the methods it runs."""
    lines = ["tables rayfed-proto reproduce can run (PAPER TABLE; * the paper's main table, run when TABLE is omitted):"]
    for paper, table in available():
        r = REPRODUCTIONS[(paper, table)]
        star = "*" if MAIN_TABLE[paper] == table else " "
        lines.append(f" {star} {paper:<11} {table:<7} {r.published.label}: {r.published.caption[:90]}")
        runnable = [c.name for c in r.columns if r.settings[c.setting].full is not None]
        lines.append(f"      methods: {', '.join(m.algorithm for m in r.methods)}; columns at --scale full: "
                     f"{', '.join(runnable)}; at --scale small: {', '.join(r.small_columns)}")
    return "\n".join(lines)


def find(paper: str, table: Optional[str]) -> Reproduction:
    """The reproduction of ``paper``'s ``table`` (None: its main table), or a ConfigError listing what there is."""
    if paper not in MAIN_TABLE:
        raise ConfigError([ConfigIssue(key="PAPER", value=paper, allowed=", ".join(MAIN_TABLE) +
                                       " (rayfed-proto reproduce --list)")])
    table = table or MAIN_TABLE[paper]
    if (paper, table) not in REPRODUCTIONS:
        tables = [t for p, t in available() if p == paper]
        raise ConfigError([ConfigIssue(key="TABLE", value=table, allowed=f"for {paper}: {', '.join(tables)}")])
    return REPRODUCTIONS[(paper, table)]


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PlannedRun:
    """One seed group: a setting (the columns it gives) run with one method."""

    setting: str
    columns: tuple[str, ...]
    method: Method
    preset: str
    overrides: tuple[str, ...]  # the scale's, then the method's, then the user's
    config: ExperimentConfig


@dataclass
class Plan:
    reproduction: Reproduction
    scale: str
    seeds: list[int]
    columns: list[str]
    runs: list[PlannedRun]
    skipped: dict[str, str] = field(default_factory=dict)  # column -> why it is not run at this scale

    @property
    def title(self) -> str:
        r = self.reproduction
        return f"{r.paper} {r.published.label} ({r.table}), scale {self.scale}"

    def describe(self) -> str:
        lines = [f"reproduce {self.title}: {len(self.runs)} seed group{'s' if len(self.runs) != 1 else ''} x "
                 f"{len(self.seeds)} seeds ({', '.join(map(str, self.seeds))}) = {len(self.runs) * len(self.seeds)} runs"]
        if self.scale == "small":
            lines.append(f"NOT the paper's experiment: {self.reproduction.small_note}")
        for i, run in enumerate(self.runs, 1):
            lines.append(f"  {i}. {run.method.algorithm} on {run.preset} -> {', '.join(run.columns)}")
            lines.append(f"     --set {' --set '.join(run.overrides)}" if run.overrides else "     (the preset as it is)")
        lines += [f"  not run: {c}: {why}" for c, why in self.skipped.items()]
        return "\n".join(lines)


def _check_columns(r: Reproduction, scale: str, columns: Optional[Sequence[str]]) -> tuple[list[str], dict[str, str]]:
    names = [c.name for c in r.columns]
    if columns:
        bad = [c for c in columns if c not in names]
        if bad:
            raise ConfigError([ConfigIssue(key="--columns", value=c, allowed=f"columns of {r.paper} {r.table}: "
                                           + ", ".join(names)) for c in bad])
        blocked = [c for c in columns if scale == "full" and r.settings[r.column(c).setting].full is None]
        if blocked:
            raise ConfigError([ConfigIssue(key="--columns", value=c, allowed=(
                f"not at --scale full ({r.settings[r.column(c).setting].unavailable}); columns at full scale: "
                + ", ".join(n for n in names if r.settings[r.column(n).setting].full is not None))) for c in blocked])
        return list(dict.fromkeys(columns)), {}
    if scale == "small":
        return list(r.small_columns), {}
    chosen = [n for n in names if r.settings[r.column(n).setting].full is not None]
    return chosen, {n: r.settings[r.column(n).setting].unavailable for n in names if n not in chosen}


def make_plan(paper: str, table: Optional[str] = None, *, scale: str = "small", seeds: Optional[Sequence[int]] = None,
              columns: Optional[Sequence[str]] = None, methods: Optional[Sequence[str]] = None,
              overrides: Sequence[str] = ()) -> Plan:
    """Every run of the reproduction, its config built and checked (no Ray, nothing written).
    ``methods``: a subset of the table's algorithms (default: all of them)."""
    from rayfed_proto.runtime.seeds import check_no_seed_override, check_seeds

    r = find(paper, table)
    if scale not in SCALES:
        raise ConfigError([ConfigIssue(key="--scale", value=scale, allowed=", ".join(SCALES))])
    seed_list = check_seeds(list(DEFAULT_SEEDS) if seeds is None else seeds)
    check_no_seed_override(overrides)
    chosen, skipped = _check_columns(r, scale, columns)
    ours = [m.algorithm for m in r.methods]
    bad = [m for m in methods or () if m not in ours]
    if bad:
        raise ConfigError([ConfigIssue(key="--methods", value=m, allowed=f"methods of {r.paper} {r.table}: "
                                       + ", ".join(ours)) for m in bad])
    runs = []
    for setting in dict.fromkeys(r.column(c).setting for c in chosen):
        scaled = getattr(r.settings[setting], scale)
        cols = tuple(c for c in chosen if r.column(c).setting == setting)
        for method in (m for m in r.methods if not methods or m.algorithm in methods):
            items = (*scaled.overrides, *method.overrides, *(method.small_overrides if scale == "small" else ()),
                     *overrides)
            runs.append(PlannedRun(setting, cols, method, scaled.preset, items,
                                   method_config(scaled.preset, method, items)))
    return Plan(r, scale, seed_list, chosen, runs, skipped)


def method_config(preset: str, method: Method, overrides: Sequence[str]) -> ExperimentConfig:
    """The preset run with ``method``: a baseline's own algorithm section replaces the preset's
    (one method's options are not another's); the paper's own method keeps the preset's."""
    import yaml

    from rayfed_proto.config import build_config
    from rayfed_proto.preset_files import resolve_config_arg

    path = Path(resolve_config_arg(preset))
    raw = yaml.safe_load(path.read_text()) or {}
    if method.options is not None:
        raw["algorithm"] = {"name": method.algorithm, **copy.deepcopy(method.options)}
    elif (raw.get("algorithm") or {}).get("name") != method.algorithm:
        raise ValueError(f"preset {preset} runs {(raw.get('algorithm') or {}).get('name')!r}, not {method.algorithm!r}: "
                         "give the method its options")
    return build_config(raw, list(overrides), f"{path} run with {method.algorithm}")


def cell_metric(r: Reproduction, scale: str, method: Method, row: str, column: str) -> Optional[tuple[str, str]]:
    """The metric (key, 'best'|'final') of our run set beside ``row`` x ``column``; None where we
    have no such figure (a per-domain column for a method without a global model)."""
    key, mode = method.rows[row] or paper_metric(method.algorithm)
    domain = r.column(column).domain
    if domain is None:
        return key, mode
    if not key.startswith("eval/global_acc"):
        return None
    # the paper metric of a domain method is the mean over domains: a domain's column reads the
    # global model's accuracy on that domain
    base = key.removesuffix("_domain_mean")
    return domain_metric(base, r.domains.get(scale, {}).get(domain, domain)), mode


# ------------------------------------------------------------------------------ running


@dataclass
class Outcome:
    plan: Plan
    values: dict[tuple[str, str], list[float]]  # (row, column) -> one value per finished seed
    rows: list[dict[str, Any]]
    markdown: str
    files: dict[str, Path]
    parent_run_id: Optional[str]
    tracking_uri: Optional[str]
    experiment_name: str
    failures: list[str]


def execute(plan: Plan, *, out_dir: Optional[Path] = None, experiment_name: Optional[str] = None,
            progress: bool = True, echo: Callable[[str], None] = print) -> Outcome:
    """Run the plan's seed groups under one MLflow parent run; the table is written (and logged)
    whatever happens to a run: a failed group leaves its cells empty and is named in the notes."""
    from rayfed_proto.runtime.seeds import run_seeds
    from rayfed_proto.tracking.mlflow_tracker import resolve_tracking_uri

    r = plan.reproduction
    first = plan.runs[0].config
    experiment = experiment_name or f"reproduce_{r.paper}"
    uri = resolve_tracking_uri(first.tracking.tracking_uri) if first.tracking.enabled else None
    out = Path(out_dir) if out_dir else Path(f"reproduce-{r.paper}-{r.table}-{plan.scale}-"
                                             f"{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    parent = _start_parent(plan, uri, experiment) if uri else None
    values: dict[tuple[str, str], list[float]] = {}
    failures: list[str] = []
    status = "FAILED"
    try:
        for i, run in enumerate(plan.runs, 1):
            echo(f"== {i}/{len(plan.runs)}: {run.method.algorithm} on {run.setting} ({run.preset}) ==")
            cfg = _nested(run.config, uri, experiment, parent)
            try:
                group = run_seeds(cfg, plan.seeds, progress=progress, echo=echo)
            except Exception as e:  # noqa: BLE001 - one failed group must not lose the others' table
                failures.append(f"{run.method.algorithm} on {run.setting}: {type(e).__name__}: {e}")
                echo(f"failed: {failures[-1]}")
                continue
            if group.status != "FINISHED":
                failures.append(f"{run.method.algorithm} on {run.setting}: {group.reason}")
            _collect(plan, run, group, values)
        status = "FAILED" if failures else "FINISHED"
    finally:  # also on Ctrl-C: the table of what finished
        rows = result_rows(plan, values)
        md = format_markdown(plan, rows, failures)
        files = write_outputs(rows, md, out)
        if parent:
            _log_parent(uri, parent, plan, rows, md, files, status)
    return Outcome(plan, values, rows, md, files, parent, uri, experiment, failures)


def _nested(cfg: ExperimentConfig, uri: Optional[str], experiment: str, parent: Optional[str]) -> ExperimentConfig:
    from rayfed_proto.config import build_config, set_dotted

    raw = cfg.to_dict()
    set_dotted(raw, "tracking.experiment_name", experiment)
    if uri:
        set_dotted(raw, "tracking.tracking_uri", uri)
    if parent:
        set_dotted(raw, "tracking.parent_run_id", parent)
    return build_config(raw)


def _collect(plan: Plan, run: PlannedRun, group, values: dict) -> None:
    """Each finished seed's value of each cell this run fills."""
    import pandas as pd

    for seed in plan.seeds:
        rec = group.records[seed]
        folder = Path(rec.output_dir) if rec.output_dir else None
        if rec.status != "finished" or folder is None or not (folder / "history.parquet").is_file():
            continue
        history = pd.read_parquet(folder / "history.parquet")
        for row in run.method.rows:
            for column in run.columns:
                metric = cell_metric(plan.reproduction, plan.scale, run.method, row, column)
                if metric is not None:
                    values.setdefault((row, column), []).append(history_value(history, *metric))


# ------------------------------------------------------------------------------ the table


def _stats(xs: list[float]) -> tuple[float, float, int]:
    import numpy as np

    ok = np.array([x for x in xs if math.isfinite(x)], dtype=float)
    if not ok.size:
        return math.nan, math.nan, 0
    return float(ok.mean()), (float(ok.std(ddof=0)) if ok.size > 1 else math.nan), int(ok.size)


def result_rows(plan: Plan, values: dict[tuple[str, str], list[float]]) -> list[dict[str, Any]]:
    """One row per (column, published row of a method we ran): the paper's number and std, ours
    (mean and population std over the seeds, in %), n, and ours minus the paper's (points)."""
    r, pub = plan.reproduction, plan.reproduction.published
    ran = {run.method.algorithm for run in plan.runs}
    out = []
    for column in plan.columns:
        for method in (m for m in r.methods if m.algorithm in ran):
            for row in method.rows:
                metric = cell_metric(r, plan.scale, method, row, column)
                cell = pub.cell(row, column)
                mean, std, n = _stats(values.get((row, column), []))
                mean, std = 100.0 * mean, 100.0 * std
                paper = cell[0] if cell else math.nan
                out.append({"paper": r.paper, "table": pub.label, "column": column, "row": row,
                            "algorithm": method.algorithm, "scale": plan.scale,
                            "metric": f"{metric[0]} ({metric[1]})" if metric else "none (no such figure)",
                            "paper_value": paper, "paper_std": cell[1] if cell and cell[1] is not None else math.nan,
                            "ours_mean": mean, "ours_std": std, "n": n,
                            "difference": mean - paper if math.isfinite(mean) and math.isfinite(paper) else math.nan})
    return out


def _num(x: float, sign: bool = False) -> str:
    return "-" if not math.isfinite(x) else (f"{x:+.2f}" if sign else f"{x:.2f}")


def _pm(mean: float, std: float) -> str:
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.2f} ± {std:.2f}" if math.isfinite(std) else f"{mean:.2f}"


def format_markdown(plan: Plan, rows: list[dict[str, Any]], failures: Sequence[str] = ()) -> str:
    """The table as Markdown, with its header: the paper's table and caption, the metrics, the
    scale (a small table says it is not the paper's experiment) and the notes."""
    r, pub = plan.reproduction, plan.reproduction.published
    lines = [f"### {r.paper}: {pub.label} ({r.table}), scale {plan.scale}", "",
             f"Paper: {pub.source}. {pub.caption}", "",
             f"Paper's metric: {pub.metric}. Ours: mean ± std (population) over seeds "
             f"{', '.join(map(str, plan.seeds))}, in %; the metric of each row is named in its line.", ""]
    if plan.scale == "small":
        lines += [f"**Small scale, NOT the paper's experiment**: {r.small_note}. The paper's numbers are beside ours "
                  "for orientation only.", ""]
    lines += [f"Note: {n}." for n in r.notes]
    lines += [f"Not run at this scale: {c} ({why})." for c, why in plan.skipped.items()]
    lines += [f"FAILED: {f}" for f in failures]
    lines += ["", "| column | method | our metric | paper | ours (n) | ours - paper |", "|---|---|---|---:|---:|---:|"]
    for row in rows:
        ours = _pm(row["ours_mean"], row["ours_std"]) + (f" ({row['n']})" if row["n"] else "")
        lines.append(f"| {row['column']} | {row['row']} | {row['metric']} | {_pm(row['paper_value'], row['paper_std'])} "
                     f"| {ours} | {_num(row['difference'], sign=True)} |")
    return "\n".join(lines)


def write_outputs(rows: list[dict[str, Any]], markdown: str, out: Path) -> dict[str, Path]:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / CSV_NAME, "markdown": out / MD_NAME}
    pd.DataFrame(rows).to_csv(files["csv"], index=False)
    files["markdown"].write_text(markdown + "\n")
    return files


# ------------------------------------------------------------------------------ MLflow


def metric_key(*parts: str) -> str:
    """An MLflow metric key from table names (``k=3|20/CIFAR-10`` has characters MLflow refuses)."""
    return "/".join(re.sub(r"[^A-Za-z0-9_\-. :]", "_", p) for p in parts)


def _start_parent(plan: Plan, uri: str, experiment: str) -> str:
    import mlflow
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tracking.mlflow_tracker import run_tags
    from rayfed_proto.tracking.parent_runs import start_parent

    r = plan.reproduction
    mlflow.set_tracking_uri(uri)
    exp = mlflow.set_experiment(experiment)
    client = MlflowClient(uri)
    tags = {**run_tags(), PAPER_TAG: f"{r.paper}/{r.table}/{plan.scale}", "paper": r.paper,
            "paper_table": r.published.label, "scale": plan.scale}
    params = {"paper": r.paper, "table": r.table, "scale": plan.scale, "seeds": ",".join(map(str, plan.seeds)),
              "columns": "; ".join(plan.columns), "methods": ",".join(m.algorithm for m in r.methods),
              "source": r.published.source}
    for i, run in enumerate(plan.runs):
        params[f"run.{i}"] = f"{run.method.algorithm} on {run.preset} --set {' '.join(run.overrides)}"
    return start_parent(client, exp.experiment_id, f"reproduce {r.paper} {r.table} {plan.scale}", tags, params)


def _log_parent(uri: str, run_id: str, plan: Plan, rows: list[dict[str, Any]], md: str, files: dict[str, Path],
                status: str) -> None:
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tracking.parent_runs import end_run, store_may_fail

    with store_may_fail(f"log the reproduction's table to MLflow run {run_id}"):  # the table is on disk and printed
        client = MlflowClient(uri)
        now = int(time.time() * 1000)
        metrics = []
        for row in rows:
            for name, value in (("ours_mean", row["ours_mean"]), ("ours_std", row["ours_std"]),
                                ("paper", row["paper_value"]), ("difference", row["difference"])):
                if math.isfinite(value):
                    metrics.append(Metric(metric_key("reproduce", row["row"], row["column"], name), value, now, 0))
        for i in range(0, len(metrics), 500):
            client.log_batch(run_id, metrics=metrics[i : i + 500])
        client.log_batch(run_id, tags=[RunTag("mlflow.note.content", md[:60000])])
        for path in files.values():
            client.log_artifact(run_id, str(path))
        end_run(client, run_id, status)
