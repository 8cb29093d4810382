"""A run's progress: shown (:class:`ProgressBar`), and watched, so that a run that makes none
stops with a reason instead of spinning (:class:`ProgressWatch`).

Two independent limits (``reliability.*``):

* ``max_consecutive_refusals``: this many submitted updates in a row were not accepted by the
  server (refused at the border, or dropped as too stale) and none was accepted in between:
  every client uploads garbage, or the data make every model non-finite;
* ``no_progress_timeout_s``: no new server version for this long while the run is not draining
  for a checkpoint or a stop.

Either raises :class:`NoProgressError`; the driver logs the counters and ends the MLflow run
FAILED with the reason. A version that aggregated nothing (sync: every update of the round was
refused) is counted and warned about loudly; it is not progress either (the refusal streak keeps
counting through it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

log = logging.getLogger("rayfed_proto")


class NoProgressError(RuntimeError):
    """The run stopped because it could not make progress; the message says why and what to check."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


class ProgressWatch:
    def __init__(self, max_consecutive_refusals: int = 0, no_progress_timeout_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_refusals, self.timeout_s, self.clock = max_consecutive_refusals, no_progress_timeout_s, clock
        self.refusal_streak = 0
        self.last_reasons: list[str] = []
        self.last_progress = clock()
        self.versions_empty = 0

    def on_receipt(self, receipt: dict[str, Any], version: int) -> None:
        """A submission's receipt from the server."""
        if receipt.get("accepted"):
            self.refusal_streak = 0
            self.last_reasons = []
            return
        reason = receipt.get("reason")
        if reason is None or reason == "run finished":  # late, after the last version: not a refusal
            return
        self.refusal_streak += 1
        self.last_reasons = (self.last_reasons + [f"client {receipt.get('client_id')}: {reason}"])[-3:]
        if self.max_refusals and self.refusal_streak >= self.max_refusals:
            raise NoProgressError(
                f"no progress: the last {self.refusal_streak} submitted updates were all refused by the server "
                f"(reliability.max_consecutive_refusals={self.max_refusals}) at version {version}; last reasons: "
                + "; ".join(self.last_reasons) + ". Check the data (non-finite values) and faults.corrupt_clients", version)

    def on_version(self, version: int, aggregated: Optional[int] = None) -> None:
        """A new version; ``aggregated``: how many updates went into it, when known (sync)."""
        self.last_progress = self.clock()
        if aggregated == 0:
            self.versions_empty += 1
            log.warning("version %d aggregated NO update: every update of the round was refused or lost (%d such "
                        "versions so far; last reasons: %s)", version, self.versions_empty,
                        "; ".join(self.last_reasons) or "none recorded")

    def pause(self) -> None:
        """Draining for a checkpoint or stop, or restarting an actor: not counted as idle time."""
        self.last_progress = self.clock()

    def check(self, version: int) -> None:
        """Called from the scheduler's loop; raises once no version came for the timeout."""
        if not self.timeout_s:
            return
        idle = self.clock() - self.last_progress
        if idle > self.timeout_s:
            raise NoProgressError(
                f"no progress: no new server version for {idle:.0f} s (reliability.no_progress_timeout_s="
                f"{self.timeout_s:g}) after version {version}"
                + (f"; last refusals: {'; '.join(self.last_reasons)}" if self.last_reasons else "")
                + ". Check the actors' logs, or raise the limit for very slow rounds", version)


class ProgressBar:
    """The run's progress bar over its versions, with the last evaluation's figures
    (:func:`~rayfed_proto.tracking.run_end.bar_postfix`); nothing at all when ``show`` is False."""

    def __init__(self, show: bool, total: int, initial: int, desc: str):
        self._bar = None
        if show:
            from tqdm.auto import tqdm  # here: only a run that shows progress needs it

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit="version", dynamic_ncols=True)

    def reached(self, version: int) -> None:
        if self._bar is not None:
            self._bar.update(max(0, version - self._bar.n))

    def evaluated(self, metrics: dict[str, Any]) -> None:
        if self._bar is not None:
            from rayfed_proto.tracking.run_end import bar_postfix  # here: it imports pandas, once Ray runs

            self._bar.set_postfix(bar_postfix(metrics), refresh=True)

    def close(self) -> None:
        """Once, at the run's end or when it stops (a second call does nothing)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
