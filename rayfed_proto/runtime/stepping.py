"""When the server aggregates: the stepping strategy a federation policy hands the server core.

The mode's answer to "when does a version form" is one of these objects, not flags for the
server to branch on: the :class:`~rayfed_proto.runtime.server_core.ServerCore` asks it how many
buffered updates a step takes, whether a full buffer is ready, what to do when one is, and the
:class:`~rayfed_proto.runtime.actors.ServerActor` asks it to start a training thread (only
:class:`ServerThread` has one). No Ray and no torch here: policies build them.

* :class:`OnRequest`: the driver asks for each step, which aggregates all the server holds, in
  client order (sync rounds: a run is reproducible);
* :class:`ServerThread`: every K accepted updates, on a server thread beside intake (async in real time);
* :class:`SimulatedSteps`: every K, when the driver asks (async with a virtual clock: the step ends
  in the server's simulated time);
* :class:`EveryK`: every K, at once inside the submission that fills the buffer (in-process use, tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["EveryK", "OnRequest", "ServerThread", "SimulatedSteps", "Stepping"]


@dataclass(frozen=True)
class Stepping:
    """A step takes ``buffer_size`` updates (None: all the server holds, when the driver asks)."""

    buffer_size: Optional[int] = None

    def ready(self, buffered: int) -> bool:
        """A full buffer: a version may form."""
        return self.buffer_size is not None and buffered >= self.buffer_size

    def take(self, buffered: int) -> int:
        """How many of the oldest buffered updates a step aggregates: exactly K with a buffer size
        (FedBuff: the rest wait for the next one, so a version's cost is bounded), else all."""
        return buffered if self.buffer_size is None else self.buffer_size

    def order(self, taken: list) -> list:
        """The updates of a step in the order they are aggregated (arrival order)."""
        return taken

    def wake(self, cond: threading.Condition) -> None:
        """The buffer just filled, under ``cond``: wake whoever steps."""

    def step_at_intake(self, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The buffer just filled (outside the lock): the receipt's part of a step taken now, if any."""
        return {}

    def start(self, train_loop: Callable[[], None]) -> None:
        """The server actor starts: a training thread, if this strategy steps on one."""


@dataclass(frozen=True)
class OnRequest(Stepping):
    """Sync rounds: the driver asks once a round is in; a round aggregates in client order."""

    def order(self, taken: list) -> list:
        # a round is aggregated in client order, not arrival order, so that a run is
        # reproducible (float sums and server-training batches depend on the order)
        return sorted(taken, key=lambda uw: uw[0].client_id)


@dataclass(frozen=True)
class ServerThread(Stepping):
    """Async in real time: a server thread aggregates K whenever K wait, so intake never waits
    behind server training (an update's staleness counts the versions produced while its client
    trained, not the time it would spend queued behind the server)."""

    def wake(self, cond: threading.Condition) -> None:
        cond.notify_all()

    def start(self, train_loop: Callable[[], None]) -> None:
        threading.Thread(target=train_loop, name="server-training", daemon=True).start()


@dataclass(frozen=True)
class SimulatedSteps(Stepping):
    """Async with a virtual clock: K at a time, when the driver asks (the step's simulated end)."""


@dataclass(frozen=True)
class EveryK(Stepping):
    """Every K, inside the submission that fills the buffer (in-process use and tests)."""

    def step_at_intake(self, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return step()
