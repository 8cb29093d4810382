"""Run a sweep: MLflow parent run + tracking server, Tune over whole federated runs, the ranking.

One sweep = one Tune experiment folder ``<storage_path>/<name>-<timestamp>/`` holding Tune's
state plus ``rayfed_sweep.yaml`` (the validated sweep, the parent run id and the tracking
store), which is all ``rayfed-proto tune --resume FOLDER`` needs to continue it.
"""

from __future__ import annotations

import copy
import csv
import logging
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import yaml

from rayfed_proto.config import ConfigError, ConfigIssue
from rayfed_proto.runtime.autoscale import withdraw_request
from rayfed_proto.tracking.links import experiment_url, no_mlflow_run_links
from rayfed_proto.tracking.metric_names import SWEEP_TRIALS, SWEEP_TRIALS_ERRORED, sweep_best
from rayfed_proto.tracking.mlflow_tracker import resolve_tracking_uri
from rayfed_proto.tracking.paper_metric import final_and_best
from rayfed_proto.tracking.parent_runs import (
    children,
    end_run,
    end_stopped,
    reopen_parent,
    start_parent,
    store_may_fail,
)
from rayfed_proto.tuning.mlflow_server import LocalMlflowServer, is_loopback_uri, is_remote_uri
from rayfed_proto.tuning.plan import check_cluster, plan_sweep, request_for_trials
from rayfed_proto.tuning.report import (
    best_config,
    format_table,
    parent_description,
    plot_metric_vs_params,
    plot_parallel_coordinates,
    rank_trials,
    write_best_yaml,
)
from rayfed_proto.tuning.spec import SweepSpec, parse_sweep
from rayfed_proto.tuning.trainable import TUNE_STOPPED, absolute_paths, make_trainable, trial_resources_fn

log = logging.getLogger("rayfed_proto")
STATE_FILE = "rayfed_sweep.yaml"


@dataclass
class SweepResult:
    experiment_path: str
    parent_run_id: Optional[str]
    tracking_uri: Optional[str]            # the store (sqlite or http), usable after the sweep
    ranked: list[dict[str, Any]] = field(default_factory=list)
    table: str = ""
    best_yaml: Optional[Path] = None
    num_errors: int = 0
    interrupted: bool = False


def _is_uri(path: str) -> bool:
    return "://" in path


def _connect_ray(address: Optional[str], spec: SweepSpec) -> None:
    import ray

    if ray.is_initialized():
        return
    address = address or spec.base_config.resources.address
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address:
        ray.init(address=address, **kwargs)
    else:
        res = spec.base_config.resources
        ray.init(num_cpus=res.num_cpus, num_gpus=res.num_gpus, **kwargs)


def _driver_pin(uri: Optional[str]) -> dict[str, float]:
    """Trial drivers log to MLflow; a loopback server is reachable only from its own node, so
    pin the driver bundle there: this process's node, or the head under Ray Client (ray://),
    where the server is the head's (cluster.yaml)."""
    if uri is None or not is_loopback_uri(uri):
        return {}
    import ray

    if ray.util.client.ray.is_connected():
        return {"node:__internal_head__": 0.001}
    return {f"node:{ray.util.get_node_ip_address()}": 0.001}


def _read_state(exp_path: str) -> dict[str, Any]:
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(exp_path) if _is_uri(exp_path) else (pafs.LocalFileSystem(), exp_path)
    try:
        with fs.open_input_stream(f"{root.rstrip('/')}/{STATE_FILE}") as f:
            return yaml.safe_load(f.read().decode())
    except (FileNotFoundError, OSError):
        raise ConfigError([ConfigIssue(key="--resume", value=exp_path, allowed=(
            f"a sweep folder written by rayfed-proto tune (with {STATE_FILE})"))]) from None


def _write_state(exp_path: str, state: dict[str, Any]) -> None:
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(exp_path) if _is_uri(exp_path) else (pafs.LocalFileSystem(), exp_path)
    fs.create_dir(root, recursive=True)
    with fs.open_output_stream(f"{root.rstrip('/')}/{STATE_FILE}") as f:
        f.write(yaml.safe_dump(state, sort_keys=False).encode())


def _scheduler(spec: SweepSpec):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = spec.file.scheduler
    if s.name == "fifo":
        return FIFOScheduler()
    # time in server versions (reported with every evaluation), not Tune iterations
    return ASHAScheduler(time_attr="version", max_t=s.max_t or spec.base_config.federation.rounds,
                         grace_period=s.grace_period, reduction_factor=s.reduction_factor, brackets=s.brackets)


def _searcher(spec: SweepSpec):
    if spec.file.searcher is None:
        return None
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(seed=spec.file.searcher.seed)


def run_sweep(spec: Optional[SweepSpec] = None, *, resume: Optional[str] = None, address: Optional[str] = None,
              tracking_uri: Optional[str] = None, best_out: Optional[Path] = None, stop=None, verbose: int = 1,
              echo: Callable[[str], None] = print) -> SweepResult:
    """Run ``spec`` (or continue the sweep folder ``resume``); returns the ranking."""
    with no_mlflow_run_links():  # MLflow's "View run ... http://127.0.0.1:<port>": the temporary server's, dead after
        return _run_sweep(spec, resume, address, tracking_uri, best_out, stop, verbose, echo)


def _run_sweep(spec, resume, address, tracking_uri, best_out, stop, verbose, echo) -> SweepResult:
    import mlflow
    from mlflow.tracking import MlflowClient
    from ray import tune

    cwd = Path.cwd()
    spec, state, exp_path, store_uri, parent_run_id, output_dir = _place(spec, resume, tracking_uri, cwd)
    base_raw = copy.deepcopy(spec.base_raw)
    absolute_paths(base_raw, cwd)  # trials run in their own folders; best.yaml keeps the paths as written
    _connect_ray(address, spec)
    server = None
    status = "FAILED"
    client = None
    asked = False
    try:
        log_uri = store_uri
        if store_uri is not None and not is_remote_uri(store_uri):
            server = LocalMlflowServer(store_uri)
            log_uri = server.start()
        if log_uri is not None:
            mlflow.set_tracking_uri(log_uri)
            client = MlflowClient(log_uri)
            experiment = mlflow.set_experiment(spec.base_config.tracking.experiment_name)
            if server is not None:
                echo(f"MLflow server for this sweep, while it runs (127.0.0.1 only): "
                     f"{experiment_url(log_uri, experiment.experiment_id)} over {store_uri}")
            if parent_run_id is None:
                parent_run_id = _start_parent_run(client, experiment.experiment_id, spec, exp_path)
            else:
                try:
                    reopen_parent(client, parent_run_id)
                except mlflow.exceptions.MlflowException as e:
                    raise ConfigError([ConfigIssue(key="--tracking-uri", value=store_uri, allowed=(
                        f"a store holding the sweep's parent run {parent_run_id} (an MLflow server over the same "
                        f"database and artifact store as before): {str(e).splitlines()[0][:200]}"))], spec.source) from None
                if tracking_uri is not None:  # the new store works: later resumes use it too
                    _write_state(exp_path, state)
                # a trial killed with the interrupted sweep may have ended its run after that sweep closed it
                _close_children(client, spec, parent_run_id, _errored_trials(exp_path))

        plan = plan_sweep(spec, base_raw, tracking_uri=log_uri, parent_run_id=parent_run_id, output_dir=output_dir,
                          driver_pin=_driver_pin(log_uri), experiment_name=exp_path.rstrip("/").rsplit("/", 1)[-1],
                          store_uri=store_uri)
        check_cluster(plan)
        asked = request_for_trials(plan)  # issue 13: an autoscaling cluster starts the nodes now
        trainable = tune.with_resources(make_trainable(plan.ctx), trial_resources_fn(plan.ctx))

        if resume is None:
            _write_state(exp_path, {"source": spec.source, "sweep": {**spec.file.model_dump(mode="json"), "base": base_raw, "set": {}},
                                    "store_uri": store_uri, "parent_run_id": parent_run_id, "output_dir": output_dir})
        from rayfed_proto.tuning.requests import NarrowRequest  # imports ray.tune: not at `tune --check`

        narrow = NarrowRequest(plan.trial_bundles, spec.file.max_concurrent_trials, spec.num_trials)
        grid = _tuner(spec, trainable, exp_path, resume is not None, stop, verbose, echo, callbacks=[narrow]).fit()

        result = _summarise(grid, spec, exp_path, store_uri, parent_run_id, client, best_out, echo)
        result.interrupted = _interrupted(exp_path, result.ranked)
        if result.interrupted:  # Ctrl-C: Tune saved its state and returned early
            echo(f"sweep interrupted; continue it with: rayfed-proto tune --resume {exp_path}")
        status = "KILLED" if result.interrupted else "FINISHED"
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if client is not None and parent_run_id is not None:
            # the server may be unreachable: the runs stay RUNNING, the sweep's outcome stands
            with store_may_fail(f"end the MLflow runs of sweep {spec.name}"):
                _close_children(client, spec, parent_run_id, _errored_trials(exp_path))
                end_run(client, parent_run_id, status)
        if server is not None:
            server.stop()
        if asked:
            withdraw_request()


def _sweep_store(uri: str, key: str, source: str) -> str:
    """A sweep's tracking store: a sqlite file (served by a local MLflow server) or a server."""
    if not (is_remote_uri(uri) or uri.startswith("sqlite:///")):
        raise ConfigError([ConfigIssue(key=key, value=uri, allowed=(
            "for a sweep: a sqlite store (sqlite:///..., or a .db path) served by a local MLflow server, or an "
            "http(s):// MLflow server"))], source)
    return uri


def _place(spec: Optional[SweepSpec], resume: Optional[str], tracking_uri: Optional[str], cwd: Path):
    """Where a sweep lives: (spec, state, experiment path, store URI, parent run id, output dir),
    read from the sweep folder ``resume`` (``tracking_uri``: its MLflow server moved) or new."""
    if resume is not None:
        exp_path = resume if _is_uri(resume) else str(Path(resume).resolve())
        state = _read_state(exp_path)
        spec = parse_sweep(state["sweep"], state["source"], cwd)
        store_uri = state["store_uri"]
        if tracking_uri is not None and store_uri is not None:  # the sweep's MLflow server moved (its cluster is gone)
            store_uri = state["store_uri"] = _sweep_store(resolve_tracking_uri(tracking_uri), "--tracking-uri", spec.source)
        return spec, state, exp_path, store_uri, state["parent_run_id"], state["output_dir"]
    assert spec is not None
    base_tr = spec.base_config.tracking
    store_uri = None
    if base_tr.enabled:
        store_uri = _sweep_store(resolve_tracking_uri(tracking_uri or spec.file.tracking_uri or base_tr.tracking_uri),
                                 "tracking.tracking_uri", spec.source)
    output_dir = str(Path(base_tr.output_dir).expanduser().resolve())
    storage = spec.file.storage_path if _is_uri(spec.file.storage_path) else str(Path(spec.file.storage_path).expanduser().resolve())
    exp_path = f"{storage.rstrip('/')}/{spec.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return spec, None, exp_path, store_uri, None, output_dir


def _start_parent_run(client, experiment_id: str, spec: SweepSpec, exp_path: str) -> str:
    """The sweep's parent MLflow run, with the search space and the sweep settings as params."""
    tags = {"rayfed_proto.sweep": spec.name, "rayfed_proto.sweep_path": exp_path}
    params = {f"search_space.{k}": d.describe() for k, d in spec.space.items()}
    params.update({"sweep.num_samples": spec.file.num_samples, "sweep.metric": spec.file.metric,
                   "sweep.mode": spec.file.mode, "sweep.scheduler": spec.file.scheduler.name,
                   "sweep.searcher": spec.file.searcher.name if spec.file.searcher else "random/grid",
                   "sweep.max_concurrent_trials": spec.file.max_concurrent_trials, "sweep.source": spec.source})
    return start_parent(client, experiment_id, spec.name, tags, params)


def _tuner(spec: SweepSpec, trainable, exp_path: str, resume: bool, stop, verbose: int, echo: Callable[[str], None],
           callbacks: Optional[list] = None):
    """A new Tune experiment at ``exp_path`` (Tune's own checkpointing and retries), or the
    interrupted one restored from there (with the callbacks it was started with: Tune keeps them)."""
    from ray import tune

    if resume:
        if not tune.Tuner.can_restore(exp_path):
            raise ConfigError([ConfigIssue(key="--resume", value=exp_path, allowed="a Tune experiment folder Tune can restore")])
        # unfinished trials continue their run from its latest checkpoint (the trainable finds
        # it), or restart from version 0 when it has none; errored ones restart too
        echo(f"resuming sweep {spec.name} from {exp_path}")
        return tune.Tuner.restore(exp_path, trainable=trainable, resume_unfinished=True, restart_errored=True)
    echo(f"sweep {spec.name}: {spec.num_trials} trials, at most {spec.file.max_concurrent_trials} at once; "
         f"folder {exp_path} (resume with: rayfed-proto tune --resume {exp_path})")
    return tune.Tuner(
        trainable, param_space=spec.param_space(),
        tune_config=tune.TuneConfig(metric=spec.file.metric, mode=spec.file.mode, scheduler=_scheduler(spec),
                                    search_alg=_searcher(spec), num_samples=spec.file.num_samples,
                                    max_concurrent_trials=spec.file.max_concurrent_trials),
        run_config=tune.RunConfig(name=exp_path.rsplit("/", 1)[1], storage_path=exp_path.rsplit("/", 1)[0],
                                  stop=stop, verbose=verbose, callbacks=callbacks,
                                  failure_config=tune.FailureConfig(max_failures=spec.file.max_failures),
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=spec.file.checkpoints_to_keep)))


def _interrupted(exp_path: str, ranked: list[dict[str, Any]]) -> bool:
    """Whether some trial neither finished nor failed (the sweep was stopped by Ctrl-C), from
    the experiment state Tune saved on its way out."""
    from ray.tune import ExperimentAnalysis

    try:
        return any(t.status not in ("TERMINATED", "ERROR") for t in ExperimentAnalysis(exp_path).trials)
    except Exception as e:  # unreadable state: fall back to trials that never reported
        log.warning("could not read the trial states of %s: %s", exp_path, e)
        return any(r["status"] == "not run" for r in ranked)


def _mark_stopped(client, rows: list[dict[str, Any]]) -> None:
    """A trial stopped early (by ASHA) dies inside its run, which then ends FAILED (or stays
    RUNNING if the trial's process was killed first): it was stopped, not broken."""
    for row in rows:
        if row["status"] != "stopped" or not row.get("mlflow_run_id"):
            continue
        try:
            if client.get_run(row["mlflow_run_id"]).info.status in ("FAILED", "RUNNING"):
                end_stopped(client, row["mlflow_run_id"], TUNE_STOPPED)
        except Exception as e:  # the ranking matters more than the status of one run
            log.warning("could not mark run %s as stopped: %s", row["mlflow_run_id"], e)


def _errored_trials(exp_path: str) -> set[str] | None:
    """Ids of the trials Tune recorded as failed (ERROR), from its saved experiment state;
    None if that state cannot be read."""
    from ray.tune import ExperimentAnalysis

    try:
        return {t.trial_id for t in ExperimentAnalysis(exp_path).trials if t.status == "ERROR"}
    except Exception as e:
        log.warning("could not read the trial states of %s: %s", exp_path, e)
        return None


def _close_children(client, spec: SweepSpec, parent_run_id: str, errored: set[str] | None) -> None:
    """Trials stopped by the scheduler, or killed with an interrupted sweep, die inside
    run_experiment: their child runs stay RUNNING, or end FAILED when the trial's actors were
    torn down under it (the order in which Ray kills them is not fixed). End them as KILLED.
    A run whose trial Tune recorded as errored keeps FAILED; so does every FAILED run when the
    trial states are unknown (``errored`` None)."""
    exp = client.get_experiment_by_name(spec.base_config.tracking.experiment_name)
    if exp is None:
        return
    for run in children(client, [exp.experiment_id], parent_run_id):
        status, name = run.info.status, run.info.run_name or ""
        stopped = status == "RUNNING" or (status == "FAILED" and errored is not None
                                          # "<values> <method> <sweep>-<trial id>" (before 0.3: "<sweep>-<trial id> [...]")
                                          and not any(w.endswith(f"-{t}") for w in name.split(" ") for t in errored))
        if stopped:
            end_stopped(client, run.info.run_id, TUNE_STOPPED)


def _summarise(grid, spec: SweepSpec, exp_path: str, store_uri, parent_run_id, client, best_out, echo) -> SweepResult:
    metric, mode = spec.file.metric, spec.file.mode
    rows = []
    errors = 0
    for res in grid:
        last = dict(res.metrics or {})
        frame = res.metrics_dataframe
        best_value = final_and_best(frame[metric], mode)[1] if frame is not None and metric in frame else float("nan")
        if res.error is not None:
            status = "ERROR"
        elif last.get("version") is None:
            status = "not run"
        else:
            status = "done" if last.get("version") == _rounds(spec, res.config) else "stopped"
        errors += res.error is not None
        config = res.config or {}
        rows.append({"trial": last.get("trial_id") or Path(res.path or "?").name, **{k: config.get(k) for k in spec.space},
                     metric: last.get(metric), f"{metric}_best": best_value, "version": last.get("version"),
                     "status": status, "mlflow_run_id": last.get("mlflow_run_id")})
    if client is not None:
        _mark_stopped(client, rows)
    ranked = rank_trials(rows, metric, mode)
    table = format_table(ranked, list(spec.space), metric)
    echo(f"\ntrials ranked by {metric} (last evaluation, {mode}):\n{table}")

    local_dir = Path(exp_path) if not _is_uri(exp_path) else Path(tempfile.mkdtemp(prefix="rayfed-sweep-"))
    csv_path = local_dir / "trials.csv"
    with csv_path.open("w", newline="") as f:
        cols = ["rank", "trial", *spec.space, metric, f"{metric}_best", "version", "status", "mlflow_run_id"]
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(ranked)
    (local_dir / "trials.txt").write_text(table + "\n")
    plot = plot_metric_vs_params(ranked, spec.space, metric, local_dir / f"{metric.replace('/', '_')}_vs_params.png",
                                 title=spec.name)
    parallel = plot_parallel_coordinates(ranked, spec.space, metric, local_dir / "parallel_coordinates.png",
                                         title=spec.name)

    best_path = None
    scored = [r for r in ranked if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
    if scored:
        best = scored[0]
        store_for_runs = store_uri
        cfg = best_config(spec, {k: best[k] for k in spec.space}, store_for_runs)
        best_path = Path(best_out) if best_out else (local_dir / "best.yaml" if not _is_uri(exp_path)
                                                     else Path.cwd() / f"{Path(exp_path).name}-best.yaml")
        write_best_yaml(best_path, cfg, spec, best, metric)
        echo(f"best trial: {best['trial']} ({metric} = {best[metric]:.4f}); config written to {best_path}\n"
             f"run it with: rayfed-proto run {best_path}")
    if client is not None and parent_run_id is not None:
        for p, sub in ((csv_path, None), (local_dir / "trials.txt", None), (plot, "plots"), (parallel, "plots")):
            client.log_artifact(parent_run_id, str(p), sub)
        if best_path is not None:
            client.log_artifact(parent_run_id, str(best_path))
            client.log_metric(parent_run_id, sweep_best(metric), float(scored[0][metric]))
            # the metric itself too, at the best trial's last version: the run list sorts the parent among
            # its trials by it (without it, sorting flattens the nesting; issue 49)
            client.log_metric(parent_run_id, metric, float(scored[0][metric]), step=int(scored[0].get("version") or 0))
            for k in spec.space:
                client.set_tag(parent_run_id, f"best.{k}", str(scored[0][k]))
            if scored[0].get("mlflow_run_id"):
                client.set_tag(parent_run_id, "best.run_id", str(scored[0]["mlflow_run_id"]))
        _mark_best_trial(client, parent_run_id, scored[0].get("mlflow_run_id") if scored else None, metric)
        client.set_tag(parent_run_id, "mlflow.note.content", parent_description(
            spec.name, metric, mode, ranked, list(spec.space), client.get_run(parent_run_id).info.experiment_id))
        # counts of one value each: tags, not one-point charts (issue 49); no errors, no tag
        client.set_tag(parent_run_id, SWEEP_TRIALS, str(len(ranked)))
        if errors:
            client.set_tag(parent_run_id, SWEEP_TRIALS_ERRORED, str(errors))
    return SweepResult(exp_path, parent_run_id, store_uri, ranked, table, best_path, errors)


BEST_TAG = "rayfed_proto.best_trial"
BEST_PREFIX = "[best] "


def best_trial_name(name: str) -> str:
    """A trial run's name in the run list once it is the sweep's best: ``[best] lam=10 fedsa sw-1``
    (in front: the list cuts long names at the end)."""
    return name if name.startswith(BEST_PREFIX) else (BEST_PREFIX + name)[:250]


def _mark_best_trial(client, parent_run_id: str, best_run_id: Optional[str], metric: str) -> None:
    """Mark the best trial's run in the run list (its name, the tag ``rayfed_proto.best_trial``) and
    unmark a trial that was the best before a resume. Bookkeeping: a failure only warns."""
    try:
        exp = client.get_run(parent_run_id).info.experiment_id
        marked = children(client, [exp], parent_run_id, where=f"tags.`{BEST_TAG}` = 'true'", max_results=1000)
        for run in marked:
            if run.info.run_id != best_run_id:
                client.delete_tag(run.info.run_id, BEST_TAG)
                name = run.info.run_name or ""
                if name.startswith(BEST_PREFIX):
                    client.set_tag(run.info.run_id, "mlflow.runName", name[len(BEST_PREFIX):])
        if best_run_id:
            client.set_tag(best_run_id, BEST_TAG, "true")
            client.set_tag(best_run_id, "mlflow.runName", best_trial_name(client.get_run(best_run_id).info.run_name or ""))
    except Exception as e:
        log.warning("could not mark the best trial (by %s) in MLflow: %s", metric, e)


def _rounds(spec: SweepSpec, config: Optional[dict[str, Any]]) -> int:
    rounds = (config or {}).get("federation.rounds")
    return int(rounds) if rounds is not None else spec.base_config.federation.rounds
