"""MLflow parent runs, in one place: a seed group's (runtime/seeds.py), a sweep's (tuning/sweep.py),
a comparison's (tracking/compare.py) and a reproduction's (reproduce/runner.py).

A parent is created with its caller's tags plus ``rfp.role: parent`` (and ``mlflow.parentRunId``
when it is itself nested) and its params in batches of 100, each value cut to 6000 characters
(MLflow's limits); it is reopened RUNNING on a resume, with the tags the earlier stop left
deleted; it ends with a status and tags. Ending is bookkeeping: where the store is gone the caller's
outcome stands, so :func:`end_parent` and :func:`store_may_fail` warn instead of raising. A child
that was stopped, not broken, ends KILLED with the tag ``rayfed_proto.stopped`` (:func:`end_stopped`).

The caller's specifics (which tags, which params, the run's name) stay with the caller. MLflow is
imported where it is used.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

from rayfed_proto.tracking.mlflow_tracker import ROLE_TAG

log = logging.getLogger("rayfed_proto")

PARENT_TAG = "mlflow.parentRunId"  # nests a run under its parent in MLflow's run list
STOPPED_TAG = "rayfed_proto.stopped"  # why a child run ended KILLED
PARAM_BATCH = 100  # MLflow's most params in one log_batch
PARAM_CHARS = 6000  # MLflow's longest param value


def log_params(client, run_id: str, params: Mapping[str, Any]) -> None:
    """``params`` on ``run_id``, each value as ``str(value)`` cut to :data:`PARAM_CHARS`, in
    batches of :data:`PARAM_BATCH` (what MLflow stores is the same as one ``log_param`` each)."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:PARAM_CHARS]) for k, v in params.items()]
    for i in range(0, len(items), PARAM_BATCH):
        client.log_batch(run_id, params=items[i : i + PARAM_BATCH])


def start_run(client, experiment_id: str, name: str, tags: Mapping[str, str], params: Optional[Mapping[str, Any]] = None,
              *, role: str, parent_run_id: Optional[str] = None) -> str:
    """A RUNNING run named ``name`` with ``tags``, the role tag ``role`` and, when ``parent_run_id``
    is given, nested under it; ``params`` logged (:func:`log_params`). Returns its id."""
    tags = {**tags, ROLE_TAG: role}
    if parent_run_id:
        tags[PARENT_TAG] = parent_run_id
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    if params:
        log_params(client, run_id, params)
    return run_id


def start_parent(client, experiment_id: str, name: str, tags: Mapping[str, str],
                 params: Optional[Mapping[str, Any]] = None, *, parent_run_id: Optional[str] = None) -> str:
    """A parent run (role ``parent``): :func:`start_run`. Returns its id."""
    return start_run(client, experiment_id, name, tags, params, role="parent", parent_run_id=parent_run_id)


def reopen_parent(client, run_id: str, stale_tags: Iterable[str] = ()) -> None:
    """A stopped parent RUNNING again, without the ``stale_tags`` it has (what the earlier stop
    recorded, no longer true). Raises MLflow's error when the run is not in this store."""
    tags = client.get_run(run_id).data.tags
    client.update_run(run_id, status="RUNNING")
    for key in stale_tags:
        if key in tags:
            client.delete_tag(run_id, key)


def end_run(client, run_id: str, status: str, tags: Optional[Mapping[str, str]] = None) -> None:
    """``tags`` set on ``run_id``, then the run ended with ``status`` (FINISHED, FAILED, KILLED)."""
    for k, v in (tags or {}).items():
        client.set_tag(run_id, k, v)
    client.set_terminated(run_id, status=status)


@contextlib.contextmanager
def store_may_fail(action: str) -> Iterator[None]:
    """Bookkeeping in MLflow whose failure (the store gone, a server unreachable) must not undo
    what the caller did: an error inside is logged as the warning ``could not <action>: <error>``."""
    try:
        yield
    except Exception as e:
        log.warning("could not %s: %s", action, e)


def end_parent(client, run_id: str, status: str, tags: Optional[Mapping[str, str]] = None, *,
               what: Optional[str] = None) -> None:
    """:func:`end_run`, warning instead of raising when it fails (``could not end <what>: <error>``;
    ``what`` defaults to ``MLflow run <id>``). ``client``: an MlflowClient, or the store's URI (None:
    MLflow's default; the client is then made inside the guard: a store that cannot be opened warns too)."""
    with store_may_fail(f"end {what or f'MLflow run {run_id}'}"):
        if client is None or isinstance(client, str):
            from mlflow.tracking import MlflowClient

            client = MlflowClient(client)
        end_run(client, run_id, status, tags)


def end_stopped(client, run_id: str, reason: str) -> None:
    """A child run that was stopped, not broken: tag :data:`STOPPED_TAG` ``reason``, status KILLED."""
    end_run(client, run_id, "KILLED", {STOPPED_TAG: reason})


def children(client, experiment_ids: Sequence[str], parent_run_id: str, *, where: Optional[str] = None,
             max_results: int = 10_000) -> list:
    """The runs nested under ``parent_run_id`` in ``experiment_ids`` (``where``: a further MLflow
    filter, joined with ``and``)."""
    filter_string = f"tags.{PARENT_TAG} = '{parent_run_id}'" + (f" and {where}" if where else "")
    return client.search_runs(list(experiment_ids), filter_string=filter_string, max_results=max_results)
