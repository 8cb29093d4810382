"""A run's output folder: an exclusive lock while a driver uses it, and the record of how it ended.

* ``.lock``: held (``fcntl.flock``, exclusive, non-blocking) by the one driver that runs or
  resumes the folder; it holds that driver's pid, host and start time so that a second driver is
  refused naming them. The kernel releases the lock when the process dies, however it dies
  (SIGKILL included), so a stale lock never blocks a resume. On network file systems ``flock``
  is only as good as the file system's lock support (NFSv4 and Lustre: yes; some FUSE mounts: no).
* ``run.json``: the MLflow run id, written as soon as the run exists (before the first
  checkpoint), so that a folder whose driver died before checkpointing can still say which MLflow
  run it left behind.
* ``finished.json``: written when the run finished (the final version and when); resuming a
  finished run does nothing unless ``federation.rounds`` is raised.

The MLflow run carries its driver's identity (:func:`driver_tags`: host, pid, the process's start
time, pid namespace, output folder), rewritten by each driver that resumes it, so that a later
start anywhere on the same host can tell that the driver of a run left RUNNING is gone
(:func:`settle_orphaned_store_runs`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import InputError

LOCK = ".lock"
RUN_INFO = "run.json"
FINISHED = "finished.json"

# MLflow tags naming the driver of a run (set when the run starts or is resumed)
DRIVER_HOST = "rayfed_proto.driver_host"  # socket.gethostname()
DRIVER_PID = "rayfed_proto.driver_pid"
DRIVER_STARTED = "rayfed_proto.driver_started"  # the process's start time (unix s): a reused pid is told apart
DRIVER_PID_NS = "rayfed_proto.driver_pid_ns"  # containers sharing a host name have pid spaces of their own
OUTPUT_DIR = "rayfed_proto.output_dir"
_START_TOLERANCE_S = 1.0  # the kernel's start times, as psutil reads them, can differ by rounding


class RunFault(RuntimeError):
    """A file-system fault during a run (a disk that filled, a folder made unwritable): not bad
    input, so exit 1 with the MLflow run FAILED; the message names the file and what was kept."""

    @classmethod
    def during_run(cls, error: OSError, out: Optional[Path], store) -> RunFault:
        where = f" ({error.filename})" if getattr(error, "filename", None) else ""
        try:
            latest = store.latest() if store is not None else None
        except Exception:  # a damaged store: say nothing of it rather than hide the fault
            latest = None
        kept = (f"the checkpoint of version {latest.version} in {latest.path} is kept: once there is room (or the "
                f"folder is writable again), resume with: rayfed-proto run --resume {out}" if latest is not None
                else "there is no checkpoint to resume from")
        return cls(f"the run failed on a file-system error{where}: {error.strerror or error}; run folder {out}; {kept}")


class RunFolderBusy(InputError):
    """Another driver holds the run folder's lock."""


class RunFolderLock:
    """Exclusive lock on a run folder for the lifetime of one driver (see module doc)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self._fd: Optional[int] = None

    def acquire(self) -> RunFolderLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunFolderBusy(
                f"run folder {self.folder} is in use by another driver (pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')}, since {holder.get('since', '?')}); two drivers would log every step twice "
                "and mix their checkpoints. Wait for it to end, or stop it (Ctrl-C / SIGTERM writes a checkpoint) and "
                "resume then") from None
        except OSError as e:  # a file system without flock support
            os.close(fd)
            raise InputError(f"cannot lock the run folder {self.folder} ({e.strerror or e}); put tracking.output_dir "
                             "on a file system that supports flock") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> RunFolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {}


def is_locked(folder: str | Path) -> bool:
    """True while a live driver holds ``folder``'s lock (probes without keeping it)."""
    import fcntl

    path = Path(folder) / LOCK
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock this probe took
    return False


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_run_info(folder: Path, run_id: Optional[str], tracking_uri: Optional[str]) -> None:
    _write_json(folder / RUN_INFO, {"run_id": run_id, "tracking_uri": tracking_uri})


def read_run_info(folder: Path) -> Optional[dict[str, Any]]:
    return _read_json(folder / RUN_INFO)


def mark_finished(folder: Path, version: int, run_id: Optional[str]) -> None:
    _write_json(folder / FINISHED, {"version": int(version), "run_id": run_id,
                                    "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def finished_version(folder: Path) -> Optional[int]:
    """The final version of a run that finished, None if it never finished."""
    data = _read_json(folder / FINISHED)
    return int(data["version"]) if data and isinstance(data.get("version"), int) else None


def clear_finished(folder: Path) -> None:
    (folder / FINISHED).unlink(missing_ok=True)


def driver_tags(folder: str | Path) -> dict[str, str]:
    """The tags that name this process as the driver of the MLflow run of the output folder
    ``folder`` (see the module doc); a tag whose value cannot be known is left out."""
    tags = {DRIVER_HOST: socket.gethostname(), DRIVER_PID: str(os.getpid()), OUTPUT_DIR: str(Path(folder).resolve())}
    started = _process_start(os.getpid())
    if started is not None:
        tags[DRIVER_STARTED] = f"{started:.3f}"
    ns = _pid_namespace()
    if ns:
        tags[DRIVER_PID_NS] = ns
    return tags


def _process_start(pid: int) -> Optional[float]:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # no psutil, no such process, not readable
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:  # not Linux
        return None


def _driver_gone(pid: int, started: Optional[float]) -> bool:
    """True when no process ``pid`` exists on this host, or the one that does is a zombie or
    started at another time than ``started`` (the pid was reused). False whenever it cannot be
    told (another user's process whose details are hidden, no psutil): a live run is never
    settled on a guess."""
    try:
        os.kill(pid, 0)
        ours = True
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, another user's
        ours = False
    except (OSError, OverflowError, ValueError):
        return False
    try:
        import psutil
    except ImportError:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        return started is not None and abs(proc.create_time() - started) > _START_TOLERANCE_S
    except psutil.ZombieProcess:
        return True
    except psutil.NoSuchProcess:
        return ours  # ours: it ended since; another user's: hidden from us (hidepid), cannot be told
    except Exception:
        return False


def _settle(client, run_id: str, folder: Optional[Path], settled: list[str]) -> None:
    """End the RUNNING run ``run_id`` of a driver that is gone: KILLED with ``stopped`` and
    ``resume_from`` when ``folder`` holds a checkpoint, FAILED with ``failure_reason`` otherwise."""
    resumable = folder is not None and any((p / "manifest.json").is_file() for p in (folder / "checkpoints").glob("v*"))
    if resumable:
        client.set_tag(run_id, "stopped", "the driver ended without stopping the run (seen at a later start)")
        client.set_tag(run_id, "resume_from", str(folder))
        client.set_terminated(run_id, "KILLED")
        settled.append(f"MLflow run {run_id} of {folder} was left RUNNING by a driver that is gone: marked KILLED; "
                       f"resume with: rayfed-proto run --resume {folder}")
    elif folder is None or folder.is_dir():
        client.set_tag(run_id, "failure_reason", "the driver ended before its first checkpoint")
        client.set_terminated(run_id, "FAILED")
        settled.append(f"MLflow run {run_id}{f' of {folder}' if folder else ''} was left RUNNING by a driver that ended "
                       "before its first checkpoint: marked FAILED")
    else:
        client.set_tag(run_id, "failure_reason", f"the driver ended; its output folder {folder} is gone")
        client.set_terminated(run_id, "FAILED")
        settled.append(f"MLflow run {run_id} was left RUNNING by a driver that is gone, and its output folder {folder} "
                       "no longer exists: marked FAILED")


def settle_orphaned_runs(root: Path) -> list[str]:
    """Run folders under ``root`` whose driver is gone (nobody holds the lock), that did not
    finish, and whose MLflow run is still RUNNING (a SIGKILLed driver, a lost machine): the run is
    marked KILLED with the tags ``stopped`` and ``resume_from`` when a checkpoint exists (it can
    be resumed), FAILED with ``failure_reason`` otherwise. Called when a new run starts, before
    :func:`settle_orphaned_store_runs`; this pass also settles runs of versions that did not tag
    their driver. Returns one line per run settled."""
    import logging

    log = logging.getLogger("rayfed_proto")
    settled: list[str] = []
    if not root.is_dir():
        return settled
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (p / RUN_INFO).is_file()):
        info = read_run_info(folder) or {}
        run_id, uri = info.get("run_id"), info.get("tracking_uri")
        if not run_id or not uri or finished_version(folder) is not None or is_locked(folder):
            continue
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(uri)
            if client.get_run(run_id).info.status != "RUNNING":
                continue
            _settle(client, run_id, folder, settled)
        except Exception as e:  # never let bookkeeping of old runs stop a new one
            log.warning("could not check the MLflow run of %s: %s", folder, e)
    return settled


def settle_orphaned_store_runs(tracking_uri: Optional[str], exclude: Iterable[str] = ()) -> list[str]:
    """Every RUNNING run of the MLflow store ``tracking_uri``, whatever its output folder, whose
    driver tags (:func:`driver_tags`) name this host (and pid namespace) and a process that no
    longer exists or is another one (its pid reused): marked KILLED with ``stopped`` and
    ``resume_from`` when its folder holds a checkpoint, FAILED with ``failure_reason`` otherwise.
    Called when a run starts or resumes. Left alone: runs of other hosts (whether their driver
    lives cannot be told from here), runs without driver tags (see :func:`settle_orphaned_runs`),
    the runs in ``exclude`` (the current one), runs whose folder is locked or finished. One search
    per 100 experiments; returns one line per run settled and never raises (a warning instead)."""
    import logging

    log = logging.getLogger("rayfed_proto")
    settled: list[str] = []
    if not tracking_uri:
        return settled
    exclude, host = set(exclude), socket.gethostname()
    try:
        from mlflow.entities import ViewType
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        experiments, token = [], None
        while True:
            page = client.search_experiments(view_type=ViewType.ACTIVE_ONLY, page_token=token)
            experiments += [e.experiment_id for e in page]
            token = page.token
            if not token:
                break
        query = f"attributes.status = 'RUNNING' and tags.`{DRIVER_HOST}` = '{host}'"
        runs = []
        for i in range(0, len(experiments), 100):  # one search per 100 experiments (and per 1000 runs found)
            token = None
            while True:
                page = client.search_runs(experiments[i : i + 100], filter_string=query, page_token=token)
                runs += list(page)
                token = page.token
                if not token:
                    break
    except Exception as e:  # never let bookkeeping of old runs stop a new one
        log.warning("could not look for runs left RUNNING in the MLflow store %s: %s", tracking_uri, e)
        return settled
    ns = _pid_namespace()
    for run in runs:
        run_id, tags = run.info.run_id, run.data.tags
        if run_id in exclude or tags.get(DRIVER_HOST) != host:
            continue
        if ns and tags.get(DRIVER_PID_NS) and tags[DRIVER_PID_NS] != ns:
            continue  # another container with this host name: its processes are not visible from here
        try:
            pid = int(tags[DRIVER_PID])
            started = float(tags[DRIVER_STARTED]) if tags.get(DRIVER_STARTED) else None
            if pid <= 0 or not _driver_gone(pid, started):
                continue
            folder = Path(tags[OUTPUT_DIR]) if tags.get(OUTPUT_DIR) else None
            if folder is not None and (is_locked(folder) or finished_version(folder) is not None):
                continue  # a driver holds the folder (one that does not tag its runs), or the run finished
            fresh = client.get_run(run_id)  # the run may have been resumed (tags rewritten) since the search
            if fresh.info.status != "RUNNING" or any(fresh.data.tags.get(k) != tags.get(k)
                                                     for k in (DRIVER_HOST, DRIVER_PID, DRIVER_STARTED)):
                continue
            _settle(client, run_id, folder, settled)
        except Exception as e:
            log.warning("could not check MLflow run %s (left RUNNING by pid %s on %s): %s", run_id,
                        tags.get(DRIVER_PID, "?"), host, e)
    return settled


PARTITION = "partition.parquet"


def load_partition(folder: Path):
    """The partition a resumed run continues with (which client holds which samples), read from
    ``folder``; an :class:`InputError` naming the file and what to do when it is missing or
    damaged (a resume cannot draw it again: the clients' states belong to this one)."""
    from rayfed_proto.data import Partition

    path = Path(folder) / PARTITION
    try:
        return Partition.load_parquet(path)
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError), missing columns or metadata
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        info = read_run_info(Path(folder)) or {}
        copy = (f"; the run's MLflow run {info['run_id']} holds a copy: mlflow artifacts download --run-id "
                f"{info['run_id']} --artifact-path {PARTITION} --dst-path {folder}" if info.get("run_id") else "")
        raise InputError(f"cannot read {path} ({first}): a resume needs the run's partition unchanged (which client "
                         f"holds which samples){copy}. Put the file back, or start the run afresh: rayfed-proto run "
                         f"{Path(folder) / 'config.yaml'}") from None


def resume_tracking(tracker, ckpt, out: Path, history: list[dict[str, Any]], cfg, driver: dict[str, str], echo) -> str:
    """The checkpoint's MLflow run, continued (a checkpoint without one: a new run); the versions
    the earlier driver logged after the checkpoint are tagged superseded. Returns the run id."""
    run_id = (tracker.resume(ckpt.manifest["run_id"], tags=driver) if ckpt.manifest.get("run_id")
              else tracker.start(cfg.flat(), tags=driver))
    echo(f"resuming from {ckpt.path} (version {ckpt.version})")
    # logged by the earlier driver after the checkpoint (and the checkpoint's own version when its
    # history lacks it): evaluated again now
    evaluated = {h["version"] for h in history}
    redone = tracker.note_superseded_steps(ckpt.version if ckpt.version in evaluated else ckpt.version - 1)
    if redone:
        echo(f"versions {redone[0]}..{redone[-1]} were logged after that checkpoint and are redone: MLflow "
             "keeps both points (the later is valid; tag superseded_steps); history.parquet holds only the "
             "valid ones")
    clear_finished(out)  # continued: it is not finished until it finishes again
    return run_id
