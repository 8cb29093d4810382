"""The algorithm interface: a client part, a server part and typed options. No Ray here.

A method is one module defining an :class:`Algorithm` subclass and registering it::

    @ALGORITHMS.register("fedfoo")
    class FedFoo(Algorithm):
        Options = FedFooOptions          # pydantic model: its fields are the config's algorithm.*
        Client = FedFooClient            # local loss, what to upload, how to use the broadcast
        Server = FedFooServer            # how to fold updates in, what to train, what to broadcast

The runtime only ever calls the hooks below (Flower's Strategy idea, without the transport).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

import numpy as np
import torch
from pydantic import ConfigDict, Field

from rayfed_proto.algorithms.common import (
    LatestUploads,
    PrototypeBank,
    aggregate_prototypes,
    local_prototypes,
    subset,
)
from rayfed_proto.algorithms.schedules import AlignmentSchedule
from rayfed_proto.messages import ClientUpdate, GlobalState, PrototypeSet
from rayfed_proto.numbers import StrictNumbers

# broadcast extra: the classes of the bank that the latest aggregation produced, the inference
# bank under ``inference_memory: round`` (absent otherwise)
ROUND_IDS = "round_class_ids"


class Options(StrictNumbers):
    """Base of every algorithm's options: unknown keys are errors; numbers are numbers (no
    booleans, no infinity or NaN: rayfed_proto.numbers)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def run_issues(self, rounds: int) -> list[tuple[str, Any, str]]:
        """Problems of these options for a run of ``rounds`` server versions, as
        (key under ``algorithm.``, value, what is allowed); checked before Ray starts."""
        return []


@dataclass
class FederationSpec:
    """What both parts know about the federation before it starts."""

    num_clients: int
    num_classes: int
    feature_dim: int
    seed: int = 0
    staleness_exponent: float = 0.5  # a in (1 + staleness)^(-a)
    # Builds a fresh model with the (homogeneous) client architecture; used by methods whose
    # server holds a global model (FedAvg). None for heterogeneous groups.
    build_model: Optional[Callable[[], torch.nn.Module]] = None
    in_channels: int = 1
    image_size: int = 32
    # Builds an untrained ``ProtoModel`` of any registered architecture for this dataset's
    # images, ``build_arch(arch, feature_dim)`` (a server-side model, FedProtoKD). Set on the server.
    build_arch: Optional[Callable[[str, int], torch.nn.Module]] = None
    # The public unlabelled proxy set (normalised images, no labels), held out before
    # partitioning, the same on every client and on the server; None when data.public_size is 0.
    public_x: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class UpdateSizes:
    """What one client's local update passes over, for the cost it declares (the virtual clock's
    work, :meth:`ClientAlgorithm.update_work`): sizes from the partition and the training config."""

    train: int  # samples of the client's training split
    local_epochs: int  # training.local_epochs
    batch_size: int  # training.batch_size
    unlabelled: int = 0  # its separate unlabelled pool (data.partition.unlabelled_per_client), 0 without
    public: int = 0  # the public proxy set (data.public_size), the same for every client
    train_class_counts: tuple[int, ...] = ()  # samples of each class in the training split


@dataclass(frozen=True)
class Pass:
    """Samples that go through the client's model in one local update: ``samples`` of set ``data``
    (``train``, ``unlabelled``, ``public``: what the docs and tests name), forward and backward
    (a training step) or forward only (``backward=False``: eval-mode passes, logits, weak views),
    counted from server version ``from_version`` on (work a method adds in a later phase, e.g.
    distillation once the server has logits). Passes only ever add work from their version on."""

    data: str
    samples: int
    backward: bool
    from_version: int = 0


@dataclass(frozen=True)
class ServerSizes:
    """What one server step works on, for the cost it declares (the virtual clock's server time,
    :meth:`ServerAlgorithm.server_work`): sizes known before the step, from the partition and config."""

    updates: int  # updates aggregated into the version (K asynchronously, the round's accepted ones in sync)
    num_classes: int
    feature_dim: int
    public: int = 0  # the public proxy set (data.public_size)
    classes_per_update: float = 0.0  # classes one upload holds, the clients' mean (prototype pairs per update)
    uploaders: int = 0  # distinct clients whose upload the server holds (aggregation_scope: latest)

    def uploads(self, scope: str = "buffer") -> int:
        """Uploads a version aggregates: the buffer's, or every uploader's latest (``latest``)."""
        return max(self.updates, self.uploaders) if scope == "latest" else self.updates


@dataclass(frozen=True)
class ServerPass:
    """Samples that go through a server-side module in one server step: ``samples`` of ``what`` (a
    name for the docs and the benchmark), forward and backward (a training step) or forward only,
    each costing ``macs`` multiply-accumulates forward, or, with ``arch`` set, one forward of that
    zoo architecture on one of the dataset's images (its MACs computed as for the clients')."""

    what: str
    samples: int
    backward: bool
    macs: int = 0
    arch: Optional[str] = None


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Mini-batches of one epoch of :class:`TrainBatchIterator` over ``n`` samples (an incomplete
    last batch is folded into the previous one or dropped: the same count; fewer than
    ``batch_size`` samples are one batch either way)."""
    if n <= 0:
        return 0
    return max(1, n // batch_size)


@dataclass
class TrainBatchIterator:
    """Seeded mini-batches over a client's training tensors (the generator state is saved).

    ``augment`` (``data.augment``, rayfed_proto.data.augment): applied to each batch's images,
    drawing from ``generator``, so the augmented batches are reproducible too. Only training
    batches pass through here; evaluation and the upload's passes read the tensors as they are.

    ``drop_last`` (``training.trailing_batch: drop``): an incomplete last batch is dropped, as
    HtFLlib's ``DataLoader(..., drop_last=True)`` (clientbase.py ``load_train_data``), so every
    batch holds ``batch_size`` samples; a client with fewer samples than one batch still trains
    on one batch of all it has (HtFLlib's client would take no step at all). Otherwise
    (``fold``) that batch joins the previous one."""

    x: torch.Tensor
    y: torch.Tensor
    batch_size: int
    generator: torch.Generator
    augment: Optional[Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = None
    drop_last: bool = False

    def epoch(self):
        order = torch.randperm(len(self.y), generator=self.generator)
        chunks = list(torch.split(order, self.batch_size))
        if len(chunks) > 1 and len(chunks[-1]) < self.batch_size:
            # An incomplete last batch joins the previous one (batches of batch_size .. 2 x batch_size - 1).
            # BatchNorm cannot train on one sample (ResNets reach 1x1 maps at 32x32), and on two or three
            # its batch statistics are nearly degenerate: in the CPU run of bench/gpu_share.py's workload
            # (FedProto, HtFE8, Dirichlet 0.1) one step on a trailing batch of 2 moved a ResNet-101's
            # largest BatchNorm weight from 1.2 to 330, and its eval-mode features overflowed to inf.
            # HtFLlib drops that batch instead (clientbase.py load_train_data, drop_last=True).
            last = chunks.pop()
            if not self.drop_last:
                chunks[-1] = torch.cat([chunks[-1], last])
        for idx in chunks:
            xb = self.x[idx]
            yield (xb if self.augment is None else self.augment(xb, self.generator)), self.y[idx]


def guarded_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
    """Backward and optimizer step, unless the loss or a gradient is not finite: then nothing
    changes and False is returned. One exploding batch must not turn a client's model into NaN
    (which would also make every later upload refused).

    One host/device synchronisation per step: a single fused gradient norm (``_foreach_norm``
    inside ``get_total_norm``) is added to the loss, and that one scalar says whether anything is
    non-finite (a NaN or inf anywhere makes the sum NaN or inf); the same norm clips the gradients
    when ``training.max_grad_norm`` is set.
    """
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else loss.new_zeros(())
    if not bool(torch.isfinite(total + loss.detach())):  # the one sync of the step
        optimizer.zero_grad(set_to_none=True)
        return False
    max_norm = getattr(optimizer, "max_grad_norm", None)  # set by the runtime from training.max_grad_norm
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total, foreach=True)
    optimizer.step()
    return True


class TrainPrototypes:
    """Per-class means of the features computed by the training forward passes (train mode,
    before each step), the way FedProto's and FedSA's reference clients collect their prototypes
    during the local epoch (HtFLlib ``clientproto.py``/``clientsa.py``: ``protos[y].append(rep)``
    then ``agg_func``), instead of a second eval-mode pass over the split.

    A forward hook on ``model.projection`` records the features of each batch; :meth:`add` folds
    the last recorded batch in, and is called only for steps that were applied (a skipped,
    non-finite step contributes nothing). Sums stay on the device: no synchronisation per step.
    """

    def __init__(self, model: torch.nn.Module, num_classes: int):
        self.model, self.num_classes = model, num_classes
        self.sums: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self.last: Optional[torch.Tensor] = None
        self._hook = None

    def __enter__(self) -> TrainPrototypes:
        def record(_module, _inputs, output):
            self.last = output.detach()

        self._hook = self.model.projection.register_forward_hook(record)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()

    def add(self, y: torch.Tensor) -> None:
        feats, self.last = self.last, None
        if feats is None or len(feats) != len(y):
            raise RuntimeError("prototype_source 'train' needs exactly one forward pass of the batch through "
                               "model.features per step; this method's loss does otherwise: use prototype_source 'eval'")
        if getattr(self.model, "normalize", False):
            feats = torch.nn.functional.normalize(feats, dim=1)  # what ProtoModel.features returns
        feats = feats.float()
        if self.sums is None:
            self.sums = torch.zeros(self.num_classes, feats.shape[1], device=feats.device)
            self.counts = torch.zeros(self.num_classes, device=feats.device)
        y = y.to(feats.device)
        self.sums.index_add_(0, y, feats)
        self.counts.index_add_(0, y, torch.ones(len(y), device=feats.device))

    def result(self, y: torch.Tensor) -> Optional[PrototypeSet]:
        """The means of the classes seen, with the split's sample counts per class (the weights the
        server's sample-weighted mean uses), or None when no step was applied."""
        if self.sums is None:
            return None
        counts = self.counts.cpu()
        seen = torch.nonzero(counts).squeeze(1)
        # FedSA Eq. 2 over the training passes: P_i^c = mean of f_i(x) over the batches of class c
        vectors = (self.sums.cpu()[seen] / counts[seen].unsqueeze(1)).numpy().astype(np.float32)
        split_counts = torch.bincount(y.cpu(), minlength=self.num_classes)[seen]
        return PrototypeSet(seen.numpy().astype(np.int64), vectors, split_counts.numpy().astype(np.int64))


class StepTally:
    """Applies local steps through :func:`guarded_step` and averages their loss terms over the
    applied steps; skipped (non-finite) steps are counted as ``nonfinite_steps``.

    Terms may be Python numbers or 0-d tensors; tensors are summed where they live and read once,
    in :meth:`result`, so a loss that returns ``{"ce": ce.detach()}`` (not ``ce.item()``) adds no
    host/device synchronisation to the step: the guarded step's finiteness check stays the only one.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float | torch.Tensor] = {}
        self.loss_sum: Optional[torch.Tensor] = None  # summed on the device: no sync per step
        self.steps = self.skipped = 0

    def step(self, model, optimizer, loss: torch.Tensor, terms: dict[str, float | torch.Tensor]) -> bool:
        if not guarded_step(model, optimizer, loss):
            self.skipped += 1
            return False
        self.steps += 1
        self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
        for k, v in terms.items():
            if isinstance(v, torch.Tensor):
                v = v.detach()
            self.totals[k] = v if k not in self.totals else self.totals[k] + v
        return True

    def result(self) -> dict[str, float]:
        totals = {"loss": self.loss_sum if self.loss_sum is not None else 0.0, **self.totals}
        out = {k: float(v) / max(self.steps, 1) for k, v in totals.items()}
        out["nonfinite_steps"] = float(self.skipped)
        return out


class ClientAlgorithm:
    """Client part; one instance per client, holding that client's algorithm state."""

    def __init__(self, options: Options, spec: FederationSpec, client_id: int):
        self.options, self.spec, self.client_id = options, spec, client_id
        self.guidance: Optional[PrototypeSet] = None
        self.version = 0

    # -- receiving -------------------------------------------------------------------------
    def receive(self, state: GlobalState, model: torch.nn.Module) -> None:
        """Take in the broadcast before training or evaluation (default: keep its bank, and the
        classes of this round's aggregate when the server sends them, ``inference_memory: round``)."""
        self.version = state.version
        self.guidance = state.prototypes
        self.round_ids = state.extras.get(ROUND_IDS)

    def set_unlabelled_pool(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The client's separate unlabelled pool (``data.partition.unlabelled_per_client``),
        given once before training; ``y`` are the true labels, for diagnostics only. Default:
        ignored (only semi-supervised methods use it)."""

    def fresh_optimizer(self, state: GlobalState) -> bool:
        """Whether the local optimizer starts this update with no state (momentum, Adam moments).

        Default: always, for every method. Every reference builds its optimizer inside each
        round's local training: the original FedProto (``yuetan031/fedproto``, ``lib/update.py``
        ``LocalUpdate.update_weights_het``: ``torch.optim.SGD(..., momentum=0.5)`` per call),
        HtFLlib's and the FedSA authors' clients (the optimizer made in every ``train()``),
        FedSC's authors (a new optimizer per client per round), and FedAvg/FedProx/MOON
        (``QinbinLi/MOON``, ``main.py`` ``train_net``). With weights broadcast the old momentum
        would also replay the client's previous direction on a model the broadcast replaced.
        ``training.keep_optimizer_state: true`` keeps the state from one update to the next for
        every method; a method may override this to decide per broadcast.
        """
        return True

    # -- training ----------------------------------------------------------------------------
    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Local objective on one mini-batch -> (loss, {term name: value}). Values are detached
        0-d tensors (or numbers): :class:`StepTally` reads them once per update, not per step."""
        _, logits = model.forward_features(x)
        ce = torch.nn.functional.cross_entropy(logits, y)
        return ce, {"ce": ce.detach()}  # read once per update by StepTally: no sync per step

    def prototype_source(self) -> str:
        """Where the uploaded prototypes come from: ``train`` (collected from the training forward
        passes, no extra pass), ``train_last_epoch`` (those of the last local epoch only, FedSC's
        authors' code) or ``eval`` (an eval-mode pass over the split after training).
        Per method, following its reference code (``algorithm.prototype_source``)."""
        return getattr(self.options, "prototype_source", "eval")

    # True when this client's local update is the default :meth:`local_train` (with at most a
    # :meth:`begin_local_train` hook) around a :meth:`loss` that reads only the model, the batch
    # and the received global state (the same for every client dispatched with that state, so one
    # client's instance can compute it for all), draws no random numbers and reads nothing on the
    # host (no ``.item()``, no branch on tensor values). Then clients of one architecture on one
    # worker may step together as one vmapped model (``resources.batch_clients``,
    # training/batched.py), equal to training one after another within float tolerance.
    batchable: ClassVar[bool] = False
    # Why not, for a method that is not batchable (``rayfed-proto list`` shows it).
    unbatchable_reason: ClassVar[str] = ""

    def begin_local_train(self, model, batches: TrainBatchIterator) -> None:
        """Called once at the start of each local update, before the first step (the batched path
        calls it too): what a method takes from the model as received (default: nothing)."""

    def take_train_prototypes(self, protos: Optional[PrototypeSet]) -> None:
        """The prototypes collected from this update's training passes (``prototype_source:
        train``), for :meth:`make_update`."""
        self._train_protos = protos

    def local_train(self, model, optimizer, batches: TrainBatchIterator, epochs: int, device) -> dict[str, float]:
        """Default local update: ``epochs`` passes of SGD on :meth:`loss`; returns mean terms."""
        self.begin_local_train(model, batches)
        model.train()
        tally = StepTally()
        source = self.prototype_source()
        collect = source in ("train", "train_last_epoch") and hasattr(model, "projection")
        self._train_protos = None
        with (TrainPrototypes(model, self.spec.num_classes) if collect else contextlib.nullcontext()) as protos:
            for epoch in range(epochs):
                record = protos is not None and (source == "train" or epoch == epochs - 1)
                for xb, yb in batches.epoch():
                    xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                    optimizer.zero_grad(set_to_none=True)
                    loss, terms = self.loss(model, xb, yb)
                    if tally.step(model, optimizer, loss, terms) and record:
                        protos.add(yb)
        if protos is not None:
            self.take_train_prototypes(protos.result(batches.y))
        return tally.result()

    def make_update(self, model, x: torch.Tensor, y: torch.Tensor) -> ClientUpdate:
        """What to upload after training (default: local prototypes of the held classes, from the
        training passes or an eval-mode pass, see :meth:`prototype_source`)."""
        protos, self._train_protos = getattr(self, "_train_protos", None), None
        if protos is None:
            protos = local_prototypes(model, x, y)  # FedSA Eq. 2, eval mode after training
        return ClientUpdate(client_id=self.client_id, base_version=self.version, num_samples=len(y), prototypes=protos)

    # -- declared cost -----------------------------------------------------------------------
    @classmethod
    def update_work(cls, options: Options, sizes: UpdateSizes) -> list[Pass]:
        """The work of one local update, as passes over the client's data: the virtual clock
        (``rayfed_proto.system``) charges each sample of a forward-backward pass one training
        sample's cost and each forward-only sample a third of it. A method that does more than
        the default hooks (distillation, extra views, extra eval passes) overrides this.

        Default, the default :meth:`local_train` and :meth:`make_update`: ``local_epochs`` passes of
        forward-backward over the training split, plus one eval-mode forward pass over it when the
        uploaded prototypes come from one (:meth:`prototype_source` ``eval``)."""
        work = [Pass("train", sizes.local_epochs * sizes.train, backward=True)]
        if getattr(options, "prototype_source", "eval") == "eval":
            work.append(Pass("train", sizes.train, backward=False))  # local_prototypes after training
        return work

    # -- inference ---------------------------------------------------------------------------
    def inference_bank(self) -> Optional[PrototypeSet]:
        """Vectors for nearest-prototype inference (None: the method has no such mode): the
        broadcast bank, restricted to the classes of the latest aggregation when the server
        sent them (``inference_memory: round``)."""
        round_ids = getattr(self, "round_ids", None)
        return self.guidance if round_ids is None else subset(self.guidance, round_ids)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state.get("version", 0))


class ServerAlgorithm:
    """Server part: folds updates into the global state, trains server modules, broadcasts."""

    def __init__(self, options: Options, spec: FederationSpec, device: torch.device):
        self.options, self.spec, self.device = options, spec, device

    def weight_shapes(self) -> Optional[dict[str, tuple[int, ...]]]:
        """Expected shapes of uploaded weights (None: this method uploads no weights)."""
        return None

    @classmethod
    def server_work(cls, options: Options, sizes: ServerSizes) -> list[ServerPass]:
        """The work of one server step (aggregation and server training), as passes through server
        modules: the virtual clock charges it at ``system.server``'s speed, as a client's declared
        work at its own. Default: none (averaging prototypes or weights is nearly free next to
        training); a method that trains something at every version declares it."""
        return []

    def aggregate(self, updates: list[ClientUpdate], weights: list[float], version: int) -> dict[str, float]:
        """Fold a buffer of accepted updates (with their staleness weights) into the global
        state that becomes ``version``; train server-side modules; return metrics."""
        raise NotImplementedError

    def broadcast(self, version: int) -> GlobalState:
        raise NotImplementedError

    def guidance_bank(self) -> Optional[PrototypeSet]:
        """The bank whose margin is tracked (None if the method has none)."""
        return None

    def extras_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the ``extras`` a client must upload (e.g. logits on the public set); an
        update whose extras differ is refused at the border. Empty: extras are not checked."""
        return {}

    def global_model(self) -> Optional[torch.nn.Module]:
        """The model the server holds (FedAvg's average, FedProtoKD's server model), ready for
        inference; the runtime evaluates it on the global test set (per domain). None: none."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass(frozen=True)
class SameAs:
    """A config default that copies another key's value (dotted): ``{"algorithm.server_lr":
    SameAs("training.lr")}`` makes FedTGP's server learning rate the client's unless the user sets
    it. Resolved by the config loader after the other defaults; the resolved config holds the value."""

    key: str


class Algorithm:
    """A registered method: options, client part, server part, a capability flag and config defaults."""

    Options: ClassVar[type[Options]] = Options
    Client: ClassVar[type[ClientAlgorithm]] = ClientAlgorithm
    Server: ClassVar[type[ServerAlgorithm]] = ServerAlgorithm
    # Methods that average weights need one architecture for every client (config checks it).
    requires_homogeneous_models: ClassVar[bool] = False
    # Config values outside ``algorithm.*`` this method wants unless the user sets them
    # (dotted keys, e.g. {"model.normalize_features": True, "data.public_size": 2500}).
    config_defaults: ClassVar[dict[str, Any]] = {}
    # Further defaults that apply only when the federation runs without rounds (federation.mode
    # async: versions every K accepted updates; dotted keys, ``algorithm.*`` included), on top of
    # ``config_defaults``; a value the user sets always wins.
    roundless_config_defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def defaults_for(cls, options: dict[str, Any], in_rounds: bool) -> dict[str, Any]:
        """The config defaults of a run of this method: ``config_defaults``, plus
        ``roundless_config_defaults`` when the federation has no rounds (``in_rounds`` False: the policy's
        ``in_rounds``, e.g. async mode). ``options`` are the ``algorithm.*`` keys as the user wrote them
        (not validated yet): a method whose run-level defaults depend on one of its options (FedSC's
        ``variant``) overrides this. A value may be a :class:`SameAs`; a value the user sets always wins.

        In a federation of rounds, a method with an ``aggregation_scope`` option aggregates the
        round's uploads (``buffer``): the papers' S_t, the clients sampled this round. ``latest``
        there would mix in the last uploads of clients not sampled (config refuses it with
        participation < 1); a method's ``latest`` default is its async-mode default."""
        defaults = {**cls.config_defaults, **(cls.roundless_config_defaults if not in_rounds else {})}
        # prototype_scope: FedSC's former name of the key; a user who set it chose the scope
        if in_rounds and "aggregation_scope" in cls.Options.model_fields and "prototype_scope" not in options:
            defaults.setdefault("algorithm.aggregation_scope", "buffer")
        return defaults


# ----------------------------------------------------------------------------- prototype methods


class PrototypeOptions(Options):
    """Options shared by the prototype methods (FedProto, FedTGP and later ones)."""

    lam: float = Field(1.0, ge=0, description="weight of the alignment term (lambda)")
    aggregation: Literal["weighted", "uniform"] = Field(
        "weighted", description="per-class mean of uploads: sample-weighted (FedSA Eq. 3) or uniform (FedProto code)")
    alignment_reduction: Literal["mean", "sum"] = Field(
        "mean", description="||f - P||^2 per dimension (reference code, default) or summed (as printed)")
    aggregation_scope: Literal["buffer", "latest"] = Field(
        "buffer", description="aggregate the buffered updates only, or every client's latest upload (staleness-weighted)")
    prototype_source: Literal["train", "eval"] = Field(
        "eval", description="uploaded prototypes: features of the training passes (no extra pass) or an eval-mode "
        "pass after training; the default follows each method's reference code (docs/algorithms.md)")
    alignment_schedule: Optional[AlignmentSchedule] = Field(
        None, description="curriculum for the alignment weight (FedSAP Eq. 7); none: the constant lam")
    inference_memory: Literal["round", "last_seen"] = Field(
        "last_seen", description="nearest-prototype inference against the classes of the latest aggregation only "
        "(round: the reference servers' bank of one round) or every class's last vector (last_seen)")

    def alignment_weight(self, version: int) -> float:
        """lambda_t: ``lam`` scaled by the schedule at the version trained against (FedSAP Eq. 7)."""
        return self.lam * (self.alignment_schedule.at_version(version) if self.alignment_schedule else 1.0)


class PrototypeServer(ServerAlgorithm):
    """Common server of prototype methods: staleness-weighted per-class aggregation into a bank.

    ``aggregation_scope="buffer"`` (ALGORITHMS.md): a version aggregates the buffered updates and
    classes nobody uploaded keep their last vector. ``"latest"``: the server remembers each
    client's most recent upload (:class:`~rayfed_proto.algorithms.common.LatestUploads`: an older
    upload arriving late never replaces a newer one) and aggregates all of them, each weighted by
    its staleness now, (1 + current version - version it was trained against)^(-a); with full
    synchronous participation both are identical.
    """

    options: PrototypeOptions

    def __init__(self, options: PrototypeOptions, spec: FederationSpec, device: torch.device):
        super().__init__(options, spec, device)
        self.bank = PrototypeBank(spec.num_classes, spec.feature_dim)
        self.latest: LatestUploads[PrototypeSet] = LatestUploads(spec.staleness_exponent)  # client -> (upload, tau)

    def _pairs(self, updates: list[ClientUpdate], weights: list[float], version: int) -> tuple[list[PrototypeSet], list[float]]:
        sets, ws = [], []
        if self.options.aggregation_scope == "latest":
            for u in updates:
                if u.prototypes is not None:
                    self.latest.offer(u.client_id, u.prototypes, u.base_version)
            for _, ps, w in self.latest.weighted(version):  # s = (1 + t - tau)^(-a), t = version - 1
                sets.append(ps)
                ws.append(w)
        else:
            for u, w in zip(updates, weights, strict=False):
                if u.prototypes is not None and len(u.prototypes):
                    sets.append(u.prototypes)
                    ws.append(w)
        return sets, ws

    def aggregate(self, updates, weights, version):
        sets, ws = self._pairs(updates, weights, version)
        self.bank.update(aggregate_prototypes(sets, ws, self.options.aggregation), version)
        return {}

    def broadcast(self, version: int) -> GlobalState:
        extras = {}
        if self.options.inference_memory == "round":  # the classes this version's aggregation produced
            extras[ROUND_IDS] = self.bank.as_set(version).class_ids
        return GlobalState(version=version, prototypes=self.bank.as_set(), extras=extras)

    def guidance_bank(self) -> Optional[PrototypeSet]:
        return self.bank.as_set()

    def state_dict(self) -> dict[str, Any]:
        return {"bank": self.bank.state_dict(), "latest": self.latest.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bank.load_state_dict(state["bank"])
        self.latest.load_state_dict(state.get("latest", {}))


def as_numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """A module's parameters and buffers as numpy arrays (the weight-exchange format)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_numpy_state(module: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    device = next(module.parameters()).device
    module.load_state_dict({k: torch.tensor(v, device=device) for k, v in weights.items()})  # copy: read-only views
