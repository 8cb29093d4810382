"""The evaluation log through stops and resumes, without Ray (issue 45 item 1).

A small asynchronous federation drives :class:`Evaluations` exactly as the scheduler does
(``keep_from`` at each dispatch, ``ticket`` and ``handed`` at each hand-over, ``formed`` at each
version, ``start_ready``; a checkpoint at a quiet point saves ``state_dict``; a resume loads it into
a fresh one and asks ``evaluates_start``). For every stop version, ``eval_every`` and
``checkpoint.every``, stopped like a Ctrl-C (in real time the running updates are handed over in
the drain; with a virtual clock they stay in simulated flight, trained but not handed), and resumed
from the stop's checkpoint and from each periodic one: every due version is evaluated exactly once,
each in the states the clients had when it was formed (the ground truth, kept apart from the log),
nothing raises, and a virtual-clock resume evaluates exactly what the uninterrupted run does.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from rayfed_proto.runtime.evaluations import EvaluationLogError, Evaluations

CLIENTS, BUFFER, ROUNDS = 4, 2, 8
COUNTERS = (None, 0.0, 0.0, {})  # what a formed version's counters would be (no result is logged here)


@dataclass
class Federation:
    """What a checkpoint holds besides the log: the version, the server's buffer, the sampling
    stream, each worker's update count, the updates in simulated flight; and the ground truth
    (every hand-over: client -> [(update, version handed at)]), which no checkpoint needs."""

    version: int = 0
    buffered: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    counts: dict[int, int] = field(default_factory=lambda: {c: 0 for c in range(CLIENTS)})
    in_flight: list[int] = field(default_factory=list)  # virtual clock: trained, not handed (a stop keeps them)
    truth: dict[int, list[tuple[int, int]]] = field(default_factory=lambda: {c: [] for c in range(CLIENTS)})


@dataclass
class Run:
    eval_every: int
    checkpoint_every: int
    evaluated: dict[int, dict[int, int]] = field(default_factory=dict)  # version -> as_of, across stops
    checkpoints: list = field(default_factory=list)  # (federation, log state, versions evaluated)


def _evaluations(run: Run, fed: Federation) -> Evaluations:
    return Evaluations(run.eval_every, ROUNDS, dict(fed.counts), fed.version, SimpleNamespace(evals_incomplete=0),
                       on_eval=lambda v, m: None, real_slots=1, resolve=lambda r: r)


def _evaluate_ready(ev: Evaluations, run: Run) -> None:
    launched = []

    def launch(version, state_ref, as_of):
        assert version not in run.evaluated, f"version {version} evaluated twice"
        run.evaluated[version] = dict(as_of)
        launched.append(version)
        return 1

    ev.start_ready(launch)
    for v in launched:  # the workers answer at once
        ev.result(v, [])


def _hand_over(ev: Evaluations, fed: Federation, run: Run, c: int) -> int:
    """Client ``c``'s update reaches the server (dispatched just before, unless it was in flight);
    returns the version it was handed at."""
    if c in fed.in_flight:
        fed.in_flight.remove(c)
    else:
        ev.keep_from(c)  # the dispatch asks for it: it must name a state
        fed.counts[c] += 1
    at = fed.version
    ev.handed(c, fed.counts[c], at, ev.ticket())
    fed.truth[c].append((fed.counts[c], at))
    fed.buffered += 1
    if fed.buffered == BUFFER:
        fed.buffered, fed.version = 0, fed.version + 1
        ev.formed(fed.version, None, lambda: COUNTERS)
    _evaluate_ready(ev, run)
    return at


def _stop(ev: Evaluations, fed: Federation, run: Run, mode: str, seed: int) -> None:
    """The drain after a Ctrl-C: in real time the running updates finish and are handed over; with
    a virtual clock those that finished wait in simulated flight (the next ones the uninterrupted
    run hands over, in its order), then the checkpoint."""
    if mode == "real":
        for c in fed.rng.sample(range(CLIENTS), fed.rng.randrange(CLIENTS)):
            if fed.version < ROUNDS:
                _hand_over(ev, fed, run, c)
    else:
        peek, bound = copy.deepcopy(fed.rng), random.Random(seed).randrange(CLIENTS)
        while len(fed.in_flight) < bound and (c := peek.randrange(CLIENTS)) not in fed.in_flight:
            fed.rng.randrange(CLIENTS)  # drawn, as the uninterrupted run draws it before handing it over
            ev.keep_from(c)
            fed.counts[c] += 1
            fed.in_flight.append(c)
    _checkpoint(ev, fed, run)


def _checkpoint(ev: Evaluations, fed: Federation, run: Run) -> None:
    assert not ev.busy(), "a checkpoint is taken with no evaluation formed or running"
    run.checkpoints.append((copy.deepcopy(fed), copy.deepcopy(ev.state_dict()), dict(run.evaluated)))


def _go(ev: Evaluations, fed: Federation, run: Run, stop_at: int | None = None, mode: str = "real",
        seed: int = 0) -> None:
    """Hand over updates until the last version, or until a Ctrl-C that lands just after the first
    update handed at version ``stop_at`` (the stop's checkpoint is the last one)."""
    while fed.in_flight and fed.version < ROUNDS:  # a resume hands over what was in simulated flight first
        _hand_over(ev, fed, run, fed.in_flight[0])
    checkpointed = {cp[0].version for cp in run.checkpoints}
    while fed.version < ROUNDS:
        if _hand_over(ev, fed, run, fed.rng.randrange(CLIENTS)) == stop_at:
            _stop(ev, fed, run, mode, seed)
            return
        if run.checkpoint_every and fed.version % run.checkpoint_every == 0 and fed.version not in checkpointed:
            checkpointed.add(fed.version)
            _checkpoint(ev, fed, run)


def _start(run: Run, fed: Federation, log_state=None) -> Evaluations:
    """A run's start: a new one, or a resume from a checkpoint's log, as the scheduler starts."""
    ev = _evaluations(run, fed)
    if log_state is not None:
        ev.load_state_dict(copy.deepcopy(log_state))
    if ev.evaluates_start(fed.version, in_history=fed.version in run.evaluated):
        ev.formed(fed.version, None, lambda: COUNTERS, force=True)
    _evaluate_ready(ev, run)
    return ev


def _as_of_truth(fed: Federation, version: int) -> dict[int, int]:
    return {c: max((n for n, at in fed.truth[c] if at < version), default=0) for c in range(CLIENTS)}


def _due(eval_every: int) -> list[int]:
    return [v for v in range(ROUNDS + 1) if v % eval_every == 0 or v == ROUNDS]


def _check(run: Run, fed: Federation) -> None:
    assert sorted(run.evaluated) == _due(run.eval_every)
    for v, as_of in run.evaluated.items():
        assert as_of == _as_of_truth(fed, v), f"version {v}"


@pytest.mark.parametrize("mode", ["real", "virtual"])
def test_every_stop_and_resume_evaluates_each_due_version_once_in_its_states(mode):
    for stop, eval_every, checkpoint_every, seed in itertools.product(range(1, ROUNDS), (1, 2, 3, 4), (0, 2, 3),
                                                                      range(3)):
        case = f"stop at {stop}, eval_every {eval_every}, checkpoint.every {checkpoint_every}, seed {seed}"
        straight_run, straight = Run(eval_every, checkpoint_every), Federation(rng=random.Random(seed))
        _go(_start(straight_run, straight), straight, straight_run)
        _check(straight_run, straight)

        stopped_run, stopped = Run(eval_every, checkpoint_every), Federation(rng=random.Random(seed))
        _go(_start(stopped_run, stopped), stopped, stopped_run, stop_at=stop, mode=mode, seed=seed)
        for fed_then, log_state, evaluated in stopped_run.checkpoints:  # the stop's, and each periodic one
            fed, run = copy.deepcopy(fed_then), Run(eval_every, checkpoint_every, evaluated=dict(evaluated))
            try:
                _go(_start(run, fed, log_state), fed, run)
                _check(run, fed)
            except (AssertionError, EvaluationLogError, StopIteration, ValueError) as e:
                raise AssertionError(f"{mode}, {case}, resumed from version {fed_then.version}: {e!r}") from e
            if mode == "virtual":  # the stop changed nothing: the same evaluations as the uninterrupted run
                assert run.evaluated == straight_run.evaluated, case


def test_a_log_that_cannot_name_a_state_is_refused_when_loaded_not_later():
    run, fed = Run(2, 2), Federation()
    fed.version = 3
    with pytest.raises(EvaluationLogError, match="clients \\[3\\]"):
        _evaluations(run, fed).load_state_dict({"log": {c: [[0, -math.inf]] for c in range(3)}})
    with pytest.raises(EvaluationLogError, match="client 1: no state as of version 4"):
        _evaluations(run, fed).load_state_dict({"log": {0: [[0, -math.inf]], 1: [[5, 4.0]], 2: [[0, 1]], 3: [[0, 1]]}})
    ev = _evaluations(run, fed)
    ev.load_state_dict({"log": {c: [[2, 1.0], [3, 3.0]] for c in range(CLIENTS)}})
    assert ev.keep_from(0) == 3
    # a due start version the log cannot name (its evaluation lost before the checkpoint) is not evaluated
    fed.version = 4
    lost = _evaluations(run, fed)
    lost.load_state_dict({"log": {c: [[3, 4.0]] for c in range(CLIENTS)}})
    assert lost.evaluates_start(4, in_history=False) is False
    assert lost.keep_from(0) == 3  # the versions after it are asked as usual
