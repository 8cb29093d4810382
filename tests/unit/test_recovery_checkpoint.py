"""Recovery.checkpoint counts what was written and what failed (no Ray: ``ray.get`` on plain values)."""

from types import SimpleNamespace

import pytest

from rayfed_proto.runtime import recovery as recovery_mod
from rayfed_proto.runtime.recovery import Recovery
from rayfed_proto.runtime.scheduler import SchedulerStats


class _Handle:
    def __init__(self, snap):
        self.snapshot = SimpleNamespace(remote=lambda: snap)


def _scheduler(outcomes):
    written = []

    def on_checkpoint(version, server_snap, actor_snaps):
        written.append(version)
        return outcomes.pop(0)

    s = SimpleNamespace(version=4, server=_Handle({"core": {"version": 4}}), actors=[_Handle(({}, None))],
                        hooks=SimpleNamespace(on_checkpoint=on_checkpoint), stats=SchedulerStats())
    return s, written


@pytest.fixture(autouse=True)
def _plain_get(monkeypatch):
    monkeypatch.setattr(recovery_mod.ray, "get", lambda ref: ref)


def test_a_failed_write_is_counted_and_tried_again_at_the_same_version():
    s, written = _scheduler([False, True])
    rec = Recovery(s, last_checkpoint=2)
    rec.checkpoint()  # the final version's write fails: counted, and not taken as done
    assert (s.stats.checkpoints, s.stats.checkpoints_failed) == (0, 1) and rec.last_checkpoint == 2
    rec.checkpoint()  # the end of the run tries the same version again: written
    assert (s.stats.checkpoints, s.stats.checkpoints_failed) == (1, 1) and rec.last_checkpoint == 4
    rec.checkpoint()  # already written: nothing to do
    assert written == [4, 4] and s.stats.checkpoints == 1


def test_the_summary_names_failed_checkpoints_and_the_newest_usable_one():
    from rayfed_proto.runtime.scheduler import SchedulerStats
    from rayfed_proto.tracking.run_end import checkpoint_summary as _checkpoint_summary

    store = SimpleNamespace(latest=lambda: SimpleNamespace(version=6))
    assert _checkpoint_summary(SchedulerStats(checkpoints=3), store) == "3 written; newest: version 6"
    row = _checkpoint_summary(SchedulerStats(checkpoints=3, checkpoints_failed=1), store)
    assert row.startswith("3 written, 1 FAILED") and row.endswith("newest: version 6")

    def damaged():
        raise OSError("unreadable manifest")

    assert _checkpoint_summary(SchedulerStats(), SimpleNamespace(latest=damaged)) == "0 written; none usable"
