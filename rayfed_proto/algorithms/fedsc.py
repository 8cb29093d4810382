"""FedSC (Wang et al. KDD 2025): FedAvg plus relational and consistent prototypes
(papers/fedsc.md).

Clients upload their weights and their local prototypes c_k^j with sample counts n_k^j (Eq. 3).
Server, each version: FedAvg of the weights (``FedAvgServer``, with its ``server_rule``),
then, over the client prototypes in scope (below), for every class j and the clients K^j that
hold it:
    g^j   = staleness-weighted mean of c_k^j over K^j                                 (Eq. 5)
    phi_k^j = cos(g^j, c_k^j)                                                        (Eq. 7)
    N_k^j = the M clients q in K^j \\ {k} with the smallest |phi_k^j - phi_q^j|, plus k (Eq. 8)
    r_k^j = mean of c_q^j over N_k^j (divided by its actual size, <= M + 1)           (Eq. 9)
    d_k   = sqrt(1/2 sum_j (n_k^j / n_k - 1/C)^2)                                     (Eq. 10)
    e_k^j = s_k sig(n_k / N - d_k / sum_i d_i) / sum_{i in K^j} s_i sig(...)          (Eq. 11)
    o^j   = sum_{k in K^j} e_k^j r_k^j                                                (Eq. 12)
s_k is the staleness weight of client k's upload (1 in sync mode). Eq. 11's normaliser runs
over the clients holding class j (ALGORITHMS.md **Decision**); N and sum_i d_i over the
clients in scope.

Scope (``aggregation_scope``, the name every method uses; ``prototype_scope`` is its deprecated
alias; the paper is synchronous): ``latest`` (variant paper) keeps every client's most recent upload
with the version it was trained against (``common.LatestUploads``: an older upload arriving late
never replaces a newer one) and uses all of them, each with staleness weight (1 + t - tau)^(-a)
at this version, as PrototypeServer's "latest"; ``buffer`` (variant code) uses only the updates
aggregated in this version (of a client twice in one buffer, its newer upload): in sync mode the
round's sampled clients, whose prototypes alone the authors' next round sees (``re_p`` is rebuilt
from ``list_local_p`` of the round's ``online_clients``).

Broadcast: the global weights, the consistent prototypes o^j as a ``PrototypeSet`` (classes that
never had one are absent; a class not covered by this version's scope keeps its last o^j),
which is also the nearest-prototype inference bank, and in ``extras`` every relational
prototype: ``relational`` (N, C, D) float32 with ``relational_mask`` (N, C) bool (True where
r_k^j exists) -- N x C x D x 4 bytes.

Client, ``variant: paper`` (Eq. 13-16): L = CE + w_rpcl L_RPCL + w_cpdr L_CPDR (both weights 1), z = f(x):
    s(z, r) = cos(z, r) / U_r,   U_r = mean over the mini-batch of ||z_b - r||_2 (detached)  (Eq. 13)
    L_RPCL  = -log sum_{r in R^y} e^{s(z, r)/tau} / sum_{r in R} e^{s(z, r)/tau}              (Eq. 14)
    L_CPDR  = sum_q |z_q - o^y_q|                                                            (Eq. 15)
R^y: every client's relational prototype of class y (positives); R: all of them.

Client, ``variant: code``: what the authors' runnable ``main_fedsc.py`` computes (docs/algorithms.md,
FedSC, quotes the lines). Its ``torch.mean(self.re_p[label_id], dim=0)`` gets a Python list and
raises TypeError; the bare ``except`` makes the RPCL positive and the CPDR target the sample's own
detached feature. So, once a prototype set has been received:
    L_CPDR = F.mse_loss(z, z.detach()) = 0, with zero gradient
    L_RPCL = mean_i -log( e^{cos(z_i, sg z_i)/tau} / (e^{cos(z_i, sg z_i)/tau}
                          + sum_m mult_m e^{cos(z_i, c_m)/tau}) ),  mult_m = #{j in batch: y_j != class(c_m)}
the negatives pooled over the whole batch (``InfoNCE_LCL.infonce_lcl_loss`` flattens every sample's
list and scores every sample against all of it), c_m the uploaded prototypes of the previous
version's clients (``get_re_p``'s merge is a no-op: M = 0; scope ``buffer``).

Variants (``variant``): ``code`` (default) is the authors' runnable code (``hwang52/FedSC``,
``main_fedsc.py`` and ``utils/options.py``): the loss above, M = 0, ``aggregation_scope: buffer``,
Eq. 11 normalised over every client in scope (``get_co_p``), prototypes averaged over the features
of the last local epoch's training passes (``prototype_source: train_last_epoch``), and as run
defaults plain SGD at lr 0.1 (no momentum, no weight decay) with 5 of 10 clients per round
(``federation.participation: 0.5``); ``paper`` is Sec. 4-5 as printed: Eq. 13-15, M = 2, an
eval-mode pass after training, SGD lr 0.01 momentum 0.9 weight decay 1e-5, every client in every
round. A key the user sets wins; the loss and Eq. 11's normaliser follow ``variant`` itself.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import Algorithm, Pass, UpdateSizes
from rayfed_proto.algorithms.common import (
    LatestUploads,
    PrototypeBank,
    bank_tensors,
    local_prototypes,
    masked_mean,
    safe_cdist,
)
from rayfed_proto.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from rayfed_proto.messages import ClientUpdate, GlobalState, PrototypeSet

FedSCVariant = Literal["code", "paper"]
# algorithm.* defaults of each variant (a value the user sets wins). The authors' main_fedsc.py:
# Local.local_train averages the features of the last local epoch (if tr_idx ==
# num_epochs_local_training - 1) and writes cpdr_loss = F.mse_loss(feas, torch.stack(reg_vector));
# Global.get_re_p writes its merge into a stacked copy and returns the raw per-client lists (M = 0);
# FedSC_main rebuilds re_p from the round's online_clients only (scope buffer). The paper prints
# Eq. 15 as an L1 sum, M = 2, and computes the prototypes from the trained model (Eq. 3-4).
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {
    "code": {"cpdr_reduction": "mse", "prototype_source": "train_last_epoch", "num_neighbors": 0,
             "aggregation_scope": "buffer"},
    "paper": {"cpdr_reduction": "sum", "prototype_source": "eval", "num_neighbors": 2, "aggregation_scope": "latest"},
}
# run-level defaults (training.*, federation.*) of each variant: the authors' Local.__init__ builds
# SGD(params, lr=args.lr_local_training) (utils/options.py: --lr_local_training 0.1, no momentum,
# no weight decay) and FedSC_main samples --num_online_clients 5 of --num_clients 10 per round; the
# paper (Sec. 5.1, "Configurations"): SGD lr 0.01, momentum 0.9, weight decay 1e-5, K = 10 clients
VARIANT_RUN_DEFAULTS: dict[str, dict[str, float]] = {
    "code": {"training.lr": 0.1, "training.momentum": 0.0, "training.weight_decay": 0.0,
             "federation.participation": 0.5},
    "paper": {"training.lr": 0.01, "training.momentum": 0.9, "training.weight_decay": 1e-5,
              "federation.participation": 1.0},
}


class FedSCOptions(FedAvgOptions):
    variant: FedSCVariant = Field(
        "code", description="what the authors' runnable code computes (hwang52/FedSC: RPCL with the sample's own "
        "feature as positive and the batch's pooled negatives, CPDR 0, M 0, buffer scope, last-epoch training-pass "
        "prototypes, SGD lr 0.1, 5 of 10 clients per round) or the paper (Eq. 13-15, M 2, eval-pass prototypes, SGD lr "
        "0.01 momentum 0.9 weight decay 1e-5, every client); other keys set explicitly win")
    num_neighbors: int = Field(2, ge=0, description="M: neighbouring clients merged into a relational prototype (Eq. 8; "
                               "paper 2; variant code 0, the authors' merge being a no-op)")
    tau: float = Field(0.05, gt=0, description="temperature of L_RPCL (Eq. 14; paper 0.05)")
    rpcl_weight: float = Field(1.0, ge=0, description="weight of L_RPCL (paper: 1, an unweighted sum); 0 turns it off")
    cpdr_weight: float = Field(1.0, ge=0, description="weight of L_CPDR (paper: 1, an unweighted sum); 0 turns it off")
    cpdr_reduction: Literal["sum", "mean", "mse"] = Field(
        "mse", description="variant paper's L_CPDR: summed L1 over the D dimensions (Eq. 15 as printed), its mean "
        "(divided by D), or the squared error averaged over the batch and D (F.mse_loss, the authors' form); variant "
        "code's target is the feature itself, 0 whatever the reduction")
    prototype_source: Literal["eval", "train", "train_last_epoch"] = Field(
        "train_last_epoch", description="uploaded prototypes: features of the last local epoch's training passes "
        "(the authors' code; variant code), of every epoch's, or an eval-mode pass after training (variant paper)")
    aggregation_scope: Literal["latest", "buffer"] = Field(
        "latest", description="client prototypes used by the server: every client's latest upload (staleness-weighted; "
        "variant paper) or only this version's buffer (variant code: the round's sampled clients; formerly prototype_scope)")

    @model_validator(mode="before")
    @classmethod
    def _variant_defaults(cls, data: Any) -> Any:
        """The chosen variant's values for the algorithm options the user left unset."""
        if not isinstance(data, dict):
            return data
        variant = data.get("variant", cls.model_fields["variant"].default)
        # an unknown or non-string variant adds nothing: validation then names the key and the values allowed
        return {**(VARIANT_OPTIONS.get(variant, {}) if isinstance(variant, str) else {}), **data}

    @model_validator(mode="before")
    @classmethod
    def _renamed_prototype_scope(cls, data: Any) -> Any:
        """``prototype_scope`` (the name up to issue 23) is read as ``aggregation_scope``, with a warning."""
        if not isinstance(data, dict) or "prototype_scope" not in data:
            return data
        data = dict(data)
        old = data.pop("prototype_scope")
        if "aggregation_scope" in data and data["aggregation_scope"] != old:
            # reported at the old key (not at the whole section, as a ValueError here would be)
            msg = (f"the deprecated name of aggregation_scope, which is set too, to {data['aggregation_scope']!r}: "
                   "keep aggregation_scope only")
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                type=PydanticCustomError("renamed_option", msg), loc=("prototype_scope",), input=old)])
        warnings.warn(f"algorithm.prototype_scope is deprecated: it was renamed algorithm.aggregation_scope (the name "
                      f"every method uses, same values); read as aggregation_scope = {old!r}. Write "
                      "aggregation_scope in your config", FutureWarning, stacklevel=2)
        data["aggregation_scope"] = old
        return data


# ----------------------------------------------------------------------------- server equations


def dense_uploads(sets: dict[int, PrototypeSet], num_clients: int, num_classes: int, dim: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """{client: upload} -> prototypes (N, C, D), held (N, C) bool, counts (N, C)."""
    protos = np.zeros((num_clients, num_classes, dim), np.float64)
    held = np.zeros((num_clients, num_classes), bool)
    counts = np.zeros((num_clients, num_classes), np.float64)
    for k, ps in sets.items():
        ids = np.asarray(ps.class_ids, np.int64)
        protos[k, ids] = np.asarray(ps.vectors, np.float64)
        held[k, ids] = True
        counts[k, ids] = np.asarray(ps.counts, np.float64)
    return protos, held, counts


def global_prototypes(protos: np.ndarray, held: np.ndarray, client_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g^j = sum_{k in K^j} s_k c_k^j / sum_{k in K^j} s_k, and the (C,) mask of classes held
    by anyone (FedSC Eq. 5 is the s_k = 1 case: the plain mean over the clients holding j)."""
    w = held * client_weights[:, None]  # (N, C)
    tot = w.sum(0)
    present = tot > 0
    g = np.einsum("kc,kcd->cd", w, protos) / np.where(present, tot, 1.0)[:, None]  # FedSC Eq. 5
    return g, present


def cosine_to_global(protos: np.ndarray, g: np.ndarray) -> np.ndarray:
    """phi_k^j = cos(g^j, c_k^j) for every (k, j) (FedSC Eq. 7); 0 where a vector is zero."""
    pn = protos / np.maximum(np.linalg.norm(protos, axis=2, keepdims=True), 1e-12)
    gn = g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-12)
    return np.einsum("kcd,cd->kc", pn, gn)  # FedSC Eq. 7


def neighbor_sets(phi: np.ndarray, holders: np.ndarray, num_neighbors: int) -> dict[int, list[int]]:
    """For one class: each holder k -> [k] + its ``num_neighbors`` holders q != k with the
    smallest |phi_k - phi_q| (FedSC Eq. 8); fewer when fewer clients hold the class. Ties go to
    the lower client id (a stable sort)."""
    out = {}
    for k in holders:
        others = np.array([q for q in holders if q != k], np.int64)
        gap = np.abs(phi[k] - phi[others])  # FedSC Eq. 8: |phi_k^j - phi_q^j|
        chosen = others[np.argsort(gap, kind="stable")[:num_neighbors]]  # argsort^M, small to large
        out[int(k)] = [int(k)] + [int(q) for q in chosen]  # ... or k_2 = k_1
    return out


def relational_prototypes(protos: np.ndarray, held: np.ndarray, g: np.ndarray, num_neighbors: int
                          ) -> tuple[np.ndarray, np.ndarray]:
    """r_k^j = mean of c_q^j over client k's neighbour set of class j (FedSC Eq. 7-9), for every
    (k, j) with k holding j; (N, C, D) and the (N, C) mask. Divided by the actual size of the
    set (Eq. 9 prints M + 1, which shrinks the vector when fewer than M others hold j)."""
    phi = cosine_to_global(protos, g)
    rel = np.zeros_like(protos)
    for j in range(held.shape[1]):
        holders = np.flatnonzero(held[:, j])
        for k, group in neighbor_sets(phi[:, j], holders, num_neighbors).items():
            rel[k, j] = protos[group, j].mean(0)  # FedSC Eq. 9: sum_q A^j(k, q) c_q^j / |N_k^j|
    return rel, held.copy()


def discrepancy(counts: np.ndarray) -> np.ndarray:
    """d_k = sqrt(1/2 sum_j (n_k^j / n_k - 1/C)^2) per client row of ``counts`` (FedSC Eq. 10);
    0 for a row without samples."""
    n = counts.sum(1, keepdims=True)
    b = counts / np.where(n > 0, n, 1.0)  # B_k^j = n_k^j / n_k
    d = np.sqrt(0.5 * ((b - 1.0 / counts.shape[1]) ** 2).sum(1))  # FedSC Eq. 10
    return np.where(n[:, 0] > 0, d, 0.0)


def consistent_weights(counts: np.ndarray, held: np.ndarray, client_weights: np.ndarray,
                       normalise_over: Literal["class", "clients"] = "class") -> np.ndarray:
    """e_k^j (N, C): s_k Sigmoid(n_k / N - d_k / sum_i d_i), normalised over the clients holding
    class j (FedSC Eq. 11; ALGORITHMS.md Decision on the index), or with ``clients`` over every
    client in scope, as the authors' ``get_co_p`` (``list_e = list_e / sum(list_e)``; variant
    code), so that a class few clients hold gets weights summing to less than 1. N and sum_i d_i
    run over the clients in scope (those holding any class); with sum_i d_i = 0 the d term is 0."""
    present = held.any(1)
    n_k = counts.sum(1)
    d = discrepancy(counts)
    n_total = n_k[present].sum()
    d_total = d[present].sum()
    a = 1.0 / n_total if n_total > 0 else 0.0  # a = 1 / N
    b = 1.0 / d_total if d_total > 0 else 0.0  # b = 1 / sum_i d_i
    sig = 1.0 / (1.0 + np.exp(-(a * n_k - b * d)))  # FedSC Eq. 11: Sigmoid(a n_k - b d_k)
    raw = held * (client_weights * sig)[:, None]
    if normalise_over == "clients":  # hwang52/FedSC main_fedsc.py get_co_p: over the round's clients
        tot = np.full(raw.shape[1], (client_weights * sig)[present].sum())
    else:
        tot = raw.sum(0)  # FedSC Eq. 11: normalised over K^j
    return raw / np.where(tot > 0, tot, 1.0)[None, :]


def consistent_prototypes(rel: np.ndarray, held: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """o^j = sum_{k in K^j} e_k^j r_k^j (FedSC Eq. 12) and the (C,) mask of classes with one."""
    o = np.einsum("kc,kcd->cd", e * held, rel)  # FedSC Eq. 12
    return o, held.any(0)


# ----------------------------------------------------------------------------- client equations


def rpcl_loss(z: torch.Tensor, labels: torch.Tensor, rel: torch.Tensor, rel_labels: torch.Tensor, tau: float) -> torch.Tensor:
    """L_RPCL (FedSC Eq. 13-14), mean over the samples whose class has a relational prototype.

    ``rel`` (m, D) holds every client's relational prototypes, ``rel_labels`` (m,) their
    classes. s(z, r) = cos(z, r) / U_r with U_r the mean distance of the mini-batch's features
    to r, detached (a normaliser estimated on the batch). Positives: the prototypes of the
    sample's class; the denominator sums over all of them (positives and negatives)."""
    if rel.numel() == 0:
        return z.sum() * 0.0
    positive = labels.unsqueeze(1) == rel_labels.unsqueeze(0)  # (B, m): r in R^{y_i}
    keep = positive.any(1)  # masked, not selected: no host read per step
    u = safe_cdist(z.detach(), rel).mean(0).clamp_min(1e-12)  # FedSC Eq. 13: U = mean_q ||z_q - r||
    cos = F.normalize(z, dim=1) @ F.normalize(rel, dim=1).T
    logits = cos / u.unsqueeze(0) / tau  # FedSC Eq. 13-14: s(z, r) / tau
    # rows without a positive get an arbitrary one (column 0) so that pos stays finite; they weigh 0
    positive = positive | (~keep).unsqueeze(1) & (torch.arange(len(rel), device=z.device) == 0).unsqueeze(0)
    pos = torch.logsumexp(logits.masked_fill(~positive, float("-inf")), dim=1)  # log sum_{R^j} e^{s/tau}
    every = torch.logsumexp(logits, dim=1)  # log (sum_{R^j} + sum_{R^{N_j}}) e^{s/tau}
    return masked_mean(every - pos, keep)  # FedSC Eq. 14


def rpcl_loss_code(z: torch.Tensor, labels: torch.Tensor, protos: torch.Tensor, proto_labels: torch.Tensor,
                   tau: float) -> torch.Tensor:
    """L_RPCL as the authors' runnable code computes it (hwang52/FedSC ``main_fedsc.py``
    ``Local.local_train``, ``utils/infonce_lcl.py`` ``infonce_lcl_loss``; variant code).

    The positive key of every sample is its own detached feature (the ``except`` branch: the
    ``torch.mean`` on a list above it always raises), so its logit is cos(z_i, sg z_i) = 1 with
    zero gradient. The negatives are pooled over the batch: sample j adds every prototype of
    every class but y_j, and every sample is scored against the whole pool, so prototype m of
    class c enters mult_m = #{j: y_j != c} times (a sample's own class among them when the batch
    holds other classes):
        mean_i -log( e^{cos(z_i, sg z_i)/tau} / (e^{cos(z_i, sg z_i)/tau} + sum_m mult_m e^{cos(z_i, c_m)/tau}) )
    With an empty pool (the code's ``torch.stack([])`` would raise) only the positive is left: 0."""
    zn = F.normalize(z, dim=1)
    pos = (zn * F.normalize(z.detach(), dim=1)).sum(1, keepdim=True)  # infonce_lcl.py: pos_logit, pos_key = feas[i].detach()
    if protos.numel() == 0:
        return z.sum() * 0.0  # F.cross_entropy over the positive alone: 0
    neg = zn @ F.normalize(protos, dim=1).T  # infonce_lcl.py: neg_logits = query @ neg_keys, (B, m)
    mult = (labels.unsqueeze(1) != proto_labels.unsqueeze(0)).sum(0)  # (m,): copies of c_m in the pooled list
    neg = (neg / tau + mult.clamp_min(1).log()).masked_fill(mult == 0, float("-inf"))  # mult_m e^{cos/tau}
    logits = torch.cat([pos / tau, neg], dim=1)
    target = torch.zeros(z.shape[0], dtype=torch.int64, device=z.device)
    return F.cross_entropy(logits, target)  # infonce_lcl.py: F.cross_entropy(logits / tau, 0, reduction='mean')


def cpdr_loss(z: torch.Tensor, labels: torch.Tensor, consistent: torch.Tensor, mask: torch.Tensor,
              reduction: Literal["sum", "mean", "mse"] = "sum") -> torch.Tensor:
    """L_CPDR = sum_q |z_q - o^y_q| (FedSC Eq. 15), mean over samples whose class has o^y;
    ``mean`` divides by D. ``mse``: the authors' ``F.mse_loss(feas, reg_vector)``, the squared
    error averaged over every sample of the batch and the D dimensions, a sample whose class has
    no o^y counting with its own detached feature as target (0)."""
    if consistent.numel() == 0:
        return z.sum() * 0.0
    keep = mask[labels]  # masked, not selected: no host read per step
    if reduction == "mse":
        # hwang52/FedSC main_fedsc.py Local.local_train: F.mse_loss(feas, torch.stack(reg_vector))
        sq = ((z - consistent[labels]) ** 2).sum(1) * keep.to(z.dtype)
        return sq.sum() / (z.shape[0] * z.shape[1])
    per_sample = (z - consistent[labels]).abs().sum(1)  # FedSC Eq. 15
    if reduction == "mean":
        per_sample = per_sample / z.shape[1]
    return masked_mean(per_sample, keep)


# ----------------------------------------------------------------------------- server and client


class FedSCServer(FedAvgServer):
    """FedAvg of the weights; relational and consistent prototypes from the client prototypes."""

    options: FedSCOptions

    def __init__(self, options: FedSCOptions, spec, device):
        super().__init__(options, spec, device)
        n, c, d = spec.num_clients, spec.num_classes, spec.feature_dim
        self.latest: LatestUploads[PrototypeSet] = LatestUploads(spec.staleness_exponent)  # client -> (upload, tau)
        self.relational = np.zeros((n, c, d), np.float32)
        self.relational_mask = np.zeros((n, c), bool)
        self.bank = PrototypeBank(c, d)  # consistent prototypes o^j

    def _scope(self, updates: list[ClientUpdate], weights: list[float], version: int
               ) -> tuple[dict[int, PrototypeSet], dict[int, float]]:
        """The client prototypes this version uses and each client's staleness weight."""
        if self.options.aggregation_scope == "latest":
            for u in updates:
                if u.prototypes is not None and len(u.prototypes):
                    self.latest.offer(u.client_id, u.prototypes, u.base_version)
            entries = self.latest.weighted(version)  # s_k = (1 + t - tau_k)^(-a), t = version - 1
            return {k: ps for k, ps, _ in entries}, {k: w for k, _, w in entries}
        # buffer: this version's uploads with the runtime's weights; of a client twice, the newer
        buffered: LatestUploads[tuple[PrototypeSet, float]] = LatestUploads(self.spec.staleness_exponent)
        for u, w in zip(updates, weights, strict=False):
            if u.prototypes is not None and len(u.prototypes):
                buffered.offer(u.client_id, (u.prototypes, float(w)), u.base_version)
        return {k: ps for k, ((ps, _), _) in buffered.items()}, {k: w for k, ((_, w), _) in buffered.items()}

    def aggregate(self, updates, weights, version):
        metrics = super().aggregate(updates, weights, version)  # FedAvg of the weights
        sets, ws = self._scope(updates, weights, version)
        if not sets:
            return metrics
        spec = self.spec
        protos, held, counts = dense_uploads(sets, spec.num_clients, spec.num_classes, spec.feature_dim)
        s = np.zeros(spec.num_clients)
        for k, w in ws.items():
            s[k] = w
        g, _ = global_prototypes(protos, held, s)  # FedSC Eq. 5
        rel, rel_mask = relational_prototypes(protos, held, g, self.options.num_neighbors)  # FedSC Eq. 7-9
        over = "clients" if self.options.variant == "code" else "class"
        e = consistent_weights(counts, held, s, over)  # FedSC Eq. 10-11
        o, o_mask = consistent_prototypes(rel, held, e)  # FedSC Eq. 12
        self.relational, self.relational_mask = rel.astype(np.float32), rel_mask
        weight_per_class = counts.sum(0)
        self.bank.update({int(c): (o[c].astype(np.float32), float(weight_per_class[c])) for c in np.flatnonzero(o_mask)}, version)
        present = held.any(1)
        metrics.update(prototype_clients=float(present.sum()), consistent_classes=float(o_mask.sum()),
                       discrepancy_mean=float(discrepancy(counts)[present].mean()))
        return metrics

    def broadcast(self, version: int) -> GlobalState:
        return GlobalState(version=version, weights=self.global_weights, prototypes=self.bank.as_set(),
                           extras={"relational": self.relational.copy(), "relational_mask": self.relational_mask.copy()})

    def guidance_bank(self) -> Optional[PrototypeSet]:
        return self.bank.as_set()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(latest=self.latest.state_dict(), relational=self.relational.copy(),
                     relational_mask=self.relational_mask.copy(), bank=self.bank.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.latest.load_state_dict(state.get("latest", {}))
        self.relational = np.array(state["relational"], np.float32)
        self.relational_mask = np.array(state["relational_mask"], bool)
        self.bank.load_state_dict(state["bank"])


class FedSCClient(FedAvgClient):
    """Loads the global weights; CE + L_RPCL + L_CPDR; uploads weights and local prototypes."""

    options: FedSCOptions

    def __init__(self, options, spec, client_id):
        super().__init__(options, spec, client_id)
        self.relational: Optional[torch.Tensor] = None  # (m, D): every relational prototype broadcast
        self.relational_labels: Optional[torch.Tensor] = None  # (m,): their classes

    def receive(self, state: GlobalState, model) -> None:
        super().receive(state, model)  # global weights; guidance = consistent prototypes
        rel, mask = state.extras.get("relational"), state.extras.get("relational_mask")
        if rel is None or mask is None or not np.asarray(mask).any():
            self.relational = self.relational_labels = None
            return
        mask = np.asarray(mask, bool)
        _, classes = np.nonzero(mask)
        self.relational = torch.tensor(np.asarray(rel)[mask], dtype=torch.float32)  # copy: object-store arrays are read-only
        self.relational_labels = torch.tensor(classes, dtype=torch.int64)

    def _relational(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The received relational prototypes (m, D) and their classes (m,), on z's device."""
        if self.relational is None:
            return z.new_zeros(0, z.shape[1]), torch.zeros(0, dtype=torch.int64, device=z.device)
        if self.relational.device != z.device:  # moved once per received state, not per batch
            self.relational, self.relational_labels = self.relational.to(z.device), self.relational_labels.to(z.device)
        return self.relational.to(z.dtype), self.relational_labels  # the model's float type (broadcasts are float32)

    def loss(self, model, x, y):
        z, logits = model.forward_features(x)
        ce = F.cross_entropy(logits, y)  # FedSC Eq. 16
        o = self.options
        rel, rel_y = self._relational(z)
        with torch.set_grad_enabled(torch.is_grad_enabled() and o.rpcl_weight > 0):
            if o.variant == "code":  # main_fedsc.py: self.lcl_func.infonce_lcl_loss(feas, pos_key, neg_keys)
                rpcl = rpcl_loss_code(z, y, rel, rel_y, o.tau)
            else:
                rpcl = rpcl_loss(z, y, rel, rel_y, o.tau)  # FedSC Eq. 13-14
        with torch.set_grad_enabled(torch.is_grad_enabled() and o.cpdr_weight > 0):
            if o.variant == "code":  # main_fedsc.py: reg_vector = feas[i].detach() (the except branch)
                cpdr = F.mse_loss(z, z.detach())  # 0, with zero gradient
            else:
                consistent, mask = bank_tensors(self.guidance, self.spec.num_classes, z.device)
                consistent = consistent.to(z.dtype)  # the model's float type (broadcasts are float32)
                cpdr = cpdr_loss(z, y, consistent, mask, o.cpdr_reduction)  # FedSC Eq. 15
        total = ce  # FedSC Eq. 16: L = L_CE + L_RPCL + L_CPDR (weights 1 in the paper and the code)
        if o.rpcl_weight > 0:
            total = total + o.rpcl_weight * rpcl
        if o.cpdr_weight > 0:
            total = total + o.cpdr_weight * cpdr
        return total, {"ce": ce.detach(), "rpcl": rpcl.detach(), "cpdr": cpdr.detach()}

    @classmethod
    def update_work(cls, options, sizes: UpdateSizes) -> list[Pass]:
        """FedAvg's local epochs, plus the eval-mode pass over the training split for the local
        prototypes (Eq. 3-4) with ``prototype_source: eval`` (the training passes cost nothing more)."""
        work = super().update_work(options, sizes)
        if options.prototype_source == "eval":
            work.append(Pass("train", sizes.train, backward=False))
        return work

    def make_update(self, model, x, y) -> ClientUpdate:
        update = super().make_update(model, x, y)  # weights (FedAvg path)
        protos, self._train_protos = getattr(self, "_train_protos", None), None  # collected by local_train
        # FedSC Eq. 3-4, with counts n_k^j: from the training passes, or an eval-mode pass now
        update.prototypes = protos if protos is not None else local_prototypes(model, x, y)
        return update

    def inference_bank(self) -> Optional[PrototypeSet]:
        return self.guidance  # nearest consistent prototype


@ALGORITHMS.register("fedsc", help="FedSC: FedAvg plus relational-prototype contrast and consistent-prototype regularisation")
class FedSC(Algorithm):
    Options = FedSCOptions
    Client = FedSCClient
    Server = FedSCServer
    requires_homogeneous_models = True
    config_defaults = {"data.global_test_fraction": 0.2}

    @classmethod
    def defaults_for(cls, options: dict[str, Any], in_rounds: bool) -> dict[str, Any]:
        """Also the run-level defaults of the chosen ``variant`` (optimizer, participation)."""
        variant = options.get("variant", FedSCOptions.model_fields["variant"].default)
        run = VARIANT_RUN_DEFAULTS.get(variant, {}) if isinstance(variant, str) else {}  # bad values: reported by validation
        return {**super().defaults_for(options, in_rounds), **run}
