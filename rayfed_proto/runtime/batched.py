"""Clients of one architecture stepping together as one vmapped model (``resources.batch_clients``).

Several clients hosted by one worker and dispatched against the same global state train their
local update at once: their parameters and buffers are stacked along a new first dimension
(``torch.func.stack_module_state``'s layout), one ``vmap`` of ``grad`` over the method's own
:meth:`~rayfed_proto.algorithms.base.ClientAlgorithm.loss` (through ``functional_call``) gives
every client's loss and gradients in one pass, and the optimizer steps every slice. Each client
keeps everything it has when it trains alone:

* its parameters, BatchNorm running statistics (stacked buffers, updated in place by the
  vmapped forward) and optimizer state (momentum, Adam moments and step count), per slice;
* its data order: each client's batches come from its own seeded iterator, epoch after epoch,
  exactly as its own loop draws them. A client with fewer batches drops out of the stack when
  its update ends; batches of another size (a trailing partial batch, or one with a single
  sample folded in) step as a group of their own at the same step index;
* its guarded step (:func:`~rayfed_proto.algorithms.base.guarded_step`): the gradient norm,
  the skip of a non-finite step and the ``max_grad_norm`` clipping are per client;
* its random stream: a batched update draws no random numbers (models with active dropout and
  methods that do not declare :attr:`ClientAlgorithm.batchable` run one client at a time).

The results equal the one-after-another path within float tolerance (grouped convolutions and
reductions sum in another order), not bit for bit. Plain PyTorch: no Ray here, no method named.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.func import functional_call, grad_and_value, vmap

from rayfed_proto.algorithms.base import ClientAlgorithm, TrainBatchIterator, TrainPrototypes

_SGD, _ADAM = "sgd", "adam"


@dataclass
class Member:
    """One client of a batched group: what its own local update would use."""

    algorithm: ClientAlgorithm
    model: torch.nn.Module
    optimizer: Any
    batches: TrainBatchIterator


# ----------------------------------------------------------------------------- who may batch


def _optimizer_kind(optimizer) -> Optional[str]:
    name = type(optimizer).__name__
    return {"LeanSGD": _SGD, "SGD": _SGD, "LeanAdam": _ADAM, "Adam": _ADAM}.get(name)


def method_refusal(client_cls: type) -> Optional[str]:
    """Why a method's client part never steps in a batched group (None: it may), from the class
    alone (``rayfed-proto list`` shows it)."""
    if not getattr(client_cls, "batchable", False):
        return f"{client_cls.__name__} does not declare a batchable local update"
    if client_cls.local_train is not ClientAlgorithm.local_train:
        return f"{client_cls.__name__} overrides local_train"
    return None


def batch_refusal(algorithm: ClientAlgorithm, model: torch.nn.Module, optimizer) -> Optional[str]:
    """Why this client's local update cannot step in a batched group (None: it can)."""
    refusal = method_refusal(type(algorithm))
    if refusal is not None:
        return refusal
    if _optimizer_kind(optimizer) is None:
        return f"optimizer {type(optimizer).__name__} has no batched form"
    groups = optimizer.param_groups
    if len(groups) != 1 or [id(p) for p in groups[0]["params"]] != [id(p) for p in model.parameters()]:
        return "the optimizer does not hold exactly the model's parameters in one group"
    g = groups[0]
    if g.get("maximize") or g.get("amsgrad") or g.get("decoupled_weight_decay"):
        return "optimizer options maximize, amsgrad or decoupled weight decay"
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return "the model has dropout (a batched update would draw another random stream)"
    return None


def group_key(algorithm: ClientAlgorithm, model: torch.nn.Module, optimizer, batches: TrainBatchIterator) -> tuple:
    """Clients with equal keys may step together: same method and options, same architecture
    (module tree, parameter and buffer shapes), same optimizer settings, same batch size."""
    shapes = tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in model.state_dict().items())
    hyper = tuple(sorted((k, repr(v)) for k, v in optimizer.param_groups[0].items() if k != "params"))
    return (type(algorithm), repr(algorithm.options), repr(model), shapes, _optimizer_kind(optimizer), hyper,
            getattr(optimizer, "max_grad_norm", None), batches.batch_size)


# ----------------------------------------------------------------------------- stacked state


def _per_client(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (N,) mask shaped to broadcast over (N, ...) stacked tensors."""
    return mask.view(-1, *([1] * (like.dim() - 1)))


class StackedOptimizer:
    """``training.optimizer`` (SGD with momentum, dampening, Nesterov and weight decay, or Adam) on
    stacked parameters: :mod:`rayfed_proto.optim`'s arithmetic on the rows of the clients whose
    step was applied, the others left as their own optimizers would have left them. When every
    client steps (the common case) the update runs in place on the whole stack, op for op as
    :class:`~rayfed_proto.optim.LeanSGD`/:class:`~rayfed_proto.optim.LeanAdam` run it on one
    client. Per-client bookkeeping (momentum started, Adam's step count) stays on the host, so
    Adam's bias corrections are the same Python floats as alone. State is read from and written
    back to the clients' own optimizers, in their format."""

    def __init__(self, members: list[Member], names: list[str], params: dict[str, torch.Tensor]):
        self.kind = _optimizer_kind(members[0].optimizer)
        self.group = members[0].optimizer.param_groups[0]
        self.names, self.n = names, len(members)
        per_client = [list(m.optimizer.param_groups[0]["params"]) for m in members]
        self.state: dict[str, dict[str, Any]] = {}
        for j, name in enumerate(names):
            states = [m.optimizer.state.get(ps[j], {}) for m, ps in zip(members, per_client, strict=True)]
            self.state[name] = self._gather(states, params[name])

    def _gather(self, states: list[dict[str, Any]], p: torch.Tensor) -> dict[str, Any]:
        def stack(key: str) -> torch.Tensor:
            return torch.stack([s[key].to(p.device, p.dtype) if s.get(key) is not None else torch.zeros_like(p[0])
                                for s in states])

        if self.kind == _SGD:
            return {"momentum_buffer": stack("momentum_buffer"),
                    "has": [s.get("momentum_buffer") is not None for s in states]}
        return {"exp_avg": stack("exp_avg"), "exp_avg_sq": stack("exp_avg_sq"),
                "step": [float(s["step"]) if "step" in s else 0.0 for s in states]}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], rows: list[int]) -> None:
        """Update the clients ``rows`` (``grads``: theirs, in that order)."""
        if not rows:
            return
        every = rows == list(range(self.n))
        index = torch.tensor(rows, device=next(iter(params.values())).device)
        for name in self.names:
            update = self._sgd if self.kind == _SGD else self._adam
            update(params[name], grads[name], self.state[name], rows, None if every else index)

    def _sgd(self, p_all, grad, state, rows, index):
        # torch.optim.SGD / optim.LeanSGD on the rows
        g = self.group
        p = p_all if index is None else p_all[index]
        if g["weight_decay"] != 0:
            grad = grad.add(p, alpha=g["weight_decay"])
        if g["momentum"] != 0:
            buf_all, has = state["momentum_buffer"], state["has"]
            started = [has[r] for r in rows]
            if index is None and all(started):
                buf = buf_all.mul_(g["momentum"]).add_(grad, alpha=1 - g["dampening"])
            else:
                old = buf_all if index is None else buf_all[index]
                if any(started):
                    started_t = torch.tensor(started, device=p.device).view(-1, *([1] * (p.dim() - 1)))
                    buf = torch.where(started_t, old.mul(g["momentum"]).add(grad, alpha=1 - g["dampening"]), grad)
                else:
                    buf = grad.detach().clone()
                if index is None:
                    buf_all.copy_(buf)
                else:
                    buf_all.index_copy_(0, index, buf)
            for r in rows:
                has[r] = True
            grad = grad.add(buf, alpha=g["momentum"]) if g["nesterov"] else buf
        if index is None:
            p_all.add_(grad, alpha=-g["lr"])
        else:
            p_all.index_copy_(0, index, p.add(grad, alpha=-g["lr"]))

    def _adam(self, p_all, grad, state, rows, index):
        # torch.optim.Adam / optim.LeanAdam (Kingma & Ba, Alg. 1, coupled weight decay) on the rows
        g = self.group
        beta1, beta2 = g["betas"]
        p = p_all if index is None else p_all[index]
        exp_avg = state["exp_avg"] if index is None else state["exp_avg"][index]
        exp_avg_sq = state["exp_avg_sq"] if index is None else state["exp_avg_sq"][index]
        for r in rows:
            state["step"][r] += 1
        steps = [state["step"][r] for r in rows]
        if g["weight_decay"] != 0:
            grad = grad.add(p, alpha=g["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if len(set(steps)) == 1:  # one step count: the scalars LeanAdam computes
            step_size = g["lr"] / (1 - beta1 ** steps[0])
            denom = (exp_avg_sq.sqrt() / (1 - beta2 ** steps[0]) ** 0.5).add_(g["eps"])
            new = p.addcdiv_(exp_avg, denom, value=-step_size) if index is None else p.addcdiv(exp_avg, denom,
                                                                                               value=-step_size)
        else:
            shape = (-1, *([1] * (p.dim() - 1)))
            step_size = torch.tensor([g["lr"] / (1 - beta1**s) for s in steps], dtype=p.dtype, device=p.device)
            bc2 = torch.tensor([(1 - beta2**s) ** 0.5 for s in steps], dtype=p.dtype, device=p.device)
            denom = (exp_avg_sq.sqrt() / bc2.view(shape)).add_(g["eps"])
            new = p - step_size.view(shape) * exp_avg / denom
            if index is None:
                p_all.copy_(new)
        if index is not None:
            p_all.index_copy_(0, index, new)
            state["exp_avg"].index_copy_(0, index, exp_avg)
            state["exp_avg_sq"].index_copy_(0, index, exp_avg_sq)

    def write_back(self, members: list[Member]) -> None:
        """Each client's optimizer state as its own optimizer would hold it (absent where it never stepped)."""
        for i, m in enumerate(members):
            for name, p in zip(self.names, m.optimizer.param_groups[0]["params"], strict=True):
                st = self.state[name]
                if self.kind == _SGD:
                    if st["has"][i] and self.group["momentum"] != 0:
                        m.optimizer.state[p] = {"momentum_buffer": torch.empty_like(p).copy_(st["momentum_buffer"][i])}
                elif st["step"][i] > 0:
                    m.optimizer.state[p] = {"step": torch.tensor(st["step"][i], dtype=torch.float32),
                                            "exp_avg": torch.empty_like(p).copy_(st["exp_avg"][i]),
                                            "exp_avg_sq": torch.empty_like(p).copy_(st["exp_avg_sq"][i])}


class StackedTally:
    """:class:`~rayfed_proto.algorithms.base.StepTally` per client: loss terms summed over each
    client's applied steps (on the device), skipped steps counted."""

    def __init__(self, n: int, device: torch.device):
        self.loss = torch.zeros(n, device=device)
        self.terms: dict[str, torch.Tensor] = {}
        self.steps = torch.zeros(n, dtype=torch.int64, device=device)
        self.skipped = torch.zeros(n, dtype=torch.int64, device=device)

    def add(self, idx: torch.Tensor, applied: torch.Tensor, loss: torch.Tensor, terms: dict[str, torch.Tensor]) -> None:
        ok = torch.zeros_like(self.steps, dtype=torch.bool).index_copy(0, idx, applied)
        stepped = torch.zeros_like(self.steps, dtype=torch.bool).index_fill(0, idx, True)
        self.steps += ok.long()
        self.skipped += (stepped & ~ok).long()
        self.loss = torch.where(ok, self.loss.index_add(0, idx, torch.where(applied, loss, 0.0)), self.loss)
        for k, v in terms.items():
            total = self.terms.get(k, torch.zeros_like(self.loss))
            self.terms[k] = torch.where(ok, total.index_add(0, idx, torch.where(applied, v.float(), 0.0)), total)

    def results(self) -> list[dict[str, float]]:
        steps, skipped = self.steps.tolist(), self.skipped.tolist()
        loss = self.loss.tolist()
        terms = {k: v.tolist() for k, v in self.terms.items()}
        out = []
        for i, n in enumerate(steps):
            row = {"loss": loss[i] / max(n, 1)}
            if n:  # as StepTally: a client with no applied step has no terms
                row.update({k: v[i] / n for k, v in terms.items()})
            row["nonfinite_steps"] = float(skipped[i])
            out.append(row)
        return out


class StackedPrototypes:
    """:class:`~rayfed_proto.algorithms.base.TrainPrototypes` per client: class sums of the
    training passes' features over each client's applied steps."""

    def __init__(self, members: list[Member], num_classes: int):
        self.members, self.num_classes = members, num_classes
        self.normalize = bool(getattr(members[0].model, "normalize", False))
        self.sums: Optional[torch.Tensor] = None  # (N * C, D)
        self.counts: Optional[torch.Tensor] = None  # (N * C,)

    def add(self, idx: torch.Tensor, applied: torch.Tensor, feats: torch.Tensor, y: torch.Tensor) -> None:
        if self.normalize:
            feats = torch.nn.functional.normalize(feats, dim=-1)  # what ProtoModel.features returns
        feats = feats.float()
        if self.sums is None:
            n = len(self.members) * self.num_classes
            self.sums = torch.zeros(n, feats.shape[-1], device=feats.device)
            self.counts = torch.zeros(n, device=feats.device)
        rows = (idx.to(y.device)[:, None] * self.num_classes + y).reshape(-1)
        keep = applied[:, None].expand_as(y).reshape(-1)
        self.sums.index_add_(0, rows, torch.where(keep[:, None], feats.reshape(-1, feats.shape[-1]), 0.0))
        self.counts.index_add_(0, rows, keep.float())

    def hand_over(self, steps: list[int]) -> None:
        """Each client's prototypes to its algorithm, as its own training passes would have
        (none for a client with no applied step)."""
        for i, m in enumerate(self.members):
            protos = TrainPrototypes(m.model, self.num_classes)
            if self.sums is not None and steps[i]:
                c = self.num_classes
                protos.sums, protos.counts = self.sums[i * c:(i + 1) * c], self.counts[i * c:(i + 1) * c]
            m.algorithm.take_train_prototypes(protos.result(m.batches.y))


# ----------------------------------------------------------------------------- the batched update


class _Objective(torch.nn.Module):
    """The method's loss as a module, so that ``functional_call`` can swap the model's tensors."""

    def __init__(self, model: torch.nn.Module, algorithm: ClientAlgorithm):
        super().__init__()
        self.model, self.algorithm = model, algorithm

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.algorithm.loss(self.model, x, y)


def _batches(member: Member, epochs: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """A client's mini-batches over its whole update, drawn as its own loop draws them, each with
    whether it is of the last local epoch (``prototype_source: train_last_epoch`` records only those)."""
    for epoch in range(epochs):
        for xb, yb in member.batches.epoch():
            yield xb, yb, epoch == epochs - 1


def _stack(members: list[Member], named: str) -> dict[str, torch.Tensor]:
    per_client = [dict(getattr(m.model, named)()) for m in members]
    return {"model." + k: torch.stack([d[k].detach() for d in per_client]) for k in per_client[0]}


class BatchedUpdate:
    """One local update of every member, stepping together; :meth:`run` returns each client's
    training terms, in member order, as its own ``local_train`` would."""

    def __init__(self, members: list[Member], epochs: int, device: torch.device):
        self.members, self.epochs, self.device = members, epochs, device
        lead = members[0]
        # the loss reads only the model, the batch and the received state (ClientAlgorithm.batchable):
        # the first client's instance computes it for all of them
        self.objective = _Objective(lead.model, lead.algorithm)
        self.params, self.buffers = _stack(members, "named_parameters"), _stack(members, "named_buffers")
        self.names = list(self.params)
        self.optimizer = StackedOptimizer(members, self.names, self.params)
        self.max_norm = getattr(lead.optimizer, "max_grad_norm", None)
        self.tally = StackedTally(len(members), device)
        source = lead.algorithm.prototype_source()
        collect = source in ("train", "train_last_epoch") and hasattr(lead.model, "projection")
        self.last_epoch_only = source == "train_last_epoch"
        self.protos = StackedPrototypes(members, lead.algorithm.spec.num_classes) if collect else None
        self._recorded: list[torch.Tensor] = []
        self._step = vmap(grad_and_value(self._loss, has_aux=True))

    def _loss(self, params, buffers, x, y):
        self._recorded.clear()
        loss, terms = functional_call(self.objective, (params, buffers), (x, y))
        terms = {k: torch.as_tensor(v, dtype=torch.float32, device=x.device).detach() for k, v in terms.items()}
        feats = self._recorded[0] if len(self._recorded) == 1 else x.new_zeros(0)
        return loss, (loss.detach(), terms, feats)

    def run(self) -> list[dict[str, float]]:
        for m in self.members:
            m.algorithm.begin_local_train(m.model, m.batches)
            m.model.train()
        hook = self.objective.model.projection.register_forward_hook(
            lambda _m, _i, out: self._recorded.append(out)) if self.protos is not None else None
        try:
            streams = [_batches(m, self.epochs) for m in self.members]
            active = list(range(len(self.members)))
            while active:
                drawn = [(i, next(streams[i], None)) for i in active]
                active = [i for i, b in drawn if b is not None]
                by_size: dict[tuple, list[tuple[int, tuple]]] = {}
                for i, b in drawn:
                    if b is not None:
                        by_size.setdefault(tuple(b[0].shape), []).append((i, b))
                for group in by_size.values():
                    self._step_group(group)
        finally:
            if hook is not None:
                hook.remove()
        self._write_back()
        return self.tally.results()

    def _step_group(self, group: list[tuple[int, tuple]]) -> None:
        """One step of the clients in ``group`` (their batches have one size), as each one's
        guarded step: gradients, per-client norm, skip when non-finite, clipping, update."""
        n = len(self.members)
        ids = [i for i, _ in group]
        idx = torch.tensor(ids, device=self.device)
        whole = ids == list(range(n))
        x = torch.stack([b[0] for _, b in group]).to(self.device, non_blocking=True)
        y = torch.stack([b[1] for _, b in group]).to(self.device, non_blocking=True)
        params = self.params if whole else {k: v[idx] for k, v in self.params.items()}
        buffers = self.buffers if whole else {k: v[idx] for k, v in self.buffers.items()}
        grads, (_, (loss, terms, feats)) = self._step(params, buffers, x, y)
        if not whole:  # BatchNorm's running statistics were updated in the gathered copies
            for k, v in buffers.items():
                self.buffers[k].index_copy_(0, idx, v)
        # algorithms.base.guarded_step, per client: one gradient norm, finiteness, clipping
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
        applied = torch.isfinite(norms + loss)
        if self.max_norm is not None:
            coef = (self.max_norm / (norms + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grads_with_norm_
            for g in grads.values():
                g.mul_(_per_client(coef, g))
        ok = applied.tolist()  # the step's one host read, as guarded_step's (one per group, not per client)
        if not all(ok):
            keep = torch.tensor([j for j, a in enumerate(ok) if a], dtype=torch.long, device=self.device)
            grads = {k: g[keep] for k, g in grads.items()}
        self.optimizer.step(self.params, grads, [i for i, a in zip(ids, ok, strict=True) if a])
        self.tally.add(idx, applied, loss, terms)
        if self.protos is not None:
            if feats.numel() == 0:
                raise RuntimeError("prototype_source 'train' needs exactly one forward pass of the batch through "
                                   "model.features per step; this method's loss does otherwise: use prototype_source 'eval'")
            record = applied
            if self.last_epoch_only:  # ClientAlgorithm.local_train: only the last epoch's passes
                record = applied & torch.tensor([b[2] for _, b in group], device=applied.device)
            self.protos.add(idx, record, feats, y)

    @torch.no_grad()
    def _write_back(self) -> None:
        """The stacked state back into each client's model, optimizer and algorithm."""
        for i, m in enumerate(self.members):
            for k, p in m.model.named_parameters():
                p.copy_(self.params["model." + k][i])
            for k, b in m.model.named_buffers():
                b.copy_(self.buffers["model." + k][i])
        self.optimizer.write_back(self.members)
        if self.protos is not None:
            self.protos.hand_over(self.tally.steps.tolist())


def train_together(members: list[Member], epochs: int, device: torch.device) -> list[dict[str, float]]:
    """Local updates of ``members`` (one architecture, one received state, see :func:`group_key`)
    as one batched model; each client's terms, as its own ``local_train`` returns them."""
    return BatchedUpdate(members, epochs, device).run()
