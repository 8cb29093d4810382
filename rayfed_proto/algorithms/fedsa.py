"""FedSA (Zhou et al. AAAI 2025): semantic anchors as prototypes (papers/fedsa.md).

Server: random class anchors A ~ N(0, 1) in R^{C x D}, projected once at initialisation through
a randomly initialised, never-trained Linear-BatchNorm1d-ReLU x2 (batch statistics over the C
anchors; ALGORITHMS.md **Decision**, the authors' code; "ER" in Table 4). Anchors exist for
every class from version 0 and are the broadcast guidance. After each buffer of uploads the
anchors of the uploaded classes move by the EMA of Eq. 10,
    A^c <- alpha A^c + (1 - alpha) P^c,
P^c the staleness-weighted per-class mean of the uploaded local prototypes (Eq. 3; uniform over
the uploading clients by default, as the authors' ``serversa.py``); classes nobody uploaded keep
their anchor.

Client loss, Eq. 9: CE + lambda1_t L_R + lambda2 L_MCL + lambda3 L_CC with
  - L_R (Eq. 5): squared distance of each sample's feature to its class anchor (per sample, as
    the authors' code; ``alignment_reduction`` as the other prototype methods);
  - L_MCL (Eq. 6-7): CE over classes of logits -(d(f(x), A^c') + m [c' = y]), client-specific
    margin m = max(d_global, d_local), d_global the Eq. 6 statistic over the anchors (by default the
    authors' mean nearest-other-class distance, ``clientsa.py``), d_local the
    same over the client's previous local prototypes (0 before its first upload; d_global when it
    holds fewer than two classes);
  - L_CC (Eq. 8): CE(h(A), [0..C-1]) with the anchors detached: only the head moves.
lambda1_t = ``lam`` scaled by the shared ``alignment_schedule`` (it is the alignment term);
lambda2 and lambda3 are constant. Defaults: the authors' run scripts (``lokinko/FedSA``,
``system/cross-device setting.sh``: ``-lam 10 -mcl 1.0 -cc 1.0``, L_R as ``nn.MSELoss``, i.e.
``alignment_reduction: mean``), which produced the paper's tables; the paper's printed values
(lambda1 0.1, lambda2 0.01 for statistical / 1 for model heterogeneity) are the preset
``fedsa_digits_printed`` and ``lam: 0.1, lambda2: 0.01``.

Prototype inference (``inference_bank: prototypes``, default): the nearest of the server's
aggregated client prototypes P^c (Eq. 3, kept beside the anchors, a class nobody uploaded keeping
its last vector), as the authors' ``clientsa.test_metrics`` scores against the server's
``global_protos``; broadcast in ``extras`` as ``client_prototype_ids`` (m,) and
``client_prototype_vectors`` (m, D). ``inference_bank: anchors`` scores against the anchors. Ablation (Table 4): a term is off when its weight is 0 (it is
then still computed without gradient, for the logs); ER off with
``use_embedding_projection=False`` (raw N(0, 1) anchors); EMA off with ``use_ema=False``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import Algorithm, ClientAlgorithm, PrototypeOptions, PrototypeServer
from rayfed_proto.algorithms.common import (
    PrototypeBank,
    aggregate_prototypes,
    alignment_loss,
    bank_tensors,
    masked_cross_entropy,
    masked_mean,
    safe_cdist,
)
from rayfed_proto.messages import GlobalState, PrototypeSet

MarginStatistic = Literal["mean_pairwise", "mean_nearest"]
# broadcast extras: the server's aggregated client prototypes (the prototype inference bank)
PROTO_IDS, PROTO_VECTORS = "client_prototype_ids", "client_prototype_vectors"


class FedSAOptions(PrototypeOptions):
    lam: float = Field(10.0, ge=0, description="lambda1: weight of L_R (Eq. 9; authors' scripts -lam 10 with nn.MSELoss; "
                       "paper text 0.1); scaled by alignment_schedule")
    lambda2: float = Field(1.0, ge=0, description="weight of L_MCL (Eq. 9; authors' scripts -mcl 1.0; paper text 0.01 "
                           "statistical, 1 model heterogeneity); 0 turns it off")
    lambda3: float = Field(1.0, ge=0, description="weight of L_CC (Eq. 9; authors' scripts -cc 1.0, paper 1); 0 turns it off")
    # FedSA's reference client (lokinko/FedSA clientsa.py, as FedProto's) collects the uploaded
    # prototypes from the train-mode forward passes of the local epoch
    prototype_source: Literal["train", "eval"] = Field("train", description="uploaded prototypes: training passes "
                                                       "(reference code, default) or an eval-mode pass after training")
    alpha: float = Field(0.9999, ge=0, le=1, description="EMA decay of the anchors (Eq. 10); 1 freezes them, 0 replaces them")
    use_ema: bool = Field(True, description="EMA update of the anchors (Eq. 10); off: anchors stay at their initial values")
    use_embedding_projection: bool = Field(
        True, description="project the random anchors once through Linear-BN-ReLU x2 (ER, Table 4)")
    # the authors' clientsa.py cal_local_gap / cal_global_gap: mean over classes of the distance
    # to the nearest other class (lokinko/FedSA); the printed Eq. 6 is the mean pairwise distance
    margin_statistic: MarginStatistic = Field(
        "mean_nearest", description="Eq. 6: mean nearest-other-class distance (authors' code, default) or mean "
        "pairwise distance (as printed)")
    # the authors' serversa.py receive_protos -> proto_aggregation: the plain mean over the
    # clients that uploaded the class (yuetan031/fedproto's); Eq. 3 prints a sample-weighted sum
    aggregation: Literal["weighted", "uniform"] = Field(
        "uniform", description="P^c of Eq. 3: uniform mean over the uploading clients (authors' serversa.py, default) "
        "or sample-weighted (as printed)")
    inference_bank: Literal["prototypes", "anchors"] = Field(
        "prototypes", description="nearest-prototype inference against the server's aggregated client prototypes "
        "(authors' test_metrics) or against the anchors")
    # the authors' serversa.py replaces global_protos with each round's proto_aggregation; async
    # mode defaults to last_seen (FedSA.roundless_config_defaults)
    inference_memory: Literal["round", "last_seen"] = Field(
        "round", description="inference_bank prototypes: the classes of the latest aggregation only (authors' "
        "serversa.py, default in sync mode) or every class's last aggregated prototype (default in async mode)")


# ----------------------------------------------------------------------------- the equations


def margin_statistic(vectors: torch.Tensor, kind: MarginStatistic = "mean_nearest") -> float:
    """The Eq. 6 margin of a set of class vectors (one row per class); 0.0 with fewer than two.

    ``mean_pairwise``: the mean of d(P^a, P^b) over the pairs a != b. The paper prints the
    normaliser 1/(N-1)^2 for a sum over the N(N-1) ordered pairs; ALGORITHMS.md reads it as
    the mean pairwise distance, i.e. the normaliser N(N-1). ``mean_nearest``: the mean over
    classes of the distance to the nearest other class (the authors' code).
    """
    n = len(vectors)
    if n < 2:
        return 0.0
    v = torch.as_tensor(vectors, dtype=torch.float32)
    d = safe_cdist(v, v)
    off = ~torch.eye(n, dtype=torch.bool, device=d.device)
    if kind == "mean_pairwise":
        return float(d[off].sum() / (n * (n - 1)))  # FedSA Eq. 6: sum_a sum_{b != a} d(P^a, P^b) / #pairs
    if kind == "mean_nearest":
        return float(d.masked_fill(~off, float("inf")).min(1).values.mean())  # authors' code: mean_a min_{b != a} d
    raise ValueError(f"unknown margin statistic {kind!r}")


def client_margin(anchors: torch.Tensor, local: Optional[torch.Tensor], kind: MarginStatistic = "mean_nearest") -> float:
    """m = max(d_global, d_local) (FedSA, after Eq. 6).

    d_local is 0 before the client's first upload (``local`` None); with fewer than two local
    classes it is undefined and d_global is used (max(d_global, 0) = d_global).
    """
    d_global = margin_statistic(anchors, kind)
    d_local = margin_statistic(local, kind) if local is not None and len(local) >= 2 else 0.0
    return max(d_global, d_local)  # FedSA: d_i^* = max{d_global, d_i}


def mcl_loss(features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, margin: float,
             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """L_MCL: CE over classes of logits -(d(f(x), A^c') + m [c' = y]), mean over samples (Eq. 7).

    ``mask`` (C,) marks the classes that have an anchor (all of them in FedSA); absent classes
    are left out of the softmax and samples of absent classes are skipped.
    """
    if anchors.numel() == 0:
        return features.sum() * 0.0
    if mask is None:
        mask = torch.ones(anchors.shape[0], dtype=torch.bool, device=features.device)
    keep = mask[labels]  # masked, not selected: no host read per step
    dist = safe_cdist(features, anchors)
    dist = dist + margin * F.one_hot(labels, anchors.shape[0]).to(dist.dtype)  # FedSA Eq. 7: d(P, A^c) + d_i^* on the true class
    logits = (-dist).masked_fill(~mask.unsqueeze(0), float("-inf"))
    # FedSA Eq. 7: -log e^{-(d + m)} / (e^{-(d + m)} + sum_{c'} e^{-d(P, A^c')}), mean over the samples with an anchor
    return masked_cross_entropy(logits, labels, keep)


def classifier_calibration_loss(head: torch.nn.Module, anchors: torch.Tensor,
                                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """L_CC: CE(h(A^c), c) averaged over the classes with an anchor (Eq. 8).

    The anchors are detached, so the gradient reaches the head only, never the feature
    extractor or the anchors.
    """
    if anchors.numel() == 0:
        return sum(p.sum() for p in head.parameters()) * 0.0
    ids = torch.arange(anchors.shape[0], device=anchors.device)
    logits = head(anchors.detach())  # FedSA Eq. 8: phi_{i,j}^T A^c
    per_class = F.cross_entropy(logits, ids, reduction="none")  # FedSA Eq. 8: -log softmax_c
    if mask is None:
        return per_class.mean()  # FedSA Eq. 8: (1/C) sum_c
    return masked_mean(per_class, mask)  # over the classes with an anchor (0 if none); no host read per step


@torch.no_grad()
def project_anchors(anchors: torch.Tensor, seed: int) -> torch.Tensor:
    """Semantic anchors h_psi(A) (ER): a randomly initialised, never-trained
    Linear-BatchNorm1d-ReLU x2 seeded with ``seed``, BatchNorm on the C anchors' batch
    statistics (ALGORITHMS.md **Decision**, the authors' code). Same seed, same output; the
    global torch RNG is left untouched.
    """
    d = anchors.shape[1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = torch.nn.Sequential(
            torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d), torch.nn.ReLU(),
            torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d), torch.nn.ReLU(),
        ).to(anchors.device)
    layer.train(len(anchors) > 1)  # batch statistics over the C anchors (one anchor: the identity init stats)
    return layer(anchors)  # FedSA: A-bar = h_psi(A)


def ema_update(anchors: np.ndarray, class_means: dict[int, np.ndarray], alpha: float) -> np.ndarray:
    """Eq. 10 for the classes in ``class_means`` only: A^c <- alpha A^c + (1 - alpha) P^c.

    Returns a new (C, D) array; the rows of classes not in ``class_means`` are unchanged.
    """
    out = np.array(anchors, dtype=np.float32, copy=True)
    for c, p in class_means.items():
        out[c] = alpha * out[c] + (1.0 - alpha) * np.asarray(p, np.float32)  # FedSA Eq. 10
    return out


def initial_anchors(num_classes: int, feature_dim: int, seed: int, project: bool) -> np.ndarray:
    """A ~ N(0, 1) in R^{C x D} from ``seed``, projected (seed + 1) when ``project``."""
    a = torch.randn(num_classes, feature_dim, generator=torch.Generator().manual_seed(seed))  # FedSA: A^c ~ N(0, 1)
    if project:
        a = project_anchors(a, seed + 1)
    return a.numpy().astype(np.float32)


# ----------------------------------------------------------------------------- server and client


class FedSAServer(PrototypeServer):
    """Anchors for every class in the bank from version 0; EMA of the uploaded classes (Eq. 10)."""

    options: FedSAOptions

    def __init__(self, options: FedSAOptions, spec, device):
        super().__init__(options, spec, device)
        anchors = initial_anchors(spec.num_classes, spec.feature_dim, spec.seed, options.use_embedding_projection)
        self.bank.update({c: (anchors[c], 1.0) for c in range(spec.num_classes)}, 0)
        # aggregated client prototypes P^c (Eq. 3), the authors' ``global_protos``: inference bank
        self.prototypes = PrototypeBank(spec.num_classes, spec.feature_dim)

    @property
    def anchors(self) -> np.ndarray:
        return self.bank.vectors

    def aggregate(self, updates, weights, version):
        sets, ws = self._pairs(updates, weights, version)
        if not sets:
            return {}
        means = aggregate_prototypes(sets, ws, self.options.aggregation)  # FedSA Eq. 3: P^c (uniform: serversa.py)
        self.prototypes.update(means, version)  # authors' serversa.receive_protos: global_protos
        if not self.options.use_ema:
            return {"anchor_shift": 0.0, "anchor_classes_updated": 0.0}
        before = self.bank.vectors.copy()
        new = ema_update(before, {c: v for c, (v, _) in means.items()}, self.options.alpha)  # FedSA Eq. 10
        self.bank.update({c: (new[c], w) for c, (_, w) in means.items()}, version)
        shift = np.linalg.norm(new - before, axis=1)[sorted(means)]
        return {"anchor_shift": float(shift.mean()), "anchor_classes_updated": float(len(means))}

    def broadcast(self, version: int) -> GlobalState:
        # the inference bank: this version's aggregate only (authors' serversa.py) or every class's last
        protos = self.prototypes.as_set(version if self.options.inference_memory == "round" else None)
        return GlobalState(version=version, prototypes=self.bank.as_set(),
                           extras={PROTO_IDS: protos.class_ids, PROTO_VECTORS: protos.vectors})

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "prototypes": self.prototypes.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "prototypes" in state:  # checkpoints written before the bank existed start it empty
            self.prototypes.load_state_dict(state["prototypes"])
        else:
            self.prototypes = PrototypeBank(self.spec.num_classes, self.spec.feature_dim)


class FedSAClient(ClientAlgorithm):
    """Eq. 9 against the broadcast anchors; remembers its last uploaded prototypes for d_local."""

    options: FedSAOptions
    # not batchable: Eq. 7's margin reads this client's own last upload (d_local), not only the broadcast
    batchable = False
    unbatchable_reason = ("Eq. 7's margin m = max(d_global, d_local) reads the client's own last upload "
                          "(d_local), not only the broadcast: one client's loss cannot stand for another's")

    def __init__(self, options, spec, client_id):
        super().__init__(options, spec, client_id)
        self.local: Optional[PrototypeSet] = None  # last uploaded local prototypes (d_local)
        self._margin: Optional[float] = None
        self.client_prototypes: Optional[PrototypeSet] = None  # the server's aggregated P^c

    def receive(self, state: GlobalState, model: torch.nn.Module) -> None:
        super().receive(state, model)
        self._margin = None
        ids, vecs = state.extras.get(PROTO_IDS), state.extras.get(PROTO_VECTORS)
        self.client_prototypes = None if ids is None or vecs is None or not len(ids) else PrototypeSet(
            np.array(ids, np.int64), np.array(vecs, np.float32), np.ones(len(ids), np.int64))

    def inference_bank(self) -> Optional[PrototypeSet]:
        """The aggregated client prototypes (authors' ``clientsa.test_metrics``: nearest of the
        server's ``global_protos``; None before any upload was aggregated) or the anchors."""
        return self.guidance if self.options.inference_bank == "anchors" else self.client_prototypes

    def margin(self) -> float:
        """m = max(d_global, d_local) for the current anchors and last upload (cached)."""
        if self._margin is None:
            # copies: the broadcast's arrays are read-only views of Ray's object store
            anchors = torch.tensor(np.asarray(self.guidance.vectors)) if self.guidance is not None else torch.zeros(0, 0)
            local = torch.tensor(np.asarray(self.local.vectors)) if self.local is not None else None
            self._margin = client_margin(anchors, local, self.options.margin_statistic)
        return self._margin

    def loss(self, model, x, y):
        feats, logits = model.forward_features(x)
        ce = F.cross_entropy(logits, y)  # L_S of FedSA Eq. 9
        anchors, mask = bank_tensors(self.guidance, self.spec.num_classes, feats.device)
        opts = self.options
        r = alignment_loss(feats, y, anchors, mask, opts.alignment_reduction)  # FedSA Eq. 5: L_R = ||f(x) - A^y||^2
        lam1 = opts.alignment_weight(self.version)  # lambda1, or its curriculum (FedSAP Eq. 7)
        with torch.set_grad_enabled(torch.is_grad_enabled() and opts.lambda2 > 0):
            mcl = mcl_loss(feats, y, anchors, self.margin(), mask)  # FedSA Eq. 7
        with torch.set_grad_enabled(torch.is_grad_enabled() and opts.lambda3 > 0):
            cc = classifier_calibration_loss(model.head, anchors, mask)  # FedSA Eq. 8
        total = ce + lam1 * r  # FedSA Eq. 9: L_S + lambda1 L_R
        if opts.lambda2 > 0:
            total = total + opts.lambda2 * mcl  # FedSA Eq. 9: + lambda2 L_MCL
        if opts.lambda3 > 0:
            total = total + opts.lambda3 * cc  # FedSA Eq. 9: + lambda3 L_CC
        return total, {"ce": ce.detach(), "r": r.detach(), "mcl": mcl.detach(), "cc": cc.detach()}

    def make_update(self, model, x, y):
        update = super().make_update(model, x, y)
        self.local = update.prototypes  # for d_local in the next rounds
        self._margin = None
        return update

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.local is not None:
            state["local"] = {"class_ids": np.asarray(self.local.class_ids).copy(),
                              "vectors": np.asarray(self.local.vectors).copy(),
                              "counts": np.asarray(self.local.counts).copy()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        loc = state.get("local")
        self.local = None if loc is None else PrototypeSet(
            np.array(loc["class_ids"]), np.array(loc["vectors"]), np.array(loc["counts"]))
        self._margin = None


@ALGORITHMS.register("fedsa", help="FedSA: semantic anchors with margin-enhanced contrastive learning and classifier calibration")
class FedSA(Algorithm):
    Options = FedSAOptions
    Client = FedSAClient
    Server = FedSAServer
    # a version of K buffered updates is no round of the sampled clients: keep every class's last prototype
    roundless_config_defaults = {"algorithm.inference_memory": "last_seen"}
