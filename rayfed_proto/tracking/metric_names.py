"""Metric names: the one place where a metric key is made.

Every metric the runtime produces is *born* with its final, namespaced name (the MLflow UI groups
the keys into sections by their first ``/`` part): the evaluation, the driver's counters, the
per-client series and the history rows all take their keys from the constants and functions
below, so ``RunResult.history``, the ``on_eval`` callback, the checkpoints' driver state, the
history.csv / history.parquet artifacts, Tune reports and MLflow hold the *same* names. Nothing
renames a key on its way out.

Sections (docs/concepts.md "Metrics" lists every name):

* ``eval/``: the clients' models on their test splits; the server's model on the global test set
  (``eval/global_acc...``, see :func:`server_metric`);
* ``train/``: :func:`train_term`, the mean over clients of each client's latest *local update*
  terms (``train/loss``: the clients' local-update loss);
* ``server/``: the server's own counters, and :func:`server_metric`, whatever an algorithm's
  ``aggregate`` (its *server step*) returns (``server/train_loss`` for an aggregate key
  ``train_loss``, ``server/loss`` for FedTGP's ``server_loss``): never the same name as a client
  figure or a runtime counter;
* ``federation/``, ``reliability/``, ``system/``: traffic and update flow, failures survived,
  actors' memory;
* ``zz_client/<series>/client_<id>`` (:func:`client_series`), ``best/<metric>`` and ``sweep/``
  (the sweep's parent run). A logged model's accuracy is its params, no metric
  (``tracking/models.py``).

Why ``zz_client``: the MLflow UI makes one chart section per key *prefix* (everything before the
last ``/``) and sorts the sections as plain text, with the run's Model metrics tab opening on the
first. Under ``client/<id>/...`` twenty clients made twenty sections that sorted before ``eval/``
(issue 26). A metric key may only hold letters, digits, ``_ - . / :`` and spaces, so no punctuation
sorts after the lowercase section names; ``zz_`` does. The series of all clients share one section
per series (``zz_client/head_acc``), last on the page. A client's constant test-split size is the
run parameter ``client.test_samples`` (a list by client id), not a flat chart.

``version`` (the step) is a history column, never a metric.

Reading *old* runs: up to 0.1.x the runtime produced flat keys (``head_acc``, ``train_loss``...)
and renamed them where they left the process. :data:`LEGACY` and :func:`mlflow_key` are now only
the reader's translation of those old names: :func:`resolve` (``metric: head_acc`` in a sweep
file, with a DeprecationWarning), :func:`get_metric_history` (a run logged before the rename), and
:func:`upgrade_history` (a checkpoint whose saved history has flat keys, converted once on load).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

# run tag rayfed_proto.metric_names: "3" = today's names; "2" = namespaced keys with client/<id>/<series> and
# eval/clients_nonfinite (RENAMED); absent: the flat keys (LEGACY)
SCHEMA_VERSION = "3"
SCHEMA_TAG = "rayfed_proto.metric_names"

VERSION = "version"  # the step: a column of the history, never a metric
PER_CLIENT = "per_client"  # not a metric: the evaluation's per-client results, taken out by the driver

# ------------------------------------------------------------------------------ eval/
EVAL_HEAD_ACC = "eval/head_acc"
EVAL_HEAD_ACC_MEAN = "eval/head_acc_mean"
EVAL_HEAD_ACC_STD = "eval/head_acc_std"
EVAL_PROTO_ACC = "eval/proto_acc"
EVAL_PROTO_ACC_MEAN = "eval/proto_acc_mean"
EVAL_PROTO_ACC_STD = "eval/proto_acc_std"
EVAL_SILHOUETTE_MEAN = "eval/silhouette_mean"
EVAL_GLOBAL_ACC = "eval/global_acc"  # server_metric("global_acc"); also global_acc_<domain>, global_acc_domain_mean
EVAL_GLOBAL_ACC_DOMAIN_MEAN = "eval/global_acc_domain_mean"
# ------------------------------------------------------------------------------ server/ (the runtime's own)
SERVER_PROTO_MARGIN_MIN = "server/proto_margin_min"
SERVER_PROTO_MARGIN_MEAN = "server/proto_margin_mean"
SERVER_TRAIN_S = "server/train_s"
SERVER_VERSIONS_ROLLED_BACK = "server/versions_rolled_back"
# ------------------------------------------------------------------------------ federation/
FEDERATION_BYTES_UP = "federation/bytes_up"
FEDERATION_BYTES_DOWN = "federation/bytes_down"
FEDERATION_STALENESS_MEAN = "federation/staleness_mean"
FEDERATION_STALENESS_MAX = "federation/staleness_max"
FEDERATION_UPDATES_ACCEPTED = "federation/updates_accepted"
FEDERATION_UPDATES_DROPPED = "federation/updates_dropped"
FEDERATION_UPDATES_LATE = "federation/updates_late"
FEDERATION_UPDATES_REFUSED = "federation/updates_refused"
FEDERATION_UPDATES_DISPATCHED = "federation/updates_dispatched"
FEDERATION_UPDATES_WITHHELD_AFTER_END = "federation/updates_withheld_after_end"
FEDERATION_CLIENT_BUSY_S = "federation/client_busy_s"
FEDERATION_SLOT_UTILISATION = "federation/slot_utilisation"
FEDERATION_WALL_S = "federation/wall_s"
FEDERATION_SIM_TIME_S = "federation/sim_time_s"  # simulated seconds at the version (virtual clock, system: profiles)
FEDERATION_TIME_TO_TARGET_SIM_S = "federation/time_to_target_sim_s"  # tracking.target_accuracy first reached
FEDERATION_TIME_TO_TARGET_WALL_S = "federation/time_to_target_wall_s"
FEDERATION_STARTUP_S = "federation/startup_s"  # run start (a process's first run: process start) to the first update
FEDERATION_VERSIONS_EMPTY = "federation/versions_empty"  # sync versions that aggregated nothing
FEDERATION_UPDATES_DROPPED_OFFLINE = "federation/updates_dropped_offline"  # client offline before its update finished
FEDERATION_UPDATES_DROPPED_DEADLINE = "federation/updates_dropped_deadline"  # sync: after federation.round_deadline_s
FEDERATION_UPDATES_DROPPED_OVER_SELECTION = "federation/updates_dropped_over_selection"  # sync: after the first K
# ------------------------------------------------------------------------------ reliability/
RELIABILITY_CLIENT_FAILURES = "reliability/client_failures"
RELIABILITY_CLIENT_ACTOR_RESTARTS = "reliability/client_actor_restarts"
RELIABILITY_UPDATES_LOST_CLIENT = "reliability/updates_lost_client"
RELIABILITY_SERVER_RESTARTS = "reliability/server_restarts"
RELIABILITY_UPDATES_LOST_SERVER = "reliability/updates_lost_server"
RELIABILITY_VERSIONS_REDONE = "reliability/versions_redone"
RELIABILITY_EVALS_INCOMPLETE = "reliability/evals_incomplete"
RELIABILITY_CLIENTS_EXCLUDED = "reliability/clients_excluded"
RELIABILITY_CHECKPOINTS_WRITTEN = "reliability/checkpoints_written"
RELIABILITY_CHECKPOINTS_FAILED = "reliability/checkpoints_failed"
RELIABILITY_CLIENTS_NONFINITE = "reliability/clients_nonfinite"  # models with NaN/inf test features (a count, not a score)
# ------------------------------------------------------------------------------ system/ (actors' memory at the end)
SYSTEM_CLIENT_PEAK_RSS_MIB_MAX = "system/actors/client_peak_rss_mib_max"
SYSTEM_CLIENT_PSS_MIB_MAX = "system/actors/client_pss_mib_max"
SYSTEM_CLIENT_PSS_MIB_TOTAL = "system/actors/client_pss_mib_total"
SYSTEM_SERVER_PEAK_RSS_MIB = "system/actors/server_peak_rss_mib"
SYSTEM_SERVER_PSS_MIB = "system/actors/server_pss_mib"
# ------------------------------------------------------------------------------ the sweep's parent run
SWEEP_TRIALS = "sweep/trials"
SWEEP_TRIALS_ERRORED = "sweep/trials_errored"

TRAIN_NONFINITE_STEPS = "train/nonfinite_steps"  # local steps skipped for a non-finite loss (train_term)

# counts of things that usually never happen: charted in MLflow only once non-zero, with the zeros before back-filled
# (tracking/series_gate.py; a chart that stays at 0 only buries the ones that move); the history (history.parquet,
# on_eval, Tune) holds every value
COUNTERS: frozenset[str] = frozenset(v for k, v in dict(globals()).items() if k.startswith("RELIABILITY_")) | {
    TRAIN_NONFINITE_STEPS,
    FEDERATION_UPDATES_DROPPED, FEDERATION_UPDATES_LATE, FEDERATION_UPDATES_REFUSED,
    FEDERATION_UPDATES_WITHHELD_AFTER_END, FEDERATION_VERSIONS_EMPTY, FEDERATION_UPDATES_DROPPED_OFFLINE,
    FEDERATION_UPDATES_DROPPED_DEADLINE, FEDERATION_UPDATES_DROPPED_OVER_SELECTION, SERVER_VERSIONS_ROLLED_BACK}

CLIENT_SECTION = "zz_client"  # sorts after every other section in the MLflow UI (module docstring)
CLIENT_SERIES = ("head_acc", "proto_acc", "train_loss")  # zz_client/<series>/client_<id>
CLIENT_TEST_SAMPLES_PARAM = "client.test_samples"  # run param: each client's test-split size, by client id
ACTOR_MEMORY = ("peak_rss_mib", "pss_mib")  # system/actors/client_actor_<a>_<figure>

# every fixed name above (the functions below make the others)
NAMES: frozenset[str] = frozenset(v for k, v in dict(globals()).items()
                                  if k.isupper() and isinstance(v, str) and "/" in v)


def train_term(term: str) -> str:
    """A local-update term of the clients (mean over clients of each one's latest update):
    ``train_term("loss") -> "train/loss"``."""
    return f"train/{term}"


def server_metric(key: str) -> str:
    """A metric of the server step, as an algorithm's ``aggregate`` (or the server's global-test
    evaluation) returns it: ``global_acc...`` -> ``eval/global_acc...``; ``server_<x>`` ->
    ``server/<x>``; anything else -> ``server/<key>`` (``train_loss`` -> ``server/train_loss``,
    never the clients' ``train/loss``). A name that would fall on one of the runtime's own names
    (``server/train_s``...) goes to ``server/aggregate/<x>`` instead: it can never overwrite one."""
    if key.startswith("global_acc"):
        return f"eval/{key}"
    name = key[len("server_"):] if key.startswith("server_") and len(key) > len("server_") else key
    out = f"server/{name}"
    return f"server/aggregate/{name}" if out in NAMES else out


def client_series(client_id: int, series: str) -> str:
    """One client's series: ``client_series(3, "head_acc") -> "zz_client/head_acc/client_3"`` (the
    UI section ``zz_client/head_acc`` holds every client's ``head_acc``, and sorts last)."""
    return f"{CLIENT_SECTION}/{series}/client_{int(client_id)}"


def actor_memory(actor: int, figure: str) -> str:
    """One client actor's memory at the end: ``system/actors/client_actor_<a>_<figure>``."""
    return f"system/actors/client_actor_{int(actor)}_{figure}"


def sweep_best(metric: str) -> str:
    """The sweep parent's best value of ``metric``: ``best/eval/head_acc``."""
    return f"best/{metric}"


_MADE = re.compile("|".join((r"train/[^/]+", r"server/(aggregate/)?[^/]+", r"eval/global_acc[^/]*",
                              rf"{CLIENT_SECTION}/({'|'.join(CLIENT_SERIES)})/client_\d+",
                              rf"system/actors/client_actor_\d+_({'|'.join(ACTOR_MEMORY)})", r"best/.+")))


def is_name(key: str) -> bool:
    """Whether ``key`` is a name this module makes (a constant, or the output of one of its functions)."""
    return key in NAMES or _MADE.fullmatch(key) is not None


# ------------------------------------------------------------------------------ old flat names (readers only)

LEGACY: dict[str, str] = {
    "head_acc": EVAL_HEAD_ACC, "head_acc_mean": EVAL_HEAD_ACC_MEAN, "head_acc_std": EVAL_HEAD_ACC_STD,
    "proto_acc": EVAL_PROTO_ACC, "proto_acc_mean": EVAL_PROTO_ACC_MEAN, "proto_acc_std": EVAL_PROTO_ACC_STD,
    "silhouette_mean": EVAL_SILHOUETTE_MEAN, "clients_nonfinite": RELIABILITY_CLIENTS_NONFINITE,
    "proto_margin_min": SERVER_PROTO_MARGIN_MIN, "proto_margin_mean": SERVER_PROTO_MARGIN_MEAN,
    "server_train_s": SERVER_TRAIN_S, "versions_rolled_back": SERVER_VERSIONS_ROLLED_BACK,
    "bytes_up": FEDERATION_BYTES_UP, "bytes_down": FEDERATION_BYTES_DOWN,
    "staleness_mean": FEDERATION_STALENESS_MEAN, "staleness_max": FEDERATION_STALENESS_MAX,
    "updates_accepted": FEDERATION_UPDATES_ACCEPTED, "updates_dropped": FEDERATION_UPDATES_DROPPED,
    "updates_late": FEDERATION_UPDATES_LATE, "updates_refused": FEDERATION_UPDATES_REFUSED,
    "updates_dispatched": FEDERATION_UPDATES_DISPATCHED,
    "updates_withheld_after_end": FEDERATION_UPDATES_WITHHELD_AFTER_END,
    "client_busy_s": FEDERATION_CLIENT_BUSY_S, "slot_utilisation": FEDERATION_SLOT_UTILISATION,
    "wall_s": FEDERATION_WALL_S, "sim_time_s": FEDERATION_SIM_TIME_S,
    "time_to_target_sim_s": FEDERATION_TIME_TO_TARGET_SIM_S, "time_to_target_wall_s": FEDERATION_TIME_TO_TARGET_WALL_S,
    "startup_s": FEDERATION_STARTUP_S, "versions_empty": FEDERATION_VERSIONS_EMPTY,
    "client_failures": RELIABILITY_CLIENT_FAILURES, "client_actor_restarts": RELIABILITY_CLIENT_ACTOR_RESTARTS,
    "updates_lost_client": RELIABILITY_UPDATES_LOST_CLIENT, "server_restarts": RELIABILITY_SERVER_RESTARTS,
    "updates_lost_server": RELIABILITY_UPDATES_LOST_SERVER, "versions_redone": RELIABILITY_VERSIONS_REDONE,
    "evals_incomplete": RELIABILITY_EVALS_INCOMPLETE, "clients_excluded": RELIABILITY_CLIENTS_EXCLUDED,
    "checkpoints_written": RELIABILITY_CHECKPOINTS_WRITTEN, "checkpoints_failed": RELIABILITY_CHECKPOINTS_FAILED,
    "peak_rss_mib_client_actor_max": SYSTEM_CLIENT_PEAK_RSS_MIB_MAX,
    "pss_mib_client_actor_max": SYSTEM_CLIENT_PSS_MIB_MAX, "pss_mib_client_actors_total": SYSTEM_CLIENT_PSS_MIB_TOTAL,
    "peak_rss_mib_server": SYSTEM_SERVER_PEAK_RSS_MIB,
}


# names of schema "2" (0.2.x) renamed since (issue 26): readers translate them like the flat names
RENAMED: dict[str, str] = {"eval/clients_nonfinite": RELIABILITY_CLIENTS_NONFINITE}
_OLD_CLIENT = re.compile(rf"client/(\d+)/({'|'.join(CLIENT_SERIES)})")
_NEW_CLIENT = re.compile(rf"{CLIENT_SECTION}/({'|'.join(CLIENT_SERIES)})/client_(\d+)")


def schema2_name(name: str) -> str:
    """Today's name -> the name a schema-"2" run logged it under (the inverse of :data:`RENAMED`
    and of the old ``client/<id>/<series>`` form); other names unchanged."""
    back = {v: k for k, v in RENAMED.items()}
    if name in back:
        return back[name]
    m = _NEW_CLIENT.fullmatch(name)
    return f"client/{m.group(2)}/{m.group(1)}" if m else name


def mlflow_key(old: str) -> str:
    """An old (0.1.x) flat key -> today's name; a name holding a ``/`` (or ``version``) is
    returned as is. Readers only (old runs, old sweep files, old checkpoints): the runtime makes
    its names with the constants and functions above. An old ``train_<term>`` was the clients'
    local-update mean: ``train/<term>``; any other old key was an aggregate metric: ``server/...``."""
    if old in RENAMED:
        return RENAMED[old]
    m = _OLD_CLIENT.fullmatch(old)
    if m:
        return client_series(int(m.group(1)), m.group(2))
    if old == VERSION or "/" in old:
        return old
    if old in LEGACY:
        return LEGACY[old]
    if old.startswith("train_"):
        return train_term(old[len("train_"):])
    return server_metric(old)


def upgrade_history(history: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A history (rows of one evaluation each) with every old flat key under today's name: the
    one conversion of a checkpoint saved before the rename, done once when it is loaded. Rows
    already holding today's names are returned unchanged (as copies)."""
    out = []
    for row in history:
        new: dict[str, Any] = {}
        for k, v in row.items():
            name = mlflow_key(k)
            if name not in new or name == k:  # a row with both spellings: today's name wins
                new[name] = v
        out.append(new)
    return out


def resolve(name: str, *, warn: bool = True) -> str:
    """A metric name as a reader may write it -> the logged name. Old flat names (the names up to
    0.1.x) and the names renamed since (:data:`RENAMED`, ``client/<id>/<series>``) are translated,
    with a DeprecationWarning; new names pass through."""
    if mlflow_key(name) == name:
        return name
    new = mlflow_key(name)
    if warn:
        warnings.warn(f"metric name {name!r} is the pre-namespacing name; it is read as {new!r} "
                      "(old names are accepted for one release)", DeprecationWarning, stacklevel=2)
    return new


def get_metric_history(client, run_id: str, name: str):
    """``MlflowClient.get_metric_history`` that also accepts an old name, of any run: a run logged
    before the rename (no ``rayfed_proto.metric_names`` tag) is read under the flat name, a
    schema-"2" run under its name of then (``client/3/head_acc`` for ``zz_client/head_acc/client_3``)."""
    schema = client.get_run(run_id).data.tags.get(SCHEMA_TAG)
    if schema is None:
        return client.get_metric_history(run_id, name)
    new = resolve(name)
    return client.get_metric_history(run_id, schema2_name(new) if schema == "2" else new)
