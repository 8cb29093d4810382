"""Before Ray starts: everything that can refuse a run does so here, and the run's folder.

The checkpoint a resume continues from, the data and its partition, the simulated clients'
availability, the output folder (created, checked writable, locked) and the run's files, the
clients' system profiles (virtual clock); and Ray itself, started when the cluster is local.
"""

from __future__ import annotations

import logging
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfed_proto.config import ExperimentConfig, InputError
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.data.datasets import dataset_warnings
from rayfed_proto.runtime import runfolder
from rayfed_proto.runtime.policies import min_update_starts
from rayfed_proto.runtime.run_state import RunData, RunFolder

if TYPE_CHECKING:
    from rayfed_proto.runtime.checkpoint import CheckpointStore

log = logging.getLogger("rayfed_proto")


def output_dir(cfg: ExperimentConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    out = Path(cfg.tracking.output_dir).resolve() / f"{stamp}-{cfg.algorithm.name}-{cfg.data.name}"
    try:
        out.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        raise PermissionError(f"cannot create the output folder {out} ({e}); set tracking.output_dir to a writable folder") from None
    return out


def resume_point(cfg: ExperimentConfig, out: Path, store):
    """The checkpoint ``run --resume out`` continues from, or an :class:`InputError` saying why
    there is nothing to resume; decided before Ray starts.

    A finished run is continued only when ``federation.rounds`` was raised above its final
    version, from the checkpoint written at its end; when that one is damaged or missing, from
    the newest usable older one, redoing the versions after it (``CheckpointStore.latest``
    skips a damaged checkpoint). Every file of the checkpoint is scanned for code before
    anything starts (``Checkpoint.check_loadable``). A folder whose driver died before its
    first checkpoint has its MLflow run, left RUNNING, marked FAILED."""
    from rayfed_proto.runtime.checkpoint import (
        CheckpointError,  # here: it imports torch, which the checks before it need not wait for
    )

    rounds = cfg.federation.rounds
    done = runfolder.finished_version(out)
    if done is not None and rounds <= done:
        raise InputError(f"run {out} already finished at version {done} (federation.rounds={rounds}): nothing to resume. "
                         f"To continue it, raise federation.rounds: rayfed-proto run --resume {out} --set federation.rounds=N "
                         f"with N > {done}")
    try:
        ckpt = store.latest(client_states=False)  # each client state's checksum: verified when the restore reads it
    except CheckpointError as e:
        raise InputError(str(e)) from None
    if ckpt is None:
        marked = fail_orphaned_mlflow_run(out, "the driver ended before its first checkpoint; nothing to resume")
        raise InputError(f"no complete checkpoint under {store.dir}: the driver ended before its first checkpoint, so "
                         f"there is nothing to resume{marked}. Start the run afresh: rayfed-proto run {out / 'config.yaml'}")
    try:  # scanned (and the small parts loaded) now: a refused checkpoint leaves the run's MLflow status alone
        ckpt.check_loadable()
    except CheckpointError as e:
        raise InputError(str(e)) from None
    if done is not None and ckpt.version < done:  # the final checkpoint is damaged or was never written
        log.warning("run %s finished at version %d, but its newest usable checkpoint is version %d: continuing from "
                    "it redoes versions %d..%d (MLflow keeps the earlier points, tagged superseded_steps)",
                    out, done, ckpt.version, ckpt.version + 1, done)
    if ckpt.version >= rounds:
        raise InputError(f"the checkpoint {ckpt.path} is at version {ckpt.version} and federation.rounds={rounds}: nothing "
                         f"left to run. Raise federation.rounds above {ckpt.version} (--set federation.rounds=N)")
    return ckpt


def fail_orphaned_mlflow_run(out: Path, reason: str) -> str:
    """Mark the MLflow run that ``out`` records (run.json) FAILED when a dead driver left it
    RUNNING; returns a phrase for the message ('' when there was nothing to mark)."""
    info = runfolder.read_run_info(out) or {}
    if not info.get("run_id") or not info.get("tracking_uri"):
        return ""
    try:
        from mlflow.tracking import MlflowClient  # here: importing MLflow costs a second, and only this case needs it

        client = MlflowClient(info["tracking_uri"])
        if client.get_run(info["run_id"]).info.status != "RUNNING":
            return ""
        client.set_tag(info["run_id"], "failure_reason", reason)
        client.set_terminated(info["run_id"], "FAILED")
    except Exception as e:  # the store is gone or unreachable: say so, do not hide the real message
        log.warning("could not mark MLflow run %s FAILED: %s", info["run_id"], e)
        return ""
    return f"; its MLflow run {info['run_id']}, left RUNNING, is now marked FAILED"


def ensure_ray(cfg: ExperimentConfig) -> None:
    import ray  # here: a config check or a refused resume never pays for importing Ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if cfg.resources.address:
        ray.init(address=cfg.resources.address, **kwargs)
    else:
        ray.init(num_cpus=cfg.resources.num_cpus, num_gpus=cfg.resources.num_gpus, **kwargs)


def resumed_folder(cfg: ExperimentConfig, resume_dir, folder_locks) -> tuple[RunFolder, Any]:
    """``run --resume DIR``: the folder (locked first: a second driver is refused at once) with its
    checkpoint store and the checkpoint to continue from (:func:`resume_point`), and the partition
    (a damaged file refused, naming it and what to do)."""
    out = Path(resume_dir).resolve()
    folder_locks.enter_context(runfolder.RunFolderLock(out))
    store = checkpoint_store(cfg, out)
    ckpt = resume_point(cfg, out, store)
    return RunFolder(out, store, ckpt), runfolder.load_partition(out)


def read_data(cfg: ExperimentConfig, partition=None, start_version: int = 0) -> RunData:
    """The dataset, the clients' partition (a resume's own, else made from the dataset) and their
    system profiles, each refused as input when this config cannot use it; the simulated clients'
    availability checked from ``start_version`` on. Only the driver ever reads the data."""
    dataset = load_data(cfg)
    if partition is None:
        partition = partition_for(cfg, dataset)
    system = system_model(cfg, partition, dataset.num_classes, dataset.channels, dataset.image_size)
    check_availability(cfg, system, start_version)
    if cfg.resources.address is None and cfg.resources.parks_clients(cfg.federation.num_clients) \
            and cfg.resources.parks_on_disk(cfg.federation.num_clients):  # a local Ray: the workers' folder is this node's
        # here: it imports torch, which the other checks need not wait for
        from rayfed_proto.runtime.parking import check_park_dir

        check_park_dir(cfg.resources.park_dir)
    return RunData(dataset, partition, system)


def load_data(cfg: ExperimentConfig):
    """The run's dataset; data this config cannot use is refused as input, doubts are logged."""
    try:
        dataset = load_dataset(cfg.data, cfg.seed)
    except (ValueError, KeyError) as e:  # infeasible data for this config: the user's to fix
        raise InputError(str(e)) from e
    for warning in dataset_warnings(dataset):
        log.warning(warning)
    return dataset


def checkpoint_store(cfg: ExperimentConfig, out: Path) -> CheckpointStore:
    from rayfed_proto.runtime.checkpoint import CheckpointStore  # here: it imports torch (see resume_point)

    return CheckpointStore(cfg.checkpoint.dir or (out / "checkpoints"), keep=cfg.checkpoint.keep)


def new_output_folder(cfg: ExperimentConfig, folder_locks) -> RunFolder:
    """The run's folder, created, checked writable (with the checkpoint store) and locked; only
    once the data and partition are known to be usable, and before Ray starts."""
    out = output_dir(cfg)
    store = checkpoint_store(cfg, out)
    try:
        store.check_writable()
    except PermissionError:
        shutil.rmtree(out, ignore_errors=True)
        raise
    folder_locks.enter_context(runfolder.RunFolderLock(out))
    return RunFolder(out, store)


def write_run_files(out: Path, cfg: ExperimentConfig, partition, echo) -> None:
    """A new run's config and partition, written once nothing can refuse it any more."""
    for line in runfolder.settle_orphaned_runs(out.parent):  # runs left RUNNING by drivers that are gone
        echo(line)
    (out / "config.yaml").write_text(cfg.to_yaml())
    partition.save_parquet(out / "partition.parquet")


def check_availability(cfg: ExperimentConfig, system, start_version: int = 0) -> None:
    """Availability windows (``system.availability: csv``) that cannot hold the updates the run
    needs: refused before Ray starts. A sound bound, not a simulation: each version needs at
    least ``policies.min_update_starts`` local updates to start inside some window, and a client
    starts at most one per ``compute_s`` of window (``SystemModel.max_update_starts``)."""
    if system is None:
        return
    need, most = min_update_starts(cfg.federation, start_version), system.max_update_starts()
    if most < need:
        raise InputError(
            f"system.availability: the windows in {cfg.system.availability.path} let at most {most:g} local updates "
            f"start (a client starts at most one per its simulated compute time inside its windows), but reaching "
            f"federation.rounds={cfg.federation.rounds} needs at least {need}; extend the windows or lower "
            "federation.rounds")


def partition_for(cfg: ExperimentConfig, dataset):
    """The clients' partition of ``dataset``; one the data cannot give is refused as input."""
    d = cfg.data
    try:
        return make_partition(dataset, d.partition, cfg.federation.num_clients, cfg.seed, d.test_fraction,
                              global_test_fraction=d.global_test_fraction, public_size=d.public_size,
                              long_tail_ratio=d.long_tail_ratio)
    except (ValueError, KeyError) as e:
        raise InputError(str(e)) from e


def system_model(cfg: ExperimentConfig, partition, num_classes: int, channels: int, image_size: int):
    """The clients' system profiles (virtual clock), or None for wall-clock mode (``system: null``)."""
    if getattr(cfg, "system", None) is None:
        return None
    # here: the registries import every algorithm module (torch), which a run without a virtual clock never needs here
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.algorithms.base import ServerSizes, UpdateSizes
    from rayfed_proto.system import SystemModel

    # the work one local update declares (the run's method, whichever it is), per client
    method, options = ALGORITHMS.get(cfg.algorithm.name), cfg.algorithm_options()
    counts = [np.bincount(partition.labels[s.train_idx], minlength=num_classes) for s in partition.clients]
    work = [method.Client.update_work(options, UpdateSizes(
        train=len(s.train_idx), local_epochs=cfg.training.local_epochs, batch_size=cfg.training.batch_size,
        unlabelled=len(s.unlabelled_idx), public=len(partition.public_idx),
        train_class_counts=tuple(int(n) for n in counts[c]))) for c, s in enumerate(partition.clients)]
    # and the work of one server step, for the updates it aggregates and the clients that have uploaded
    classes = float(np.mean([np.count_nonzero(n) for n in counts])) if counts else 0.0

    def server_work(updates: int, uploaders: int) -> list:
        return method.Server.server_work(options, ServerSizes(updates, num_classes, cfg.model.feature_dim,
                                                              len(partition.public_idx), classes, uploaders))

    return SystemModel.from_config(cfg, [len(s.train_idx) for s in partition.clients], channels, image_size, num_classes,
                                   work=work, server_work=server_work)


_RUNS_STARTED = 0  # runs started in this process: the first one's startup includes the process's


def run_start_unix() -> float:
    """When a run starts, for its ``federation/startup_s`` (to its first update): the process's
    start for the first run of a process (its imports and Ray's start count too), now for the
    next ones."""
    global _RUNS_STARTED
    _RUNS_STARTED += 1
    return process_start_unix() if _RUNS_STARTED == 1 else time.time()


def process_start_unix() -> float:
    """When this process started."""
    try:
        import psutil  # here: optional; without it the startup is counted from this call

        return psutil.Process().create_time()
    except Exception:  # no psutil or no /proc: from this call on
        return time.time()
