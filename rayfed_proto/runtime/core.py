"""What actors do, without Ray: a client runner and the server's buffer/version logic.

The Ray actors in :mod:`rayfed_proto.runtime.actors` are thin shells around these classes, so
the whole update path (train -> message -> validate -> buffer -> aggregate -> broadcast) can be
tested in-process. Nothing here names an algorithm: the registry resolves ``algorithm.name``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rayfed_proto import optim
from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.algorithms.common import nearest_prototype_predict, prototype_margin, staleness_weight
from rayfed_proto.config import ExperimentConfig, group_is_homogeneous
from rayfed_proto.data import ArrayDataset, ClientSplit
from rayfed_proto.data.augment import batch_augment
from rayfed_proto.messages import ClientUpdate, GlobalState, UpdateSchema, validate_update
from rayfed_proto.models import MODEL_GROUPS, build_client_model, build_model
from rayfed_proto.runtime import batched
from rayfed_proto.runtime.determinism import apply_determinism
from rayfed_proto.runtime.parking import ParkedStates, resolve
from rayfed_proto.runtime.policies import ServerNeeds

log = logging.getLogger("rayfed_proto")


@dataclass
class EvalSet:
    """A labelled evaluation set held by the server (the global test set), with the domain of
    each sample when the dataset has domains."""

    x: torch.Tensor
    y: torch.Tensor
    domains: Optional[np.ndarray] = None
    domain_names: list[str] = field(default_factory=list)

    @classmethod
    def from_dataset(cls, dataset: ArrayDataset, indices: np.ndarray) -> Optional[EvalSet]:
        if len(indices) == 0:
            return None
        x, y = dataset.tensors(indices)
        domains = getattr(dataset, "domains", None)
        return cls(x, y, None if domains is None else np.asarray(domains)[np.asarray(indices, dtype=np.int64)],
                   list(getattr(dataset, "domain_names", []) or []))


def eval_batch_size(device: torch.device) -> int:
    """Batch size of evaluation passes: 256 on CPU, where a larger batch's activations leave the
    core's caches (the FedAvg CNN's first feature map is 74 KiB a sample: 512 of them are 37 MiB):
    a forward pass of 1,930 MNIST-sized images at 256 took 0.977 of the time at 512 in
    channels_last and 0.878 in contiguous layout, 1,024 took 1.33 and 1.18 (one thread,
    ``bench/eval_batch.py``, 2026-11-25, since removed: ``git show 71023e8:bench/eval_batch.py``); 512 on
    accelerators."""
    return 256 if device.type == "cpu" else 512


@torch.no_grad()
def evaluate_global_model(model: torch.nn.Module, data: EvalSet, device: torch.device,
                          batch_size: Optional[int] = None) -> dict[str, float]:
    """Accuracy of a server-held model on the global test set: ``global_acc`` over all samples and,
    with domains, ``global_acc_<domain>`` each plus ``global_acc_domain_mean``, their unweighted
    mean (the average FedLSA reports)."""
    was_training = model.training
    model.eval()
    correct = torch.zeros(len(data.y), dtype=torch.bool)
    batch_size = batch_size or eval_batch_size(device)
    for i in range(0, len(data.y), batch_size):
        logits = model(data.x[i : i + batch_size].to(device))
        correct[i : i + batch_size] = (logits.argmax(1).cpu() == data.y[i : i + batch_size])
    model.train(was_training)
    out = {"global_acc": int(correct.sum()) / len(correct)}
    if data.domains is not None:
        per_domain = []
        for d in np.unique(data.domains):
            mask = torch.from_numpy(data.domains == d)
            name = data.domain_names[d] if d < len(data.domain_names) else str(d)
            out[f"global_acc_{name}"] = int(correct[mask].sum()) / int(mask.sum())
            per_domain.append(out[f"global_acc_{name}"])
        out["global_acc_domain_mean"] = float(np.mean(per_domain))
    return out


def memory_format(cfg: ExperimentConfig, device: torch.device) -> torch.memory_format:
    """``training.memory_format`` for a client's (or the server's) model on ``device``:
    channels_last (NHWC) on CPU by default, where oneDNN's convolutions make an SGD step of the
    FedAvg CNN at batch 10 about 16 % cheaper at one torch thread (bench/memory_format.py,
    since removed: ``git show 71023e8:bench/memory_format.py``);
    contiguous (NCHW) on GPU, where channels_last pays only with mixed precision. Only 4-d weights (convolutions) change layout; the values,
    the messages (weights travel as C-ordered arrays) and the checkpoints' contents do not."""
    choice = cfg.training.memory_format
    if choice == "auto":
        choice = "channels_last" if device.type == "cpu" else "contiguous"
    return torch.channels_last if choice == "channels_last" else torch.contiguous_format


def federation_spec(cfg: ExperimentConfig, num_classes: int, in_channels: int, image_size: int,
                    public_x: Optional[torch.Tensor] = None, device: Optional[torch.device] = None) -> FederationSpec:
    """The spec both parts share; ``build_model`` only for single-architecture groups. With the
    ``device`` the models will live on, they are built in ``training.memory_format``'s layout
    (the server's global model is evaluated on the global test set every evaluated version)."""
    archs = MODEL_GROUPS.get(cfg.model.group)
    homogeneous = group_is_homogeneous(cfg.model.group, cfg.federation.num_clients)
    m = cfg.model
    layout = memory_format(cfg, device) if device is not None else torch.contiguous_format

    def build_arch(arch: str, feature_dim: int = m.feature_dim) -> torch.nn.Module:
        # model.weights is for the clients' architectures: a server-only model (FedProtoKD's) starts
        # from its own initialisation
        return build_model(arch, in_channels, image_size, num_classes, feature_dim, m.projector,
                           m.normalize_features, stem=m.stem, weights=m.weights if arch in archs else "none",
                           ).to(memory_format=layout)

    return FederationSpec(
        num_clients=cfg.federation.num_clients, num_classes=num_classes, feature_dim=m.feature_dim,
        seed=cfg.seed, staleness_exponent=cfg.federation.staleness_exponent,
        build_model=(lambda: build_arch(archs[0])) if homogeneous else None,
        in_channels=in_channels, image_size=image_size, build_arch=build_arch, public_x=public_x,
    )


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
    ``state`` as one vmapped model (:mod:`rayfed_proto.runtime.batched`): with ``batch_clients:
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


def _state_is_finite(state: GlobalState) -> bool:
    arrays = list((state.weights or {}).values()) + list(state.extras.values())
    if state.prototypes is not None:
        arrays.append(state.prototypes.vectors)
    return all(np.isfinite(a).all() for a in arrays if np.issubdtype(np.asarray(a).dtype, np.floating))


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

    The federation policy's :class:`~rayfed_proto.runtime.policies.ServerNeeds` set how:
    ``buffer_size=None`` means the caller decides when to aggregate (sync rounds call
    :meth:`step` once the round is complete); otherwise a version is produced each time the
    buffer holds ``buffer_size`` accepted updates (async, FedBuff-style). Updates trained more
    than ``max_staleness`` versions ago are dropped.

    With ``background=True`` :meth:`submit` only validates and buffers, under a lock, and a
    training thread calls :meth:`wait_and_step`, which aggregates K buffered updates whenever
    there are K. Intake therefore never waits behind server training (a generator, anchors):
    an update's staleness counts the versions produced while its client trained, not the time
    it would otherwise spend queued behind the server. Without it (tests, in-process use),
    :meth:`submit` aggregates inline, unless ``steps_on_request`` (the virtual clock: the driver
    calls :meth:`step` when the server's simulated step ends).
    """

    def __init__(self, cfg: ExperimentConfig, num_classes: int, in_channels: int, image_size: int,
                 device: torch.device, needs: ServerNeeds, global_test: Optional[EvalSet] = None,
                 public_x: Optional[torch.Tensor] = None):
        apply_determinism(cfg.resources.deterministic)  # in-process runs; the server actor applied it already
        self.cfg = cfg
        self.device = device
        self.global_test = global_test
        self.buffer_size, self.background, self.max_staleness = needs.buffer_size, needs.background, needs.max_staleness
        self.steps_on_request, self.client_order = needs.steps_on_request, needs.client_order
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

    @property
    def inline(self) -> bool:
        """Aggregate in :meth:`submit` once K updates are in: neither a server thread
        (``background``) nor the driver (``steps_on_request``, the virtual clock) steps."""
        return not self.background and not self.steps_on_request

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
        return self.buffer_size is not None and len(self.buffer) >= self.buffer_size and self.version < self.max_version

    def submit(self, update: Any) -> dict[str, Any]:
        """Validate and buffer one update (aggregating inline unless ``background``). Returns a receipt."""
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
            if ready and self.background:
                self.cond.notify_all()
        if ready and self.inline:
            receipt.update(self.step())
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
            # with a buffer size exactly K updates per version (FedBuff), the rest wait for the next
            # one, so a version's cost is bounded; without one (the caller asks): all it holds
            k = len(self.buffer) if self.buffer_size is None else self.buffer_size
            taken, self.buffer = self.buffer[:k], self.buffer[k:]
            if self.client_order:
                # a round is aggregated in client order, not arrival order, so that a run is
                # reproducible (float sums and server-training batches depend on the order)
                taken.sort(key=lambda uw: uw[0].client_id)
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
