"""The start-up's signal handling (issue 40.1): a signal only records its name; the run stops at
the next safe point; Ray's handlers do not replace it; a file-system fault is a RunFault (40.6)."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from rayfed_proto.runtime.signals import StartupSignals, StartupStopped, ray_keeps_our_handlers


def test_a_signal_is_noted_and_raised_only_at_a_safe_point():
    before = signal.getsignal(signal.SIGTERM)
    startup = StartupSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here and returns: nothing is raised inside it
        assert startup.received == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # a second signal does not change which one stops the run
        assert startup.received == "SIGTERM"
        with pytest.raises(StartupStopped) as stop:
            startup.enter("actors starting")
        assert stop.value.signal_name == "SIGTERM" and stop.value.stage == "before Ray"
        assert isinstance(stop.value, KeyboardInterrupt)  # the CLI's interrupted path
    finally:
        startup.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_no_signal_no_stop():
    startup = StartupSignals().install()
    try:
        startup.enter("Ray starting")
        startup.check()
        assert startup.stage == "Ray starting"
    finally:
        startup.restore()


def test_ray_init_does_not_replace_the_handler():
    import ray._private.utils as ray_utils

    startup = StartupSignals().install()
    try:
        with ray_keeps_our_handlers():
            ray_utils.set_sigterm_handler(lambda *a: (_ for _ in ()).throw(SystemExit(15)))  # what ray.init does
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as if a library had replaced it some other way
        assert signal.getsignal(signal.SIGTERM) == startup._handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert startup.received == "SIGTERM"
    finally:
        startup.restore()


def test_a_file_system_fault_names_the_folder_the_file_and_what_was_kept(tmp_path):
    from rayfed_proto.runtime.checkpoint import CheckpointStore
    from rayfed_proto.runtime.runfolder import RunFault

    store = CheckpointStore(tmp_path / "checkpoints")
    error = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "history.parquet"))
    fault = RunFault.during_run(error, tmp_path, store)
    assert "No space left on device" in str(fault) and str(tmp_path / "history.parquet") in str(fault)
    assert f"run folder {tmp_path}" in str(fault) and "no checkpoint" in str(fault)
    import torch

    store.save(3, server={}, clients=[(0, {"w": torch.zeros(1)})], actor_rng={}, driver={}, run_id="r")
    fault = RunFault.during_run(error, tmp_path, store)
    assert "checkpoint of version 3" in str(fault) and f"rayfed-proto run --resume {tmp_path}" in str(fault)


def test_the_cli_exits_1_on_a_fault_not_2(monkeypatch, capsys):
    from rayfed_proto import cli
    from rayfed_proto.runtime import driver
    from rayfed_proto.runtime.runfolder import RunFault

    def failing(cfg, **kwargs):
        raise RunFault("the run failed on a file-system error: Permission denied; run folder /x")

    monkeypatch.setattr(driver, "run_experiment", failing)
    assert cli.main(["run", "--set", "federation.rounds=1", "--set", "federation.eval_every=1"]) == 1
    assert "Permission denied" in capsys.readouterr().err
