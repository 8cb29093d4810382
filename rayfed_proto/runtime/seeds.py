"""Repeated seeds: one experiment run once per seed, as one MLflow parent run with a nested run
per seed (``rayfed-proto run CONFIG --seeds 0 1 2``, ``rayfed_proto.run(..., seeds=[0, 1, 2])``).

A seed group lives in one folder, ``<tracking.output_dir>/<time>-<algorithm>-<dataset>-seeds-0-1-2/``:

* ``seeds.json``: the seeds, the parent MLflow run and store, and per seed its status
  (``pending``, ``running``, ``interrupted``, ``failed``, ``finished``), run folder and MLflow run;
* ``config.yaml``: the shared config (each seed's run is it with ``seed: <s>``);
* ``seed-<s>/<time>-<algorithm>-<dataset>/``: the seed's run folder, as a plain run's
  (``run --resume`` works on it alone too);
* ``summary.txt`` and ``seeds.csv``: per seed the final and best ``eval/head_acc`` (and
  ``eval/proto_acc``, ``eval/global_acc`` when the method logs them, and the keys of its paper
  metric, ``tracking.paper_metric``), then their mean and standard deviation, and a line naming
  the method's paper metric with its mean ± std (the parent's tag ``rayfed_proto.paper_metric``);
* ``.lock``: held by the driver running the group (a second one is refused).

``rayfed-proto run --resume GROUP`` continues the group: a finished seed is skipped, an
interrupted or failed one is resumed from its run folder's checkpoint (started afresh when it has
none), a seed not started yet runs.

The parent run's params are the shared config (``seed`` left out, ``seeds`` added), its tag
``rayfed_proto.seeds`` lists the seeds, its tag ``rfp.role`` is ``parent``; each seed's run is named
what differs first (the run list cuts names short): ``seed=<s> <algorithm> <dataset>`` in a group
of its own, ``<algorithm> seed=<s> <dataset>`` when several methods share the experiment
(``run --methods``, :func:`run_seeds`'s ``method_first``), and nested by the tag
``mlflow.parentRunId`` (set by the tracker from ``tracking.parent_run_id``, as for a sweep's
trials). The parent's metrics are, per version, the mean over the finished seeds under the
metric's own name (``eval/head_acc``: drawn in one chart with the seeds' runs, and its last value,
the mean of the seeds' final values, is what the run list shows and sorts by) and the std as
``eval/head_acc_seed_std`` (tracking/group_metrics.py); the final and best figures over the seeds
are tags ``seeds/<column>`` (``seeds/eval/head_acc_final``: ``0.8123 ± 0.0040 (n=3)``), in the
table of its description and artifacts. The parent ends FINISHED when every seed finished, KILLED
when the group was stopped (tags ``stopped``, ``resume_from``), FAILED otherwise (tag
``failure_reason``).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import (
    SEED_MAX,
    ConfigError,
    ConfigIssue,
    ExperimentConfig,
    InputError,
    build_config,
    load_config,
    set_dotted,
)

log = logging.getLogger("rayfed_proto")

STATE_FILE = "seeds.json"
KIND = "rayfed_proto.seeds"
SEEDS_TAG = "rayfed_proto.seeds"  # the parent run's seeds, "0,1,2"
GROUP_TAG = "rayfed_proto.seed_group"  # the parent run's group folder
# final and best of each, when a seed's history has it (plus the keys of the method's paper metric)
SUMMARY_METRICS = ("eval/head_acc", "eval/proto_acc", "eval/global_acc")
PAPER_METRIC_TAG = "rayfed_proto.paper_metric"  # the parent's tag: the per_seed column of the paper metric
STD_NOTE = ("std: population standard deviation over the finished seeds (numpy's std, as rayfed-proto compare and "
            "the bench tables use); none for a single seed")


SEEDS_FINISHED_TAG = "rayfed_proto.seeds_finished"  # the number of seeds the parent's mean and std are over


def seeds_tag(column: str) -> str:
    """The parent's tag of a final or best figure over the seeds: ``seeds_tag("eval/head_acc_final") ->
    "seeds/eval/head_acc_final"`` (a tag: one value per group, no chart)."""
    return f"seeds/{column}"


def check_seeds(seeds: Any, key: str = "--seeds") -> list[int]:
    """The seeds as a list of distinct ints from 0 to ``SEED_MAX``, or a ConfigError naming ``key``."""
    allowed = f"one or more distinct integers from 0 to 2**32 - 1 = {SEED_MAX} (e.g. 0 1 2)"
    try:
        items = None if isinstance(seeds, (str, bytes, Mapping)) else list(seeds)
    except TypeError:  # not iterable
        items = None
    if not items:
        raise ConfigError([ConfigIssue(key=key, value=seeds, allowed=allowed)])
    issues = [ConfigIssue(key=key, value=s, allowed=allowed) for s in items
              if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s <= SEED_MAX]
    if issues:
        raise ConfigError(issues)
    out = [int(s) for s in items]
    dupes = sorted({s for s in out if out.count(s) > 1})
    if dupes:
        raise ConfigError([ConfigIssue(key=key, value=out, allowed=f"{allowed}; repeated: {', '.join(map(str, dupes))}")])
    return out


def check_no_seed_override(overrides: Sequence[str] | None) -> None:
    """``--set seed=N`` together with ``--seeds``: refused (each seed's run sets ``seed``)."""
    from rayfed_proto.config import parse_override

    for item in overrides or []:
        key, value = parse_override(item)
        if key == "seed":
            raise ConfigError([ConfigIssue(key="seed", value=value, allowed=(
                "not with --seeds: each seed's run sets it (give the seeds to --seeds)"))])


def is_group(folder: str | Path) -> bool:
    """Whether ``folder`` is a seed group's folder (it holds ``seeds.json``)."""
    return (Path(folder) / STATE_FILE).is_file()


@dataclass
class SeedRecord:
    """One seed of a group, as ``seeds.json`` records it."""

    status: str = "pending"  # pending, running, interrupted, failed, finished
    output_dir: Optional[str] = None
    run_id: Optional[str] = None
    final_version: Optional[int] = None
    reason: Optional[str] = None


@dataclass
class SeedGroup:
    """A seed group after ``run_seeds`` / ``resume_seeds`` returned: the records, the table."""

    output_dir: Path
    seeds: list[int]
    name: str
    parent_run_id: Optional[str]
    tracking_uri: Optional[str]
    experiment_name: str
    records: dict[int, SeedRecord] = field(default_factory=dict)
    per_seed: Any = None  # pandas DataFrame: one row per seed (status, version, run, final and best metrics)
    stats: Any = None  # pandas DataFrame: rows mean and std of the metric columns over the finished seeds
    summary: str = ""
    status: str = "RUNNING"  # FINISHED, FAILED (a seed failed), KILLED (stopped)
    reason: Optional[str] = None
    method_first: bool = False  # seed run names lead with the method (several methods in one experiment)

    # -------------------------------------------------------------------------- seeds.json
    def save(self) -> None:
        data = {"kind": KIND, "name": self.name, "seeds": self.seeds, "parent_run_id": self.parent_run_id,
                "tracking_uri": self.tracking_uri, "experiment_name": self.experiment_name,
                "method_first": self.method_first, "runs": {str(s): vars(r) for s, r in self.records.items()}}
        path = self.output_dir / STATE_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, folder: str | Path) -> SeedGroup:
        folder = Path(folder).resolve()
        path = folder / STATE_FILE
        try:
            data = json.loads(path.read_text())
            if data.get("kind") != KIND:
                raise ValueError(f"kind is {data.get('kind')!r}, not {KIND!r}")
            seeds = check_seeds(data["seeds"], key=f"{path} seeds")
            records = {s: SeedRecord(**data.get("runs", {}).get(str(s), {})) for s in seeds}
            return cls(folder, seeds, str(data["name"]), data.get("parent_run_id"), data.get("tracking_uri"),
                       str(data.get("experiment_name") or ""), records, method_first=bool(data.get("method_first", False)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path} is not a readable seed-group record ({e}); pass the folder printed as "
                             "'outputs:' by rayfed-proto run --seeds") from None

    # -------------------------------------------------------------------------- per seed
    def seed_config(self, shared: ExperimentConfig, seed: int) -> ExperimentConfig:
        """The shared config as seed ``seed``'s run: its seed, run name, parent run and folder."""
        raw = copy.deepcopy(shared.to_dict())
        raw["seed"] = seed
        set_dotted(raw, "tracking.output_dir", str(self.output_dir / f"seed-{seed}"))
        set_dotted(raw, "tracking.run_name", seed_run_name(shared, seed, self.method_first))
        if self.parent_run_id:
            set_dotted(raw, "tracking.parent_run_id", self.parent_run_id)
        if shared.checkpoint.dir:  # one store per seed, or the seeds would share checkpoints
            set_dotted(raw, "checkpoint.dir", f"{shared.checkpoint.dir.rstrip('/')}/seed-{seed}")
        return build_config(raw, source=f"{self.output_dir / 'config.yaml'} (seed {seed})")

    def seed_folder(self, seed: int) -> Optional[Path]:
        """The seed's run folder: the recorded one, else the newest run folder under ``seed-<s>``
        (a driver that died before recording it)."""
        rec = self.records[seed]
        if rec.output_dir and (Path(rec.output_dir) / "config.yaml").is_file():
            return Path(rec.output_dir)
        found = sorted(p for p in (self.output_dir / f"seed-{seed}").glob("*") if (p / "config.yaml").is_file())
        return found[-1] if found else None


def _base_name(cfg: ExperimentConfig) -> str:
    return cfg.tracking.run_name or f"{cfg.algorithm.name}-{cfg.data.name}"


def seed_run_name(cfg: ExperimentConfig, seed: int, method_first: bool = False) -> str:
    """A seed's run name, what differs first (the run list cuts names short): ``seed=1 fedsa digits``
    in a group of one method (``seed=1 <tracking.run_name>`` when set); with ``method_first`` (several
    methods in one experiment, ``run --methods``) ``fedsa seed=1 digits`` (``fedsa seed=1 <run_name>``)."""
    if method_first:
        return f"{cfg.algorithm.name} seed={seed} {cfg.tracking.run_name or cfg.data.name}"[:250]
    return f"seed={seed} {cfg.tracking.run_name or f'{cfg.algorithm.name} {cfg.data.name}'}"[:250]


def _seeds_label(seeds: list[int]) -> str:
    shown = seeds if len(seeds) <= 8 else seeds[:3]
    label = "-".join(map(str, shown))
    return label if len(seeds) <= 8 else f"{label}-and-{len(seeds) - 3}-more"


def group_name(cfg: ExperimentConfig, seeds: list[int]) -> str:
    """The parent run's name: ``<algorithm>-<dataset>-seeds-0-1-2`` (``tracking.run_name``, when
    set, instead of ``<algorithm>-<dataset>``)."""
    return f"{_base_name(cfg)}-seeds-{_seeds_label(seeds)}"


# ------------------------------------------------------------------------------ entry points


def run_seeds(cfg: ExperimentConfig, seeds: Sequence[int], *, progress: bool = True,
              echo: Callable[[str], None] = print, method_first: bool = False) -> SeedGroup:
    """Run ``cfg`` once per seed in a new group folder (see the module doc); returns the group
    with its table. ``method_first``: the seeds' run names lead with the method (:func:`seed_run_name`;
    for groups of several methods in one experiment). A stop (Ctrl-C, SIGTERM, ``faults.stop_at_version``) raises
    :class:`~rayfed_proto.runtime.signals.RunInterrupted` naming the group folder to resume."""
    from rayfed_proto.runtime.runfolder import RunFolderLock
    from rayfed_proto.tracking import make_tracker

    seeds = check_seeds(seeds)
    for seed in seeds:  # every seed's config is checked before anything is created (the folder, the parent run)
        build_config({**cfg.to_dict(), "seed": seed}, source=f"--seeds {seed}")
    tracker = make_tracker(cfg.tracking)  # the store, resolved and created now: every seed's run uses it
    shared = cfg
    if tracker.uri is not None:
        raw = shared.to_dict()
        set_dotted(raw, "tracking.tracking_uri", tracker.uri)
        shared = build_config(raw)
    name = group_name(cfg, seeds)
    folder = _new_group_folder(cfg, seeds)
    group = SeedGroup(folder, seeds, name, None, tracker.uri, cfg.tracking.experiment_name,
                      {s: SeedRecord() for s in seeds}, method_first=method_first)
    with RunFolderLock(folder):
        (folder / "config.yaml").write_text(
            f"# the shared config of the seed group {name}: each seed's run uses it with seed: <s> (see {STATE_FILE})\n"
            + shared.to_yaml())
        group.save()
        if tracker.uri is not None:
            group.parent_run_id = _start_parent(group, shared)
            group.save()
        echo(f"seed group {name}: {len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds))}); "
             f"folder {folder} (resume with: rayfed-proto run --resume {folder})")
        _run_group(group, shared, overrides=None, progress=progress, echo=echo)
    return group


def resume_seeds(folder: str | Path, overrides: Optional[list[str]] = None, *, progress: bool = True,
                 echo: Callable[[str], None] = print) -> SeedGroup:
    """Continue the seed group in ``folder``: finished seeds are skipped, interrupted or failed
    ones resumed from their run folder, the others run. ``overrides`` (``KEY=VALUE``) apply to
    every seed as with ``run --resume --set`` (only how the runs go on; the caller checks that)."""
    from rayfed_proto.runtime.runfolder import RunFolderLock

    folder = Path(folder).resolve()
    with RunFolderLock(folder):  # first: a second driver of the same group is refused at once
        group = SeedGroup.load(folder)
        shared = load_config(folder / "config.yaml", overrides)
        if group.parent_run_id and group.tracking_uri:
            _reopen_parent(group)
        echo(f"resuming seed group {group.name} from {folder}")
        _run_group(group, shared, overrides=overrides, progress=progress, echo=echo)
    return group


# ------------------------------------------------------------------------------ the group's loop


def _new_group_folder(cfg: ExperimentConfig, seeds: list[int]) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    out = Path(cfg.tracking.output_dir).resolve() / f"{stamp}-{cfg.algorithm.name}-{cfg.data.name}-seeds-{_seeds_label(seeds)}"
    try:
        out.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        raise PermissionError(f"cannot create the seed group's folder {out} ({e}); set tracking.output_dir to a "
                              "writable folder") from None
    return out


def _plan(group: SeedGroup, shared: ExperimentConfig, seed: int, overrides, echo) -> tuple[str, Optional[Path], Any]:
    """What to do with ``seed`` now: ("skip", folder, None), ("resume", folder, cfg) or ("fresh", None, cfg)."""
    from rayfed_proto.runtime import runfolder
    from rayfed_proto.runtime.checkpoint import CheckpointError
    from rayfed_proto.runtime.preparation import checkpoint_store

    folder = group.seed_folder(seed)
    if folder is not None:
        cfg = load_config(folder / "config.yaml", overrides)
        done = runfolder.finished_version(folder)
        if done is not None and cfg.federation.rounds <= done:
            return "skip", folder, None
        try:
            usable = checkpoint_store(cfg, folder).latest() is not None
        except CheckpointError as e:
            echo(f"seed {seed}: no usable checkpoint in {folder} ({e}); starting it afresh")
            usable = False
        if usable:
            return "resume", folder, cfg
        if group.records[seed].status != "pending":
            echo(f"seed {seed}: its run folder {folder} has no checkpoint; starting it afresh")
    return "fresh", None, group.seed_config(shared, seed)


def _run_group(group: SeedGroup, shared: ExperimentConfig, *, overrides, progress: bool, echo) -> None:
    """Each seed in turn, then the table; a stop anywhere (also between seeds) ends the parent
    KILLED and raises RunInterrupted naming the group folder."""
    from rayfed_proto.runtime.signals import RunInterrupted

    seed = group.seeds[0]
    failed: list[str] = []
    try:
        for i, seed in enumerate(group.seeds, 1):
            _run_seed(group, shared, seed, i, overrides, progress, echo, failed)
        _summarise(group)
        group.status = "FAILED" if failed else "FINISHED"
        group.reason = "; ".join(failed) or None
        _log_summary(group)
        _end_parent(group, group.status, {"failure_reason": group.reason[:5000]} if group.reason else {})
    except RunInterrupted:
        raise
    except KeyboardInterrupt:  # between seeds, or before a run's own handlers were in place
        if group.records[seed].status == "running":
            _record_folder(group, seed, "interrupted", None)
        raise _stopped(group, seed, f"seed group stopped at once (at seed {seed})", "SIGINT", 0) from None


def _run_seed(group: SeedGroup, shared: ExperimentConfig, seed: int, i: int, overrides, progress: bool, echo,
              failed: list[str]) -> None:
    from rayfed_proto.runtime import runfolder
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.progress import NoProgressError
    from rayfed_proto.runtime.signals import RunInterrupted

    rec = group.records[seed]
    action, folder, cfg = _plan(group, shared, seed, overrides, echo)
    if action == "skip":
        info = runfolder.read_run_info(folder) or {}
        rec.status, rec.output_dir, rec.reason = "finished", str(folder), None
        rec.final_version, rec.run_id = runfolder.finished_version(folder), info.get("run_id", rec.run_id)
        group.save()
        echo(f"seed {seed} ({i} of {len(group.seeds)}): finished already (version {rec.final_version}), skipped")
        return
    echo(f"seed {seed} ({i} of {len(group.seeds)}): " + (f"resuming {folder}" if action == "resume" else "starting"))
    rec.status, rec.reason = "running", None
    rec.output_dir = str(folder) if folder is not None else None
    group.save()
    try:
        result = run_experiment(cfg, progress=progress, echo=echo, resume_dir=folder)
    except RunInterrupted as e:  # drained and checkpointed (or stopped at once by a second Ctrl-C)
        rec.status, rec.output_dir = "interrupted", str(e.output_dir)
        rec.run_id = (runfolder.read_run_info(e.output_dir) or {}).get("run_id") or rec.run_id
        group.save()
        first = str(e).split("\nResume with:")[0].split("\nStart again with:")[0]
        raise _stopped(group, seed, f"seed {seed}: {first}", e.signal_name, e.version) from None
    except NoProgressError as e:  # the seed's run failed (its MLflow run is FAILED); the others still run
        _record_folder(group, seed, "failed", str(e))
        failed.append(f"seed {seed}: {e}")
        echo(f"seed {seed} failed: {e}")
        return
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # bad input or an unexpected error: it would hit the next seeds too
        _record_folder(group, seed, "failed", f"{type(e).__name__}: {e}")
        group.status, group.reason = "FAILED", f"seed {seed}: {type(e).__name__}: {e}"
        _end_parent(group, "FAILED", {"failure_reason": group.reason[:5000]})
        raise
    rec.status, rec.output_dir, rec.run_id = "finished", str(result.output_dir), result.run_id
    rec.final_version, rec.reason = result.final_version, None
    group.save()
    echo(f"seed {seed}: finished at version {result.final_version}")


def _record_folder(group: SeedGroup, seed: int, status: str, reason: Optional[str]) -> None:
    from rayfed_proto.runtime import runfolder

    rec = group.records[seed]
    folder = group.seed_folder(seed)
    rec.status, rec.reason = status, reason
    if folder is not None:
        rec.output_dir = str(folder)
        rec.run_id = (runfolder.read_run_info(folder) or {}).get("run_id", rec.run_id)
    group.save()


def _stopped(group: SeedGroup, seed: int, what: str, signal_name: str, version: int):
    """The group stopped while seed ``seed`` ran: the parent KILLED, a message naming the group
    folder to resume."""
    from rayfed_proto.runtime.signals import RunInterrupted

    done = [s for s in group.seeds if group.records[s].status == "finished"]
    todo = [s for s in group.seeds if group.records[s].status in ("pending", "failed") and s != seed]
    group.status, group.reason = "KILLED", what
    _end_parent(group, "KILLED", {"stopped": what[:5000], "resume_from": str(group.output_dir)})
    msg = (f"{what}\nseed group {group.name}: finished seeds: {', '.join(map(str, done)) or 'none'}; seed {seed} "
           f"goes on from its checkpoint (or starts afresh without one); still to run: {', '.join(map(str, todo)) or 'none'}.\n"
           f"Resume the group with: rayfed-proto run --resume {group.output_dir}")
    return RunInterrupted(msg, group.output_dir, version, signal_name)


# ------------------------------------------------------------------------------ the table


def _final_and_best(history, key: str) -> tuple[float, float]:
    """(final, best) of ``key`` in a seed's history (tracking.paper_metric.final_and_best: the one home)."""
    from rayfed_proto.tracking.paper_metric import final_and_best

    if history is None or key not in history:
        return math.nan, math.nan
    return final_and_best(history[key].to_numpy(dtype=float))


def _group_algorithm(group: SeedGroup) -> Optional[str]:
    """The group's ``algorithm.name``, from its shared config.yaml (None when unreadable)."""
    import yaml

    try:
        raw = yaml.safe_load((Path(group.output_dir) / "config.yaml").read_text(encoding="utf-8")) or {}
        name = (raw.get("algorithm") or {}).get("name")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    return name if isinstance(name, str) else None


def summary_metrics(algorithm: Optional[str]) -> tuple[str, ...]:
    """The metrics a group's table reports (each when a seed logged it): :data:`SUMMARY_METRICS` and
    the keys of the method's paper metric (``tracking.paper_metric``)."""
    from rayfed_proto.tracking.paper_metric import paper_metric

    extra = paper_metric(algorithm).keys if algorithm else ()
    return tuple(dict.fromkeys((*SUMMARY_METRICS, *extra)))


def _summarise(group: SeedGroup, metrics: Optional[Sequence[str]] = None) -> None:
    """``per_seed``, ``stats`` and the text table, from each finished seed's history.parquet:
    the final and best of each of ``metrics`` (default :func:`summary_metrics`) a seed logged."""
    import pandas as pd

    metrics = tuple(metrics) if metrics is not None else summary_metrics(_group_algorithm(group))
    rows = []
    present: list[str] = []
    for seed in group.seeds:
        rec = group.records[seed]
        row: dict[str, Any] = {"seed": seed, "status": rec.status, "final_version": rec.final_version,
                               "run_id": rec.run_id, "output_dir": rec.output_dir}
        history = None
        if rec.status == "finished" and rec.output_dir and (Path(rec.output_dir) / "history.parquet").is_file():
            history = pd.read_parquet(Path(rec.output_dir) / "history.parquet")
        for key in metrics:
            final, best = _final_and_best(history, key)
            row[f"{key}_final"], row[f"{key}_best"] = final, best
            if math.isfinite(final) and key not in present:
                present.append(key)
        rows.append(row)
    columns = [f"{k}_{w}" for k in metrics if k in present for w in ("final", "best")]
    per_seed = pd.DataFrame(rows, columns=["seed", "status", "final_version", "run_id", "output_dir",
                                           *[f"{k}_{w}" for k in metrics for w in ("final", "best")]])
    per_seed = per_seed[["seed", "status", "final_version", "run_id", "output_dir", *columns]].set_index("seed")
    per_seed["final_version"] = per_seed["final_version"].astype("Int64")  # a whole number, or missing
    finished = per_seed[per_seed["status"] == "finished"][columns].astype(float)
    std = finished.std(ddof=0) if len(finished) > 1 else finished.mean() * math.nan  # no spread from one seed
    stats = pd.DataFrame({"mean": finished.mean(), "std": std}).T if columns else pd.DataFrame(index=["mean", "std"])
    stats["n"] = len(finished)
    group.per_seed, group.stats = per_seed, stats
    group.summary = format_seed_table(group)


def summarise(group: SeedGroup, metrics: Sequence[str]) -> SeedGroup:
    """The group's table again with the chosen ``metrics`` (``eval/global_acc``, ...; each a final
    and a best column where a seed logged it): ``per_seed``, ``stats`` and ``summary`` replaced."""
    from rayfed_proto.tracking.metric_names import resolve

    _summarise(group, [resolve(m) for m in metrics])
    return group


def _pct(x: Any) -> str:
    return f"{100.0 * float(x):.2f}%" if x is not None and math.isfinite(float(x)) else "-"


def format_seed_table(group: SeedGroup) -> str:
    """An ASCII table: one row per seed (status, final version, each metric's final and best),
    then the mean and standard deviation over the finished seeds."""
    import pandas as pd

    per_seed, stats = group.per_seed, group.stats
    columns = [c for c in per_seed.columns if c.startswith("eval/")]
    head = ["seed", "status", "version", *[c.rsplit("_", 1)[0] + f" ({c.rsplit('_', 1)[1]})" for c in columns]]
    body = [[str(s), r["status"], "-" if pd.isna(r["final_version"]) else str(int(r["final_version"])),
             *[_pct(r[c]) for c in columns]] for s, r in per_seed.iterrows()]
    n = int(stats["n"].iloc[0]) if len(stats) else 0
    foot = [["mean", f"n={n}", "", *[_pct(stats.loc["mean", c]) for c in columns]],
            ["std", "", "", *[_pct(stats.loc["std", c]) for c in columns]]]
    widths = [max(len(row[i]) for row in [head, *body, *foot]) for i in range(len(head))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    title = f"Seeds summary: {group.name} ({n} of {len(group.seeds)} seed{'s' if len(group.seeds) != 1 else ''} finished)"
    lines = [title, rule, line(head), rule, *map(line, body), rule, *map(line, foot), rule, STD_NOTE]
    paper = paper_metric_line(group)
    if paper:
        lines.append(paper)
    if group.parent_run_id:
        lines.append(f"MLflow parent run: {group.parent_run_id} @ {group.tracking_uri}")
    lines.append(f"group folder: {group.output_dir}")
    return "\n".join(lines)


def paper_metric_column(group: SeedGroup) -> Optional[tuple[str, Any]]:
    """(column of ``per_seed``/``stats``, PaperMetric) of the method's paper metric, when the group's
    seeds logged one of its keys; None otherwise."""
    from rayfed_proto.tracking.paper_metric import paper_metric

    algorithm = _group_algorithm(group)
    if algorithm is None or group.per_seed is None:
        return None
    pm = paper_metric(algorithm)
    logged = [c.rsplit("_", 1)[0] for c in group.per_seed.columns if c.startswith("eval/")]
    key = pm.key_in(logged)
    return (f"{key}_{pm.stat}", pm) if key is not None else None


def paper_metric_line(group: SeedGroup) -> str:
    """``paper metric: eval/proto_acc (best) = 81.20% ± 0.40% over 3 seeds (source)``, or ""."""
    found = paper_metric_column(group)
    if found is None:
        return ""
    column, pm = found
    n = int(group.stats["n"].iloc[0]) if len(group.stats) else 0
    mean, std = group.stats.loc["mean", column], group.stats.loc["std", column]
    spread = f" ± {_pct(std)}" if n > 1 else ""
    return (f"paper metric: {pm.label(column.rsplit('_', 1)[0])} = {_pct(mean)}{spread} over {n} seed"
            f"{'s' if n != 1 else ''} ({pm.source})")


# ------------------------------------------------------------------------------ the parent run


def _client(group: SeedGroup):
    from mlflow.tracking import MlflowClient

    return MlflowClient(group.tracking_uri)


def _start_parent(group: SeedGroup, shared: ExperimentConfig) -> str:
    """The group's parent run (RUNNING until the group ends), with the shared config as params."""
    import mlflow

    from rayfed_proto.tracking.metric_names import SCHEMA_TAG, SCHEMA_VERSION
    from rayfed_proto.tracking.mlflow_tracker import run_tags
    from rayfed_proto.tracking.parent_runs import start_parent

    mlflow.set_tracking_uri(group.tracking_uri)
    try:
        experiment = mlflow.set_experiment(group.experiment_name)
    except Exception as e:  # created by another run a moment ago
        if "already exists" not in str(e).lower() and "unique" not in str(e).lower():
            raise
        experiment = mlflow.set_experiment(group.experiment_name)
    tags = {**run_tags(), SCHEMA_TAG: SCHEMA_VERSION, SEEDS_TAG: ",".join(map(str, group.seeds)),
            GROUP_TAG: str(group.output_dir), "algorithm": shared.algorithm.name, "dataset": shared.data.name,
            "mode": shared.federation.mode, "model_group": shared.model.group}
    params = {k: v for k, v in shared.flat().items() if k != "seed"} | {"seeds": ",".join(map(str, group.seeds))}
    # parent_run_id: the group itself nested under a run the user named
    return start_parent(_client(group), experiment.experiment_id, group.name, tags, params,
                        parent_run_id=shared.tracking.parent_run_id)


def _reopen_parent(group: SeedGroup) -> None:
    from rayfed_proto.tracking.parent_runs import reopen_parent

    try:  # the tags left by the earlier stop are no longer true
        reopen_parent(_client(group), group.parent_run_id, ("stopped", "resume_from", "failure_reason"))
    except Exception as e:  # deleted, or another store
        raise InputError(f"the seed group's MLflow parent run {group.parent_run_id} is not in {group.tracking_uri} "
                         f"({e}); resume with the store the group was started with") from None


def _log_summary(group: SeedGroup) -> None:
    """The table into the group folder (summary.txt, seeds.csv) and onto the parent run: the
    curves over the seeds as metrics (:func:`_log_curves`), the final and best figures as tags, the
    table as its description and artifacts."""
    import pandas as pd
    from mlflow.entities import RunTag

    (group.output_dir / "summary.txt").write_text(group.summary + "\n")
    rows = [{**r, "final_version": "" if pd.isna(r["final_version"]) else int(r["final_version"])}
            for r in group.per_seed.reset_index().to_dict("records")]
    rows += [{"seed": stat, "status": f"n={int(group.stats['n'].iloc[0])}" if stat == "mean" else "",
              **group.stats.loc[stat].drop("n").to_dict()} for stat in ("mean", "std")]
    table = pd.DataFrame(rows)
    table.to_csv(group.output_dir / "seeds.csv", index=False)
    if not group.parent_run_id:
        return
    try:
        client = _client(group)
        n = int(group.stats["n"].iloc[0])
        tags = [RunTag("mlflow.note.content", parent_note(group)), RunTag(SEEDS_FINISHED_TAG, str(n))]
        if (paper := paper_metric_column(group)) is not None:  # which seeds/<column> is the paper's figure
            tags.append(RunTag(PAPER_METRIC_TAG, paper[0]))
        tags += [RunTag(seeds_tag(column), _stat_text(group, column)) for column in group.stats.columns.drop("n")]
        client.log_batch(group.parent_run_id, tags=tags)
        _log_curves(group, client)  # eval/head_acc first: the compare page's parallel coordinates take the first metric
        client.log_artifact(group.parent_run_id, str(group.output_dir / "summary.txt"))
        client.log_artifact(group.parent_run_id, str(group.output_dir / "seeds.csv"))
        client.log_table(group.parent_run_id, table.astype({"seed": str, "final_version": str}), "tables/seeds.json")
    except Exception as e:  # the table is on disk and printed: the store being gone does not undo the seeds
        log.warning("could not log the seed group's summary to MLflow run %s: %s", group.parent_run_id, e)


def _stat_text(group: SeedGroup, column: str) -> str:
    """``0.8123 ± 0.0040 (n=3)`` (the mean alone for one seed, ``-`` for none)."""
    n = int(group.stats["n"].iloc[0])
    mean, std = float(group.stats.loc["mean", column]), float(group.stats.loc["std", column])
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.4f}" + (f" ± {std:.4f}" if math.isfinite(std) else "") + f" (n={n})"


def parent_note(group: SeedGroup) -> str:
    """The parent's description: what its metrics are, a link to the Compare page of its seeds'
    runs (on the seed against the metric), and the table."""
    from rayfed_proto.tracking.links import compare_url, relative

    lines = ["This parent's `eval/head_acc` (and the other `eval/` and `train/loss` series): per version the mean "
             "over the finished seeds, its std beside it as `eval/head_acc_seed_std`; its last value, which the run "
             "list shows and sorts by, is the mean of the seeds' final values. The final and best figures over the "
             "seeds are the tags `seeds/...` and the table below."]
    run_ids = [group.records[s].run_id for s in group.seeds if group.records[s].status == "finished"]
    experiment = _experiment_id(group)
    if experiment and len([r for r in run_ids if r]) > 1:
        link = relative(compare_url("", experiment, [r for r in run_ids if r]))
        lines.append(f"[Compare the seeds' runs]({link}) (MLflow's Compare page: `seed` against `eval/head_acc`).")
    return "\n\n".join([*lines, f"```\n{group.summary}\n```"])


def _experiment_id(group: SeedGroup) -> Optional[str]:
    try:
        return _client(group).get_run(group.parent_run_id).info.experiment_id
    except Exception:
        return None


def _log_curves(group: SeedGroup, client) -> None:
    """Per version, the mean over the finished seeds as the parent's ``eval/head_acc`` ... and the std as
    ``eval/head_acc_seed_std`` ... (tracking/group_metrics.py), and the banded plot."""
    import pandas as pd

    from rayfed_proto.tracking.group_metrics import log_seed_curves

    folders = [group.seed_folder(s) for s in group.seeds if group.records[s].status == "finished"]
    histories = [pd.read_parquet(f / "history.parquet") for f in folders if f is not None and (f / "history.parquet").is_file()]
    if histories:
        log_seed_curves(client, group.parent_run_id, histories, group.output_dir, group.name)


def _end_parent(group: SeedGroup, status: str, tags: dict[str, str]) -> None:
    from rayfed_proto.tracking.parent_runs import end_parent

    if group.parent_run_id:  # the store's URI: a store that cannot be opened warns too
        end_parent(group.tracking_uri, group.parent_run_id, status, tags,
                   what=f"the seed group's MLflow run {group.parent_run_id}")
