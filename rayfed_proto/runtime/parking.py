"""Where a worker keeps the states of clients that are not training (``resources.park_idle_clients``).

A parked state is the same dict of plain tensors a checkpoint holds for the client. It lives in
the worker's memory, or (``resources.park_to: disk``) in one file per state on the node's local
disk, so that a worker's memory follows the clients it runs at once, not the clients it hosts:
10,000 clients with their own 3 MiB models are 33 GB of states, of which a worker running 20 at
a time holds 20 (docs/simulation.md, "10,000 clients").

A state on disk is a :class:`OnDisk` handle: written once, never changed (a local update parks a
new state, it does not edit the old one), and its file is deleted when the last reference to the
handle goes. So the state an evaluation may still ask for (``ClientHost.kept``) and the client's
current parked state can be the same handle, and nothing is copied to keep it. ``torch.save`` and
``torch.load`` of tensors round-trip exactly: a state restored from disk is bit-for-bit the state
parked.

Each worker writes under its own folder, ``<park_dir>/rayfed_proto-parked/<pid>-<random>``,
removed when the run ends (the fleet calls ``ClientActor.close`` before killing its workers), when
the store is garbage-collected or when the process exits; a folder left by a worker that died
(its pid is gone) is removed by the next worker that starts on the node.
No Ray here.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Optional, Union

import torch

from rayfed_proto.runtime import checkpoint  # registers the globals a state may hold; its SHA-256

SUBDIR = "rayfed_proto-parked"


class OnDisk:
    """One parked state in a file of its own; the file goes with the last reference to this handle.
    A state adopted from a checkpoint (:meth:`ParkedStates.adopt`: the checkpoint's own file,
    hard-linked or copied, checked, not loaded) is read without the entries kept for evaluations
    it may list: its host took those at adoption."""

    __slots__ = ("path", "updates", "adopted", "__weakref__")

    def __init__(self, path: Path, state: Optional[dict[str, Any]], updates: int = 0):
        self.path, self.adopted = path, state is None
        self.updates = int(state.get("updates", 0)) if state is not None else int(updates)
        if state is not None:
            try:
                torch.save(state, path)  # not fsynced: a parked state need not survive the machine, only the process
            except (OSError, RuntimeError) as e:  # disk full: torch reports it as either
                _unlink(str(path))
                raise OSError(f"cannot park a client state in {path.parent} ({e}); free space there, set "
                              "resources.park_dir to a local folder with room for every trained client's model, or "
                              "resources.park_to=memory") from None
        weakref.finalize(self, _unlink, str(path))

    def load(self) -> dict[str, Any]:
        # weights_only: only tensors, numpy arrays and plain containers, as in a checkpoint
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        if self.adopted:
            state.pop("kept", None)
        return state


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


State = Union[dict, OnDisk]


def resolve(state: State) -> dict[str, Any]:
    """The state itself, read from disk when it is a handle."""
    return state.load() if isinstance(state, OnDisk) else state


class ParkedStates:
    """Client id -> its parked state, in memory (``folder=None``) or one file per state under ``folder``."""

    def __init__(self, folder: Optional[Path] = None):
        self.folder = folder
        self._states: dict[int, State] = {}
        self._written = 0  # files written (unique names; also a count for tests)
        self._cleanup: Optional[weakref.finalize] = None  # removes the folder (on_disk)

    @classmethod
    def on_disk(cls, park_dir: Optional[str] = None) -> ParkedStates:
        """A store in a fresh folder of this process under ``park_dir`` (None: the system's temp
        folder), after removing the folders of workers on this node whose process is gone."""
        root = Path(park_dir or tempfile.gettempdir()) / SUBDIR
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PermissionError(f"resources.park_dir: cannot create {root} ({e.strerror or e}); set "
                                  "resources.park_dir to a writable local folder, or resources.park_to=memory") from None
        remove_orphaned(root)
        folder = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
        store = cls(folder)
        store._cleanup = weakref.finalize(store, shutil.rmtree, str(folder), True)  # also at interpreter exit
        return store

    def close(self) -> None:
        """Forget every state and remove the folder (a worker ends: Ray kills its process, so no
        exit handler would run)."""
        self._states.clear()
        if self._cleanup is not None:
            self._cleanup()

    def __contains__(self, c: int) -> bool:
        return c in self._states

    def __len__(self) -> int:
        return len(self._states)

    def clients(self) -> list[int]:
        return sorted(self._states)

    def hold(self, state: dict[str, Any], c: int) -> State:
        """``state`` as this store keeps it: the dict itself in memory, else a new file's handle."""
        if self.folder is None:
            return state
        self._written += 1
        return OnDisk(self.folder / f"{c}-{int(state.get('updates', 0))}-{self._written}.pt", state)

    def put(self, c: int, state: dict[str, Any]) -> None:
        self._states[c] = self.hold(state, c)

    def adopt(self, c: int, source: Path, size: int, sha256: str) -> Optional[dict[int, Optional[dict[str, Any]]]]:
        """Park a checkpoint's state file as it is: hard-linked into this store's folder (a copy
        where the folder is on another file system), its SHA-256 checked here, and not loaded
        (the pickle alone is read for the update count). Returns the state's entries kept for
        evaluations (``{updates: state}``; None for the client's fresh start, which needs no
        state): each a dict whose tensors are mapped from the linked file, not read, for the
        caller to hold (:meth:`hold` copies them into a file of their own). None, with nothing
        parked, where this store is in memory, the file cannot be reached from this node, or is
        not ``size`` bytes or not ``sha256`` (the driver then reads it, checks it and names the
        damage): the caller then sends the bytes."""
        if self.folder is None:
            return None
        try:
            if os.stat(source).st_size != size:
                return None
        except OSError:  # another node's disk
            return None
        self._written += 1
        dest = self.folder / f"{c}-restored-{self._written}.pt"
        try:
            try:
                os.link(source, dest)
            except OSError:  # another file system (or no hard links there)
                shutil.copyfile(source, dest)
            intact = checkpoint._sha256(dest) == sha256
            # weights_only as everywhere; mmap: the tensors stay mapped, unread
            peek = torch.load(dest, map_location="cpu", weights_only=True, mmap=True) if intact else None
            kept = (peek.get("kept") or {}) if isinstance(peek, dict) else None
        except Exception:  # unreadable here: the driver reads it, checks it and names the problem
            kept = None
        if kept is None or not all(v is None or isinstance(v, dict) for v in kept.values()):
            _unlink(str(dest))
            return None
        self._states[c] = OnDisk(dest, None, updates=int(peek.get("updates", 0)))
        return {int(n): v for n, v in kept.items()}

    def share(self, c: int) -> State:
        """What an evaluation of the parked state reads, to keep beside the states that replace it:
        on disk, the handle itself (the file is never changed); in memory, the model's tensors
        (never changed either: loading copies them into a model) with a copy of the algorithm
        state (loading a runner may hand its arrays to code that changes them in place)."""
        st = self._states[c]
        if isinstance(st, OnDisk):
            return st
        return {"model": st["model"], "algorithm": copy.deepcopy(st["algorithm"]), "last_loss": st["last_loss"],
                "updates": int(st.get("updates", 0))}

    def handle_of(self, c: int) -> State:
        """The parked state as stored: the dict (memory) or its file's handle (disk)."""
        return self._states[c]

    def get(self, c: int) -> dict[str, Any]:
        return resolve(self._states[c])

    def updates(self, c: int) -> int:
        st = self._states[c]
        return st.updates if isinstance(st, OnDisk) else int(st.get("updates", 0))

    def pop(self, c: int) -> None:
        self._states.pop(c, None)

    def files(self) -> int:
        """Files of this store now on disk (0 in memory)."""
        return 0 if self.folder is None else sum(1 for _ in self.folder.glob("*.pt"))


def check_park_dir(park_dir: Optional[str]) -> Path:
    """Fail before Ray starts, not in every worker's setup, when ``resources.park_dir`` (None:
    the temp folder) is not a writable folder: a file, read-only, not creatable."""
    where = Path(park_dir or tempfile.gettempdir()).expanduser()
    root = where / SUBDIR
    problem = None
    if where.exists() and not where.is_dir():
        problem = "it is a file, not a folder"
    else:
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            problem = f"cannot write {root}: {e.strerror or e}"
    if problem is not None:
        raise PermissionError(f"resources.park_dir = {str(park_dir) if park_dir else None!r} ({where}): {problem}; parked "
                              "client states need a writable local folder: set resources.park_dir to one, or "
                              "resources.park_to=memory") from None
    return root


def remove_orphaned(root: Path) -> list[Path]:
    """Remove the folders under ``root`` whose worker process (the pid in the name) is gone."""
    removed = []
    for d in root.glob("*-*"):
        pid = d.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
