"""The Python API (``from rayfed_proto import run, load_config``), for notebooks and scripts.

    from rayfed_proto import run

    result = run("fedsa_digits", set={"federation.rounds": 10})
    result.history          # pandas DataFrame: one row per evaluated version, MLflow metric names as columns
    result.final            # the last evaluation's metrics, {"eval/head_acc": 0.81, ...}
    result.run_id           # the MLflow run

    group = run("fedsa_digits", set={"federation.rounds": 10}, seeds=[0, 1, 2])
    group.stats             # DataFrame: mean and std of the final and best accuracies over the seeds
    group.results[1].history

Everything the CLI refuses is refused here with the same exceptions (``ConfigError`` for a bad
config, ``InputError`` for bad input found before training), with the same messages. Importing
this module is cheap: Ray, PyTorch, MLflow and pandas are imported when a run starts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Optional, Union

from rayfed_proto.config import ConfigError, ConfigIssue, ExperimentConfig, InputError, build_config
from rayfed_proto.config import load_config as _load_file
from rayfed_proto.preset_files import resolve_config_arg

ConfigLike = Union[ExperimentConfig, Mapping[str, Any], str, PathLike, None]
Overrides = Union[Mapping[str, Any], list[str], tuple[str, ...], None]

__all__ = ["Result", "SeedsResult", "load_config", "run"]


def _override_items(overrides: Overrides, key: str) -> list[str]:
    """``["federation.rounds=5"]`` as given, or a mapping ``{"federation.rounds": 5}`` as the
    same ``KEY=VALUE`` items (values written as JSON, which the override parser reads as YAML)."""
    if overrides is None:
        return []
    allowed = ("a list of 'KEY=VALUE' strings (as --set takes) or a mapping of dotted keys to values, "
               "e.g. {'federation.rounds': 5}")
    if isinstance(overrides, Mapping):
        items = []
        for k, v in overrides.items():
            if not isinstance(k, str) or not k.strip():
                raise ConfigError([ConfigIssue(key=key, value=k, allowed="keys: dotted config keys such as 'federation.rounds'")])
            if isinstance(v, float) and not math.isfinite(v):
                text = ".nan" if math.isnan(v) else (".inf" if v > 0 else "-.inf")
            else:
                try:
                    text = json.dumps(v)
                except TypeError:
                    raise ConfigError([ConfigIssue(key=k, value=v, allowed=(
                        "a YAML value: a number, string, bool, None, or a list or mapping of them"))]) from None
            items.append(f"{k}={text}")
        return items
    if isinstance(overrides, (list, tuple)) and all(isinstance(i, str) for i in overrides):
        return list(overrides)
    raise ConfigError([ConfigIssue(key=key, value=overrides, allowed=allowed)])


def load_config(config: ConfigLike = None, overrides: Overrides = None) -> ExperimentConfig:
    """A validated :class:`ExperimentConfig`, as ``rayfed-proto validate`` builds it.

    ``config``: a preset name (``"fedsa_digits"``), a YAML path, a mapping (the YAML's content),
    an ``ExperimentConfig``, or None for the default preset. ``overrides``: ``--set`` items
    (``["federation.rounds=5"]``) or a mapping of dotted keys (``{"federation.rounds": 5}``).
    Raises ``ConfigError`` naming each bad key, its value and what is allowed."""
    items = _override_items(overrides, "overrides")
    if isinstance(config, ExperimentConfig):
        return build_config(config.to_dict(), items, "<ExperimentConfig>")
    if isinstance(config, Mapping):
        return build_config(dict(config), items, "<mapping>")
    if config is None or isinstance(config, (str, PathLike)):
        return _load_file(resolve_config_arg(None if config is None else str(config)), items)
    raise ConfigError([ConfigIssue(key="config", value=type(config).__name__, allowed=(
        "a preset name, a YAML path, a mapping, an ExperimentConfig, or None (the default preset)"))])


# ------------------------------------------------------------------------------ results


@dataclass
class Result:
    """One run: ``history`` (a pandas DataFrame, one row per evaluated version, the column
    ``version`` then the MLflow metric names), ``final`` (the last evaluation's metrics, NaN
    left out), ``run_id`` and ``tracking_uri`` (the MLflow run; None with tracking off),
    ``output_dir`` (the run folder), ``final_version``, ``summary`` (the printed table)."""

    run_id: Optional[str]
    tracking_uri: Optional[str]
    output_dir: Path
    final_version: int
    history: Any  # pandas.DataFrame
    final: dict[str, float] = field(default_factory=dict)
    summary: str = ""

    @classmethod
    def from_run(cls, result) -> Result:
        """From the driver's ``RunResult``."""
        from rayfed_proto.tracking.report import history_to_frame

        frame = history_to_frame(result.history)
        return cls(result.run_id, result.tracking_uri, Path(result.output_dir), result.final_version, frame,
                   _last_row(frame), result.summary)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Result:
        """From a finished run's folder (``history.parquet``, ``run.json``, ``finished.json``, ``summary.txt``)."""
        import pandas as pd

        from rayfed_proto.runtime import runfolder

        folder = Path(folder)
        if not (folder / "history.parquet").is_file() or runfolder.finished_version(folder) is None:
            raise InputError(f"{folder} is not the folder of a finished run (no history.parquet or finished.json)")
        frame = pd.read_parquet(folder / "history.parquet")
        info = runfolder.read_run_info(folder) or {}
        summary = (folder / "summary.txt").read_text().rstrip("\n") if (folder / "summary.txt").is_file() else ""
        return cls(info.get("run_id"), info.get("tracking_uri"), folder, int(runfolder.finished_version(folder)), frame,
                   _last_row(frame), summary)

    def __repr__(self) -> str:
        acc = self.final.get("eval/head_acc")
        return (f"Result(run_id={self.run_id!r}, final_version={self.final_version}, "
                + (f"eval/head_acc={acc:.4f}, " if acc is not None else "") + f"output_dir='{self.output_dir}')")


def _last_row(frame) -> dict[str, float]:
    if frame is None or len(frame) == 0:
        return {}
    row = frame.iloc[-1]
    return {str(k): (int(v) if k == "version" else float(v)) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


@dataclass
class SeedsResult:
    """A seed group (``run(..., seeds=[...])``): ``results`` (seed -> :class:`Result`, the finished
    seeds), ``per_seed`` (DataFrame indexed by seed: status, final version, MLflow run, final and
    best ``eval/head_acc`` / ``eval/proto_acc``), ``stats`` (DataFrame, rows ``mean`` and ``std``
    over the finished seeds, column ``n``; the population std, as numpy's, NaN for one seed),
    ``run_id`` (the MLflow parent run), ``output_dir`` (the group folder), ``status``
    (``FINISHED`` or ``FAILED``), ``summary``."""

    seeds: list[int]
    results: dict[int, Result]
    per_seed: Any  # pandas.DataFrame
    stats: Any  # pandas.DataFrame
    run_id: Optional[str]
    tracking_uri: Optional[str]
    output_dir: Path
    status: str
    summary: str = ""
    reason: Optional[str] = None

    @classmethod
    def from_group(cls, group) -> SeedsResult:
        results = {s: Result.from_folder(r.output_dir) for s, r in group.records.items()
                   if r.status == "finished" and r.output_dir}
        return cls(list(group.seeds), results, group.per_seed, group.stats, group.parent_run_id, group.tracking_uri,
                   Path(group.output_dir), group.status, group.summary, group.reason)

    def __repr__(self) -> str:
        return (f"SeedsResult(seeds={self.seeds}, status={self.status!r}, run_id={self.run_id!r}, "
                f"output_dir='{self.output_dir}')")


# ------------------------------------------------------------------------------ run


def run(config: ConfigLike = None, *, set: Overrides = None, seeds=None, resume: str | PathLike | None = None,
        progress: bool = True, echo: Optional[Callable[[str], None]] = print) -> Result | SeedsResult:
    """Run an experiment, as ``rayfed-proto run`` does; returns a :class:`Result`.

    ``config`` and ``set``: as for :func:`load_config` (a preset name, a YAML path, a mapping or
    an ``ExperimentConfig``; ``--set`` items or a mapping of dotted keys). ``seeds``: a list of
    seeds runs the experiment once per seed as one MLflow parent run with a nested run per seed
    and returns a :class:`SeedsResult` (``rayfed-proto run --seeds``). ``resume``: the folder of
    an interrupted run or seed group, continued (``config`` must then be None; ``set`` may only
    change how it goes on, as with ``run --resume --set``). ``progress``: the progress bar;
    ``echo``: where the run's messages and the summary go (None: nowhere).

    A stop (Ctrl-C, or ``faults.stop_at_version``) raises ``RunInterrupted`` (a
    ``KeyboardInterrupt``) whose message names the folder to resume."""
    from rayfed_proto.runtime import seeds as seed_groups

    say = echo if echo is not None else (lambda _line: None)
    items = _override_items(set, "set")
    if resume is not None:
        return _resume(config, resume, items, seeds, progress, say)
    cfg = load_config(config, items)
    if seeds is not None:
        seed_list = seed_groups.check_seeds(seeds, key="seeds")
        _no_seed_override(items)
        group = seed_groups.run_seeds(cfg, seed_list, progress=progress, echo=say)
        say(group.summary)
        return SeedsResult.from_group(group)
    from rayfed_proto.runtime.driver import run_experiment

    result = Result.from_run(run_experiment(cfg, progress=progress, echo=say))
    say(result.summary)
    return result


def _no_seed_override(items: list[str]) -> None:
    from rayfed_proto.config import parse_override

    for item in items:
        key, value = parse_override(item)
        if key == "seed":
            raise ConfigError([ConfigIssue(key="seed", value=value, allowed="not with seeds=[...]: each seed's run sets it")])


def _resume(config, resume, items: list[str], seeds, progress: bool, say) -> Result | SeedsResult:
    from rayfed_proto.config import check_resume_overrides
    from rayfed_proto.runtime import seeds as seed_groups

    if config is not None:
        raise ConfigError([ConfigIssue(key="config", value=str(config), allowed=(
            "None with resume=...: the run's own config.yaml is used"))])
    check_resume_overrides(items)
    folder = Path(resume)
    if seed_groups.is_group(folder):
        if seeds is not None:
            raise ConfigError([ConfigIssue(key="seeds", value=seeds, allowed=(
                "None with resume=... of a seed group: its seeds.json lists the seeds"))])
        group = seed_groups.resume_seeds(folder, items, progress=progress, echo=say)
        say(group.summary)
        return SeedsResult.from_group(group)
    if seeds is not None:
        raise ConfigError([ConfigIssue(key="seeds", value=seeds, allowed=(
            f"None with resume=...: {folder} is a single run's folder, not a seed group's"))])
    if not (folder / "config.yaml").is_file():
        raise InputError(f"{folder} is not the output folder of a run or seed group (no config.yaml or seeds.json in it)")
    from rayfed_proto.runtime.driver import run_experiment

    cfg = _load_file(folder / "config.yaml", items)
    result = Result.from_run(run_experiment(cfg, progress=progress, echo=say, resume_dir=folder))
    say(result.summary)
    return result
