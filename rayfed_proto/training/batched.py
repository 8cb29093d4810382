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
  exactly as its own loop draws them. The stack has a row (a lane) per client, or with
  ``resources.batch_clients: lanes`` fewer lanes that the clients queue for: a client whose
  update ends leaves its lane (its state written back) and the next one is loaded into it
  (:class:`BatchedUpdate`). Batches of another size (a folded trailing batch, or a client with
  fewer samples than a batch) step as a group of their own at the same step index;
* its guarded step (:func:`~rayfed_proto.algorithms.base.guarded_step`): the gradient norm (of
  the client's whole flat gradient, guarded_step's norm of per-tensor norms within rounding),
  the skip of a non-finite step and the ``max_grad_norm`` clipping are per client, and none of
  them reads anything on the host (the skip is a ``torch.where``);
* its random stream: a batched update draws no random numbers (models with active dropout and
  methods that do not declare :attr:`ClientAlgorithm.batchable` run one client at a time).

The results equal the one-after-another path within float tolerance (grouped convolutions and
reductions sum in another order), not bit for bit. Plain PyTorch: no Ray here, no method named.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.func import functional_call, grad_and_value, vmap

from rayfed_proto.algorithms.base import ClientAlgorithm, TrainBatchIterator, TrainPrototypes
from rayfed_proto.optim import adam_direction, sgd_direction

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
        reason = getattr(client_cls, "unbatchable_reason", "")
        return f"{client_cls.__name__}: {reason}" if reason else f"{client_cls.__name__} does not declare a batchable local update"
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


class FlatStack:
    """The parameters of every client (one layout: same names, shapes and dtypes) as one (N, total)
    tensor per dtype, each client's tensors flattened and concatenated in name order (the optimizer
    state likewise). A group step gathers the stepping clients' rows, takes the gradient norm,
    clips, updates and scatters back with one op per dtype, where a stack per tensor needs one per
    tensor, and the gradient comes out of ``vmap`` in this layout (the backward of
    :meth:`unflatten`'s split is one concatenation). The price: each client's tensor is a strided
    view of its row, which some batching rules (convolution, BatchNorm, linear) copy once per step
    before reshaping it (about 10 % more ops in a ResNet-18's vmapped forward and backward)."""

    def __init__(self, per_client: list[dict[str, torch.Tensor]]):
        first = per_client[0]
        self.dtypes = sorted({t.dtype for t in first.values()}, key=str)
        self.layout: list[list[tuple[str, tuple[int, ...]]]] = [
            [(k, tuple(t.shape)) for k, t in first.items() if t.dtype == dt] for dt in self.dtypes]
        self.sizes = [[math.prod(shape) for _, shape in part] for part in self.layout]
        self.flat: tuple[torch.Tensor, ...] = tuple(
            torch.stack([torch.cat([d[k].detach().reshape(-1) for k, _ in part]) for d in per_client])
            for part in self.layout)

    def unflatten(self, rows: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """Named views of one client's flat rows (inside ``vmap``: of every client's)."""
        out = {}
        for part, sizes, row in zip(self.layout, self.sizes, rows, strict=True):
            for (k, shape), chunk in zip(part, row.split(sizes, dim=-1), strict=True):
                out[k] = chunk.view(tuple(row.shape[:-1]) + shape)
        return out

    def client(self, i: int) -> dict[str, torch.Tensor]:
        """Client ``i``'s named tensors (views of the stack)."""
        return self.unflatten(tuple(f[i] for f in self.flat))

    @torch.no_grad()
    def load(self, i: int, named: dict[str, torch.Tensor]) -> None:
        """Row ``i`` set to one client's tensors (a client entering lane ``i``)."""
        for part, f in zip(self.layout, self.flat, strict=True):
            f[i].copy_(torch.cat([named[k].detach().reshape(-1) for k, _ in part]))


class BufferStack:
    """Named buffers of every client as one 1-d tensor per dtype, laid out tensor by tensor, each
    tensor's (N, ...) stack contiguous in it: ``vmap`` gets one contiguous view per buffer, which
    BatchNorm's batching rule updates in place (it reshapes the running statistics, so a strided view
    would be updated in a copy), and the rows of a subset of clients are gathered and scattered back
    with one op per dtype, through element indices built once per subset."""

    def __init__(self, per_client: list[dict[str, torch.Tensor]]):
        first, self.n = (per_client[0] if per_client else {}), len(per_client)
        self.dtypes = sorted({t.dtype for t in first.values()}, key=str)
        self.layout = [[(k, tuple(t.shape), t.numel()) for k, t in first.items() if t.dtype == dt] for dt in self.dtypes]
        self.flat: tuple[torch.Tensor, ...] = tuple(
            torch.cat([torch.stack([d[k].detach().reshape(-1) for d in per_client]).reshape(-1) for k, _, _ in part])
            for part in self.layout)
        self._elements: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        self._patterns: dict[tuple[int, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def views(self, flat: tuple[torch.Tensor, ...], m: int) -> dict[str, torch.Tensor]:
        """Each buffer's (m, ...) stack in ``flat`` (the whole stack's, or :meth:`gather`'s for m clients)."""
        out = {}
        for part, f in zip(self.layout, flat, strict=True):
            start = 0
            for k, shape, size in part:
                out[k] = f[start:start + m * size].view((m, *shape))
                start += m * size
        return out

    def client(self, i: int) -> dict[str, torch.Tensor]:
        """Client ``i``'s named buffers (views of the stack)."""
        return {k: v[i] for k, v in self.views(self.flat, self.n).items()}

    @torch.no_grad()
    def load(self, i: int, named: dict[str, torch.Tensor]) -> None:
        """Client ``i``'s buffers set to ``named`` (a client entering lane ``i``)."""
        for k, v in self.views(self.flat, self.n).items():
            v[i].copy_(named[k])

    def _element_index(self, ids: tuple[int, ...], idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Where each element of the gathered layout for clients ``idx`` sits in the stack: a few ops
        per set of clients, over all buffers at once (the pattern per number of clients is kept)."""
        if ids not in self._elements:
            m, out = len(ids), []
            for dt, part, f in zip(self.dtypes, self.layout, self.flat, strict=True):
                if (m, dt) not in self._patterns:
                    sizes = torch.tensor([size for _, _, size in part]).to(f.device, non_blocking=True)
                    starts = torch.cumsum(sizes, 0) - sizes  # each buffer's offset in one client's row
                    block = sizes * m
                    k = torch.repeat_interleave(torch.arange(len(part), device=f.device), block,
                                                output_size=len(f) // self.n * m)
                    within = torch.arange(len(k), device=f.device) - (torch.cumsum(block, 0) - block)[k]
                    size = sizes[k]
                    row = torch.div(within, size, rounding_mode="floor")
                    self._patterns[m, dt] = (starts[k] * self.n + within - row * size, row, size)
                base, row, size = self._patterns[m, dt]
                out.append(base + idx[row] * size)
            self._elements[ids] = tuple(out)
        return self._elements[ids]

    def gather(self, ids: tuple[int, ...], idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(f[e] for f, e in zip(self.flat, self._element_index(ids, idx), strict=True))

    def scatter(self, ids: tuple[int, ...], idx: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
        for f, e, r in zip(self.flat, self._element_index(ids, idx), rows, strict=True):
            f.index_copy_(0, e, r)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A (n,) per-client tensor shaped to broadcast over (n, total) flat rows."""
    return x.view(-1, 1)


class StackedOptimizer:
    """``training.optimizer`` (SGD with momentum, dampening, Nesterov and weight decay, or Adam) on
    flat stacked parameters (:class:`FlatStack`): :mod:`rayfed_proto.optim`'s update rules
    (:func:`~rayfed_proto.optim.sgd_direction`, :func:`~rayfed_proto.optim.adam_direction`, the ones
    LeanSGD and LeanAdam apply) on the rows of a group step, out of place, with a client whose step was not applied (non-finite) left as its own optimizer
    would have left it by ``torch.where`` on the device, so a step reads nothing on the host. The
    per-client bookkeeping (momentum started, Adam's step count) is a device tensor too, and Adam's
    bias corrections are computed per row in float64 from it. State is read from and written back
    to the clients' own optimizers, in their format (one host read, at the end)."""

    def __init__(self, members: list[Member], names: list[str], params: FlatStack):
        self.kind = _optimizer_kind(members[0].optimizer)
        self.group = members[0].optimizer.param_groups[0]
        self.names, self.n, self.stack = names, len(members), params
        device = params.flat[0].device
        self._zero = torch.zeros((), dtype=torch.float32, device=device)  # torch.where's other value (a Python 0.0 costs an op a call)
        # float64 for the step counts and bias corrections, as the Python floats of LeanAdam (not on MPS)
        self.count_dtype = torch.float32 if device.type == "mps" else torch.float64
        states = [self._states(m) for m in members]
        if self.kind == _SGD:
            self.buf = self._gather(states, "momentum_buffer")
            # a client's momentum has started when its optimizer holds buffers (torch's SGD creates them
            # for every parameter with a gradient, and every parameter gets one in a batched step)
            self.has = torch.tensor([any(s.get("momentum_buffer") is not None for s in st.values()) for st in states],
                                    device=device)
        else:
            self.exp_avg, self.exp_avg_sq = self._gather(states, "exp_avg"), self._gather(states, "exp_avg_sq")
            self.steps = torch.tensor([next((float(s["step"]) for s in st.values() if "step" in s), 0.0) for st in states],
                                      dtype=self.count_dtype, device=device)

    def _states(self, member: Member) -> dict[str, dict]:
        """The client's optimizer state per parameter name (empty where it has none)."""
        params = dict(zip(self.names, member.optimizer.param_groups[0]["params"], strict=True))
        return {k: member.optimizer.state.get(p, {}) for k, p in params.items()}

    def _row(self, state: dict[str, dict], key: str) -> list[torch.Tensor]:
        """One client's ``key`` state as flat rows, one per dtype (zeros where it has none)."""
        rows = []
        for part, sizes, f in zip(self.stack.layout, self.stack.sizes, self.stack.flat, strict=True):
            chunks = [state[k][key].detach().to(f.device, f.dtype).reshape(-1) if state[k].get(key) is not None
                      else f.new_zeros(size) for (k, _), size in zip(part, sizes, strict=True)]
            rows.append(torch.cat(chunks) if chunks else f.new_zeros(0))
        return rows

    def _gather(self, states: list[dict[str, dict]], key: str) -> tuple[torch.Tensor, ...]:
        return tuple(torch.stack(rows) for rows in zip(*(self._row(st, key) for st in states), strict=True))

    @torch.no_grad()
    def load(self, i: int, member: Member) -> None:
        """Row ``i`` set to ``member``'s optimizer state (a client entering lane ``i``)."""
        state = self._states(member)
        if self.kind == _SGD:
            for f, row in zip(self.buf, self._row(state, "momentum_buffer"), strict=True):
                f[i].copy_(row)
            self.has[i] = any(s.get("momentum_buffer") is not None for s in state.values())
        else:
            for flat, key in ((self.exp_avg, "exp_avg"), (self.exp_avg_sq, "exp_avg_sq")):
                for f, row in zip(flat, self._row(state, key), strict=True):
                    f[i].copy_(row)
            self.steps[i] = next((float(s["step"]) for s in state.values() if "step" in s), 0.0)

    def snapshot(self, i: int) -> tuple:
        """Row ``i``'s state as device copies (its client's update has ended; no host read)."""
        if self.kind == _SGD:
            return self.has[i].clone(), (tuple(f[i].clone() for f in self.buf),)
        return self.steps[i].clone(), (tuple(f[i].clone() for f in self.exp_avg), tuple(f[i].clone() for f in self.exp_avg_sq))

    @torch.no_grad()
    def step(self, params: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], idx: torch.Tensor,
             whole: bool, applied: torch.Tensor) -> None:
        """Update rows ``idx`` of the stack (``params``: their values, the stack itself when
        ``whole``; ``grads``: theirs), each only where ``applied``."""
        ok = _rows(applied)
        if self.kind == _SGD:
            momentum = self.group["momentum"] != 0
            started = (self.has if whole else self.has[idx]) if momentum else None
            for j, (p, g) in enumerate(zip(params, grads, strict=True)):
                self._sgd(j, p, g, idx, whole, ok, _rows(started) if momentum else None)
            if momentum:
                if whole:
                    self.has.logical_or_(applied)
                else:
                    self.has.index_copy_(0, idx, started | applied)
        else:
            old = self.steps if whole else self.steps[idx]
            step = old + 1
            for j, (p, g) in enumerate(zip(params, grads, strict=True)):
                self._adam(j, p, g, idx, whole, ok, step)
            new = torch.where(applied, step, old)
            if whole:
                self.steps.copy_(new)
            else:
                self.steps.index_copy_(0, idx, new)

    def _store(self, into: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, whole: bool) -> None:
        if whole:
            into.copy_(rows)
        else:
            into.index_copy_(0, idx, rows)

    def _apply(self, j: int, p: torch.Tensor, direction: torch.Tensor, alpha: float | torch.Tensor, idx: torch.Tensor,
               whole: bool, ok: torch.Tensor) -> None:
        """p += alpha * direction on the applied rows (an unapplied row adds 0: unchanged); a float
        ``alpha`` is the add the client's own optimizer makes (``add_(grad, alpha=-lr)``), op for op."""
        direction = torch.where(ok, direction, self._zero)
        if isinstance(alpha, torch.Tensor):
            new = p.addcmul_(direction, alpha) if whole else p.addcmul(direction, alpha)
        else:
            new = p.add_(direction, alpha=alpha) if whole else p.add(direction, alpha=alpha)
        if not whole:
            self.stack.flat[j].index_copy_(0, idx, new)

    def _sgd(self, j, p, grad, idx, whole, ok, started):
        # torch.optim.SGD's update rule (optim.sgd_direction, shared with optim.LeanSGD) on the rows
        old = (self.buf[j] if whole else self.buf[j][idx]) if started is not None else None
        direction, buf = sgd_direction(p, grad, old, self.group, started=started, inplace=False)
        if buf is not None:
            self._store(self.buf[j], torch.where(ok, buf, old), idx, whole)
        self._apply(j, p, direction, -self.group["lr"], idx, whole, ok)

    def _adam(self, j, p, grad, idx, whole, ok, step):
        # torch.optim.Adam's update rule (Kingma & Ba, Alg. 1, coupled weight decay; optim.adam_direction,
        # shared with optim.LeanAdam) on the rows, each with its own step count
        g = self.group
        beta1, beta2 = g["betas"]
        neg_step_size = _rows((-g["lr"] / (1 - torch.pow(beta1, step))).to(p.dtype))
        bias_correction2_sqrt = _rows((1 - torch.pow(beta2, step)).sqrt().to(p.dtype))
        m_old = self.exp_avg[j] if whole else self.exp_avg[j][idx]
        v_old = self.exp_avg_sq[j] if whole else self.exp_avg_sq[j][idx]
        m, v, denom = adam_direction(p, grad, m_old, v_old, g, bias_correction2_sqrt, inplace=False)
        self._store(self.exp_avg[j], torch.where(ok, m, m_old), idx, whole)
        self._store(self.exp_avg_sq[j], torch.where(ok, v, v_old), idx, whole)
        self._apply(j, p, m.div(denom), neg_step_size, idx, whole, ok)

    def write_back(self, members: list[Member], snapshots: list[tuple]) -> None:
        """Each client's optimizer state (its :meth:`snapshot`) as its own optimizer would hold it
        (absent where it never stepped); one host read for all of them."""
        if self.kind == _SGD and self.group["momentum"] == 0:
            return
        has = torch.stack([s[0] for s in snapshots]).tolist()
        for i, (m, (_, rows)) in enumerate(zip(members, snapshots, strict=True)):
            if not has[i]:
                continue
            if self.kind == _SGD:
                views = {k: {"momentum_buffer": v} for k, v in self.stack.unflatten(rows[0]).items()}
            else:
                avg, avg_sq = self.stack.unflatten(rows[0]), self.stack.unflatten(rows[1])
                views = {k: {"step": torch.tensor(has[i], dtype=torch.float32), "exp_avg": avg[k],
                             "exp_avg_sq": avg_sq[k]} for k in avg}
            for name, p in zip(self.names, m.optimizer.param_groups[0]["params"], strict=True):
                m.optimizer.state[p] = {k: v if k == "step" else torch.empty_like(p).copy_(v)
                                        for k, v in views[name].items()}


class StackedTally:
    """:class:`~rayfed_proto.algorithms.base.StepTally` per client: loss terms summed over each
    client's applied steps and the applied and skipped steps counted, in one (N, terms + 2) matrix
    on the device (a few ops a step, read once at the end)."""

    def __init__(self, n: int, device: torch.device):
        self.n, self.device = n, device
        self.keys: Optional[list[str]] = None
        self.sums: Optional[torch.Tensor] = None  # columns: loss, terms..., applied steps, skipped steps
        self._zero = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, idx: torch.Tensor, applied: torch.Tensor, loss: torch.Tensor, terms: dict[str, torch.Tensor]) -> None:
        if self.keys is None:
            self.keys = list(terms)
            self.sums = torch.zeros(self.n, len(self.keys) + 3, dtype=torch.float32, device=self.device)
        vals = torch.where(_rows(applied), torch.stack([loss.float(), *(terms[k].float() for k in self.keys)], 1), self._zero)
        counts = torch.stack([applied, ~applied], 1).to(vals.dtype)
        self.sums.index_add_(0, idx, torch.cat([vals, counts], 1))

    def snapshot(self, i: int) -> Optional[torch.Tensor]:
        """Row ``i`` (a device copy; None before any step), and the row cleared for the lane's next client."""
        if self.sums is None:
            return None
        row = self.sums[i].clone()
        self.sums[i].zero_()
        return row

    def results(self, rows: list[Optional[torch.Tensor]]) -> tuple[list[dict[str, float]], list[int]]:
        """Each client's terms from its :meth:`snapshot` (one host read), and its applied steps."""
        read = torch.stack([r for r in rows if r is not None]).tolist() if any(r is not None for r in rows) else []
        out, steps = [], []
        for r in rows:
            row = read.pop(0) if r is not None else [0.0, *([0.0] * len(self.keys or [])), 0.0, 0.0]
            n = int(row[-2])
            values = {"loss": row[0] / max(n, 1)}
            if n:  # as StepTally: a client with no applied step has no terms
                values.update({k: v / n for k, v in zip(self.keys, row[1:-2], strict=True)})
            values["nonfinite_steps"] = float(row[-1])
            out.append(values)
            steps.append(n)
        return out, steps


class StackedPrototypes:
    """:class:`~rayfed_proto.algorithms.base.TrainPrototypes` per client: class sums of the
    training passes' features over each client's applied steps."""

    def __init__(self, lanes: int, num_classes: int, normalize: bool):
        self.lanes, self.num_classes, self.normalize = lanes, num_classes, normalize
        self.sums: Optional[torch.Tensor] = None  # (N * C, D)
        self.counts: Optional[torch.Tensor] = None  # (N * C,)
        self._zero = torch.zeros(())

    def add(self, first_rows: torch.Tensor, applied: torch.Tensor, feats: torch.Tensor, y: torch.Tensor) -> None:
        """``first_rows``: (n,) each stepping client's first row (client index times C)."""
        if self.normalize:
            feats = torch.nn.functional.normalize(feats, dim=-1)  # what ProtoModel.features returns
        feats = feats.float()
        if self.sums is None:
            n = self.lanes * self.num_classes
            self.sums = torch.zeros(n, feats.shape[-1], device=feats.device)
            self.counts = torch.zeros(n, device=feats.device)
            self._zero = self._zero.to(feats.device)
        rows = (first_rows[:, None] + y).reshape(-1)
        keep = applied[:, None].expand_as(y).reshape(-1)
        self.sums.index_add_(0, rows, torch.where(keep[:, None], feats.reshape(-1, feats.shape[-1]), self._zero))
        self.counts.index_add_(0, rows, keep.float())

    def snapshot(self, i: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Lane ``i``'s class sums and counts (device copies; None before any), cleared for its next client."""
        if self.sums is None:
            return None
        rows = slice(i * self.num_classes, (i + 1) * self.num_classes)
        out = self.sums[rows].clone(), self.counts[rows].clone()
        self.sums[rows].zero_()
        self.counts[rows].zero_()
        return out

    def hand_over(self, member: Member, snapshot: Optional[tuple], steps: int) -> None:
        """A client's prototypes to its algorithm, as its own training passes would have (none for
        a client with no applied step)."""
        protos = TrainPrototypes(member.model, self.num_classes)
        if snapshot is not None and steps:
            protos.sums, protos.counts = snapshot
        member.algorithm.take_train_prototypes(protos.result(member.batches.y))


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


def _named(members: list[Member], named: str) -> list[dict[str, torch.Tensor]]:
    return [{"model." + k: v for k, v in getattr(m.model, named)()} for m in members]


class BatchedUpdate:
    """One local update of every member, in ``lanes`` rows of one stacked model; :meth:`run`
    returns each client's training terms, in member order, as its own ``local_train`` would.

    Continuous batching (``resources.batch_clients: lanes``): the members queue for the lanes, and
    every step advances every busy lane by one batch. When a lane's client has run its local
    epochs, its state (parameters, BatchNorm buffers, optimizer state, loss tally, prototype sums)
    leaves the lane and the next waiting member is loaded into it, so the lanes stay full until
    the work runs out. With as many lanes as members (``on``) nobody waits: the group steps
    together and empties as its clients finish. Batches of another shape than the others' (a
    folded trailing batch, ``training.trailing_batch: fold``) step as a sub-group at the same step.

    A group step issues the ops of one client's step (on stacked tensors) plus a fixed few: the
    parameters, buffers and optimizer state are flat stacks (:class:`FlatStack`, one tensor per
    dtype), so gathering the stepping lanes' rows, the gradient norm, clipping, the update and
    the scatter back are one op each, whatever the number of parameter tensors; the lanes' row
    indices are built once per set of lanes (not per step), and the non-finite skip is a
    ``torch.where``: no host read in a step (nor when a client leaves its lane: its state is
    copied on the device and read once at the end)."""

    def __init__(self, members: list[Member], epochs: int, device: torch.device, lanes: Optional[int] = None):
        self.members, self.epochs, self.device = members, epochs, device
        self.n = min(lanes or len(members), len(members))  # lanes; the stacks are built from the first occupants
        first, lead = members[:self.n], members[0]
        # the loss reads only the model, the batch and the received state (ClientAlgorithm.batchable):
        # the first client's instance computes it for all of them
        self.objective = _Objective(lead.model, lead.algorithm)
        self.params = FlatStack(_named(first, "named_parameters"))
        self.buffers = BufferStack(_named(first, "named_buffers"))
        self.names = ["model." + k for k, _ in lead.model.named_parameters()]
        self.optimizer = StackedOptimizer(first, self.names, self.params)
        self.max_norm = getattr(lead.optimizer, "max_grad_norm", None)
        self.tally = StackedTally(self.n, device)
        source = lead.algorithm.prototype_source()
        collect = source in ("train", "train_last_epoch") and hasattr(lead.model, "projection")
        self.last_epoch_only = source == "train_last_epoch"
        self.num_classes = lead.algorithm.spec.num_classes
        normalize = bool(getattr(lead.model, "normalize", False))
        self.protos = StackedPrototypes(self.n, self.num_classes, normalize) if collect else None
        self.occupant: list[Optional[int]] = [None] * self.n  # the member in each lane
        self.streams: list[Iterator] = [iter(())] * self.n  # each lane's client's batches
        self.waiting = deque(range(len(members)))
        self.finished: dict[int, tuple] = {}  # member -> its state's snapshots (optimizer, tally, prototypes)
        self._recorded: list[torch.Tensor] = []
        self._indices: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._step = vmap(grad_and_value(self._loss, has_aux=True))

    def _loss(self, params, buffers, x, y):
        self._recorded.clear()
        named = {**self.params.unflatten(params), **buffers}
        loss, terms = functional_call(self.objective, named, (x, y))
        terms = {k: torch.as_tensor(v, dtype=torch.float32, device=x.device).detach() for k, v in terms.items()}
        feats = self._recorded[0] if len(self._recorded) == 1 else x.new_zeros(0)
        return loss, (loss.detach(), terms, feats)

    def _index(self, ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The device row indices of ``ids`` (and their first prototype rows), built once per set."""
        if ids not in self._indices:
            # non_blocking: torch.tensor(ids, device=cuda) would wait for the stream (a blocking copy)
            idx = torch.tensor(ids).to(self.device, non_blocking=True)
            self._indices[ids] = (idx, idx * self.num_classes)
        return self._indices[ids]

    def run(self) -> list[dict[str, float]]:
        """Load the lanes, then step every busy lane, retire finished ones and refill them, until
        no client is left."""
        hook = self.objective.model.projection.register_forward_hook(
            lambda _m, _i, out: self._recorded.append(out)) if self.protos is not None else None
        try:
            for lane in range(self.n):
                self._refill(lane, load=False)  # the stacks were built from these first occupants
            while drawn := self._draw():
                by_shape: dict[tuple, list[tuple[int, tuple]]] = {}
                for lane, b in drawn:
                    by_shape.setdefault(tuple(b[0].shape), []).append((lane, b))
                for group in by_shape.values():
                    self._step_group(group)
        finally:
            if hook is not None:
                hook.remove()
        return self._hand_over()

    def _draw(self) -> list[tuple[int, tuple]]:
        """Each busy lane's next batch; a lane whose client has no batch left is retired and
        refilled (until one with a batch, or nobody, is in it)."""
        drawn = []
        for lane in range(self.n):
            while self.occupant[lane] is not None:
                batch = next(self.streams[lane], None)
                if batch is not None:
                    drawn.append((lane, batch))
                    break
                self._retire(lane)
                self._refill(lane)
        return drawn

    def _refill(self, lane: int, load: bool = True) -> None:
        """The next waiting member into ``lane`` (its state into the stacks unless already there)."""
        if not self.waiting:
            self.occupant[lane] = None
            return
        k = self.waiting.popleft()
        m = self.members[k]
        if load:
            self.params.load(lane, _named([m], "named_parameters")[0])
            self.buffers.load(lane, _named([m], "named_buffers")[0])
            self.optimizer.load(lane, m)
        m.algorithm.begin_local_train(m.model, m.batches)
        m.model.train()
        self.streams[lane], self.occupant[lane] = _batches(m, self.epochs), k

    @torch.no_grad()
    def _retire(self, lane: int) -> None:
        """The lane's client has run its update: its parameters and buffers back into its model,
        the rest kept as device copies until :meth:`_hand_over`; the lane is free."""
        k = self.occupant[lane]
        m = self.members[k]
        params, buffers = self.params.client(lane), self.buffers.client(lane)
        for name, p in m.model.named_parameters():
            p.copy_(params["model." + name])
        for name, b in m.model.named_buffers():
            b.copy_(buffers["model." + name])
        self.finished[k] = (self.optimizer.snapshot(lane), self.tally.snapshot(lane),
                            self.protos.snapshot(lane) if self.protos is not None else None)
        self.occupant[lane] = None

    def _hand_over(self) -> list[dict[str, float]]:
        """Every client's optimizer state, terms and prototypes, in member order (the host reads)."""
        done = [self.finished[k] for k in range(len(self.members))]
        self.optimizer.write_back(self.members, [d[0] for d in done])
        terms, steps = self.tally.results([d[1] for d in done])
        if self.protos is not None:
            for m, d, n in zip(self.members, done, steps, strict=True):
                self.protos.hand_over(m, d[2], n)
        return terms

    def _step_group(self, group: list[tuple[int, tuple]]) -> None:
        """One step of the clients in ``group`` (their batches have one size), as each one's
        guarded step: gradients, per-client norm, skip when non-finite, clipping, update."""
        ids = tuple(i for i, _ in group)
        idx, first_rows = self._index(ids)
        whole = len(ids) == self.n  # ids: distinct and increasing
        x = torch.stack([b[0] for _, b in group]).to(self.device, non_blocking=True)
        y = torch.stack([b[1] for _, b in group]).to(self.device, non_blocking=True)
        params = self.params.flat if whole else tuple(f[idx] for f in self.params.flat)
        buffers = self.buffers.flat if whole else self.buffers.gather(ids, idx)
        grads, (_, (loss, terms, feats)) = self._step(params, self.buffers.views(buffers, len(ids)), x, y)
        if not whole:  # BatchNorm's running statistics were updated in the gathered copies
            self.buffers.scatter(ids, idx, buffers)
        # algorithms.base.guarded_step, per client: one gradient norm, finiteness, clipping
        norms = torch.linalg.vector_norm(grads[0], dim=1) if len(grads) == 1 else torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, dim=1) for g in grads], 1), dim=1)
        applied = torch.isfinite(norms + loss)
        if self.max_norm is not None:
            coef = _rows((self.max_norm / (norms + 1e-6)).clamp(max=1.0))  # torch.nn.utils.clip_grads_with_norm_
            grads = tuple(g.mul_(coef.to(g.dtype)) for g in grads)
        # a non-finite client's rows are left as they are by torch.where: no host read here
        self.optimizer.step(params, grads, idx, whole, applied)
        self.tally.add(idx, applied, loss, terms)
        if self.protos is not None:
            if feats.numel() == 0:
                raise RuntimeError("prototype_source 'train' needs exactly one forward pass of the batch through "
                                   "model.features per step; this method's loss does otherwise: use prototype_source 'eval'")
            record = applied
            if self.last_epoch_only:  # ClientAlgorithm.local_train: only the last epoch's passes
                last = [b[2] for _, b in group]
                if not any(last):
                    return
                if not all(last):
                    record = applied & torch.tensor(last).to(applied.device, non_blocking=True)
            self.protos.add(first_rows, record, feats, y)


def train_together(members: list[Member], epochs: int, device: torch.device,
                   lanes: Optional[int] = None) -> list[dict[str, float]]:
    """Local updates of ``members`` (one architecture, one received state, see :func:`group_key`)
    as one batched model of ``lanes`` rows (None: one per member); each client's terms, as its own
    ``local_train`` returns them."""
    return BatchedUpdate(members, epochs, device, lanes).run()
