"""FedTGP (Zhang et al. AAAI 2024): trainable global prototypes with an adaptive margin.

As described in ALGORITHMS.md (and in FedSA / FedProtoKD related work): the server keeps a
generator G: class embedding E (N(0,1) init) -> Linear(D, H) -> ReLU -> Linear(H, D). After each
aggregation it computes the class means P^c of the uploaded prototypes, the adaptive margin
delta = min(max_c min_{c' != c} d(P^c, P^c'), tau), and trains G for ``server_epochs`` on the
uploaded (p, c) pairs with the margin-enhanced contrastive loss
    CE over c' of logits -(d(p, G(c')) + delta * [c' = c]),
with plain SGD at the client's learning rate and batch size unless ``server_lr`` /
``server_batch_size`` are set (the reference: ``TsingZ0/HtFLlib``
``system/flcore/servers/servertgp.py``, ``FedTGP.__init__``: ``server_learning_rate =
args.local_learning_rate``, ``batch_size = args.batch_size``). It broadcasts G(c) for every class
the generator knows, all C of them, once it has trained (``update_Gen``: ``for class_id in
range(self.num_classes)``); ``broadcast_classes: seen`` keeps only the classes ever uploaded.
Clients use FedProto's loss.

Asynchronous mode (this platform's): ``aggregation_scope`` defaults to ``latest`` when
``federation.mode`` is async (``roundless_config_defaults``): the generator trains on every client's
latest upload, each staleness-weighted, and the margin is taken over all the classes they
hold, instead of ``server_epochs`` epochs on the K updates of one buffer and a margin over
their classes only. In sync mode the default stays ``buffer`` (FedTGP's round: the uploads of
the sampled clients); with full participation both are the same.

Server work per update (``server_work``): the reference trains ``server_epochs`` epochs over one
round's uploads, so each client update buys ``server_epochs`` passes over the pairs it uploaded.
With ``latest`` a version of K updates trains on all N clients' uploads: ``server_epochs`` epochs
there would be N / K times that work per update (10x in the default experiment, 20 clients,
K = 2). ``per_update`` (default) trains round(server_epochs x K / N) epochs (at least 1), K the
updates of this version with prototypes and N the uploads trained on: exactly ``server_epochs``
whenever the two are the same (``buffer``, or sync with full participation). ``per_version``:
``server_epochs`` every version.

Which model the uploaded prototypes come from (``prototype_model``): ``trained`` (default) is the
paper's client, whose prototypes are those of the model after its local training. The authors'
code (``TsingZ0/FedTGP`` and ``TsingZ0/HtFLlib``, ``system/flcore/clients/clienttgp.py``,
``clientTGP.train`` then ``collect_protos``) uploads the prototypes of the model as it was before
this round's local training: ``collect_protos`` reloads the model file that the previous
``train()`` saved (the file is rewritten only after ``collect_protos`` returns), i.e. the weights
this round's training started from. ``before_training`` reproduces that, for replication.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from rayfed_proto import optim
from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import Algorithm, PrototypeOptions, PrototypeServer, SameAs, ServerPass, ServerSizes
from rayfed_proto.algorithms.common import aggregate_prototypes, local_prototypes, safe_cdist
from rayfed_proto.algorithms.fedproto import PrototypeAlignmentClient
from rayfed_proto.messages import ClientUpdate, PrototypeSet


class FedTGPOptions(PrototypeOptions):
    lam: float = Field(10.0, ge=0, description="alignment weight lambda (FedTGP reference: 10)")
    aggregation: Literal["weighted", "uniform"] = Field(
        "uniform", description="class means P^c for the margin: uniform mean of the uploads (FedTGP) or sample-weighted")
    margin_threshold: float = Field(100.0, gt=0, description="tau: upper bound of the adaptive margin")
    server_epochs: int = Field(100, ge=0, description="generator epochs per round of the reference: per server version "
                               "when the generator trains on this version's updates only (see server_work)")
    server_work: Literal["per_update", "per_version"] = Field(
        "per_update", description="per_update: server_epochs x (updates of this version) / (uploads trained on) epochs, "
        "the reference's work per client update; per_version: server_epochs epochs every version")
    # the reference's server uses the client's lr and batch size (HtFLlib servertgp.py, FedTGP.__init__);
    # config_defaults copy training.lr / training.batch_size here unless set
    server_lr: float = Field(0.01, gt=0, description="generator SGD learning rate (default: training.lr)")
    server_batch_size: int = Field(10, ge=1, description="generator mini-batch of (prototype, class) pairs "
                                   "(default: training.batch_size)")
    broadcast_classes: Literal["all", "seen"] = Field(
        "all", description="broadcast G(c) for every class once the generator has trained (reference update_Gen) or "
        "only for the classes ever uploaded")
    hidden_dim: int = Field(0, ge=0, description="generator hidden width (0: feature_dim)")
    # "before_training" follows the authors' code (TsingZ0/FedTGP, HtFLlib clienttgp.py:
    # clientTGP.collect_protos reloads the model saved before this round's train()); the default
    # "trained" is the paper's (prototypes of the locally trained model)
    prototype_model: Literal["trained", "before_training"] = Field(
        "trained", description="model the uploaded prototypes are computed with: after this update's local training "
        "(paper, default) or as it was before it (the authors' clienttgp.py collect_protos), for replication")

    def run_issues(self, rounds: int) -> list[tuple[str, Any, str]]:
        if self.prototype_model == "before_training" and self.prototype_source == "train":
            return [("prototype_model", self.prototype_model,
                     "'trained' with prototype_source 'train' (the training passes are those of the model being "
                     "trained); 'before_training' needs prototype_source 'eval' (an eval-mode pass, as collect_protos)")]
        return []


class PrototypeGenerator(torch.nn.Module):
    """G(c) = W2 ReLU(W1 E[c] + b1) + b2 with E ~ N(0, 1) (nn.Embedding's init)."""

    def __init__(self, num_classes: int, feature_dim: int, hidden_dim: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(num_classes, feature_dim)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(feature_dim, hidden_dim), torch.nn.ReLU(), torch.nn.Linear(hidden_dim, feature_dim))

    def forward(self, class_ids: torch.Tensor) -> torch.Tensor:
        return self.net(self.embedding(class_ids))


def generator_epochs(server_epochs: int, server_work: str, new_uploads: int, trained_on: int) -> int:
    """Generator epochs for a version of ``new_uploads`` updates training on ``trained_on``
    uploads: ``server_epochs`` x new / trained (rounded, at least 1) with ``server_work:
    per_update``, the reference's work per client update; ``server_epochs`` with ``per_version``."""
    if server_work == "per_version" or server_epochs == 0 or trained_on <= new_uploads:
        return server_epochs
    return max(1, round(server_epochs * new_uploads / trained_on))


def generator_work(sizes: ServerSizes, epochs: int, batch_size: int, hidden_dim: int, scope: str) -> list[ServerPass]:
    """One version's generator training (FedTGP's and FedProtoKD's loop): ``epochs`` x the
    mini-batches of the version's (prototype, class) pairs (of the buffer's uploads, or of every
    uploader's latest with ``scope`` latest), each a forward-backward of the generator over every
    class (two ``feature_dim`` x ``hidden`` layers) and of the batch's distances to them."""
    pairs = round(sizes.uploads(scope) * sizes.classes_per_update)
    steps = epochs * -(-pairs // batch_size)
    d, h = sizes.feature_dim, hidden_dim or sizes.feature_dim
    return [ServerPass("generator", steps * sizes.num_classes, backward=True, macs=2 * d * h),
            ServerPass("distances", steps * min(batch_size, pairs), backward=True, macs=sizes.num_classes * d),
            ServerPass("bank", sizes.num_classes, backward=False, macs=2 * d * h)]


def adaptive_margin(class_means: torch.Tensor, threshold: float) -> float:
    """delta = min(max_c gap_c, tau), gap_c = min_{c' != c} d(P^c, P^c') (FedTGP).

    ``class_means`` holds one row per uploaded class. With fewer than two classes no gap is
    defined and the margin is the threshold (FedTGP's code reaches the same value: every gap
    stays at its 1e9 initialisation and is clipped by tau).
    """
    if len(class_means) < 2:
        return float(threshold)
    d = safe_cdist(class_means, class_means)
    d.fill_diagonal_(float("inf"))
    gaps = d.min(1).values  # FedTGP: gap_c = min_{c' != c} d(P^c, P^c')
    return float(min(float(gaps.max()), threshold))  # FedTGP: delta = min(max_c gap_c, tau)


def margin_contrastive_loss(protos: torch.Tensor, labels: torch.Tensor, generated: torch.Tensor, margin: float,
                            weights: torch.Tensor | None = None) -> torch.Tensor:
    """CE(-(d(p, G(c')) + delta [c' = y]), y) over the pairs (FedTGP server loss).

    ``weights`` (async extension): each pair's staleness weight; the loss is their weighted mean
    (plain mean when None, as in FedTGP).
    """
    dist = safe_cdist(protos, generated)
    dist = dist + margin * F.one_hot(labels, generated.shape[0]).to(dist.dtype)  # FedTGP: d + delta [c' = c]
    per_pair = F.cross_entropy(-dist, labels, reduction="none")  # FedTGP: CE over logits -(d + delta [c' = c])
    if weights is None:
        return per_pair.mean()
    return (per_pair * weights).sum() / weights.sum()


class FedTGPServer(PrototypeServer):
    options: FedTGPOptions

    def __init__(self, options: FedTGPOptions, spec, device):
        super().__init__(options, spec, device)
        torch.manual_seed(spec.seed)
        hidden = options.hidden_dim or spec.feature_dim
        self.generator = PrototypeGenerator(spec.num_classes, spec.feature_dim, hidden).to(device)
        self.seen = np.zeros(spec.num_classes, bool)
        self.shuffle = torch.Generator().manual_seed(spec.seed)
        self.margin = float(options.margin_threshold)

    def aggregate(self, updates, weights, version):
        sets, ws = self._pairs(updates, weights, version)
        if not sets:
            return {}
        means = aggregate_prototypes(sets, ws, self.options.aggregation)  # P^c: mean of the uploaded prototypes
        classes = sorted(means)
        self.margin = adaptive_margin(torch.tensor(np.stack([means[c][0] for c in classes])), self.options.margin_threshold)
        protos = torch.tensor(np.concatenate([ps.vectors for ps in sets]), device=self.device)
        labels = torch.tensor(np.concatenate([ps.class_ids for ps in sets]), device=self.device)
        pair_w = torch.tensor(np.concatenate([np.full(len(ps), w, np.float32) for ps, w in zip(sets, ws, strict=False)]), device=self.device)
        epochs = self.epochs_for(sum(1 for u in updates if u.prototypes is not None and len(u.prototypes)), len(sets))
        loss = self._train_generator(protos, labels, pair_w, epochs)
        self.seen[classes] = True
        self._refresh_bank(version)
        return {"server_loss": loss, "server_margin": self.margin, "server_epochs": float(epochs)}

    def epochs_for(self, new_uploads: int, trained_on: int) -> int:
        """Generator epochs for a version of ``new_uploads`` updates training on ``trained_on``
        uploads: ``server_epochs`` x new / trained (rounded, at least 1) with ``server_work:
        per_update``, the reference's work per client update; ``server_epochs`` with ``per_version``."""
        return generator_epochs(self.options.server_epochs, self.options.server_work, new_uploads, trained_on)

    @classmethod
    def server_work(cls, options: FedTGPOptions, sizes: ServerSizes) -> list[ServerPass]:
        """The generator's ``server_epochs`` over the version's prototype pairs (:func:`generator_work`)."""
        epochs = generator_epochs(options.server_epochs, options.server_work, sizes.updates,
                                  sizes.uploads(options.aggregation_scope))
        return generator_work(sizes, epochs, options.server_batch_size, options.hidden_dim, options.aggregation_scope)

    def _train_generator(self, protos: torch.Tensor, labels: torch.Tensor, pair_w: torch.Tensor, epochs: int) -> float:
        opt = optim.sgd(self.generator.parameters(), lr=self.options.server_lr)
        all_classes = torch.arange(self.spec.num_classes, device=self.device)
        self.generator.train()
        total, steps = 0.0, 0
        bs = self.options.server_batch_size
        for _ in range(epochs):
            order = torch.randperm(len(labels), generator=self.shuffle).to(self.device)
            for i in range(0, len(order), bs):
                idx = order[i : i + bs]
                loss = margin_contrastive_loss(protos[idx], labels[idx], self.generator(all_classes), self.margin, pair_w[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, steps = total + loss.item(), steps + 1
        return total / max(steps, 1)

    @torch.no_grad()
    def _refresh_bank(self, version: int) -> None:
        self.generator.eval()
        # reference update_Gen: G(c) for every class; "seen": only the classes ever uploaded
        ids = np.flatnonzero(self.seen) if self.options.broadcast_classes == "seen" else np.arange(self.spec.num_classes)
        gen = self.generator(torch.as_tensor(ids, device=self.device)).cpu().numpy()
        self.bank.update({int(c): (gen[i], 1.0) for i, c in enumerate(ids)}, version)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # copies: on CPU .numpy() shares memory with the live weights, and a rollback must restore
        # the generator as it was, not as later training left it
        state.update(generator={k: v.detach().cpu().numpy().copy() for k, v in self.generator.state_dict().items()},
                     seen=self.seen.copy(), margin=self.margin, shuffle=self.shuffle.get_state().numpy())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.load_state_dict({k: torch.as_tensor(v) for k, v in state["generator"].items()})
        self.seen = np.array(state["seen"])
        self.margin = float(state["margin"])
        self.shuffle.set_state(torch.as_tensor(state["shuffle"]))


class FedTGPClient(PrototypeAlignmentClient):
    """FedProto's local loss; the upload comes from the trained model (paper) or, with
    ``prototype_model: before_training``, from the model before this update's training (authors' code)."""

    options: FedTGPOptions

    def begin_local_train(self, model, batches):
        super().begin_local_train(model, batches)
        self._before_training: PrototypeSet | None = None
        if self.options.prototype_model == "before_training":
            # TsingZ0/FedTGP, HtFLlib system/flcore/clients/clienttgp.py, clientTGP.collect_protos: class
            # means of the features over the training split, eval mode, no gradients, with the model the
            # previous train() saved, i.e. the weights this update starts from. Taken here, before the
            # first step (the eval pass draws no random numbers: the training that follows is unchanged)
            self._before_training = local_prototypes(model, batches.x, batches.y)

    def make_update(self, model, x, y) -> ClientUpdate:
        protos, self._before_training = getattr(self, "_before_training", None), None
        if protos is None:
            return super().make_update(model, x, y)  # prototypes of the trained model (paper)
        self._train_protos = None
        return ClientUpdate(client_id=self.client_id, base_version=self.version, num_samples=len(y), prototypes=protos)


@ALGORITHMS.register("fedtgp", help="FedTGP: server-trained prototype generator with adaptive margin")
class FedTGP(Algorithm):
    Options = FedTGPOptions
    Client = FedTGPClient
    Server = FedTGPServer
    config_defaults = {"algorithm.server_lr": SameAs("training.lr"), "algorithm.server_batch_size": SameAs("training.batch_size")}
    roundless_config_defaults = {"algorithm.aggregation_scope": "latest"}
