"""The Tune trial: one whole federated run (its own server and client actors) per trial.

Each evaluation of the run is reported to Tune (so ASHA can stop a bad trial early) and logged
by the run's own tracker as a child run of the sweep's parent run. Everything a trial needs
travels in :class:`TrialContext` (plain data, pickled with the function), never in the
param_space, so a restored sweep re-registers the trainable with a fresh context (a new
MLflow server port) without touching the trials' sampled values.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import ExperimentConfig, build_config, set_dotted
from rayfed_proto.tuning.resources import TrialPlan, placement_group_factory, trial_overrides
from rayfed_proto.tuning.spec import TrialResources

# the tag rayfed_proto.stopped of a trial's run (and of the sweep's child runs) ended KILLED
TUNE_STOPPED = "by the Tune scheduler or an interrupted sweep"


@dataclass
class TrialContext:
    sweep_name: str
    base_raw: dict[str, Any]
    space_keys: list[str]
    trial_resources: dict[str, Any]
    gpus_per_trial: float
    metric: str
    tracking_uri: Optional[str]           # None: tracking disabled in the base
    parent_run_id: Optional[str]
    output_dir: str                       # absolute: trials run inside their own Tune folders
    driver_pin: dict[str, float] = field(default_factory=dict)
    experiment_name: str = ""             # the sweep's Tune folder name: each trial's runs go under
                                          # <output_dir>/<experiment_name>/<trial id>/ (found again on resume)
    store_uri: Optional[str] = None       # the store behind tracking_uri (the sweep's temporary server): what lasts
    source: str = ""                      # the sweep file


def trial_source(ctx: TrialContext) -> str:
    """A trial run's Source (the tag ``mlflow.source.name``): the command that ran it, not Ray's
    ``default_worker.py`` that MLflow reads from the worker's ``sys.argv``."""
    return f"rayfed-proto tune {ctx.source}".strip() if ctx.source else f"rayfed-proto tune ({ctx.sweep_name})"


def trial_context_env(ctx: TrialContext) -> dict[str, str]:
    """Environment of a trial's process: MLflow's ``MLFLOW_RUN_CONTEXT`` (tags MLflow's own context
    resolution applies to the runs started there, over its defaults: the Source) and no printed
    "View run" links (the sweep's server is temporary; the sweep prints a lasting link)."""
    return {"MLFLOW_RUN_CONTEXT": json.dumps({"mlflow.source.name": trial_source(ctx), "mlflow.source.type": "LOCAL"}),
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def trial_run_tags(ctx: TrialContext) -> dict[str, str]:
    """Tags set on a trial's run once it runs: ``tracking.tracking_uri`` names the store (the
    temporary server's URL is dead once the sweep ends), the server is ``tracking.server_uri``."""
    if ctx.store_uri is None or ctx.store_uri == ctx.tracking_uri:
        return {}
    return {"tracking.tracking_uri": ctx.store_uri, "tracking.server_uri": str(ctx.tracking_uri)}


def absolute_paths(raw: dict[str, Any], cwd: Path) -> None:
    """Relative paths of a run config, made absolute against ``cwd``: Tune runs each trial with
    its trial folder as working directory."""
    data = raw.get("data")
    if isinstance(data, dict):
        for key in ("root", "path"):
            v = data.get(key)
            if isinstance(v, str) and v and "://" not in v and not Path(v).expanduser().is_absolute():
                data[key] = str((cwd / Path(v).expanduser()).resolve())


def trial_output_dir(ctx: TrialContext, trial_id: str) -> Path:
    """Where the runs of one trial go: a fixed folder per trial, so a resumed sweep finds the
    interrupted run of the trial and its checkpoints."""
    return Path(ctx.output_dir) / ctx.experiment_name / trial_id if ctx.experiment_name else Path(ctx.output_dir) / trial_id


def resumable_run(folder: Path, cfg: ExperimentConfig) -> Optional[Path]:
    """The newest run under a trial's folder that stopped before its end and has a complete
    checkpoint to continue from; None when there is none (the trial starts at version 0)."""
    from rayfed_proto.runtime.preparation import checkpoint_store

    if not folder.is_dir():
        return None
    runs = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "config.yaml").is_file() and (p / "partition.parquet").is_file())
    if not runs or (runs[-1] / "summary.txt").exists():  # a finished run is not continued
        return None
    return runs[-1] if checkpoint_store(cfg, runs[-1]).latest() is not None else None


def trial_config(ctx: TrialContext, values: dict[str, Any], run_name: Optional[str] = None,
                 trial_id: Optional[str] = None) -> tuple[ExperimentConfig, TrialPlan]:
    """The trial's validated config and its placement plan, from the sampled ``values``."""
    raw = copy.deepcopy(ctx.base_raw)
    for k in ctx.space_keys:
        set_dotted(raw, k, values[k])
    plan = trial_overrides(build_config(raw), TrialResources(**ctx.trial_resources), ctx.gpus_per_trial,
                           check=True, driver_pin=ctx.driver_pin)
    for k, v in plan.overrides.items():
        set_dotted(raw, k, v)
    set_dotted(raw, "tracking.output_dir", str(trial_output_dir(ctx, trial_id)) if trial_id else ctx.output_dir)
    set_dotted(raw, "checkpoint.dir", None)  # one folder per run: a shared checkpoint.dir would mix the trials
    if ctx.tracking_uri is not None:
        set_dotted(raw, "tracking.tracking_uri", ctx.tracking_uri)
        set_dotted(raw, "tracking.parent_run_id", ctx.parent_run_id)
    set_dotted(raw, "tracking.run_name", run_name)
    return build_config(raw, source="(trial)"), plan


def trial_resources_fn(ctx: TrialContext):
    """For ``tune.with_resources``: the placement group of the trial with this config (keys
    like num_clients may be swept, so each trial can differ)."""

    def resources(config: dict[str, Any]):
        _, plan = trial_config(ctx, config)
        return placement_group_factory(plan)

    return resources


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a history row, under the names they were born with (``eval/head_acc``...)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def trial_run_name(sweep_name: str, trial_id: str, values: dict[str, Any], keys: list[str], method: str = "") -> str:
    """``lam=0.5 lr=0.003 fedproto <sweep>-<trial id>``: the swept values first, by the last part of
    each key (the whole key when two would read alike), then the method, so child runs tell apart
    in the MLflow run list even where it cuts the name short (issue 26)."""
    short = [k.rsplit(".", 1)[-1] for k in keys]
    names = [s if short.count(s) == 1 else k for s, k in zip(short, keys, strict=True)]

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    shown = " ".join(f"{n}={fmt(values[k])}" for n, k in zip(names, keys, strict=True) if k in values)
    name = " ".join(x for x in (shown, method, f"{sweep_name}-{trial_id}") if x)
    return name[:250]


def make_trainable(ctx: TrialContext):
    def rayfed_trial(config: dict[str, Any]) -> None:
        from ray import tune

        from rayfed_proto.runtime.driver import run_experiment

        trial_id = tune.get_context().get_trial_id()
        os.environ.update(trial_context_env(ctx))  # the trial's own process (Ray's worker): its Source, no dead links
        method = trial_config(ctx, config, trial_id=trial_id)[0].algorithm.name  # swept or the base's
        run_name = trial_run_name(ctx.sweep_name, trial_id, config, ctx.space_keys, method)
        cfg, _ = trial_config(ctx, config, run_name=run_name, trial_id=trial_id)
        folder = trial_output_dir(ctx, trial_id)
        restored = tune.get_checkpoint()  # a retried trial (its node lost) or a resumed sweep: from storage_path
        if restored is not None:
            restore_run_folder(restored, folder)
        # the trial continues its run from the latest checkpoint (restored above, or on this disk)
        resume_dir = resumable_run(folder, cfg)
        attached: list[int] = []
        run_ids: list[str] = []
        reported: list[int] = []

        def on_eval(version: int, metrics: dict[str, Any]) -> None:
            report: dict[str, Any] = {**_numeric(metrics), "version": version}  # the metrics' names: eval/head_acc...
            if cfg.tracking.enabled:
                import mlflow

                run = mlflow.active_run()
                if run is not None and not run_ids:
                    run_ids.append(run.info.run_id)
                    if tags := trial_run_tags(ctx):
                        mlflow.set_tags(tags)
                report["mlflow_run_id"] = run_ids[0] if run_ids else None
            if ctx.metric not in report:  # proto_acc has no value before the first bank (version 0)
                return
            if version >= cfg.federation.rounds:
                # The last evaluation is reported once the run has ended: a scheduler stops a
                # trial at its last report (ASHA at max_t), which would cut the run before its
                # final artifacts and leave it FAILED.
                final.append(report)
                return
            reported.append(version)
            report_with_checkpoint(report, folder, attached)  # raises SystemExit when the scheduler stops this trial
            if cfg.faults.fail_trial_at_version == version and restored is None:  # after the report: its checkpoint stands
                raise InjectedTrialFailure(f"faults.fail_trial_at_version={version}")

        final: list[dict[str, Any]] = []
        try:
            result = run_experiment(cfg, progress=False, echo=lambda s: None, on_eval=on_eval, resume_dir=resume_dir)
        except InjectedTrialFailure:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)  # as if the node went down with its disk
            raise
        except SystemExit:
            # Stopped by the scheduler (ASHA) or an interrupted sweep: the run ended KILLED (and
            # released its actors); it was stopped, not broken.
            if run_ids:
                from mlflow.tracking import MlflowClient

                from rayfed_proto.tracking.parent_runs import end_stopped

                end_stopped(MlflowClient(cfg.tracking.tracking_uri), run_ids[0], TUNE_STOPPED)
            raise
        if not final and not reported:
            # resumed from a checkpoint of the last version: every evaluation is in the history
            # already and none was reported in this attempt; Tune gets the last one
            last = next((h for h in reversed(result.history) if ctx.metric in _numeric(h)), None)
            if last is not None:
                final.append({**_numeric(last), "version": int(last.get("version", result.final_version)),
                              "mlflow_run_id": result.run_id})
        for report in final:
            tune.report(report)

    return rayfed_trial


class InjectedTrialFailure(RuntimeError):
    """``faults.fail_trial_at_version``: a trial failing as if its node were lost."""


CHECKPOINT_META = "rayfed_run.json"


def report_with_checkpoint(report: dict[str, Any], folder: Path, attached: list[int]) -> None:
    """``tune.report``, with a Tune checkpoint when the trial's run wrote a newer checkpoint since
    the last one attached: the run folder's config, partition and run id plus that checkpoint,
    which Tune persists under ``storage_path`` (S3 on a cluster), where a retried trial on another
    node finds it (:func:`restore_run_folder`)."""
    import shutil
    import tempfile

    from ray import tune

    run = _newest_run(folder)
    latest = _latest_checkpoint_dir(run) if run is not None else None
    if latest is None or (attached and attached[-1] == int(latest.name[1:])):
        tune.report(report)
        return
    with tempfile.TemporaryDirectory(prefix="rayfed-tune-ckpt-") as tmp:
        dest = Path(tmp) / "run"
        dest.mkdir()
        for name in ("config.yaml", "partition.parquet", "run.json"):
            if (run / name).is_file():
                shutil.copy2(run / name, dest / name)
        shutil.copytree(latest, dest / "checkpoints" / latest.name)
        (Path(tmp) / CHECKPOINT_META).write_text(json.dumps({"run_folder": run.name, "version": int(latest.name[1:])}))
        attached.append(int(latest.name[1:]))
        tune.report(report, checkpoint=tune.Checkpoint.from_directory(tmp))


def restore_run_folder(checkpoint, folder: Path) -> Optional[Path]:
    """Write the run folder held by a Tune checkpoint into the trial's folder (beside whatever this
    node still has of it), so that :func:`resumable_run` continues from it."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rayfed-tune-restore-") as tmp:
        checkpoint.to_directory(tmp)
        meta_path = Path(tmp) / CHECKPOINT_META
        if not meta_path.is_file():
            return None
        meta = json.loads(meta_path.read_text())
        run = folder / meta["run_folder"]
        run.mkdir(parents=True, exist_ok=True)
        for item in (Path(tmp) / "run").iterdir():
            if item.is_dir():
                shutil.copytree(item, run / item.name, dirs_exist_ok=True)
            elif not (run / item.name).exists():
                shutil.copy2(item, run / item.name)
        return run


def _newest_run(folder: Path) -> Optional[Path]:
    runs = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "config.yaml").is_file()) if folder.is_dir() else []
    return runs[-1] if runs else None


def _latest_checkpoint_dir(run: Path) -> Optional[Path]:
    from rayfed_proto.runtime.checkpoint import MANIFEST

    done = [p for p in (run / "checkpoints").glob("v*") if p.name[1:].isdigit() and (p / MANIFEST).is_file()]
    return max(done, key=lambda p: int(p.name[1:])) if done else None
