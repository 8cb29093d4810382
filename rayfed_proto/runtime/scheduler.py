"""The driver-side loop: keep ``concurrency`` clients busy, hand updates to the server as they land.

One loop serves both modes (sync is async with buffer = the round's sampled clients and no
overlap between rounds):

* a *slot* is a client update in flight; free slots are filled with sampled clients whose
  actor is idle (seeded sampling: uniform over idle clients in async mode, a fresh sample of
  ceil(rho N) clients per round in sync mode);
* ``ray.wait`` returns whatever finishes first: a client's metadata (its upload's ObjectRef goes
  straight to ``server.submit``, never through the driver), new versions (async: the server's
  training thread aggregates whenever its buffer is full and ``wait_versions`` hands over each
  version's state ObjectRef, put once by the server; sync: the receipt of the round's ``step``),
  or an evaluation result; every later client and the version's evaluation receive that ref;
* every ``eval_every`` versions all clients are evaluated against that version's state; the
  metrics are assembled once all results for that version are in.

The scheduler never inspects a payload and never names an algorithm.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import ray

log = logging.getLogger("rayfed_proto")


@dataclass
class SchedulerStats:
    dispatched: int = 0
    busy_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    withheld: int = 0  # finished after the last version: never submitted
    last_terms: dict[int, dict[str, float]] = field(default_factory=dict)  # client -> its latest training terms


class Scheduler:
    def __init__(
        self,
        *,
        mode: str,
        buffer_size: int,
        num_clients: int,
        rounds: int,
        concurrency: int,
        clients_per_round: int,
        eval_every: int,
        seed: int,
        server,
        actors: list,
        actor_clients: list[list[int]],
        on_eval: Callable[[int, dict[str, Any]], None],
        on_version: Optional[Callable[[int], None]] = None,
    ):
        self.mode, self.buffer_size, self.num_clients, self.rounds = mode, buffer_size, num_clients, rounds
        self.concurrency, self.clients_per_round, self.eval_every = concurrency, clients_per_round, eval_every
        self.rng = np.random.default_rng([seed, 0x5C4ED])  # client sampling stream
        self.server, self.actors, self.actor_clients = server, actors, actor_clients
        self.actor_of = {c: a for a, cs in enumerate(actor_clients) for c in cs}
        self.on_eval, self.on_version = on_eval, on_version
        self.stats = SchedulerStats()

        self.version = 0
        self.global_ref = server.global_state.remote()
        self.train_refs: dict[Any, tuple[int, Any]] = {}  # meta ref -> (client, update ref)
        self.receipt_refs: set = set()
        self.eval_refs: dict[Any, int] = {}  # ref -> version
        self.eval_results: dict[int, list] = {}
        self.eval_pending: dict[int, int] = {}
        self.eval_snapshot: dict[int, tuple] = {}  # version -> (scheduler stats, wall, server stats ref)
        self.busy_actors: set[int] = set()
        self.round_queue: list[int] = []
        self.round_outstanding = 0
        self.step_ref = None
        self.versions_ref = None  # async: the outstanding server.wait_versions call
        self.backlog = 0  # accepted updates waiting at the server (latest report) ...
        self.backlog_version = 0  # ... and the server version it was read at
        self.unreported_submits = 0  # submitted, receipt not back yet
        self.t0 = time.perf_counter()

    # ---------------------------------------------------------------------------- helpers
    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def _idle_clients(self) -> list[int]:
        busy = {c for c, _ in self.train_refs.values()}
        return [c for c in range(self.num_clients) if c not in busy and self.actor_of[c] not in self.busy_actors]

    def _dispatch(self, client: int) -> None:
        a = self.actor_of[client]
        meta_ref, update_ref = self.actors[a].train.options(num_returns=2).remote(client, self.global_ref)
        self.train_refs[meta_ref] = (client, update_ref)
        self.busy_actors.add(a)
        self.stats.dispatched += 1

    def _start_round(self) -> None:
        chosen = self.rng.choice(self.num_clients, size=self.clients_per_round, replace=False)
        self.round_queue = sorted(int(c) for c in chosen)
        self.round_outstanding = len(self.round_queue)

    def _fill_slots(self) -> None:
        if self.version >= self.rounds:
            return
        if self.mode == "sync":
            if not self.round_queue and self.round_outstanding == 0 and self.step_ref is None:
                self._start_round()
            while self.round_queue and len(self.train_refs) < self.concurrency:
                free = [c for c in self.round_queue if self.actor_of[c] not in self.busy_actors]
                if not free:
                    break
                self.round_queue.remove(free[0])
                self._dispatch(free[0])
        else:
            # Backpressure: while a full next version already waits at the server, a new update
            # would only wait there too and grow stale; let the server catch up first.
            while len(self.train_refs) < self.concurrency and self.backlog + self.unreported_submits < self.buffer_size:
                idle = self._idle_clients()
                if not idle:
                    break
                self._dispatch(int(self.rng.choice(idle)))

    def _note_backlog(self, backlog: int, at_version: int) -> None:
        # readings can arrive out of order: a receipt taken before the server's last step must
        # not overwrite a later reading (it would stall dispatch until the next one)
        if at_version >= self.backlog_version:
            self.backlog, self.backlog_version = backlog, at_version

    def _start_eval(self, version: int, state_ref) -> None:
        # Counters are read now, when the version exists: evaluation results arrive later (they
        # queue behind local updates on the actors) and must not be credited with later work.
        self.eval_snapshot[version] = (dataclasses.replace(self.stats, last_terms=dict(self.stats.last_terms)),
                                       self.wall(), self.server.stats.remote(version))
        self.eval_pending[version] = len(self.actors)
        self.eval_results[version] = []
        for a, clients in enumerate(self.actor_clients):
            self.eval_refs[self.actors[a].evaluate.remote(clients, state_ref)] = version

    def _eval_due(self, version: int) -> bool:
        return version % self.eval_every == 0 or version == self.rounds

    # ---------------------------------------------------------------------------- handlers
    def _on_meta(self, ref) -> None:
        client, update_ref = self.train_refs.pop(ref)
        self.busy_actors.discard(self.actor_of[client])
        meta = ray.get(ref)
        self.stats.busy_s += meta["busy_s"]
        self.stats.bytes_up += meta["upload_bytes"]
        self.stats.bytes_down += meta["download_bytes"]
        self.stats.last_terms[client] = dict(meta["terms"])
        if self.version >= self.rounds:
            self.stats.withheld += 1  # finished: late updates are not submitted
            return
        self.receipt_refs.add(self.server.submit.remote(update_ref))
        self.unreported_submits += 1

    def _on_receipt(self, ref) -> None:
        self.receipt_refs.discard(ref)
        receipt = ray.get(ref)
        if ref is not self.step_ref:
            self.unreported_submits -= 1
            if "backlog" in receipt:
                self._note_backlog(receipt["backlog"], receipt["version"])
        if ref is self.step_ref:
            self.step_ref = None
        elif self.mode == "sync":
            self.round_outstanding -= 1
            if self.round_outstanding == 0 and not self.round_queue:
                self.step_ref = self.server.step.remote()
                self.receipt_refs.add(self.step_ref)
        if receipt.get("new_version") is not None:  # sync: the round's step
            self._on_new_version(receipt["new_version"], receipt["state_ref"])

    def _on_versions(self, ref) -> None:
        """Async: the server's training thread produced these versions since the last wait."""
        self.versions_ref = None
        reply = ray.get(ref)
        self._note_backlog(reply["backlog"], reply["version"])
        for version, state_ref in sorted(reply["versions"], key=lambda vs: vs[0]):
            self._on_new_version(version, state_ref)

    def _on_new_version(self, new_version: int, state_ref) -> None:
        # each version is evaluated against its own state, whatever order versions are seen in
        if self._eval_due(new_version):
            self._start_eval(new_version, state_ref)
        if new_version > self.version:
            self.version = new_version
            self.global_ref = state_ref
            if self.on_version:
                self.on_version(self.version)

    def _on_eval_result(self, ref) -> None:
        version = self.eval_refs.pop(ref)
        results = ray.get(ref)
        wrong = {r["state_version"] for r in results} - {version}
        if wrong:  # an invariant, not an input error: evaluation must see exactly its version's state
            raise RuntimeError(f"evaluation of version {version} received the state of version(s) {sorted(wrong)}")
        self.eval_results[version].extend(results)
        self.eval_pending[version] -= 1
        if self.eval_pending[version] == 0:
            del self.eval_pending[version]
            results = self.eval_results.pop(version)
            stats, wall, server_ref = self.eval_snapshot.pop(version)
            self.on_eval(version, self._metrics(version, results, ray.get(server_ref), stats, wall))

    # ---------------------------------------------------------------------------- metrics
    def _metrics(self, version: int, results: list[dict], server: dict, stats: SchedulerStats, wall: float) -> dict[str, Any]:
        results = [r for r in results if r["n"] > 0]  # a client without test samples has no accuracy
        n = np.array([r["n"] for r in results], float)
        head = np.array([r["head_correct"] for r in results], float)
        m: dict[str, Any] = {
            "head_acc": float(head.sum() / n.sum()),
            "head_acc_mean": float(np.mean(head / n)),
            "head_acc_std": float(np.std(head / n)),
        }
        if all(r["proto_correct"] is not None for r in results):
            proto = np.array([r["proto_correct"] for r in results], float)
            m.update(proto_acc=float(proto.sum() / n.sum()), proto_acc_mean=float(np.mean(proto / n)),
                     proto_acc_std=float(np.std(proto / n)))
        # every term a method reports from local training (loss, its parts, pseudo-label counts ...):
        # the mean over clients of each one's latest update, as train_<term>
        for key in sorted({k for terms in stats.last_terms.values() for k in terms}):
            values = [t[key] for t in stats.last_terms.values() if key in t and math.isfinite(t[key])]
            m[f"train_{key}"] = float(np.mean(values)) if values else float("nan")
        m["clients_nonfinite"] = sum(1 for r in results if r.get("nonfinite"))  # models that produce NaN/inf features
        silhouettes = [r["silhouette"] for r in results if r.get("silhouette") is not None]
        if silhouettes:
            m["silhouette_mean"] = float(np.mean(silhouettes))
        margin_min, margin_mean = server["margin"]
        m.update(
            proto_margin_min=margin_min, proto_margin_mean=margin_mean,
            bytes_up=stats.bytes_up, bytes_down=stats.bytes_down,
            staleness_mean=server["staleness_mean"], staleness_max=server["staleness_max"],
            updates_accepted=server["accepted"], updates_dropped=server["dropped_stale"], updates_late=server["late"],
            versions_rolled_back=server["rolled_back"],
            updates_refused=server["refused"], updates_dispatched=stats.dispatched,
            client_busy_s=stats.busy_s, server_train_s=server["server_train_s"], wall_s=wall,
            slot_utilisation=stats.busy_s / (self.concurrency * wall) if wall > 0 else float("nan"),
        )
        for k, v in server.get("server_metrics", {}).items():
            m[k] = v
        return m

    # ---------------------------------------------------------------------------- main loop
    def run(self) -> int:
        """Run until ``rounds`` versions exist and their evaluation is logged; returns the version."""
        self._start_eval(0, self.global_ref)
        # receipts too: one for an earlier version may still be due for evaluation after the last
        while self.version < self.rounds or self.eval_refs or self.receipt_refs:
            self._fill_slots()
            if self.mode == "async" and self.versions_ref is None and self.version < self.rounds:
                self.versions_ref = self.server.wait_versions.remote()
            pending = list(self.train_refs) + list(self.receipt_refs) + list(self.eval_refs)
            if self.versions_ref is not None and self.version < self.rounds:
                pending.append(self.versions_ref)
            if not pending:
                raise RuntimeError("scheduler stalled: nothing in flight before the last version")
            ready, _ = ray.wait(pending, num_returns=1)
            ref = ready[0]
            if ref in self.train_refs:
                self._on_meta(ref)
            elif ref in self.receipt_refs:
                self._on_receipt(ref)
            elif ref in self.eval_refs:
                self._on_eval_result(ref)
            else:
                self._on_versions(ref)
        # let in-flight local updates finish so actors are quiet before shutdown; they count as withheld
        if self.train_refs:
            done, _ = ray.wait(list(self.train_refs), num_returns=len(self.train_refs), timeout=120)
            for ref in done:
                self._on_meta(ref)
        return self.version
