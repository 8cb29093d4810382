"""How a tracked run ends: the MLflow status for each way out, and what the caller is told.

A run whose MLflow run exists ends FINISHED, KILLED (a requested stop, a second Ctrl-C, a Tune
trial told to stop) or FAILED; a resume refused as input leaves the status it had; a full disk
or an unwritable folder is a fault named with what was kept (:class:`~rayfed_proto.runtime.
runfolder.RunFault`). :func:`run_outcome` is that ladder, around the driver's steps
(:mod:`rayfed_proto.runtime.driver`), which sets ``status = "FINISHED"`` when it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rayfed_proto.runtime import runfolder, signals
from rayfed_proto.runtime.signals import RunInterrupted, StartupStopped

log = logging.getLogger("rayfed_proto")

__all__ = ["Outcome", "refused_unless_resumable", "run_outcome"]


@dataclass
class Outcome:
    """The MLflow status the run ends with (FAILED until the run says otherwise)."""

    status: str = "FAILED"


@contextmanager
def run_outcome(folder, tracker) -> Iterator[Outcome]:
    """The exception-to-status ladder of a tracked run (``folder``: its :class:`~rayfed_proto.
    runtime.run_state.RunFolder`, ``tracker``: its MLflow run); the caller ends the MLflow run with
    ``outcome.status`` however it ends."""
    from rayfed_proto.runtime.checkpoint import CheckpointError  # here: it imports torch (see preparation.resume_point)

    outcome = Outcome()
    try:
        yield outcome
    except StartupStopped as stop:  # a resumed run KILLED (its checkpoint stands), a new one FAILED with the reason
        outcome.status, msg, version = signals.stopped_in_startup(folder, tracker, stop)
        raise RunInterrupted(msg, folder.out, version, stop.signal_name) from None
    except CheckpointError:  # a client state damaged since the scan (its checksum, at the restore): refused as input,
        outcome.status = getattr(tracker, "resumed_status", None) or "FAILED"  # the run's status left as it was
        raise
    except OSError as e:  # a disk that filled, a folder made unwritable: a fault (exit 1), named, with what was kept
        fault = runfolder.RunFault.during_run(e, folder.out, folder.store)
        tracker.set_tags({"failure_reason": str(fault)[:5000]})
        raise fault from None
    except RunInterrupted:
        outcome.status = "KILLED"
        raise
    except (KeyboardInterrupt, SystemExit) as e:  # SystemExit: a Tune trial told to stop, a stop and not a failure
        outcome.status = "KILLED"
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C: stopped at once, no drain
            raise signals.stopped_at_once(folder.store, folder.out, tracker) from None
        raise


@contextmanager
def refused_unless_resumable(folder) -> Iterator[None]:
    """A resume whose restore or evaluation-log hand-over raises cannot go on: refused as input
    (:class:`CheckpointError`, exit 2), so that the MLflow run ends with the status it had
    (KILLED after a stop, never FAILED) and the folder keeps its checkpoints and history (nothing
    is written there before the event loop). A new run's failures are failures as before."""
    from rayfed_proto.runtime.checkpoint import CheckpointError  # here: it imports torch (see preparation.resume_point)

    try:
        yield
    except Exception as e:
        if folder.ckpt is None or isinstance(e, CheckpointError):
            raise
        log.debug("the resume of %s failed before its first step", folder.out, exc_info=True)
        raise CheckpointError(
            f"cannot resume {folder.out} from its checkpoint of version {folder.ckpt.version} ({type(e).__name__}: {e}); "
            "nothing was changed: the MLflow run keeps its status and the folder its checkpoints and history. Run "
            "with -v for the traceback, and report it with the checkpoint folder") from e
