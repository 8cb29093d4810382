"""Stopped at every version and resumed, through real actors (issue 45 item 1).

A Ctrl-C lands anywhere: here just after the first update handed over at the target version
(``recovery.request_stop``, what the signal handler calls, without a signal). One short
asynchronous run, with ``eval_every`` and ``checkpoint.every`` above 1, is stopped and resumed at
each of its versions in turn, due for evaluation or not. With a virtual clock the run that went
through every stop equals the uninterrupted one exactly; in real time it finishes with every due
version evaluated once. A resume that cannot go on is refused and leaves the run as it was.
"""

import math

import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.config import InputError, build_config
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.runtime.evaluations import Evaluations
from rayfed_proto.runtime.preparation import checkpoint_store
from rayfed_proto.runtime.scheduler import Scheduler
from rayfed_proto.runtime.signals import RunInterrupted
from rayfed_proto.tracking import metric_names as names

pytestmark = pytest.mark.integration

QUIET = {"progress": False, "echo": lambda s: None}
ROUNDS = 4
DUE = [0, 3, 4]  # eval_every=3, and the last version
COMMON = ["algorithm.name=fedproto", "data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20",
          "model.group=small_hetero", "model.feature_dim=16", "federation.num_clients=4", "federation.mode=async",
          "federation.buffer_size=2", "federation.concurrency=2", f"federation.rounds={ROUNDS}",
          "federation.eval_every=3", "checkpoint.every=2", "resources.torch_threads=1"]
VIRTUAL = ["system.speed.kind=lognormal", "system.speed.sigma=1.0", "resources.clients_per_actor=4"]  # one worker
REAL_TIME = ["resources.clients_per_actor=2"]  # two workers: two updates at once
KEYS = ("version", names.EVAL_HEAD_ACC, names.EVAL_PROTO_ACC, names.train_term("loss"), names.FEDERATION_STALENESS_MEAN,
        names.FEDERATION_UPDATES_ACCEPTED, names.FEDERATION_UPDATES_DISPATCHED, names.FEDERATION_BYTES_UP,
        names.FEDERATION_SIM_TIME_S)


def _comparable(history):
    return [{k: ("nan" if isinstance(h.get(k), float) and math.isnan(h[k]) else h.get(k)) for k in KEYS} for h in history]


class CtrlC:
    """Requests a stop just after the ``nth`` update handed over at version ``at`` or later."""

    def __init__(self, monkeypatch, nth: int = 1):
        self.at, self.schedulers, self.seen = None, [], 0
        init, handed = Scheduler.__init__, Evaluations.handed

        def record(scheduler, *args, **kwargs):
            init(scheduler, *args, **kwargs)
            self.schedulers.append(scheduler)

        def handed_then_stop(evals, client, update_no, at, ticket=-1):
            handed(evals, client, update_no, at, ticket)
            if self.at is not None and client >= 0 and at >= self.at:
                self.seen += 1
                if self.seen >= nth:
                    self.schedulers[-1].recovery.request_stop("SIGINT")

        monkeypatch.setattr(Scheduler, "__init__", record)
        monkeypatch.setattr(Evaluations, "handed", handed_then_stop)


def _files(folder):
    return {p.relative_to(folder): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


def _stopped_at_every_version(overrides, ctrl_c, monkeypatch=None, uri=None):
    """Stop after a hand-over at version 1, resume, stop after one at the next version... until the
    run ends; returns (result, versions of the stops' checkpoints). With ``monkeypatch``, the
    first resume is tried first with a restore that raises: refused, nothing changed."""
    out, stops, result = None, [], None
    while result is None:
        ctrl_c.at, ctrl_c.seen = (stops[-1] + 1 if stops else 1), 0
        try:
            result = run_experiment(build_config({}, overrides), resume_dir=out, **QUIET)
        except RunInterrupted as stopped:
            out = stopped.output_dir
            stops.append(checkpoint_store(build_config({}, overrides), out).latest().version)
        if monkeypatch is not None and out is not None and result is None:
            _refused_resume_leaves_the_run_as_it_was(overrides, out, uri, monkeypatch)
            monkeypatch = None
    return result, stops


def _refused_resume_leaves_the_run_as_it_was(overrides, out, uri, monkeypatch):
    run_id = checkpoint_store(build_config({}, overrides), out).latest().manifest["run_id"]
    client = MlflowClient(uri)
    before, status = _files(out), client.get_run(run_id).info.status
    assert status == "KILLED"
    with monkeypatch.context() as m:
        def broken(evals, state):
            raise ValueError("max() arg is an empty sequence")

        m.setattr(Evaluations, "load_state_dict", broken)
        with pytest.raises(InputError, match="cannot resume .* nothing was changed") as refused:
            run_experiment(build_config({}, overrides), resume_dir=out, **QUIET)
    assert "ValueError: max() arg is an empty sequence" in str(refused.value)  # exit 2 (an InputError), named
    assert client.get_run(run_id).info.status == "KILLED"
    assert _files(out) == before


def test_virtual_clock_stopped_at_every_version_equals_the_uninterrupted_run(ray_session, tracking, monkeypatch):
    uri, track = tracking
    overrides = COMMON + VIRTUAL + track
    straight = run_experiment(build_config({}, overrides), **QUIET)
    resumed, stops = _stopped_at_every_version(overrides, CtrlC(monkeypatch), monkeypatch, uri)
    assert stops == [1, 2, 3]  # updates in simulated flight wait: a stop forms no version
    assert [h["version"] for h in straight.history] == DUE
    assert _comparable(resumed.history) == _comparable(straight.history)


def test_real_time_stopped_at_every_version_evaluates_every_due_version(ray_session, tracking, monkeypatch):
    uri, track = tracking
    # after the second update handed at a version (the buffer holds 2): the drain hands the one still
    # running over at the next version, and the stop's checkpoint holds a client handed at it
    resumed, stops = _stopped_at_every_version(COMMON + REAL_TIME + track, CtrlC(monkeypatch, nth=2))
    assert stops == sorted(set(stops)) and set(stops) - set(DUE), stops  # at least one stop at a version not evaluated
    assert [h["version"] for h in resumed.history] == DUE
    steps = sorted(m.step for m in MlflowClient(uri).get_metric_history(resumed.run_id, names.EVAL_HEAD_ACC))
    assert steps == DUE  # one run, each due version once
