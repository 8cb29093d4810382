"""Atomic checkpoints of a whole run: server, every client, the driver's scheduler and history.

Layout of a checkpoint folder (one per checkpointed server version)::

    <dir>/v000040/
        manifest.json      written last: version, run id, each file's size and SHA-256, when; its
                           presence marks completeness, its checksums are verified before use
        server.pt          ServerCore state (algorithm modules and their optimizers, buffer, counters)
                           plus the server process's torch RNG state
        clients/<id>.pt    ClientRunner state (model, optimizer, algorithm state, batch RNG)
        actors.pt          each client actor's torch RNG state (shared by the clients it hosts)
        driver.pt          scheduler counters and sampling RNG, the history so far, MLflow run id

A checkpoint is first written to a hidden ``.tmp-...`` folder beside the others and renamed into
place only once every file is on disk (``os.replace`` of a folder is atomic on POSIX); a crash
while writing leaves a ``.tmp-`` folder that :meth:`CheckpointStore.latest` never loads and the
next save removes. Only the newest ``keep`` complete checkpoints are kept.

Before a checkpoint is used, :meth:`CheckpointStore.latest` checks it against its manifest
(every file present, same size, same SHA-256); a damaged one is skipped with a warning naming it
and the next older complete one is used. For a resume, the client states' checksums are left to
the restore, which verifies each state's SHA-256 when it reads it (:meth:`Checkpoint.client_state`,
from the same bytes it loads): a 10,000-client checkpoint holds gigabytes of client states, which
the restore reads once anyway (issue 39, item 3: hashing them all before Ray starts, and reading
them again to restore, was most of a resumed run's start-up).

Files are read with ``torch.load(weights_only=True)``: only tensors, plain containers, numpy
arrays and this project's message dataclasses can come out of a checkpoint, so a checkpoint
folder on shared storage cannot run code. Before a resume starts anything,
:meth:`Checkpoint.check_loadable` scans every file, client states included: each must be a torch
zip archive whose pickle (``data.pkl``, a few kilobytes; the tensor bytes are not read) names
only globals a checkpoint may hold. A raw pickle or a file naming other code is refused there,
before Ray starts and before the MLflow run reopens.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rayfed_proto.config import InputError

MANIFEST = "manifest.json"
_PREFIX = "v"
_FORMAT = 2  # 2: the manifest lists every file with its size and SHA-256

log = logging.getLogger("rayfed_proto")


class CheckpointError(InputError):
    """A checkpoint that cannot be used (damaged, incomplete, or holding objects that are not data);
    the message names the folder or file and what is wrong."""


def _safe_globals() -> list:
    """What a checkpoint of this project may hold besides tensors and plain containers: numpy
    arrays and scalars (algorithm states, the update buffer) and the message dataclasses."""
    from rayfed_proto.messages import ClientUpdate, GlobalState, PrototypeSet

    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype,
               ClientUpdate, GlobalState, PrototypeSet]
    allowed += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType") and n != "ObjectDType"]
    return allowed


torch.serialization.add_safe_globals(_safe_globals())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _allowed_global_names() -> set[str]:
    return {f"{g.__module__}.{g.__qualname__}" for g in _safe_globals()}


def _refuse_code(path: Path, names: list[str]) -> CheckpointError:
    return CheckpointError(
        f"refused {path}: it holds {', '.join(sorted(names)[:5])}, which is code or a class a rayfed-proto "
        "checkpoint never holds (only tensors, numpy arrays, plain containers and this project's messages), so "
        "someone or something other than rayfed-proto wrote it; nothing from it was run. Use an older checkpoint "
        "(delete this version's folder) or start the run afresh")


def _allowed_in_a_checkpoint() -> set[str]:
    """Every global ``torch.load(weights_only=True)`` accepts now: torch's own (tensor rebuilds,
    storages, OrderedDict...) and those registered above."""
    try:
        from torch import _weights_only_unpickler as wou

        return set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())
    except (ImportError, AttributeError):  # another torch: its public scan, file by file (slower)
        return set()


def _pickle_globals(path: Path) -> list[str]:
    """The globals named by the pickle of the torch zip archive ``path`` (only its ``data.pkl``
    is read, not the tensor records); :class:`CheckpointError` when ``path`` is not such an
    archive (a raw pickle, garbage, a truncated file)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise zipfile.BadZipFile(f"{len(pickles)} data.pkl records")
            data = archive.read(pickles[0])
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"refused {path}: it is not a file rayfed-proto writes (a torch zip archive of tensors and plain "
            f"containers: {e}); a raw pickle could run code when loaded, so nothing was loaded from it. Use an older "
            "checkpoint (delete this version's folder) or start the run afresh") from None
    try:
        from torch import _weights_only_unpickler as wou

        return sorted(wou.get_globals_in_pkl(io.BytesIO(data)))
    except (ImportError, AttributeError):
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # a pickle that cannot even be disassembled
        raise CheckpointError(f"refused {path}: its pickle is damaged ({e}); use an older checkpoint (delete this "
                              "version's folder) or start the run afresh") from None


def unsafe_globals(path: Path, allowed: Optional[set[str]] = None) -> list[str]:
    """The globals ``path``'s pickle names beyond what a checkpoint may hold, read without
    loading anything; [] for a file that is not a torch zip archive (:func:`_load` says what is wrong)."""
    try:
        found = _pickle_globals(path)
    except CheckpointError as e:
        log.debug("cannot scan %s: %s", path, e)
        return []
    allowed = (allowed or _allowed_in_a_checkpoint()) | _allowed_global_names()
    return [g for g in found if g not in allowed]


def _load(path: Path, data: Optional[bytes] = None, scan: bool = True) -> Any:
    """``path`` (or its ``data``, already read) loaded weights_only. On failure, ``scan`` reads the
    file for code to name it; a worker loading bytes the driver sent (``load_client_bytes``) has no
    file to read, and the driver scanned it before the run (``check_loadable``)."""
    # weights_only: a checkpoint on shared storage must not be able to run code when loaded
    try:
        return torch.load(io.BytesIO(data) if data is not None else path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, garbage, or an object type a checkpoint never holds
        code = unsafe_globals(path) if scan else []
        if code:
            raise _refuse_code(path, code) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in first or "Weights only" in first:  # torch's advice (weights_only=False) is not ours
            first = "it holds an object a rayfed-proto checkpoint never holds"
        raise CheckpointError(f"cannot load {path}: {first} (expected a checkpoint file written by rayfed-proto: "
                              "tensors, numpy arrays and plain containers)") from None


def load_client_bytes(name: str, data: bytes) -> dict[str, Any]:
    """A client state from the bytes ``Checkpoint.client_bytes`` checked, loaded where it is used (a
    worker, possibly on another node: ``name`` is for messages only)."""
    return _load(Path(name), data, scan=False)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for the keys a checkpoint needs."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable JSON manifest ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("version"), int):
        raise CheckpointError(f"{path}: expected a JSON object with an integer 'version', got {str(manifest)[:80]!r}")
    files = manifest.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str) for v in files.values())):
        raise CheckpointError(f"{path}: 'files' must map each file to its size and sha256")
    return manifest


def is_client_state(name: str) -> bool:
    """A manifest entry holding one client's state (checksummed when read, see the module doc)."""
    return name.startswith("clients/")


def verify(folder: Path, *, client_states: bool = True) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest (each file present, same size, same
    SHA-256); returns the manifest or raises :class:`CheckpointError` saying what is wrong.
    ``client_states=False``: the client states' sizes only (their checksums are verified as
    each is read). A manifest without a file list (written before checksums existed) is checked
    for the files every checkpoint has."""
    manifest = read_manifest(folder)
    files = manifest.get("files")
    if files is None:
        expected = {"server.pt": None, "driver.pt": None}
    else:
        expected = files
    for name, meta in expected.items():
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        if meta is None:
            continue
        size = f.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"{f} has {size} bytes, the manifest says {meta['size']}")
        if (client_states or not is_client_state(name)) and _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{f} does not match its checksum in the manifest")
    return manifest


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
        """The client's state, its bytes checked against the manifest's SHA-256 before they are loaded."""
        data = self.client_bytes(client_id)
        return None if data is None else _load(self.path / "clients" / f"{client_id}.pt", data)

    def client_file(self, client_id: int) -> Optional[tuple[str, int, str]]:
        """``(path, size, sha256)`` of the client's state file as the manifest lists it (None: no
        state saved, or a manifest without checksums): what a worker on this node checks and
        parks as it is (``ParkedStates.adopt``)."""
        meta = self._client_meta(client_id)
        return None if meta is None else (str(self.path / "clients" / f"{client_id}.pt"), meta["size"], meta["sha256"])

    def _client_meta(self, client_id: int) -> Optional[dict[str, Any]]:
        """The manifest's size and SHA-256 of the client's state file (None: not listed)."""
        return (self.manifest.get("files") or {}).get(f"clients/{client_id}.pt")

    def client_bytes(self, client_id: int) -> Optional[bytes]:
        """The client's state file as bytes, checked against the manifest's SHA-256 (None: no state
        saved). A resume sends these to the worker, which loads them (``load_client_bytes``): the
        driver reads and checks the next chunk while the worker loads this one."""
        p = self.path / "clients" / f"{client_id}.pt"
        if not p.exists():
            return None
        data = p.read_bytes()
        meta = self._client_meta(client_id)
        if meta is not None and (len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]):
            raise CheckpointError(
                f"{p} does not match its checksum in the manifest (damaged after it was written). Resume from the "
                f"older checkpoint by deleting {self.path}, or start the run afresh")
        return data

    def actor_rng(self) -> dict[int, Any]:
        p = self.path / "actors.pt"
        return _load(p) if p.exists() else {}

    def driver_state(self) -> dict[str, Any]:
        return _load(self.path / "driver.pt")

    def check_loadable(self) -> None:
        """Before anything starts (a resume): every file of the checkpoint, client states included,
        is a torch zip archive whose pickle names only globals a checkpoint may hold (scanned, not
        loaded: only each file's ``data.pkl`` is read), and the small ones (server, driver) load."""
        allowed = _allowed_in_a_checkpoint() | _allowed_global_names()
        listed = self.manifest.get("files")
        paths = sorted(self.path / n for n in listed) if listed is not None else sorted(self.path.rglob("*.pt"))
        for f in paths:
            code = [g for g in _pickle_globals(f) if g not in allowed]
            if code:
                raise _refuse_code(f, code)
        self.server_state()
        self.driver_state()


class CheckpointStore:
    """Checkpoints in a local folder, or at a URI (``s3://bucket/prefix``, ``gs://``, ``file://``; any
    location ``pyarrow.fs`` opens, or ``filesystem``): then each checkpoint is written to a local
    staging folder as above and uploaded, its manifest last (a reader that finds the manifest finds
    every file; each object is one atomic PUT), and :meth:`latest` downloads the newest complete
    ones it lacks (a run resumed on another node) and verifies them as any local checkpoint."""

    def __init__(self, directory: str | Path, keep: int = 2, filesystem=None):
        from rayfed_proto.runtime import storage

        self.remote = storage.Location(str(directory), filesystem) if storage.is_remote(directory) else None
        self.dir = storage.cache_dir(str(directory)) if self.remote is not None else Path(directory).resolve()
        self.keep = keep

    def check_writable(self) -> None:
        """Fail before training, not at the first checkpoint, when the folder cannot be written."""
        try:
            if self.remote is not None:
                self.remote.probe()
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise PermissionError(
                f"cannot write checkpoints to {self.remote.uri if self.remote is not None else self.dir} ({e.strerror or e}); "
                "set checkpoint.dir to a writable folder or URI, "
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
        files = {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.rglob("*.pt"))}
        manifest = {"version": int(version), "run_id": run_id, "clients": sorted(client_ids), "format": _FORMAT,
                    "files": files, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = self.dir / f"{_PREFIX}{version:06d}"
        if final.exists():  # the same version checkpointed again (a stop right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        if self.remote is not None:
            self._upload(final)
            shutil.rmtree(final, ignore_errors=True)  # the remote copy is the checkpoint; latest() fetches it again
            return final
        self._prune()
        return final

    def release_cache(self) -> None:
        """A remote store's local staging folder (in the temp folder) removed at the end of a run:
        the checkpoints live at the remote location; a local store keeps everything."""
        if self.remote is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _upload(self, final: Path) -> None:
        self.remote.upload_dir(final, final.name, last=MANIFEST)
        done = [n for n in self.remote.list() if n.startswith(_PREFIX) and n[1:].isdigit() and self.remote.exists(f"{n}/{MANIFEST}")]
        for old in sorted(done, key=lambda n: int(n[1:]))[: max(0, len(done) - self.keep)]:
            self.remote.delete(old)

    def _fetch(self) -> None:
        """Bring the newest ``keep`` complete remote checkpoints into the staging folder (those it
        lacks, or holds with another manifest: another run's, or an older write)."""
        names = [n for n in self.remote.list() if n.startswith(_PREFIX) and n[1:].isdigit()]
        complete = [n for n in names if self.remote.exists(f"{n}/{MANIFEST}")]
        for name in sorted(complete, key=lambda n: int(n[1:]))[-self.keep:]:
            local = self.dir / name
            manifest = self.remote.read_bytes(f"{name}/{MANIFEST}")
            if (local / MANIFEST).is_file() and (local / MANIFEST).read_bytes() == manifest:
                continue
            self.dir.mkdir(parents=True, exist_ok=True)
            self.remote.download_dir(name, local)

    def save_or_warn(self, version: int, *, attempts: int = 3, delay_s: float = 2.0, **parts: Any) -> Optional[Path]:
        """:meth:`save`, retried on an OS error (disk full, a network file system hiccup); when every
        attempt fails, a warning says so and None is returned: the previous checkpoint still
        stands and the run goes on (a fault during a run must not end it as if the input were bad)."""
        if iter(parts["clients"]) is parts["clients"]:  # a generator would be spent by the first attempt
            parts["clients"] = list(parts["clients"])
        for attempt in range(1, attempts + 1):
            try:
                return self.save(version, **parts)
            except OSError as e:
                for stale in self.dir.glob(".tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                if attempt < attempts:
                    log.warning("checkpoint of version %d: writing to %s failed (%s), retrying (%d/%d)",
                                version, self.dir, e, attempt, attempts)
                    time.sleep(delay_s * attempt)
                    continue
                done = self.complete()
                log.warning("checkpoint of version %d could NOT be written to %s after %d attempts (%s); %s; the run "
                            "goes on", version, self.dir, attempts, e,
                            f"the previous checkpoint {done[-1].name} still stands" if done else "there is no checkpoint yet")
        return None

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir()
                 if p.is_dir() and p.name.startswith(_PREFIX) and p.name[1:].isdigit() and (p / MANIFEST).is_file()]
        return sorted(found, key=lambda p: int(p.name[1:]))

    def latest(self, *, client_states: bool = True) -> Optional[Checkpoint]:
        """The newest complete checkpoint that passes :func:`verify`; a damaged newer one is
        skipped with a warning naming it. None when there is no complete checkpoint; raises
        :class:`CheckpointError` (naming every damaged one) when there are some but none is usable.
        ``client_states=False`` (a resume): the client states' checksums are left to the reads of
        the restore (:meth:`Checkpoint.client_state`); an actor recreated during a run keeps the
        full check, so a damaged client state there means the older checkpoint, not a failed run."""
        if self.remote is not None:
            self._fetch()
        done = self.complete()
        damaged: list[str] = []
        for folder in reversed(done):
            try:
                manifest = verify(folder, client_states=client_states)
            except CheckpointError as e:
                damaged.append(str(e))
                log.warning("checkpoint %s is damaged and skipped: %s", folder, e)
                continue
            if damaged:
                log.warning("using the older checkpoint %s (version %d) instead", folder, manifest["version"])
            return Checkpoint(folder, manifest)
        if damaged:
            raise CheckpointError(f"no usable checkpoint under {self.dir}: every complete one is damaged ("
                                  + "; ".join(damaged) + "); start the run afresh")
        return None

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
