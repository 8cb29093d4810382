"""Evaluations, from a version's formation to its logged metrics (the driver's side).

**The invariant.** The evaluation labelled version v uses, for each client, exactly the state it
had when v was formed: its state after its latest local update that the server had *handled*
(accepted, or refused: a refused update still changed the client's own model) before v was
formed, evaluated against v's broadcast. Sync: after its round-v update (version 0: the initial
models); async and virtual clock: never an update still in flight. A client names its states by
the number of local updates it has done (``update_no``), so "the state as of v" is one number per
client (``as_of``), computed here from the receipts:

* every receipt carries the server version at which its update was handled (``at``); update n of
  client c counts for every version v > at;
* the evaluation of v is started once every receipt of a submission made before v was seen is
  back (async: a receipt may arrive after the server reported v), so ``as_of`` is final;
* the worker evaluates that state whether or not later updates of the client have run since:
  the host keeps the states an evaluation may still ask for (``keep_from``, sent with each
  local update), see :class:`rayfed_proto.runtime.client_core.ClientHost`.

So evaluations may run whenever the workers are free, overlapping the server's work, and still
measure exactly their version. No Ray calls here: the scheduler launches and collects.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from rayfed_proto.tracking.round_metrics import version_metrics

logger = logging.getLogger("rayfed_proto")

EVAL_SAMPLE_STREAM = 0xE7A1  # default_rng([seed, EVAL_SAMPLE_STREAM]): the evaluated clients' own stream


class EvaluationLogError(RuntimeError):
    """The evaluation log cannot name a client's state as of a version (an invariant of the
    runtime; a resume that meets it is refused, its run left as it was)."""


def eval_sample(eval_clients: Union[str, int, float], num_clients: int, seed: int) -> Optional[list[int]]:
    """The clients every evaluation covers (``federation.eval_clients``), sorted; None: all of them.
    A number or a fraction (ceil(f x N)) of the clients, drawn once from the run's seed on a stream
    of its own (no other random stream moves), so every version is evaluated on the same clients
    (FedScale's fixed evaluation sample) and training never changes."""
    if eval_clients == "all":
        return None
    m = int(eval_clients) if isinstance(eval_clients, int) else math.ceil(float(eval_clients) * num_clients)
    if m >= num_clients:
        return None
    rng = np.random.default_rng([seed, EVAL_SAMPLE_STREAM])
    return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))


@dataclass
class _Formed:
    version: int
    state_ref: Any
    counters: tuple  # (scheduler stats, wall s, simulated s, server stats or a ref to them) when formed
    gate: int  # the receipts of submissions up to this ticket must be back before it starts


@dataclass
class _Running:
    parts: int  # worker actors still to answer
    as_of: dict[int, int]
    counters: tuple
    results: list = field(default_factory=list)
    incomplete: bool = False  # a worker died: some clients' results are missing
    done: bool = False  # every part answered; logged once no earlier version is still running


class Evaluations:
    """Which versions are evaluated, in which client states, and their results as they arrive."""

    def __init__(self, eval_every: int, rounds: int, counts: dict[int, int], version: int, stats,
                 on_eval: Callable[[int, dict[str, Any]], None], real_slots: int, resolve: Callable[[Any], Any],
                 sample: Optional[list[int]] = None):
        """``counts``: each client's local updates done at the start (its state then);
        ``resolve``: turns the server's stats ref into the stats (``ray.get``); ``sample``: the
        clients evaluated (:func:`eval_sample`; None: all): the others' states are never asked for."""
        self.eval_every, self.rounds, self.stats, self.on_eval = eval_every, rounds, stats, on_eval
        self.real_slots, self.resolve = real_slots, resolve
        self.sample = None if sample is None else frozenset(sample)
        self.log: dict[int, list[tuple[int, float]]] = {c: [(n, -math.inf)] for c, n in counts.items()}
        # clients whose log holds more than one entry: the only ones a trim can shorten. Trimming every
        # client at each scheduler step cost 15 ms per update at 10,000 clients (docs/benchmarks.md)
        self.long: set[int] = set()
        self.formed_queue: list[_Formed] = []  # formed, not started: version order
        self.running: dict[int, _Running] = {}
        self.tickets = 0  # submissions made
        self.open: set[int] = set()  # submissions whose receipt is not back
        self.newest = version  # the newest version seen

    # ------------------------------------------------------------------ what the server handled
    def ticket(self) -> int:
        """A submission is made: its number (its receipt gates evaluations of later versions)."""
        self.tickets += 1
        self.open.add(self.tickets)
        return self.tickets

    def handed(self, client: int, update_no: int, at: float, ticket: int = -1) -> None:
        """The server handled update ``update_no`` of ``client`` at version ``at`` (its receipt)."""
        self.open.discard(ticket)
        if client >= 0:
            self.log[client].append((update_no, at))
            self._trim(client)

    def actor_restarted(self, counts: dict[int, int]) -> None:
        """A worker was recreated from a checkpoint: its clients' states are those now."""
        for c, n in counts.items():
            self.log[c] = [(n, -math.inf)]
            self.long.discard(c)

    def _state_before(self, client: int, version: float) -> int:
        for n, at in reversed(self.log[client]):
            if at < version:
                return n
        raise EvaluationLogError(f"client {client}: no state as of version {version:g} in its evaluation log "
                                 f"{self.log[client]} (update count, version handed at)")

    def _oldest_asked(self) -> float:
        return self.formed_queue[0].version if self.formed_queue else self.newest + 1

    def keep_from(self, client: int) -> Optional[int]:
        """The oldest state of ``client`` an evaluation not yet started may ask for (None: no
        evaluation ever asks for it, a client outside the sample)."""
        if self.sample is not None and client not in self.sample:
            return None
        return self._state_before(client, self._oldest_asked())

    def _trim(self, client: int) -> None:
        log, oldest = self.log[client], self._oldest_asked()
        keep = max((i for i, (_, at) in enumerate(log) if at < oldest), default=0)  # none before it: nothing to drop
        del log[:keep]
        if len(log) > 1:
            self.long.add(client)
        else:
            self.long.discard(client)

    def _trim_all(self) -> None:
        """Drop every entry no evaluation can ask for any more (the clients with more than one)."""
        for c in list(self.long):
            self._trim(c)

    # ------------------------------------------------------------------ versions
    def due(self, version: int) -> bool:
        return version % self.eval_every == 0 or version == self.rounds

    def evaluates_start(self, version: int, in_history: bool) -> bool:
        """Whether a run starting at ``version`` evaluates it: when it is due and its history lacks
        it (a new run's version 0). A resume never evaluates a version the uninterrupted run would
        not: a stop at a version that is not due (Ctrl-C lands anywhere) adds no row, and its
        checkpoint need not hold the states before it. A due one is in the history (a checkpoint
        waits for the evaluations of every version formed) unless its evaluation was lost with
        its workers, when the log may not name its states: lost, as in the uninterrupted run."""
        if in_history or not self.due(version):
            return False
        clients = [c for c in self.log if self.sample is None or c in self.sample]
        gaps = [c for c in clients if not any(at < version for _, at in self.log[c])]
        if gaps:
            logger.warning("version %d is not in the resumed run's history and the checkpoint cannot name the states of "
                        "clients %s as of it: not evaluated (its evaluation was lost before the checkpoint)", version,
                        gaps[:10])
        return not gaps

    def formed(self, version: int, state_ref, counters: Callable[[], tuple], force: bool = False) -> None:
        """Version ``version`` exists (``counters`` reads the run's counters at it, only when due)."""
        self.newest = max(self.newest, version)
        if force or self.due(version):
            self.formed_queue.append(_Formed(version, state_ref, counters(), gate=self.tickets))
            self.formed_queue.sort(key=lambda f: f.version)

    def start_ready(self, launch: Callable[[int, Any, dict[int, int]], int]) -> None:
        """Start, in version order, each formed evaluation whose earlier receipts are all back;
        ``launch(version, state_ref, as_of)`` sends it to the workers and returns their number."""
        while self.formed_queue and min(self.open, default=math.inf) > self.formed_queue[0].gate:
            f = self.formed_queue.pop(0)
            as_of = {c: self._state_before(c, f.version) for c in self.log if self.sample is None or c in self.sample}
            self.running[f.version] = _Running(launch(f.version, f.state_ref, as_of), as_of, f.counters)
        self._trim_all()

    def busy(self) -> bool:
        return bool(self.formed_queue or self.running)

    def server_restarted(self, version: int) -> None:
        """The server went back to ``version``: later versions are redone, and evaluated then. The
        clients keep the states they reached, so updates handled by the dead server count for
        every redone version."""
        self.formed_queue = [f for f in self.formed_queue if f.version <= version]
        self.running = {v: r for v, r in self.running.items() if v <= version}
        self.newest = version
        for c, log in self.log.items():  # every client: a single entry may name a version that is gone
            self.log[c] = [(n, min(at, version)) for n, at in log]
            self._trim(c)

    def state_dict(self) -> dict[str, Any]:
        """Each client's handed updates that a later evaluation may still need (a checkpoint is taken
        with no evaluation running; with a virtual clock, updates in simulated flight are not
        handed yet, so their clients are still evaluated as before them)."""
        return {"log": {c: [[n, at] for n, at in log] for c, log in self.log.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's log, checked: every client the workers host has one, and each names the
        state that the next version's evaluation asks for (:class:`EvaluationLogError` otherwise)."""
        loaded = {int(c): [(int(n), float(at)) for n, at in log] for c, log in state["log"].items()}
        missing = sorted(set(self.log) - set(loaded))
        if missing:
            raise EvaluationLogError(f"the checkpoint's evaluation log has no entry for clients {missing[:10]}")
        self.log = loaded
        self.long = {c for c, log in self.log.items() if len(log) > 1}
        for c in self.log:
            self._state_before(c, self.newest + 1)

    # ------------------------------------------------------------------ results
    def result(self, version: int, results: list[dict[str, Any]]) -> None:
        run = self.running[version]
        for r in results:  # invariants of the runtime, not input errors
            if r["state_version"] != version:
                raise RuntimeError(f"evaluation of version {version} received the state of version {r['state_version']}")
            if r["update"] > run.as_of[r["client_id"]]:
                raise RuntimeError(f"evaluation of version {version} saw client {r['client_id']} after {r['update']} "
                                   f"local updates; its state as of that version is after {run.as_of[r['client_id']]}")
        run.results.extend(results)
        self._part_done(version)

    def part_lost(self, version: int) -> None:
        if version in self.running and not self.running[version].done:
            self.running[version].incomplete = True
            self._part_done(version)

    def _part_done(self, version: int) -> None:
        run = self.running[version]
        run.parts -= 1
        if run.parts:
            return
        run.done = True
        # logged in version order, whichever worker answers first: the history (and on_eval) never
        # depends on how fast the workers were
        while self.running and self.running[first := min(self.running)].done:
            self._log(first, self.running.pop(first))

    def _log(self, version: int, run: _Running) -> None:
        stats, wall, sim, server_stats = run.counters
        if not isinstance(server_stats, dict):
            try:
                server_stats = self.resolve(server_stats)
            except Exception:  # the server died after producing it: the version is redone
                return
        self.stats.evals_incomplete += run.incomplete
        if run.results:
            self.on_eval(version, version_metrics(run.results, server_stats, stats, wall, sim, self.real_slots))

