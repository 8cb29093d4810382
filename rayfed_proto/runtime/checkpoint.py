"""Atomic checkpoints of a whole run: server, every client, the driver's scheduler and history.

Layout of a checkpoint folder (one per checkpointed server version)::

    <dir>/v000040/
        manifest.json      written last: version, run id, files, when; its presence marks completeness
        server.pt          ServerCore state (algorithm modules and their optimizers, buffer, counters)
                           plus the server process's torch RNG state
        clients/<id>.pt    ClientRunner state (model, optimizer, algorithm state, batch RNG)
        actors.pt          each client actor's torch RNG state (shared by the clients it hosts)
        driver.pt          scheduler counters and sampling RNG, the history so far, MLflow run id

A checkpoint is first written to a hidden ``.tmp-...`` folder beside the others and renamed into
place only once every file is on disk (``os.replace`` of a folder is atomic on POSIX); a crash
while writing leaves a ``.tmp-`` folder that :meth:`CheckpointStore.latest` never loads and the
next save removes. Only the newest ``keep`` complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

MANIFEST = "manifest.json"
_PREFIX = "v"


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _load(path: Path) -> Any:
    # our own files (plain dicts, tensors, numpy arrays, message dataclasses): not untrusted input
    return torch.load(path, map_location="cpu", weights_only=False)


@dataclass
class Checkpoint:
    path: Path
    manifest: dict[str, Any]

    @property
    def version(self) -> int:
        return int(self.manifest["version"])

    def server_state(self) -> dict[str, Any]:
        return _load(self.path / "server.pt")

    def client_state(self, client_id: int) -> Optional[dict[str, Any]]:
        p = self.path / "clients" / f"{client_id}.pt"
        return _load(p) if p.exists() else None

    def actor_rng(self) -> dict[int, Any]:
        p = self.path / "actors.pt"
        return _load(p) if p.exists() else {}

    def driver_state(self) -> dict[str, Any]:
        return _load(self.path / "driver.pt")


class CheckpointStore:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.dir = Path(directory).resolve()
        self.keep = keep

    def check_writable(self) -> None:
        """Fail before training, not at the first checkpoint, when the folder cannot be written."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise PermissionError(
                f"cannot write checkpoints to {self.dir} ({e.strerror or e}); set checkpoint.dir to a writable "
                "folder, or checkpoint.every=0 and keep the default folder writable") from None

    def save(self, version: int, *, server: dict[str, Any], clients: Iterable[tuple[int, dict[str, Any]]],
             actor_rng: dict[int, Any], driver: dict[str, Any], run_id: Optional[str]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".tmp-*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.dir / f".tmp-{_PREFIX}{version:06d}-{os.getpid()}-{time.time_ns()}"
        (tmp / "clients").mkdir(parents=True)
        _save(server, tmp / "server.pt")
        client_ids = []
        for cid, state in clients:
            _save(state, tmp / "clients" / f"{cid}.pt")
            client_ids.append(int(cid))
        _save(actor_rng, tmp / "actors.pt")
        _save(driver, tmp / "driver.pt")
        manifest = {"version": int(version), "run_id": run_id, "clients": sorted(client_ids),
                    "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = self.dir / f"{_PREFIX}{version:06d}"
        if final.exists():  # the same version checkpointed again (a stop right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir()
                 if p.is_dir() and p.name.startswith(_PREFIX) and p.name[1:].isdigit() and (p / MANIFEST).is_file()]
        return sorted(found, key=lambda p: int(p.name[1:]))

    def latest(self) -> Optional[Checkpoint]:
        done = self.complete()
        if not done:
            return None
        with open(done[-1] / MANIFEST) as f:
            return Checkpoint(done[-1], json.load(f))

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
