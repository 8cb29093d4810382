"""A virtual clock for the simulated federation (``system:`` config section). No Ray here.

Each dispatched local update gets a simulated start time (the clock's ``now``) and a simulated
duration from the client's system profile (:class:`rayfed_proto.system.SystemModel`): its
compute time, known at dispatch, plus the transfer times of the messages, known once the update
is back (their sizes are measured). The scheduler hands updates to the server strictly in order
of simulated finish time, while the real computations run in parallel on the workers:

* an entry whose real computation has not returned is keyed by a *lower bound* of its finish
  time (start + compute, transfers not yet known);
* once it returns, its key becomes *exact* (start + download + compute + upload);
* the entry with the smallest key is released when its key is exact: every other entry's true
  finish time is at least its key, so nothing can overtake it. Otherwise the driver waits for
  that entry's real computation (and only for it).

Ties break by dispatch order. The order of releases therefore depends only on the seed and the
profiles, never on real timing: the number of real slots, the machine or its load do not change
a run's results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from rayfed_proto.runtime.progress import NoProgressError


@dataclass
class SimEntry:
    """One local update in flight in simulated time."""

    seq: int  # dispatch order (ties)
    client: int
    start: float
    finish: float  # exact once ``exact``; a lower bound before
    exact: bool = False
    token: Any = None  # the scheduler's handle for the real computation (its metadata ref)
    update: Any = None  # the update (ref, or the object itself in a checkpoint), once back
    meta: Optional[dict[str, Any]] = None
    version: int = 0  # the server version it trains against (its method's declared work for it)
    offline_at: float = math.inf  # when its client goes offline (the end of the window it started in)
    dropped: bool = False  # exact: it would finish after offline_at, so it is lost there (``finish`` = offline_at)

    def key(self) -> tuple[float, int]:
        return (self.finish, self.seq)


class NoClientOnline(NoProgressError):
    """The availability windows ended before the run's last version: the run stops FAILED with
    the reason, its counters and its history, as every run that cannot make progress."""

    def __init__(self, message: str):
        super().__init__(message, version=-1)  # the driver records the scheduler's version


class VirtualClock:
    def __init__(self, system, seed: int):
        self.system = system
        self.now = 0.0
        self.seq = 0
        self.entries: dict[int, SimEntry] = {}  # seq -> entry
        self.rng = np.random.default_rng([seed, 0xA7A1])  # availability draws (probability profiles)

    # ------------------------------------------------------------------ availability
    def online(self, candidates: list[int]) -> list[int]:
        """The candidates online now (offline clients are never dispatched)."""
        return self.system.online_clients(candidates, self.now, self.rng) if candidates else []

    def wait_for_online(self, candidates: list[int]) -> None:
        """Nobody is online and nothing is in flight: move the clock to when someone may be."""
        t = self.system.next_online_time(candidates, self.now)
        if t is None:
            raise NoClientOnline(f"no client can be online after simulated time {self.now:.1f} s (the availability "
                                 "windows of system.availability end before the run's last version); extend the "
                                 "windows or lower federation.rounds")
        self.now = max(self.now, float(t))

    # ------------------------------------------------------------------ updates
    def start(self, client: int, token: Any, version: int = 0) -> SimEntry:
        """A local update of ``client`` against server ``version`` starts now (its compute time is the
        work its method declares for that version)."""
        offline = getattr(self.system, "offline_at", None)  # a system without windows (test doubles): never
        offline_at = float(offline(client, self.now)) if offline is not None else math.inf
        e = SimEntry(self.seq, client, self.now, min(self.now + self.system.compute_at(client, version), offline_at),
                     token=token, version=version, offline_at=offline_at)
        self.entries[e.seq] = e
        self.seq += 1
        return e

    def finish(self, entry: SimEntry, meta: dict[str, Any], update: Any) -> None:
        """The real computation returned: its transfer sizes make the finish time exact. The dropout
        rule: an update that would finish after its client goes offline (``offline_at``, the end of
        the window it started in) is lost at ``offline_at``: ``dropped``, released then. Its key
        before (min of start + compute and offline_at) stays a lower bound of that release time."""
        done = entry.start + self.system.update_duration(entry.client, meta["download_bytes"], meta["upload_bytes"],
                                                         version=entry.version)
        entry.dropped = done > entry.offline_at
        entry.finish = min(done, entry.offline_at)
        entry.exact, entry.meta, entry.update = True, meta, update

    def first(self) -> Optional[SimEntry]:
        return min(self.entries.values(), key=SimEntry.key) if self.entries else None

    def pop_ready(self) -> Optional[SimEntry]:
        """The next update in simulated order, if it is known to be next; the clock moves to its finish."""
        e = self.first()
        if e is None or not e.exact:
            return None
        del self.entries[e.seq]
        self.now = max(self.now, e.finish)
        return e

    def may_go_offline(self, client: int) -> bool:
        """An update of ``client`` starting now may be lost: its client's window ends (availability windows)."""
        offline = getattr(self.system, "offline_at", None)
        return offline is not None and math.isfinite(offline(client, self.now))

    def server_step_s(self, updates: int, uploaders: int = 0) -> float:
        """Simulated seconds of a server step aggregating ``updates`` (0: a free server, or a system
        model without a server, as the test doubles)."""
        step_s = getattr(self.system, "server_step_s", None)
        return float(step_s(updates, uploaders)) if step_s is not None else 0.0

    def drop(self, entry: SimEntry) -> None:
        """A lost update (its actor died): it never finishes."""
        self.entries.pop(entry.seq, None)

    def in_flight(self) -> int:
        return len(self.entries)

    def clients_in_flight(self) -> set[int]:
        return {e.client for e in self.entries.values()}

    # ------------------------------------------------------------------ state
    def state_dict(self, resolve) -> dict[str, Any]:
        """Clock, draws and the updates in simulated flight (all back from the workers: a
        checkpoint waits for that; one still running at the very end of a run is left out);
        ``resolve`` turns an update ref into the update."""
        pending = [{"seq": e.seq, "client": e.client, "start": e.start, "finish": e.finish, "meta": e.meta,
                    "offline_at": e.offline_at, "dropped": e.dropped,
                    "update": None if e.dropped else resolve(e.update)}  # a dropped one never reaches the server
                   for e in self.entries.values() if e.exact]
        return {"now": self.now, "seq": self.seq, "rng": self.rng.bit_generator.state, "pending": pending}

    def load_state_dict(self, state: dict[str, Any], store) -> None:
        """``store`` turns a checkpointed update back into what the scheduler submits (a ref)."""
        self.now, self.seq = float(state["now"]), int(state["seq"])
        self.rng.bit_generator.state = state["rng"]
        self.entries = {}
        for p in state["pending"]:
            dropped = bool(p.get("dropped", False))  # absent: a checkpoint from before the dropout rule
            e = SimEntry(int(p["seq"]), int(p["client"]), float(p["start"]), float(p["finish"]), exact=True,
                         meta=p["meta"], update=None if dropped else store(p["update"]),
                         offline_at=float(p.get("offline_at", math.inf)), dropped=dropped)
            self.entries[e.seq] = e
