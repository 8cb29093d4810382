"""SIGINT / SIGTERM while a run starts: noted at once, acted on at the next safe point.

Until the scheduler runs (and its own handlers drain, checkpoint and stop), a run is in library
code most of the time: MLflow's SQLAlchemy store, ``ray.init`` starting its processes, actors
being created. An exception raised by a signal handler lands wherever the interpreter is, and in a
garbage-collector callback (SQLAlchemy's) it is printed and swallowed, so the run went on; Ray's
own SIGTERM handler (``sys.exit``, set by ``ray.init``) raised ``SystemExit`` inside Ray's start-up
and the driver died by SIGABRT, its MLflow run left RUNNING and Ray's processes alive.

:class:`StartupSignals` replaces both handlers for the start-up: a signal only records its name;
the driver calls :meth:`StartupSignals.check` between its steps (before Ray, after Ray started,
once the workers are set up, after the restore) and :class:`StartupStopped` unwinds the start-up
through the driver's ordinary clean-up (actors killed, the MLflow run ended, Ray shut down at
exit). ``ray.init`` is kept from installing its handler (:func:`ray_keeps_our_handlers`). The
handlers are installed only in the main thread (a Tune trial's thread has Tune's).
:func:`signal_cli_at_stage` sends a signal to the CLI as a given stage begins (the fault drill's
and the tests' way in).

Once the scheduler runs, :func:`install_stop_handlers` takes over: the first signal asks it to
drain, checkpoint and stop (:class:`RunInterrupted` then says where to resume), a second SIGINT
stops at once (:func:`stopped_at_once`). No Ray import at module level.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("rayfed_proto")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
STAGE_LOG = "start-up stage: "  # logged (debug, so with ``rayfed-proto -v``) as each start-up stage begins


class StartupStopped(KeyboardInterrupt):
    """A SIGINT or SIGTERM arrived while the run was starting (``signal_name``)."""

    def __init__(self, signal_name: str, stage: str):
        super().__init__(f"{signal_name} during start-up ({stage})")
        self.signal_name, self.stage = signal_name, stage


class StartupSignals:
    """The start-up's handlers for SIGINT and SIGTERM (see the module doc)."""

    def __init__(self) -> None:
        self.received: Optional[str] = None  # the first signal's name
        self.stage = "before Ray"
        self._previous: dict[int, Any] = {}

    def install(self) -> StartupSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                current = signal.getsignal(sig)
                if current != self._handler:
                    self._previous[sig] = current
                    signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        """The handlers from before :meth:`install` (a later run of the process gets them back)."""
        for sig, previous in self._previous.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(sig, previous)
        self._previous.clear()

    def _handler(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            log.warning("%s received while the run starts (%s): stopping at the next safe point", name, self.stage)

    def enter(self, stage: str) -> None:
        """A safe point: stop now if a signal came; then the next stage begins (logged, for tests
        and for a user who wonders where a slow start-up is)."""
        self.check()
        self.stage = stage
        log.debug("%s%s", STAGE_LOG, stage)

    def check(self) -> None:
        if self.received is not None:
            raise StartupStopped(self.received, self.stage)


@contextlib.contextmanager
def ray_keeps_our_handlers():
    """``ray.init`` without its SIGTERM handler (``sys.exit`` wherever the interpreter is), and
    the handlers in place before it installed again after it: Ray's core worker installs a C-level
    failure handler for SIGTERM (a stack dump, then SIGABRT) that Python's record of its handlers
    does not show. Ray is shut down at exit all the same (``atexit``)."""
    main = threading.current_thread() is threading.main_thread()
    ours = {sig: signal.getsignal(sig) for sig in SIGNALS} if main else {}
    try:
        import ray._private.utils as ray_utils
    except ImportError:
        ray_utils = None
    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if original is not None:
            ray_utils.set_sigterm_handler = original
        for sig, handler in ours.items():
            if handler is not None:  # None: set from C, not by Python; nothing to put back
                signal.signal(sig, handler)


def stopped_before_tracking(folder, fleet, stop: StartupStopped) -> tuple[str, int]:
    """A signal before the MLflow run existed (``folder``: the run's :class:`~rayfed_proto.runtime.
    run_state.RunFolder`, None before it was made; ``fleet``: the workers, None before they were
    started or once released): the workers released and a new run's folder removed (nothing refers
    to it); a resumed run's folder and checkpoint are as they were. The message and the version to
    report."""
    if fleet is not None:
        fleet.shutdown()
    if folder is None or folder.ckpt is None:
        if folder is not None:
            shutil.rmtree(folder.out, ignore_errors=True)
        return f"stopped ({stop.signal_name}) while the run was starting ({stop.stage}): nothing was kept", 0
    return (f"stopped ({stop.signal_name}) while the run was starting ({stop.stage}); the run folder and its checkpoint "
            f"of version {folder.ckpt.version} are unchanged.\nResume with: rayfed-proto run --resume {folder.out}",
            folder.ckpt.version)


def stopped_in_startup(folder, tracker, stop: StartupStopped) -> tuple[str, str, int]:
    """A signal after the MLflow run existed, before the scheduler ran: a resumed run is KILLED
    (its checkpoint still stands: resume again), a new one FAILED with the reason as
    ``failure_reason`` (nothing was formed). The MLflow status, the message and the version."""
    if folder.ckpt is not None:
        tracker.set_tags({"stopped": f"{stop.signal_name} during start-up", "resume_from": str(folder.out)})
        return "KILLED", (f"stopped ({stop.signal_name}) while the run was starting ({stop.stage}); the checkpoint of "
                          f"version {folder.ckpt.version} in {folder.ckpt.path} still stands.\nResume with: rayfed-proto run "
                          f"--resume {folder.out}"), folder.ckpt.version
    reason = f"stopped by {stop.signal_name} while the run was starting ({stop.stage}), before its first version"
    tracker.set_tags({"failure_reason": reason})
    return "FAILED", f"{reason}: nothing to resume. Start again with: rayfed-proto run {folder.out / 'config.yaml'}", 0


@dataclass
class StageSignalled:
    """What :func:`signal_cli_at_stage` saw: the CLI's exit code, its whole output, whether the
    stage began (and so the signal went), and the processes it started still alive at the end."""

    returncode: int
    output: str
    sent: bool
    alive: list[int]


def signal_cli_at_stage(args: list[str], stage: str, sig: int, cwd: Path,
                        timeout: Optional[float] = None) -> StageSignalled:
    """Run ``python -m rayfed_proto.cli -v ARGS`` (``-v`` logs each start-up stage) in ``cwd``, this
    package first on its path, and send ``sig`` once the line of ``stage`` appears. After the CLI
    ends (and 3 s for Ray's processes, which end after the driver's atexit shutdown), the
    processes it started that are still alive. ``timeout``: seconds before the CLI is killed and
    :class:`TimeoutError` raised with the end of its output. For ``bench/fault_drill.py`` and
    ``tests/integration/test_startup_faults.py``."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "rayfed_proto.cli", "-v", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
    started, lines, sent = set(), [], False
    deadline = None if timeout is None else time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        try:
            started |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.Error:
            pass
        if not sent and f"{STAGE_LOG}{stage}" in line:
            proc.send_signal(sig)
            sent = True
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"the CLI ran past {timeout} s:\n" + "".join(lines[-50:]))
    proc.wait(timeout=60)

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    # Ray's processes end after the driver (atexit shutdown): what is still alive 3 s after it
    # exited is left behind (polled: the wait ends as soon as every process is gone)
    until = time.monotonic() + 3
    while (left := [p for p in started if alive(p)]) and time.monotonic() < until:
        time.sleep(0.1)
    return StageSignalled(proc.returncode, "".join(lines), sent, left)


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM (or ``faults.stop_at_version``) after a clean drain; the
    message says how to resume. A KeyboardInterrupt, so callers that only know Ctrl-C still stop."""

    def __init__(self, message: str, output_dir: Path, version: int, signal_name: str):
        super().__init__(message)
        self.output_dir, self.version, self.signal_name = output_dir, version, signal_name


def install_stop_handlers(scheduler) -> Callable[[], None]:
    """SIGINT/SIGTERM: the first asks the scheduler to drain, checkpoint and stop; a second
    SIGINT stops at once (KeyboardInterrupt). Only possible in the main thread (not in a Tune
    trial's thread, where Tune handles stopping)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if scheduler.stop_requested() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        scheduler.request_stop(name)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def stopped_at_once(store, out: Path, tracker) -> RunInterrupted:
    """A second Ctrl-C abandoned the running updates: say where the run can resume from."""
    try:
        latest = store.latest()
    except Exception:  # a damaged store: the resume will say more
        latest = None
    if latest is not None:
        tracker.set_tags({"stopped": "SIGINT (at once)", "resume_from": str(out)})
        msg = (f"stopped at once (second Ctrl-C); the running updates were abandoned; checkpoint of version "
               f"{latest.version} in {latest.path}.\nResume with: rayfed-proto run --resume {out}")
    else:
        msg = (f"stopped at once (second Ctrl-C) before the first checkpoint: nothing to resume. "
               f"Start again with: rayfed-proto run {out / 'config.yaml'}")
    return RunInterrupted(msg, out, latest.version if latest is not None else 0, "SIGINT")
