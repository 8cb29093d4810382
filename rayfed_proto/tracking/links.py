"""Links into the MLflow UI that open on the model-training view, and the ``rayfed-proto ui`` server.

What decides the view (MLflow 3.17, ``mlflow/server/js``): the UI holds one *workflow type*,
``genai`` or ``machine_learning``, taken from the page address's ``workflowType`` query parameter,
else from the browser's local storage (``mlflow.workflowType_v1``, written only when the user
flips the sidebar's "GenAI / Model training" switch), else ``genai``. An experiment opened with
``genai`` lands on its GenAI overview (traces, "Detect Issues"); with ``machine_learning`` on its
runs. The experiment tag ``mlflow.experimentKind`` that earlier 3.x releases read is ignored by
3.17 (its feature check always takes the workflow type). So every link here carries
``?workflowType=machine_learning``; a link without it (the experiment list, a bookmark) follows
the browser's stored choice, which the sidebar switch sets once per browser.

The workflow type is read on every page, the Compare page (``#/compare-runs?...``) included, so a
compare link carries it too (:func:`compare_url`). What the project cannot change: MLflow's own
Compare button, its Home and Experiments lists, link without it; the experiment tag
``mlflow.experimentKind`` (``custom_model_development``) is still set on every experiment the
project creates, for the releases that read it (3.0-3.x before the workflow switch) and as a label.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

ML_VIEW = "workflowType=machine_learning"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5000


def ui_base(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    return f"http://{host}:{port}"


def experiment_url(base: str, experiment_id: str) -> str:
    """The experiment's runs, in the model-training view: ``<base>/#/experiments/<id>/runs?workflowType=...``."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{ML_VIEW}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """One run's page, in the model-training view."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{ML_VIEW}"


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    """MLflow's Compare page of ``run_ids`` (what the run list's Compare button opens, without the
    ``workflowType`` that keeps its sidebar and breadcrumb in the model-training view)."""
    import json
    from urllib.parse import quote

    def arg(values: list[str]) -> str:
        return quote(json.dumps(values, separators=(",", ":")), safe="")

    return f"{base.rstrip('/')}/#/compare-runs?runs={arg(list(run_ids))}&experiments={arg([experiment_id])}&{ML_VIEW}"


def relative(url: str) -> str:
    """A link of a run's description (markdown), relative to the page that shows it: ``#/...``
    (MLflow's UI opens it in a new tab on the same server)."""
    return url[url.index("#/"):]


@contextlib.contextmanager
def no_mlflow_run_links():
    """Without MLflow's own "View run <name> at: <server>/#/experiments/<id>/runs/<id>" lines (printed
    when a run on a tracking server ends): they have no ``workflowType`` (the GenAI view), and a
    sweep's are links to its temporary server, dead once it ends. The command prints its own link."""
    key = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
    before = os.environ.get(key)
    os.environ[key] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def is_server(uri: Optional[str]) -> bool:
    return bool(uri) and uri.startswith(("http://", "https://"))


def experiment_of(tracking_uri: str, run_id: str) -> Optional[str]:
    """The experiment id of ``run_id``; None when the store cannot be read."""
    try:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
    except Exception:
        return None


def ui_command(tracking_uri: str) -> str:
    return f"rayfed-proto ui --tracking-uri {tracking_uri}"


def browse_hint(tracking_uri: str, run_id: Optional[str] = None, experiment_id: Optional[str] = None) -> str:
    """How to look at a run, a link that outlives the process that printed it: on a tracking
    server its page; on a store (sqlite) the ``rayfed-proto ui`` command that serves it and the
    page it serves."""
    if experiment_id is None and run_id is not None:
        experiment_id = experiment_of(tracking_uri, run_id)
    if is_server(tracking_uri):
        base = tracking_uri.rstrip("/")
        prefix = "open "
    else:
        base = ui_base()
        prefix = f"browse with: {ui_command(tracking_uri)}, then open "
    if experiment_id is None:  # the store could not say: the UI's #/runs/<id> route still leads to the run
        return prefix + base + (f"/#/runs/{run_id}" if run_id else "")
    return prefix + (run_url(base, experiment_id, run_id) if run_id else experiment_url(base, experiment_id))


def find_experiment(tracking_uri: str, name: Optional[str]):
    """The experiment ``name`` in the store, else (no name) the most recently updated one that holds
    runs; None when there is none."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if name:
        return client.get_experiment_by_name(name)
    found = [e for e in client.search_experiments(order_by=["last_update_time DESC"], max_results=50)
             if client.search_runs([e.experiment_id], max_results=1)]
    return found[0] if found else None


def ui_server_command(tracking_uri: str, host: str, port: int) -> list[str]:
    """``mlflow ui`` on the store (artifacts served through it; file stores are read where the runs wrote them)."""
    import sys

    return [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri, "--host", host, "--port", str(port)]
