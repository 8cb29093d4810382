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
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import InputError

LOCK = ".lock"
RUN_INFO = "run.json"
FINISHED = "finished.json"


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


def settle_orphaned_runs(root: Path) -> list[str]:
    """Run folders under ``root`` whose driver is gone (nobody holds the lock), that did not
    finish, and whose MLflow run is still RUNNING (a SIGKILLed driver, a lost machine): the run is
    marked KILLED with the tags ``stopped`` and ``resume_from`` when a checkpoint exists (it can
    be resumed), FAILED with ``failure_reason`` otherwise. Called when a new run starts, so that
    nothing stays RUNNING after an exit the platform can observe. Returns one line per run settled."""
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
            resumable = any((p / "manifest.json").is_file() for p in (folder / "checkpoints").glob("v*"))
            if resumable:
                client.set_tag(run_id, "stopped", "the driver ended without stopping the run (seen at a later start)")
                client.set_tag(run_id, "resume_from", str(folder))
                client.set_terminated(run_id, "KILLED")
                settled.append(f"MLflow run {run_id} of {folder} was left RUNNING by a driver that is gone: marked KILLED; "
                               f"resume with: rayfed-proto run --resume {folder}")
            else:
                client.set_tag(run_id, "failure_reason", "the driver ended before its first checkpoint")
                client.set_terminated(run_id, "FAILED")
                settled.append(f"MLflow run {run_id} of {folder} was left RUNNING by a driver that ended before its first "
                               "checkpoint: marked FAILED")
        except Exception as e:  # never let bookkeeping of old runs stop a new one
            log.warning("could not check the MLflow run of %s: %s", folder, e)
    return settled
