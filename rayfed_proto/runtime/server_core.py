"""The server side of what actors do, without Ray: intake, staleness, buffer and versions.

:class:`ServerCore` wraps the algorithm's server part; when it steps is the policy's stepping
strategy (:mod:`rayfed_proto.runtime.stepping`). :class:`~rayfed_proto.runtime.actors.ServerActor`
is a thin shell around it.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.common import prototype_margin, staleness_weight
from rayfed_proto.config import ExperimentConfig
from rayfed_proto.messages import ClientUpdate, GlobalState, UpdateSchema, validate_update
from rayfed_proto.runtime.core import EvalSet, evaluate_global_model, federation_spec
from rayfed_proto.runtime.determinism import apply_determinism
from rayfed_proto.runtime.policies import ServerNeeds

log = logging.getLogger("rayfed_proto")


def _state_is_finite(state: GlobalState) -> bool:
    arrays = list((state.weights or {}).values()) + list(state.extras.values())
    if state.prototypes is not None:
        arrays.append(state.prototypes.vectors)
    return all(np.isfinite(a).all() for a in arrays if np.issubdtype(np.asarray(a).dtype, np.floating))


@dataclass
class ServerCounters:
    accepted: int = 0
    refused: int = 0
    dropped_stale: int = 0
    late: int = 0
    staleness: list[int] = field(default_factory=list)  # of accepted updates since last read
    server_train_s: float = 0.0
    rolled_back: int = 0  # versions whose aggregate was non-finite and was undone
    refusals: list[str] = field(default_factory=list)  # last reasons, for the log


class ServerCore:
    """Validation, staleness, buffering and versioning around the algorithm's server part.

    The federation policy's :class:`~rayfed_proto.runtime.policies.ServerNeeds` hand it a
    :mod:`stepping strategy <rayfed_proto.runtime.stepping>`: when a version forms (the driver
    asks, a server thread steps every K, or the submission that fills the buffer does) and what a
    step takes. :meth:`submit` validates and buffers under a lock; a training thread calls
    :meth:`wait_and_step`. Updates trained more than ``max_staleness`` versions ago are dropped.
    """

    def __init__(self, cfg: ExperimentConfig, num_classes: int, in_channels: int, image_size: int,
                 device: torch.device, needs: ServerNeeds, global_test: Optional[EvalSet] = None,
                 public_x: Optional[torch.Tensor] = None):
        apply_determinism(cfg.resources.deterministic)  # in-process runs; the server actor applied it already
        self.cfg = cfg
        self.device = device
        self.global_test = global_test
        self.stepping, self.max_staleness = needs.stepping, needs.max_staleness
        self.max_version = cfg.federation.rounds
        spec = federation_spec(cfg, num_classes, in_channels, image_size, public_x, device)
        self.algorithm = ALGORITHMS.get(cfg.algorithm.name).Server(cfg.algorithm_options(), spec, device)
        self.schema = UpdateSchema(spec.num_clients, num_classes, spec.feature_dim, self.algorithm.weight_shapes(),
                                   self.algorithm.extras_shapes())
        self.cond = threading.Condition()  # guards buffer, counters, version and the published state
        self.step_lock = threading.Lock()  # held for a whole aggregation: snapshots see none half done
        self.version = 0
        self.buffer: list[tuple[ClientUpdate, float]] = []
        self.counters = ServerCounters()
        self.margins: dict[int, tuple[float, float]] = {}
        self.version_metrics: dict[int, dict[str, float]] = {}  # server-side metrics of each version
        self._evaluator: Optional[ThreadPoolExecutor] = None  # the global-test evaluations' thread
        self.pending_evals: dict[int, Future] = {}  # version -> its global-test evaluation, running
        self.state, self.margins[0] = self._broadcast(0)
        self.start_state = self.state  # the version the driver starts from (see load_state_dict)
        self.version_metrics[0] = {}
        self._start_global_eval(0)

    def _start_global_eval(self, version: int) -> None:
        """Global-test-set accuracy of the server's model at an evaluated version (methods with a
        global model and a run with data.global_test_fraction > 0), merged into that version's
        metrics when done. A copy of the model is taken now, right after the version is produced,
        so the figure is exactly that version's; the evaluation itself runs on a thread of its
        own, so the new version is handed out at once and the next round trains while the server
        evaluates (in a sync round it used to hold every worker idle for its duration).
        :meth:`settle` waits for it; whoever reads or saves a version's metrics calls it."""
        fed = self.cfg.federation
        if self.global_test is None or not (version % fed.eval_every == 0 or version == fed.rounds):
            return
        model = self.algorithm.global_model()
        if model is None:
            return
        if self._evaluator is None:
            self._evaluator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="global-eval")
        self.pending_evals[version] = self._evaluator.submit(
            evaluate_global_model, copy.deepcopy(model), self.global_test, self.device)

    def settle(self, version: Optional[int] = None) -> None:
        """Wait for the global-test evaluation of ``version`` (all pending ones when None) and
        merge its result into ``version_metrics``. An evaluation that failed raises here. Takes
        only ``cond`` (the evaluation thread takes no lock), so it may be called holding
        ``step_lock``, which keeps a step from starting a new evaluation meanwhile."""
        with self.cond:
            versions = list(self.pending_evals) if version is None else [version]
            futures = [(v, self.pending_evals.pop(v)) for v in versions if v in self.pending_evals]
        for v, future in futures:
            result = future.result()  # outside the lock: intake goes on meanwhile
            with self.cond:
                self.version_metrics.setdefault(v, {}).update(result)

    def _broadcast(self, version: int) -> tuple[GlobalState, tuple[float, float]]:
        state = self.algorithm.broadcast(version)
        bank = self.algorithm.guidance_bank()
        return state, prototype_margin(bank.vectors) if bank is not None else (float("nan"), float("nan"))

    def buffer_ready(self) -> bool:
        return self.stepping.ready(len(self.buffer)) and self.version < self.max_version

    def submit(self, update: Any) -> dict[str, Any]:
        """Validate and buffer one update (a full buffer: what the stepping strategy does). Returns a receipt."""
        receipt: dict[str, Any] = {"client_id": getattr(update, "client_id", None), "accepted": False}
        with self.cond:
            if self.version >= self.max_version:
                self.counters.late += 1
                return {**receipt, "reason": "run finished", "version": self.version}
            reason = validate_update(update, self.schema, self.version)
            if reason is not None:
                self.counters.refused += 1
                self.counters.refusals = (self.counters.refusals + [reason])[-20:]
                log.warning("refused update from client %s: %s", receipt["client_id"], reason)
                return {**receipt, "reason": reason, "version": self.version}
            staleness = self.version - update.base_version
            if staleness > self.max_staleness:
                self.counters.dropped_stale += 1
                return {**receipt, "reason": f"staleness {staleness} > max_staleness {self.max_staleness}",
                        "version": self.version, "staleness": staleness}
            self.counters.accepted += 1
            self.counters.staleness.append(staleness)
            self.buffer.append((update, staleness_weight(staleness, self.cfg.federation.staleness_exponent)))
            receipt.update(accepted=True, staleness=staleness, version=self.version, backlog=len(self.buffer))
            ready = self.buffer_ready()
            if ready:
                self.stepping.wake(self.cond)
        if ready:
            receipt.update(self.stepping.step_at_intake(self.step))
        return receipt

    def wait_and_step(self, timeout: float) -> Optional[dict[str, Any]]:
        """Training thread: wait up to ``timeout`` for a full buffer, then aggregate it."""
        with self.cond:
            if not self.cond.wait_for(self.buffer_ready, timeout):
                return None
        return self.step()

    def step(self) -> dict[str, Any]:
        """Aggregate the buffer into the next version (also when it is empty: a round passed).

        The buffer is taken under the lock; aggregation and server training run outside it, so
        submissions keep arriving (they are staleness-checked against the current version).
        """
        with self.step_lock:
            return self._step()

    def _step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.cond:
            k = self.stepping.take(len(self.buffer))
            taken, self.buffer = self.stepping.order(self.buffer[:k]), self.buffer[k:]
            new_version = self.version + 1
        updates = [u for u, _ in taken]
        weights = [w for _, w in taken]
        before = self.algorithm.state_dict() if updates else None
        metrics = self.algorithm.aggregate(updates, weights, new_version) if updates else {}
        state, margin = self._broadcast(new_version)
        if before is not None and not _state_is_finite(state):
            # finite-but-absurd uploads (a client whose model blew up) can still drive the
            # aggregate or server training to inf/NaN: the global state must never hold one
            self.algorithm.load_state_dict(before)
            state, margin = self._broadcast(new_version)
            metrics = {"rolled_back": 1.0}
            with self.cond:
                self.counters.rolled_back += 1
            log.warning("version %d produced a non-finite global state: rolled back, %d updates discarded",
                        new_version, len(updates))
        dt = time.perf_counter() - t0  # server training time; the global-test evaluation is not part of it
        with self.cond:
            self.version, self.state = new_version, state
            self.margins[new_version] = margin
            self.version_metrics[new_version] = dict(metrics)
            self.counters.server_train_s += dt
            self._start_global_eval(new_version)
            self.cond.notify_all()
        # server_metrics: the aggregation's own; the global-test figures join version_metrics later (read_stats)
        return {"new_version": new_version, "state": state, "aggregated": len(taken), "server_s": dt,
                "server_metrics": dict(metrics)}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue from here (for checkpoints): plain dicts and arrays."""
        with self.step_lock:  # no step starts another evaluation between the settle and the copy
            self.settle()  # every version's metrics complete in the checkpoint
            with self.cond:  # a deep copy: the caller may serialise it while training goes on
                return copy.deepcopy(self._state_dict())

    def _state_dict(self) -> dict[str, Any]:
        c = self.counters
        return {"version": self.version, "algorithm": self.algorithm.state_dict(),
                "buffer": [(u, w) for u, w in self.buffer],
                "counters": {"accepted": c.accepted, "refused": c.refused, "dropped_stale": c.dropped_stale,
                             "late": c.late, "server_train_s": c.server_train_s, "rolled_back": c.rolled_back,
                             # the window since the last read: a stop between evaluated versions keeps it
                             "staleness": list(c.staleness)},
                "margins": {int(v): m for v, m in self.margins.items()},
                "version_metrics": {int(v): dict(m) for v, m in self.version_metrics.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.step_lock:
            self.settle()  # nothing of the replaced history may land after the restore
            with self.cond:
                self._load_state_dict(state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.buffer = list(state["buffer"])
        for k, v in state["counters"].items():
            setattr(self.counters, k, v)
        self.margins = dict(state["margins"])
        self.version_metrics = dict(state["version_metrics"])
        self.state, _ = self._broadcast(self.version)
        # the restored version's state, taken under step_lock: a restored buffer may already hold K
        # updates, and the training thread may step past this version before the driver asks for
        # the state it starts from (an evaluation of the restored version then got the next one's)
        self.start_state = self.state

    def read_stats(self, version: int | None = None) -> dict[str, Any]:
        """Counters for the driver; the staleness window restarts at each read.

        Margins and server metrics are those of ``version`` (default: the current one): a read
        queued behind later submissions must not report the next version's aggregation. The
        counters are read at once; the server metrics once that version's global-test evaluation
        is done (:meth:`settle`).
        """
        with self.cond:
            version = self.version if version is None else version
            stats = self._read_stats(version)
        self.settle(version)
        with self.cond:
            stats["server_metrics"] = dict(self.version_metrics.get(version, {}))
        return stats

    def _read_stats(self, version: int) -> dict[str, Any]:
        c = self.counters
        stale = c.staleness
        c.staleness = []
        return {"version": self.version, "accepted": c.accepted, "refused": c.refused,
                "dropped_stale": c.dropped_stale, "late": c.late, "server_train_s": c.server_train_s,
                "rolled_back": c.rolled_back,
                "staleness_mean": float(np.mean(stale)) if stale else 0.0,
                "staleness_max": int(max(stale)) if stale else 0,
                "margin": self.margins.get(version, (float("nan"), float("nan"))), "last_refusals": list(c.refusals),
                "server_metrics": dict(self.version_metrics.get(version, {}))}
