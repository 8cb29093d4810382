"""MLflow logging from the driver, the single writer of a run.

Tracking URI: ``tracking.tracking_uri`` if set, else ``$MLFLOW_TRACKING_URI``, else MLflow's
own default (``sqlite:///mlflow.db`` in the working directory for MLflow 3.x). Relative
``sqlite:///`` paths and plain folders are resolved to absolute URIs so that processes started
elsewhere (Tune trials, Ray workers) write to the same store.

A sqlite store is one file that several processes may write (runs started at once, a sweep's
server). MLflow waits 20 s for the file's lock, then raises ``database is locked``; a run's writes
(metrics, params, tags, artifacts, its end) then wait and retry, with a warning, for up to
``MlflowTracker.busy_retry_s`` (5 minutes, about what MLflow's HTTP client retries a server for),
instead of failing the run (measured in ``bench/tracking_load.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import InputError, TrackingConfig
from rayfed_proto.tracking.metric_names import EVAL_HEAD_ACC, SCHEMA_TAG, SCHEMA_VERSION, is_name
from rayfed_proto.tracking.series_gate import SeriesGate

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


ROLE_TAG = "rfp.role"  # parent (a seed group's, a sweep's, a compare run's), child (a seed's or a trial's run), run, comparison (a compared group)
ROLES = ("parent", "child", "run", "comparison")


def check_store_scheme(uri: str, key: str = "tracking.tracking_uri") -> None:
    """An :class:`InputError` naming ``key``, the URI and the schemes MLflow knows, when ``uri``'s
    scheme is none of them (MLflow itself raises a bare ``KeyError`` later on)."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
        from mlflow.utils.uri import get_uri_scheme

        known = set(_tracking_store_registry._registry)
        scheme = get_uri_scheme(uri)
    except Exception:  # another MLflow: let it say what it says
        return
    if scheme not in known and scheme.split("+", 1)[0] not in known:
        raise InputError(f"{key} = {uri!r}: MLflow has no tracking store for the scheme {scheme!r}; use sqlite:///path.db, "
                         "a folder, http(s)://server, or a database URI (" + ", ".join(sorted(k for k in known if k))
                         + "), or tracking.enabled=false")


EXPERIMENT_KIND = "custom_model_development"  # experiment tag mlflow.experimentKind: not a GenAI experiment
# config keys that differ per run by construction: logged as run tags, not params
BOOKKEEPING_PARAMS = ("tracking.output_dir", "tracking.run_name", "tracking.parent_run_id", "tracking.tracking_uri",
                      "checkpoint.dir")


def param_text(value: Any) -> str:
    """A param's value as MLflow shows it (at most 6000 characters): ``None`` is ``None``, a string
    as written (``faults.corrupt_kind = nan``, the kind of corruption, not a missing value: quoting
    it showed ``'nan'`` in every run, issue 38)."""
    if value is None:
        return "None"
    return str(value)[:6000]


_BUSY = ("database is locked", "database is busy", "database table is locked")


def is_store_busy(error: BaseException | str) -> bool:
    """A sqlite store whose lock another process held past MLflow's own 20 s wait: transient, worth
    waiting out. Any other error (a missing table, a refused value, an unreachable server) is not."""
    text = str(error).lower()
    return any(s in text for s in _BUSY)


SYSTEM_SAMPLES_PER_RUN = 60  # the system metrics' points over a run's length so far, until the longest interval
SYSTEM_SHORTEST_INTERVAL_S = 1.0


def system_metrics_interval(elapsed_s: float, longest_s: float) -> float:
    """The system metrics' sampling interval after ``elapsed_s`` seconds of a run: about
    :data:`SYSTEM_SAMPLES_PER_RUN` samples over the run so far (``elapsed_s / 60``), at least 1 s,
    at most ``tracking.system_metrics_interval_s`` (``longest_s``). MLflow's fixed 10 s gave a
    one-minute run 5 points, the first of them 0 % CPU (psutil's first reading: issue 49)."""
    return min(float(longest_s), max(SYSTEM_SHORTEST_INTERVAL_S, elapsed_s / SYSTEM_SAMPLES_PER_RUN))


class StoreBusyError(RuntimeError):
    """The MLflow store stayed locked for longer than :attr:`MlflowTracker.busy_retry_s`."""


class _DropBusyRecords(logging.Filter):
    """MLflow logs a lock error itself before raising it (``ERROR mlflow.store.db.utils: SQLAlchemy
    database error`` with a traceback; the system-metrics thread's ``Failed to get mlflow run:
    ... database is locked``, after which that thread stops). The tracker retries the first and
    restarts the thread, and says so in one warning of its own; an error it gives up on is raised."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_store_busy(record.getMessage())


_BUSY_FILTER = _DropBusyRecords()
_BUSY_LOGGERS = ("mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor")
_sleep = time.sleep  # the tests replace these two
_clock = time.monotonic


class MlflowTracker:
    busy_retry_s = 300.0  # how long a write waits out a locked store, on top of MLflow's 20 s per try

    def __init__(self, cfg: TrackingConfig):
        import mlflow

        for name in _BUSY_LOGGERS:
            logging.getLogger(name).addFilter(_BUSY_FILTER)  # once: a logger keeps one copy of a filter
        self.retries = 0  # writes retried because the store was locked
        self.system_metrics_restarts = 0
        self.mlflow = mlflow
        self.uri = resolve_tracking_uri(cfg.tracking_uri)
        check_store_scheme(self.uri, "tracking.tracking_uri" if cfg.tracking_uri else "$MLFLOW_TRACKING_URI")
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
        self.gate = SeriesGate()  # what becomes a chart (tracking/series_gate.py)
        self._system_metrics_pending = False  # started after the run's first metrics
        self._resumed = False
        self.resumed_status: Optional[str] = None  # a resumed run's status before this driver reopened it
        self.system_metrics = cfg.system_metrics
        self.system_metrics_longest_s = cfg.system_metrics_interval_s
        self._system_started: Optional[float] = None

    def _write(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, retried while the store is locked by another process (backoff
        1, 2, 4 ... 30 s with jitter, for up to :attr:`busy_retry_s`); any other error at once.
        A failed try wrote nothing (MLflow's sqlite writes are transactions), so a retry never
        logs a point twice."""
        started, attempt = _clock(), 0
        while True:
            try:
                result = fn(*args, **kwargs)
                break
            except Exception as e:
                if not is_store_busy(e):
                    raise
                waited = _clock() - started
                if waited >= self.busy_retry_s:
                    raise StoreBusyError(
                        f"the MLflow store {self.uri} stayed locked by another process for {waited:.0f} s ({what} "
                        f"tried {attempt + 1} times, MLflow waiting 20 s each): free it (a backup, `mlflow gc`, a long "
                        "query), or log to an MLflow server (mlflow server --backend-store-uri <the store>; "
                        "tracking.tracking_uri=http://...)") from e
                attempt += 1
                self.retries += 1
                delay = min(30.0, 2.0 ** (attempt - 1)) * (0.5 + random.random())
                delay = min(delay, max(0.1, self.busy_retry_s - waited))
                log.warning("MLflow store %s: another process holds its lock (MLflow waited 20 s); %s again in "
                            "%.0f s (try %d, for up to %.0f s)", self.uri, what, delay, attempt + 1, self.busy_retry_s)
                _sleep(delay)
        if attempt:
            self._revive_system_metrics()
        return result

    def _revive_system_metrics(self) -> None:
        """MLflow's system-metrics thread stops for good at its first failed call (a locked store):
        start it again, same run, next step. Nothing when it runs, or when MLflow has no such thread."""
        if not self.system_metrics or self.run_id is None:
            return
        try:
            from mlflow.tracking import fluent

            monitor = fluent.run_id_to_system_metrics_monitor.get(self.run_id)
            thread = getattr(monitor, "_process", None)
            if thread is not None and not thread.is_alive() and not monitor._shutdown_event.is_set():
                monitor.start()
                self.system_metrics_restarts += 1
                (log.warning if self.system_metrics_restarts == 1 else log.debug)(
                    "MLflow system metrics of run %s had stopped (the store locked by another process); restarted",
                    self.run_id)
        except Exception:  # another MLflow version: its system metrics are its own business
            pass

    def start(self, params: dict[str, Any], tags: Optional[dict[str, str]] = None, nested: bool = False) -> str:
        mlflow = self.mlflow
        try:
            exp = self._write("set_experiment", mlflow.set_experiment, self.experiment_name)
        except Exception as e:  # another run created the same experiment a moment ago: it exists now
            if "already exists" not in str(e).lower() and "unique" not in str(e).lower():
                raise
            exp = self._write("set_experiment", mlflow.set_experiment, self.experiment_name)
        self.experiment_id = exp.experiment_id
        tags = {**run_tags(), **dict(tags or {}), SCHEMA_TAG: SCHEMA_VERSION}
        tags.setdefault(ROLE_TAG, "child" if self.parent_run_id else "run")  # filter parents out: tags.rfp.role != 'parent'
        if self.parent_run_id:
            # The tag the UI nests by. Not start_run(parent_run_id=...): that requires the parent to
            # be ACTIVE and a resumed sweep's parent may be marked KILLED while its trials restart.
            tags["mlflow.parentRunId"] = self.parent_run_id
        if "mlflow.experimentKind" not in (exp.tags or {}):  # the UI opens the experiment on its runs (issue 26)
            with contextlib.suppress(Exception):
                self._write("set_experiment_tag", mlflow.set_experiment_tag, "mlflow.experimentKind", EXPERIMENT_KIND)
        # per-run bookkeeping (where the run writes, its name): tags, so the compare view's parallel
        # coordinates and the params table show what was varied, not what differs by construction
        tags.update({k: str(params[k]) for k in BOOKKEEPING_PARAMS if params.get(k) is not None})
        params = {k: v for k, v in params.items() if k not in BOOKKEEPING_PARAMS}
        # system metrics start after the first metrics (_start_system_metrics): see there
        run = mlflow.start_run(run_name=self.run_name, tags=tags, nested=nested, log_system_metrics=False)
        self.run_id = run.info.run_id
        self._system_metrics_pending = self.system_metrics
        # MLflow caps a param value at 6000 characters and a batch at 100 params
        items = [(k, param_text(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._write("log_params", mlflow.log_params, dict(items[i : i + 100]))
        return self.run_id

    def resume(self, run_id: str, tags: Optional[dict[str, str]] = None) -> str:
        """Continue an existing run (``run --resume``): same run id, metrics go on at later steps.
        ``tags`` (the new driver's identity) are set before the run is RUNNING again, so that it
        is never RUNNING under the tags of the driver that died."""
        try:
            self.resumed_status = self.mlflow.get_run(run_id).info.status  # a refused restore ends it so again
        except Exception as e:  # deleted run, or another tracking store
            raise FileNotFoundError(f"MLflow run {run_id} not found at {self.uri} ({e}); resume with the same "
                                    "tracking.tracking_uri as the interrupted run") from None
        if tags:
            from mlflow.entities import RunTag
            from mlflow.tracking import MlflowClient

            self._write("set_tags", MlflowClient(self.uri).log_batch, run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        run = self.mlflow.start_run(run_id=run_id, log_system_metrics=False)
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        self.gate = SeriesGate(run.data.metrics)  # charted before the interruption: they go on
        self._system_metrics_pending, self._resumed = self.system_metrics, True
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
        not make is logged as given, with a warning (once per key): it bypasses the table.

        What becomes a chart is :class:`~rayfed_proto.tracking.series_gate.SeriesGate`'s call: a
        one-value figure is a tag, a series is held while it keeps its first value (a counter: 0)."""
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        if not clean:
            return
        _warn_unnamed(clean)
        now, backfill, tags = self.gate.admit(clean, step)
        if tags:
            self.set_tags(tags)
        if backfill:
            self.log_metric_points(backfill)
        with _no_schema_hint():  # a dataset not logged before (a resumed run) has its schema inferred here
            for items in _chunks(list(now.items()), 1000):  # MLflow's batch limit
                self._write("log_metrics", self.mlflow.log_metrics, dict(items), step=step, model_id=model_id,
                            dataset=dataset)
        self._start_system_metrics()
        self._revive_system_metrics()
        self._pace_system_metrics()

    def _start_system_metrics(self) -> None:
        """MLflow's system-metrics thread, started once the run has logged its first metrics (the
        first evaluation: ``eval/head_acc`` first). The MLflow UI's compare page draws parallel
        coordinates of the first metric the runs logged (``latest_metrics`` in the order written);
        started with the run, the thread's ``system/cpu_utilization_percentage`` came first."""
        if not self._system_metrics_pending or self.run_id is None:
            return
        self._system_metrics_pending = False
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            from mlflow.tracking import fluent

            monitor = SystemMetricsMonitor(self.run_id, sampling_interval=system_metrics_interval(0.0, self.system_metrics_longest_s),
                                           samples_before_logging=1, resume_logging=self._resumed)
            fluent.run_id_to_system_metrics_monitor[self.run_id] = monitor  # end_run finishes it
            monitor.start()
            self._system_started = _clock()
        except Exception as e:  # the run goes on without them
            log.warning("could not start MLflow system metrics for run %s: %r", self.run_id, e)

    def _pace_system_metrics(self) -> None:
        """Stretch the system metrics' sampling interval with the run's length so far
        (:func:`system_metrics_interval`): MLflow's monitor reads it before each sample."""
        if self._system_started is None or self.run_id is None:
            return
        try:
            from mlflow.tracking import fluent

            monitor = fluent.run_id_to_system_metrics_monitor.get(self.run_id)
            if monitor is not None:
                monitor.sampling_interval = system_metrics_interval(_clock() - self._system_started,
                                                                    self.system_metrics_longest_s)
        except Exception:  # another MLflow version: its system metrics are its own business
            pass

    def log_metric_points(self, points: list[tuple[str, float, int]]) -> None:
        """(key, value, step) logged after the fact (back-filled series), keys as given."""
        import time

        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in points if math.isfinite(float(v))]
        client = MlflowClient(self.uri)
        for chunk in _chunks(metrics, 1000):
            self._write("log_metric_points", client.log_batch, self.run_id, metrics=chunk)

    def log_table(self, frame, artifact_file: str) -> None:
        self._write("log_table", self.mlflow.log_table, data=frame, artifact_file=artifact_file)

    def log_inputs(self, datasets: list, contexts: list[str], tags: Optional[list[dict[str, str]]] = None) -> None:
        with _no_schema_hint():  # the datasets' schemas are inferred here, on first use
            self._write("log_inputs", self.mlflow.log_inputs, datasets=datasets, contexts=contexts, tags_list=tags)

    def log_model(self, model, name: str, step: int = 0, tags: Optional[dict[str, str]] = None,
                  model_params: Optional[dict[str, str]] = None, **kwargs) -> Optional[str]:
        """``mlflow.pytorch.log_model`` (``kwargs``) as an output of this run at ``step`` (and never an
        input), with no run metric linked to it; the model's params are the run's plus
        ``model_params`` (its accuracy when it was logged); returns the logged model's id.

        Under an active run, MLflow 3's ``log_model(step=s)`` links every metric the run holds at step
        ``s`` to the new model (system metrics included), and the metrics logged later at ``s`` in this
        process too: every ``eval/``, ``federation/``... figure of the final version would be the
        model's. So the logged model is created with this run as its source, written from a thread
        that has no active run (MLflow's active run is thread-local), and recorded as the run's output
        at ``step`` here. The figures that measure the model are its params, not metrics linked to it:
        ``log_metrics(model_id=...)`` made a one-point run chart per figure, and recorded the model as
        an *input* of the run too (MLflow's fluent API does so for a model it does not yet know as an
        output of the active run object), shown as "Input", step "-" on the run's Overview (issue 49)."""
        from concurrent.futures import ThreadPoolExecutor

        import mlflow.pytorch
        from mlflow.entities import LoggedModelOutput
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        params = {**client.get_run(self.run_id).data.params,  # as log_model does: the model carries the run's params
                  **{k: str(v) for k, v in (model_params or {}).items()}}
        logged = self.mlflow.initialize_logged_model(name=name, source_run_id=self.run_id, tags=tags, params=params,
                                                     experiment_id=self.experiment_id)
        with ThreadPoolExecutor(1, thread_name_prefix="mlflow-log-model") as pool, _no_pickle_notice():
            pool.submit(mlflow.pytorch.log_model, model, name=name, model_id=logged.model_id, **kwargs).result()
        client.log_outputs(self.run_id, [LoggedModelOutput(logged.model_id, step=step)])
        return logged.model_id

    def log_params(self, params: dict[str, Any]) -> None:
        """Params logged after :meth:`start` (a value MLflow caps at 6000 characters)."""
        self._write("log_params", self.mlflow.log_params, {k: str(v)[:6000] for k, v in params.items()})

    def set_description(self, text: str) -> None:
        """The run's description (the Overview's "Description" box, markdown)."""
        self._write("set_tag", self.mlflow.set_tag, "mlflow.note.content", text)

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None:
        self._write("log_artifact", self.mlflow.log_artifact, str(path), artifact_path=artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._write("set_tags", self.mlflow.set_tags, {k: str(v) for k, v in tags.items()})

    def delete_tags(self, keys) -> None:
        """Remove tags that no longer hold (``stopped`` on a run that was resumed and finished)."""
        run = self.mlflow.active_run()
        if run is None:
            return
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        present = self._write("get_run", client.get_run, run.info.run_id).data.tags
        for key in keys:
            if key in present:
                self._write("delete_tag", client.delete_tag, run.info.run_id, key)

    def end(self, status: str = "FINISHED") -> None:
        from rayfed_proto.tracking.links import no_mlflow_run_links

        run = self.mlflow.active_run()
        if run is None:
            return
        try:
            with no_mlflow_run_links():  # the command prints the run's link, in the model-training view
                self.mlflow.end_run(status=status)
        except Exception as e:
            if not is_store_busy(e):
                raise
            # end_run took the run off MLflow's stack before its write failed: the run would stay
            # RUNNING. Write its end here, retried.
            from mlflow.tracking import MlflowClient

            self.retries += 1
            log.warning("MLflow store %s: another process holds its lock (MLflow waited 20 s); ending run %s "
                        "again", self.uri, run.info.run_id)
            self._write("end_run", MlflowClient(self.uri).set_terminated, run.info.run_id, status=status)


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

    def log_model(self, model, name, step=0, tags=None, model_params=None, **kwargs):
        return None

    def log_params(self, params):
        pass

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


@contextlib.contextmanager
def _no_schema_hint():
    """Without MLflow's "Inferred schema contains integer column(s)" hint: the logged datasets'
    integer columns (sample indices, client ids, labels) never hold a missing value, and no model
    signature is inferred from them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column", category=UserWarning)
        yield


class _DropPickleNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Saving pytorch model by Pickle")


@contextlib.contextmanager
def _no_pickle_notice():
    """Without ``mlflow.pytorch``'s warning that the pickle format runs code on load: the format is
    chosen on purpose (tracking/models.py says why), and the docs say to load only trusted models."""
    notice = _DropPickleNotice()
    logger = logging.getLogger("mlflow.pytorch")
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


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
