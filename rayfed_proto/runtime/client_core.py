"""The client side of what actors do, without Ray: a client's runner and a worker's clients.

:class:`ClientRunner` trains and evaluates one client; :class:`ClientHost` holds a worker's
clients, live or parked, the states evaluations may still ask for, and batched stepping
(``resources.batch_clients``). :class:`~rayfed_proto.runtime.actors.ClientActor` is a thin shell
around it. Nothing here names an algorithm: the registry resolves ``algorithm.name``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rayfed_proto import optim
from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.algorithms.common import nearest_prototype_predict
from rayfed_proto.config import ExperimentConfig
from rayfed_proto.data import ArrayDataset, ClientSplit
from rayfed_proto.data.augment import batch_augment
from rayfed_proto.messages import ClientUpdate, GlobalState
from rayfed_proto.models import build_client_model
from rayfed_proto.runtime.core import eval_batch_size, federation_spec, memory_format
from rayfed_proto.runtime.determinism import apply_determinism
from rayfed_proto.runtime.parking import ParkedStates, resolve
from rayfed_proto.training import batched

log = logging.getLogger("rayfed_proto")


def make_optimizer(cfg: ExperimentConfig, model: torch.nn.Module) -> optim.LeanOptimizer | torch.optim.Optimizer:
    """The client's optimizer (``training.optimizer``): :mod:`rayfed_proto.optim`'s, which is
    ``torch.optim``'s arithmetic on the CPU without its ``torch._dynamo`` import."""
    t = cfg.training
    if t.optimizer == "adam":
        opt = optim.adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    else:
        opt = optim.sgd(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    opt.max_grad_norm = t.max_grad_norm  # read by algorithms.base.guarded_step
    return opt


class ClientRunner:
    """One client: its model, optimizer, algorithm state and data shard (train/test tensors)."""

    def __init__(self, cfg: ExperimentConfig, split: ClientSplit, dataset: ArrayDataset, device: torch.device,
                 public_x: Optional[torch.Tensor] = None):
        self.cfg, self.client_id, self.device = cfg, split.client_id, device
        apply_determinism(cfg.resources.deterministic)  # in-process runs; a client actor applied it already
        # The client's own torch RNG stream starts here (seeded with its id); model.init: per_client also
        # draws the initial weights from it, shared draws them from the run's seed, one model per architecture.
        torch.manual_seed(cfg.seed * 100_003 + split.client_id)
        m = cfg.model
        self.model = build_client_model(m.group, split.client_id, dataset.channels, dataset.image_size,
                                        dataset.num_classes, m.feature_dim, m.projector, m.normalize_features,
                                        shared_seed=cfg.seed if m.init == "shared" else None,
                                        stem=m.stem, weights=m.weights).to(device, memory_format=memory_format(cfg, device))
        self.optimizer = make_optimizer(cfg, self.model)
        algo = ALGORITHMS.get(cfg.algorithm.name)
        spec = federation_spec(cfg, dataset.num_classes, dataset.channels, dataset.image_size, public_x)
        spec.build_model = spec.build_arch = None  # clients never need the server's model factories
        self.algorithm = algo.Client(cfg.algorithm_options(), spec, split.client_id)
        self.train_x, self.train_y = dataset.tensors(split.train_idx)
        self.test_x, self.test_y = dataset.tensors(split.test_idx)
        if len(split.unlabelled_idx):  # data.partition.unlabelled_per_client: labels hidden from training
            self.algorithm.set_unlabelled_pool(*dataset.tensors(split.unlabelled_idx))
        self.batches = TrainBatchIterator(self.train_x, self.train_y, cfg.training.batch_size,
                                          torch.Generator().manual_seed(cfg.seed * 7919 + split.client_id),
                                          augment=batch_augment(cfg.data),  # data.augment: training batches only
                                          drop_last=cfg.training.trailing_batch == "drop")
        self.last_loss = float("nan")
        self.updates = 0  # local updates completed: names the state an evaluation asks for (``as_of``)
        # The client's own torch RNG stream (dropout and anything else drawing from torch's global
        # generator), swapped in around its local updates: a client's result does not depend on
        # which other clients share its worker process, or in which order they ran.
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def _swap_rng(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        outer = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda_rng is not None else None)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        return outer

    def _restore_rng(self, outer: tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
        self.torch_rng = torch.get_rng_state()
        torch.set_rng_state(outer[0])
        if self.cuda_rng is not None:
            self.cuda_rng = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(outer[1], self.device)

    @contextlib.contextmanager
    def own_rng(self):
        """This client's torch random stream in place of the process's, for the duration."""
        outer = self._swap_rng()
        try:
            yield
        finally:
            self._restore_rng(outer)

    def train(self, state: GlobalState) -> tuple[dict[str, Any], ClientUpdate]:
        """Local update against ``state``: returns (small metadata for the driver, the upload)."""
        t0 = time.perf_counter()
        with self.own_rng():
            self.begin_update(state)
            terms = self.algorithm.local_train(self.model, self.optimizer, self.batches, self.cfg.training.local_epochs,
                                               self.device)
            update = self.end_update()
        return self.finished(state, terms, update, time.perf_counter() - t0)

    def begin_update(self, state: GlobalState) -> None:
        """Before a local update's steps: take the broadcast in, reset the optimizer if fresh."""
        self.algorithm.receive(state, self.model)
        self._reset_optimizer_if_fresh(state)

    def end_update(self) -> ClientUpdate:
        """After a local update's steps: the upload."""
        update = self.algorithm.make_update(self.model, self.train_x, self.train_y)
        self.optimizer.zero_grad(set_to_none=True)  # gradients are not state: none held between updates
        return update

    def finished(self, state: GlobalState, terms: dict[str, float], update: ClientUpdate,
                 busy: float) -> tuple[dict[str, Any], ClientUpdate]:
        """Count the update done; (metadata for the driver, the upload)."""
        self.last_loss = terms.get("loss", float("nan"))
        self.updates += 1
        meta = {"client_id": self.client_id, "base_version": state.version, "busy_s": busy, "update": self.updates,
                "terms": terms, "upload_bytes": update.nbytes, "download_bytes": state.nbytes}
        return meta, update

    def _reset_optimizer_if_fresh(self, state: GlobalState) -> None:
        """Drop the optimizer's state (momentum buffers) when the algorithm says this update
        starts afresh (by default every update), unless training.keep_optimizer_state."""
        if not self.cfg.training.keep_optimizer_state and self.algorithm.fresh_optimizer(state):
            self.optimizer.state.clear()  # as a new optimizer: same param groups, no per-parameter state

    @torch.no_grad()
    def evaluate(self, state: GlobalState, batch_size: Optional[int] = None) -> dict[str, Any]:
        """Correct counts on the client's test split, head and nearest-prototype modes."""
        batch_size = batch_size or eval_batch_size(self.device)
        self.algorithm.receive(state, self.model)
        self.model.eval()
        bank = self.algorithm.inference_bank()
        candidates = self.train_y.unique() if self.cfg.evaluation.proto_candidates == "own_classes" else None
        head = proto = 0
        all_feats = []
        for i in range(0, len(self.test_y), batch_size):
            x = self.test_x[i : i + batch_size].to(self.device)
            y = self.test_y[i : i + batch_size].to(self.device)
            feats, logits = self.model.forward_features(x)
            all_feats.append(feats.float().cpu())
            head += int((logits.argmax(1) == y).sum())
            pred = nearest_prototype_predict(feats, bank, candidates)
            if pred is not None:
                proto += int((pred == y).sum())
        self.model.train()
        return {"client_id": self.client_id, "state_version": state.version, "update": self.updates,
                "n": int(len(self.test_y)), "head_correct": head,
                "proto_correct": proto if bank is not None and len(bank) else None, "train_loss": self.last_loss,
                "silhouette": embedding_silhouette(torch.cat(all_feats) if all_feats else None, self.test_y),
                "nonfinite": bool(all_feats) and not bool(torch.isfinite(torch.cat(all_feats)).all())}

    def state_dict(self) -> dict[str, Any]:
        return {"model": {k: v.cpu() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "algorithm": self.algorithm.state_dict(),
                "batch_rng": self.batches.generator.get_state(), "last_loss": self.last_loss,
                "torch_rng": self.torch_rng, "cuda_rng": self.cuda_rng, "updates": self.updates}

    def eval_state(self) -> dict[str, Any]:
        """What an evaluation reads (model, algorithm state, last loss, update count), copied: the
        state kept for an evaluation of a version formed before the next local update lands."""
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "algorithm": copy.deepcopy(self.algorithm.state_dict()), "last_loss": self.last_loss,
                "updates": self.updates}

    def load_eval_state(self, state: dict[str, Any]) -> None:
        """Load what :meth:`eval_state` (or :meth:`state_dict`) wrote, optimizer and RNG untouched."""
        self.model.load_state_dict(state["model"])
        self.algorithm.load_state_dict(copy.deepcopy(state["algorithm"]))
        self.last_loss = state["last_loss"]
        self.updates = int(state.get("updates", 0))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.batches.generator.set_state(state["batch_rng"])
        self.last_loss = state["last_loss"]
        self.updates = int(state.get("updates", 0))  # checkpoints from before the count: 0
        if state.get("torch_rng") is not None:  # checkpoints from before per-client streams keep the fresh one
            self.torch_rng = state["torch_rng"]
        if state.get("cuda_rng") is not None and self.cuda_rng is not None:
            self.cuda_rng = state["cuda_rng"]


class ClientHost:
    """The clients one worker actor hosts; each client's state (model, optimizer, algorithm
    state, RNG streams) belongs here and is checkpointed per client.

    With ``park=True`` a client is *materialised* (a :class:`ClientRunner`: model, optimizer, its
    data shard as float tensors) only while it trains or is evaluated. After a local update its
    state is *parked* as the same plain tensors a checkpoint holds, and the runner is dropped; a
    client that never trained holds nothing (it is rebuilt from its seed, exactly as at the
    start). An evaluation leaves a parked client as it was. So a 1,000-client cross-device run
    keeps only the clients in flight as live models. Parked states live in memory or, with a
    ``parked`` store on disk (:mod:`rayfed_proto.runtime.parking`), one file each, so memory
    follows the clients in flight, not the clients hosted (10,000 clients). With ``park=False``
    every hosted client stays live (cheapest for small federations).

    **Evaluation states.** The evaluation of version v asks, for each client, for its state after
    a given number of local updates (``as_of``: its latest update the server had handled when v
    was formed, docs/architecture.md "The evaluation invariant"). A local update queued on this
    worker before the evaluation may already have run, so before each update the host keeps the
    state it replaces (``kept``) whenever the driver's ``keep_from`` says an evaluation may still
    ask for it, and drops kept states no evaluation can ask for any more.
    """

    def __init__(self, cfg: ExperimentConfig, dataset: ArrayDataset, splits: list[ClientSplit], device: torch.device,
                 public_x: Optional[torch.Tensor] = None, park: bool = False, parked: Optional[ParkedStates] = None):
        self.cfg, self.dataset, self.device, self.public_x, self.park = cfg, dataset, device, public_x, park
        self.splits = {s.client_id: s for s in splits}
        self.live: dict[int, ClientRunner] = {}
        self.parked = parked if parked is not None else ParkedStates()  # in memory unless given a store on disk
        self.materialised = 0  # runners built (a count for tests and logs)
        # client -> {local updates done: evaluation state}; None stands for the seeded initial state
        self.kept: dict[int, dict[int, Optional[dict[str, Any]]]] = {}
        # client -> its whole state before its latest local update, kept when that update may be lost
        # (virtual clock: its client may go offline first): ``discard`` goes back to it. None: never trained
        self.undo: dict[int, Any] = {}
        if not park:
            for c in self.splits:
                self._runner(c)

    @property
    def client_ids(self) -> list[int]:
        return sorted(self.splits)

    def _runner(self, c: int) -> ClientRunner:
        runner = self.live.get(c)
        if runner is None:
            runner = ClientRunner(self.cfg, self.splits[c], self.dataset, self.device, self.public_x)
            if c in self.parked:
                runner.load_state_dict(self.parked.get(c))
            self.live[c] = runner
            self.materialised += 1
        return runner

    def _release(self, c: int, keep_state: bool) -> None:
        if self.park:
            runner = self.live.pop(c)
            if keep_state:
                self.parked.put(c, runner.state_dict())

    def updates_done(self, c: int) -> int:
        """Local updates client ``c`` has completed (its state's name for evaluations)."""
        if c in self.live:
            return self.live[c].updates
        return self.parked.updates(c) if c in self.parked else 0

    def update_counts(self) -> dict[int, int]:
        return {c: self.updates_done(c) for c in self.client_ids}

    def _keep_before_update(self, c: int, keep_from: Optional[int]) -> None:
        """Keep the state a local update is about to replace when an evaluation may still ask for
        it (``keep_from``: the oldest update count one may ask for; None: no evaluation will)."""
        kept = self.kept.pop(c, {})
        if keep_from is None:
            return
        kept = {n: st for n, st in kept.items() if n >= keep_from}
        n = self.updates_done(c)
        if n >= keep_from:
            if c in self.live:
                kept[n] = self.live[c].eval_state()
            elif c in self.parked:  # the update parks a new state, never changes this one: shared
                kept[n] = self.parked.share(c)
            else:
                kept[n] = None  # never trained: rebuilt from its seed
        if kept:
            self.kept[c] = kept

    def train(self, c: int, state: GlobalState, keep_from: Optional[int] = None,
              undoable: bool = False) -> tuple[dict[str, Any], ClientUpdate]:
        """A local update; ``undoable``: it may be lost (its client may go offline before it
        finishes), so the whole state before it is kept for :meth:`discard`."""
        self._keep_before_update(c, keep_from)
        self.undo.pop(c, None)
        if undoable:
            self.undo[c] = self._whole_state(c)
        try:
            return self._runner(c).train(state)
        finally:
            self._release(c, keep_state=True)

    def train_group(self, clients: list[int], state: GlobalState,
                    keep_from: Optional[list[Optional[int]]] = None) -> list[tuple[dict[str, Any], ClientUpdate]]:
        """Local updates of ``clients`` against one ``state``, results in their order, each what
        :meth:`train` returns. Where ``resources.batch_clients`` batches (:func:`batches_on`) the clients that can
        (:func:`batched.batch_refusal`) and share an architecture and settings
        (:func:`batched.group_key`) step together as one batched model; the others, and every
        client with ``off``, train one after another."""
        keep_from = keep_from if keep_from is not None else [None] * len(clients)
        if not batches_on(self.cfg.resources.batch_clients, self.device):  # each parked again after its update
            return [self.train(c, state, k) for c, k in zip(clients, keep_from, strict=True)]
        for c, k in zip(clients, keep_from, strict=True):
            self._keep_before_update(c, k)
        results: dict[int, tuple[dict[str, Any], ClientUpdate]] = {}
        try:
            runners = {c: self._runner(c) for c in clients}
            for group in self._batch_groups(runners):
                if len(group) == 1:
                    results[group[0]] = runners[group[0]].train(state)
                else:
                    results.update(zip(group, train_batched([runners[c] for c in group], state), strict=True))
        finally:
            for c in clients:
                if c in self.live:
                    self._release(c, keep_state=True)
        return [results[c] for c in clients]

    def _batch_groups(self, runners: dict[int, ClientRunner]) -> list[list[int]]:
        """The clients that step together (one list each), in client order of their first member."""
        groups: dict[Any, list[int]] = {}
        for c, r in runners.items():
            alone = batched.batch_refusal(r.algorithm, r.model, r.optimizer) is not None
            key = ("alone", c) if alone else batched.group_key(r.algorithm, r.model, r.optimizer, r.batches)
            groups.setdefault(key, []).append(c)
        return list(groups.values())

    def _whole_state(self, c: int) -> Any:
        """Client ``c``'s whole state now (model, optimizer, algorithm, RNG streams, update count),
        a copy no local update changes: a parked file's handle, a copy of a parked dict or of a
        live runner's state; None for a client that never trained (rebuilt from its seed)."""
        if c in self.live:
            return copy.deepcopy(self.live[c].state_dict())
        if c in self.parked:
            st = self.parked.handle_of(c)
            return st if not isinstance(st, dict) else {**st, "algorithm": copy.deepcopy(st["algorithm"])}
        return None

    def discard(self, c: int) -> bool:
        """Client ``c``'s latest local update was lost (its client went offline before it finished):
        its state goes back to what it was before that update, as FedScale discards the work, so
        its evaluations and its next update start from the same state. False: no state was kept
        (the update was not dispatched as undoable, or this worker was restored from a checkpoint
        since): the client keeps the training."""
        if c not in self.undo:
            return False
        before = self.undo.pop(c)  # the states kept for evaluations are all from before the lost update: they stay
        if self.park:
            self.live.pop(c, None)
            if before is None:
                self.parked.pop(c)
            else:
                self.parked.put(c, resolve(before))
        elif before is None:
            self.live[c] = ClientRunner(self.cfg, self.splits[c], self.dataset, self.device, self.public_x)
        else:
            self._runner(c).load_state_dict(before)
        return True

    def evaluate(self, clients: list[int], state: GlobalState,
                 as_of: Optional[dict[int, int]] = None) -> list[dict[str, Any]]:
        """Each client's state after ``as_of[c]`` local updates (its newest without ``as_of``),
        evaluated against ``state``; every client is left as it was."""
        results = []
        for c in clients:
            want = None if as_of is None else as_of.get(c)
            try:
                results.append(self._evaluate_as_of(c, state, want))
            finally:
                self._release(c, keep_state=False)
            if want is not None and c in self.kept:  # later evaluations ask for this state or newer ones,
                now = self.updates_done(c)  # and the current state needs no copy
                self.kept[c] = {n: st for n, st in self.kept[c].items() if want <= n < now}
                if not self.kept[c]:
                    del self.kept[c]
        return results

    def _evaluate_as_of(self, c: int, state: GlobalState, want: Optional[int]) -> dict[str, Any]:
        runner = self._runner(c)
        if want is None or runner.updates <= want:  # its newest state (older than asked: restored from a checkpoint)
            return runner.evaluate(state)
        kept = self.kept.get(c, {})
        if want not in kept:  # an invariant of the runtime, not an input error
            raise RuntimeError(f"client {c}: an evaluation asks for its state after {want} local updates, but it has "
                               f"done {runner.updates} and kept only {sorted(kept)}")
        if self.park:  # the runner is dropped after this evaluation: load the kept state into it
            if kept[want] is None:
                runner = self.live[c] = ClientRunner(self.cfg, self.splits[c], self.dataset, self.device, self.public_x)
            else:
                runner.load_eval_state(resolve(kept[want]))
            return runner.evaluate(state)
        current = runner.eval_state()
        try:
            runner.load_eval_state(kept[want])
            return runner.evaluate(state)
        finally:
            runner.load_eval_state(current)

    def export_model(self, c: int, state: GlobalState) -> tuple[torch.nn.Module, dict[str, Any]]:
        """A CPU copy of client ``c``'s model as an evaluation against ``state`` scores it, with that
        evaluation (MLflow model logging); a parked client is left as it was."""

        try:
            runner = self._runner(c)
            result = runner.evaluate(state)
            return copy.deepcopy(runner.model).cpu().eval(), result
        finally:
            self._release(c, keep_state=False)

    def state_dicts(self) -> dict[int, dict[str, Any]]:
        """Every client with a state (live, or parked; a never-trained parked client has none), with
        the earlier states an evaluation may still ask for (``kept``: with a virtual clock, a client
        whose update is in simulated flight at a checkpoint is evaluated as before it)."""
        return self.client_states(self.stateful_clients())

    def stateful_clients(self) -> list[int]:
        """The clients :meth:`state_dicts` returns a state for."""
        return sorted(set(self.parked.clients()) | set(self.live))

    def client_states(self, clients: list[int]) -> dict[int, dict[str, Any]]:
        """:meth:`state_dicts` for ``clients`` only (a checkpoint fetches a worker's states in chunks)."""
        states = {}
        for c in clients:
            if c in self.live:
                st = self.live[c].state_dict()
            elif c in self.parked:
                st = self.parked.get(c)
            else:
                continue
            if c in self.kept:
                st = {**st, "kept": {int(n): resolve(k) if k is not None else None for n, k in self.kept[c].items()}}
            states[c] = st
        return states

    def load_state_dicts(self, states: dict[int, dict[str, Any]]) -> None:
        for c, st in states.items():
            self.kept.pop(c, None)
            if st.get("kept"):
                self.kept[c] = {int(n): kept if kept is None else self.parked.hold(kept, c)
                                for n, kept in st["kept"].items()}
                st = {k: v for k, v in st.items() if k != "kept"}
            if self.park:
                self.live.pop(c, None)
                self.parked.put(c, st)
            else:
                self._runner(c).load_state_dict(st)

    def adopt_files(self, files: dict[int, tuple[str, int, str]]) -> list[int]:
        """Park checkpointed states from their files (``client -> (path, size, sha256)``), checked
        and not loaded (:meth:`ParkedStates.adopt`), with the earlier states they keep for
        evaluations (each copied from the linked file into one of its own); returns the clients
        whose state must come as bytes instead (parked in memory, not parking, the file out of
        reach or damaged)."""
        if not self.park:
            return sorted(files)
        left = []
        for c, (path, size, sha256) in files.items():
            kept = self.parked.adopt(c, Path(path), size, sha256)
            if kept is None:
                left.append(c)
                continue
            self.live.pop(c, None)
            self.kept.pop(c, None)
            if kept:
                self.kept[c] = {n: st if st is None else self.parked.hold(st, c) for n, st in kept.items()}
        return left

    def drop_kept(self, keep_from: dict[int, Optional[int]]) -> None:
        """Drop the kept states no evaluation can ask for any more (``keep_from``: for each client,
        the oldest it may; None: none), before a checkpoint saves them: a state kept before a
        client's latest update is needed only while a version formed before that update may still
        be evaluated. So a stop's checkpoint holds kept states only for updates in simulated flight."""
        for c, oldest in keep_from.items():
            if c not in self.kept:
                continue
            kept = {} if oldest is None else {n: st for n, st in self.kept[c].items() if n >= oldest}
            if kept:
                self.kept[c] = kept
            else:
                del self.kept[c]

    def live_count(self) -> int:
        return len(self.live)


def batches_on(batch_clients: str, device: torch.device) -> bool:
    """Whether ``resources.batch_clients`` steps a worker's clients as one batched model on
    ``device``: ``on`` and ``lanes`` everywhere, ``auto`` on accelerators only. On the CPU the vmapped update is
    slower than one client after another (grouped NCHW convolutions and pools against per-client
    channels_last ones, docs/benchmarks.md "Batched clients"); on a GPU, where a batch-10 step is
    launch-bound, one launch for all clients is the point."""
    return batch_clients in ("on", "lanes") or (batch_clients == "auto" and device.type != "cpu")


def train_batched(runners: list[ClientRunner], state: GlobalState) -> list[tuple[dict[str, Any], ClientUpdate]]:
    """Local updates of ``runners`` (one batched group, :meth:`ClientHost.train_group`) against
    ``state`` as one vmapped model (:mod:`rayfed_proto.training.batched`): with ``batch_clients:
    lanes``, ``resources.lanes`` rows that the clients queue for (continuous batching), otherwise
    one row per client; each result is what its :meth:`ClientRunner.train` returns, within float
    tolerance. ``busy_s``: the group's time
    shared equally among its clients."""
    t0 = time.perf_counter()
    for r in runners:
        with r.own_rng():
            r.begin_update(state)
    lead = runners[0]
    members = [batched.Member(r.algorithm, r.model, r.optimizer, r.batches) for r in runners]
    res = lead.cfg.resources
    lanes = res.lanes if res.batch_clients == "lanes" else None
    terms = batched.train_together(members, lead.cfg.training.local_epochs, lead.device, lanes)
    updates = []
    for r in runners:
        with r.own_rng():
            updates.append(r.end_update())
    busy = (time.perf_counter() - t0) / len(runners)
    return [r.finished(state, t, u, busy) for r, t, u in zip(runners, terms, updates, strict=True)]


def corrupt_update(update: ClientUpdate, kind: str) -> ClientUpdate:
    """A deliberately bad upload (fault injection): what a buggy or malicious client might send.
    Every kind must be refused at the border (messages.validate_update)."""
    import dataclasses

    p = update.prototypes
    if kind == "future_version":
        return dataclasses.replace(update, base_version=update.base_version + 1_000)
    if p is None or not len(p):  # weight-only methods: corrupt the first floating weight
        weights = {k: v.copy() for k, v in (update.weights or {}).items()}
        key = next((k for k, v in weights.items() if np.issubdtype(v.dtype, np.floating)), None)
        if key is not None:
            if kind == "shape":
                weights[key] = weights[key].reshape(-1)[:-1]
            else:
                weights[key].flat[0] = np.nan if kind == "nan" else np.inf
        return dataclasses.replace(update, weights=weights)
    vectors, ids = p.vectors.copy(), p.class_ids.copy()
    if kind == "nan":
        vectors[0, 0] = np.nan
    elif kind == "inf":
        vectors[:] = np.inf
    elif kind == "shape":
        vectors = vectors[:, :-1]
    elif kind == "unknown_class":
        ids[0] = 10_000
    return dataclasses.replace(update, prototypes=type(p)(ids, vectors, p.counts))


def embedding_silhouette(features: Optional[torch.Tensor], labels: torch.Tensor, block: int = 1024) -> Optional[float]:
    """Silhouette score of the embeddings grouped by true class (FedSAP reports it per
    evaluation): how compact and separated the classes are. None when undefined (fewer than 2
    classes, or as many classes as samples).

    Rousseeuw's definition, as scikit-learn's ``silhouette_score`` computes it: for sample i of
    class l, a_i = mean Euclidean distance to the other samples of l, b_i = the smallest mean
    distance to the samples of another class, s_i = (b_i - a_i) / max(a_i, b_i) (0 for a class of
    one sample, and where a_i = b_i = 0); the score is the mean of s_i. Computed here in float64
    torch, ``block`` rows of the distance matrix at a time, so that worker processes need not
    import scikit-learn and SciPy (about 70 MiB each) for one metric; tests check it against
    scikit-learn."""
    if features is None or not bool(torch.isfinite(features).all()):
        return None  # a diverged model has no geometry to score; counted as clients_nonfinite
    classes, y = torch.unique(labels, return_inverse=True)
    n, k = len(labels), len(classes)
    if k < 2 or k >= n:
        return None
    x = features.detach().to(torch.float64).reshape(n, -1)
    onehot = torch.nn.functional.one_hot(y, k).to(torch.float64)  # n x k
    sizes = onehot.sum(0)  # samples per class
    s = torch.empty(n, dtype=torch.float64)
    for i in range(0, n, block):
        d = torch.cdist(x[i : i + block], x)  # rows i.. of the pairwise distances
        sums = d @ onehot  # distance of each row to all samples of each class (itself: 0)
        own = y[i : i + block]
        own_size = sizes[own]
        a = sums.gather(1, own[:, None]).squeeze(1) / (own_size - 1).clamp(min=1)
        mean_other = sums / sizes
        mean_other.scatter_(1, own[:, None], float("inf"))
        b = mean_other.min(1).values
        denom = torch.maximum(a, b)
        si = torch.where(denom > 0, (b - a) / torch.where(denom > 0, denom, 1.0), 0.0)
        s[i : i + block] = torch.where(own_size > 1, si, 0.0)
    return float(s.mean())
