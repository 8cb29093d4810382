"""MLflow logging from the driver, the single writer of a run.

Tracking URI: ``tracking.tracking_uri`` if set, else ``$MLFLOW_TRACKING_URI``, else MLflow's
own default (``sqlite:///mlflow.db`` in the working directory for MLflow 3.x). Relative
``sqlite:///`` paths and plain folders are resolved to absolute URIs so that processes started
elsewhere (Tune trials, Ray workers) write to the same store.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import TrackingConfig
from rayfed_proto.tracking.metric_names import EVAL_HEAD_ACC, SCHEMA_TAG, SCHEMA_VERSION, is_name

log = logging.getLogger("rayfed_proto")


def resolve_tracking_uri(uri: Optional[str]) -> str:
    import mlflow

    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    if ":" not in uri and not uri.startswith("databricks"):  # a bare path: MLflow >= 3.13 refuses a folder store, use sqlite inside
        p = Path(uri).resolve()
        return f"sqlite:///{p / 'mlflow.db'}" if p.suffix != ".db" else f"sqlite:///{p}"
    return uri


class MlflowTracker:
    def __init__(self, cfg: TrackingConfig):
        import mlflow

        self.mlflow = mlflow
        self.uri = resolve_tracking_uri(cfg.tracking_uri)
        if self.uri.startswith("sqlite:///"):
            db = Path(self.uri[len("sqlite:///"):])
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
                with open(db, "ab"):
                    pass  # creates it if missing, proves it writable; sqlite fills an empty file
            except OSError as e:
                raise PermissionError(f"cannot write the MLflow store {db} ({e.strerror or e}); set tracking.tracking_uri "
                                      "to a writable location, or tracking.enabled=false") from None
        mlflow.set_tracking_uri(self.uri)
        if self.uri.startswith("sqlite:///"):
            _create_store(self.uri)  # now, before the run's output folder exists: a failure leaves nothing behind
        self.experiment_name = cfg.experiment_name
        self.run_name = cfg.run_name
        self.parent_run_id = cfg.parent_run_id
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.system_metrics = cfg.system_metrics
        if cfg.system_metrics:
            from mlflow.system_metrics import set_system_metrics_sampling_interval

            set_system_metrics_sampling_interval(cfg.system_metrics_interval_s)

    def start(self, params: dict[str, Any], tags: Optional[dict[str, str]] = None, nested: bool = False) -> str:
        mlflow = self.mlflow
        try:
            exp = mlflow.set_experiment(self.experiment_name)
        except Exception as e:  # another run created the same experiment a moment ago: it exists now
            if "already exists" not in str(e).lower() and "unique" not in str(e).lower():
                raise
            exp = mlflow.set_experiment(self.experiment_name)
        self.experiment_id = exp.experiment_id
        tags = {**run_tags(), **dict(tags or {}), SCHEMA_TAG: SCHEMA_VERSION}
        if self.parent_run_id:
            # The tag the UI nests by. Not start_run(parent_run_id=...): that requires the parent to
            # be ACTIVE and a resumed sweep's parent may be marked KILLED while its trials restart.
            tags["mlflow.parentRunId"] = self.parent_run_id
        run = mlflow.start_run(run_name=self.run_name, tags=tags, nested=nested, log_system_metrics=self.system_metrics)
        self.run_id = run.info.run_id
        # MLflow caps a param value at 6000 characters and a batch at 100 params
        items = [(k, "None" if v is None else str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i : i + 100]))
        return self.run_id

    def resume(self, run_id: str, tags: Optional[dict[str, str]] = None) -> str:
        """Continue an existing run (``run --resume``): same run id, metrics go on at later steps.
        ``tags`` (the new driver's identity) are set before the run is RUNNING again, so that it
        is never RUNNING under the tags of the driver that died."""
        try:
            self.mlflow.get_run(run_id)
        except Exception as e:  # deleted run, or another tracking store
            raise FileNotFoundError(f"MLflow run {run_id} not found at {self.uri} ({e}); resume with the same "
                                    "tracking.tracking_uri as the interrupted run") from None
        if tags:
            from mlflow.entities import RunTag
            from mlflow.tracking import MlflowClient

            MlflowClient(self.uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        run = self.mlflow.start_run(run_id=run_id, log_system_metrics=self.system_metrics)
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        return self.run_id

    def note_superseded_steps(self, after: int, key: str = EVAL_HEAD_ACC) -> list[int]:
        """Resuming from a checkpoint whose history ends at version ``after``: steps above it that
        the earlier driver had already logged are redone now, so MLflow will hold two points for them (it cannot delete
        one). Record them in the tag ``superseded_steps`` (the later point of each is the valid
        one; ``history.parquet`` holds only the valid ones) and return them."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        steps = sorted({m.step for m in client.get_metric_history(self.run_id, key) if m.step > after})
        if steps:
            before = client.get_run(self.run_id).data.tags.get("superseded_steps")
            span = f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
            self.set_tags({"superseded_steps": f"{before},{span}" if before else span})
        return steps

    def log_metrics(self, metrics: dict[str, Any], step: int, model_id: Optional[str] = None, dataset=None) -> None:
        """Finite numbers only, under the names they were born with (made by
        :mod:`rayfed_proto.tracking.metric_names`; nothing is renamed here). A key that module did
        not make is logged as given, with a warning (once per key): it bypasses the table."""
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        _warn_unnamed(clean)
        for items in _chunks(list(clean.items()), 1000):  # MLflow's batch limit
            self.mlflow.log_metrics(dict(items), step=step, model_id=model_id, dataset=dataset)

    def log_metric_points(self, points: list[tuple[str, float, int]]) -> None:
        """(key, value, step) logged after the fact (back-filled series), keys as given."""
        import time

        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in points if math.isfinite(float(v))]
        client = MlflowClient(self.uri)
        for chunk in _chunks(metrics, 1000):
            client.log_batch(self.run_id, metrics=chunk)

    def log_table(self, frame, artifact_file: str) -> None:
        self.mlflow.log_table(data=frame, artifact_file=artifact_file)

    def log_inputs(self, datasets: list, contexts: list[str], tags: Optional[list[dict[str, str]]] = None) -> None:
        self.mlflow.log_inputs(datasets=datasets, contexts=contexts, tags_list=tags)

    def log_model(self, model, name: str, **kwargs) -> Optional[str]:
        """``mlflow.pytorch.log_model`` under this run; returns the logged model's id."""
        import mlflow.pytorch

        info = mlflow.pytorch.log_model(model, name=name, **kwargs)
        return info.model_id

    def set_description(self, text: str) -> None:
        """The run's description (the Overview's "Description" box, markdown)."""
        self.mlflow.set_tag("mlflow.note.content", text)

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None:
        self.mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def delete_tags(self, keys) -> None:
        """Remove tags that no longer hold (``stopped`` on a run that was resumed and finished)."""
        run = self.mlflow.active_run()
        if run is None:
            return
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        present = client.get_run(run.info.run_id).data.tags
        for key in keys:
            if key in present:
                client.delete_tag(run.info.run_id, key)

    def end(self, status: str = "FINISHED") -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run(status=status)


def _create_store(uri: str, attempts: int = 6) -> None:
    """Create (or open) the sqlite store before anything of the run is written.

    Two runs started at the same moment on a fresh ``mlflow.db`` would both run MLflow's schema
    migrations, and the loser crashes ("table ... already exists", "Online migration expected to
    match one row"), possibly leaving the schema half-migrated. Creation is therefore serialised
    by an exclusive lock on ``<db>.lock`` beside the store; a store that still reports a transient
    error ("database is locked") is retried."""
    import fcntl
    import random
    import time

    from mlflow.tracking import MlflowClient

    db = Path(uri[len("sqlite:///"):])
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            for attempt in range(1, attempts + 1):
                try:
                    MlflowClient(uri).search_experiments(max_results=1)
                    return
                except Exception as e:
                    text = str(e).lower()
                    if attempt == attempts or not ("already exists" in text or "locked" in text):
                        raise
                    time.sleep(0.2 * attempt + random.random() * 0.3)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


class NullTracker:
    """Used when ``tracking.enabled`` is false: same interface, writes nothing."""

    uri = None
    run_id = None

    def start(self, params, tags=None, nested=False):
        return None

    def resume(self, run_id, tags=None):
        return None

    def note_superseded_steps(self, after, key=EVAL_HEAD_ACC):
        return []

    def log_metrics(self, metrics, step, model_id=None, dataset=None):
        pass

    def log_metric_points(self, points):
        pass

    def log_table(self, frame, artifact_file):
        pass

    def log_inputs(self, datasets, contexts, tags=None):
        pass

    def log_model(self, model, name, **kwargs):
        return None

    def set_description(self, text):
        pass

    def log_artifact(self, path, artifact_path=None):
        pass

    def set_tags(self, tags):
        pass

    def delete_tags(self, keys):
        pass

    def end(self, status="FINISHED"):
        pass


def _chunks(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i : i + n]


_WARNED: set[str] = set()


def _warn_unnamed(metrics: dict[str, float]) -> None:
    """A warning, once per key, for a metric key that :mod:`rayfed_proto.tracking.metric_names`
    does not make (a name made elsewhere: it belongs in the table)."""
    for k in metrics:
        if k not in _WARNED and not is_name(k):
            _WARNED.add(k)
            log.warning("metric %r is not a name of rayfed_proto.tracking.metric_names; logged as given", k)


def git_commit() -> tuple[Optional[str], Optional[bool]]:
    """(commit, dirty) of the git checkout holding this package; (None, None) outside one (an
    installed wheel) or without git."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return (commit or None), bool(status.strip())


def run_tags() -> dict[str, str]:
    """Tags every run carries: the package version and, from a git checkout, the commit."""
    import rayfed_proto

    tags = {"rayfed_proto.version": rayfed_proto.__version__}
    commit, dirty = git_commit()
    if commit:
        tags.update({"mlflow.source.git.commit": commit, "rayfed_proto.git_commit": commit,
                     "rayfed_proto.git_dirty": str(dirty).lower()})
    return tags


def make_tracker(cfg: TrackingConfig):
    return MlflowTracker(cfg) if cfg.enabled else NullTracker()
