"""FedSAP (Casado-Diez et al. 2026): scheduled alignment and proxy separation, with the optional
semi-supervised extension (Sec. 3.6).

Client (Eq. 3): CE + lambda_t * L_Proto + L_Proxy, where
- L_Proto (Eq. 5) is the squared distance of f(x) to the global prototype of its class, divided
  by D (``nn.MSELoss``, FedProto's code; ``alignment_reduction: sum`` is Eq. 5 as printed), over
  the samples whose class has one;
- lambda_t (Eq. 7 and appendix) = M * g((t - r_start) / t_w), the shared alignment curriculum
  (:mod:`rayfed_proto.algorithms.schedules`) at round t = the server version the client trained
  against + 1 (rounds counted from 1); defaults M 0.7, linear from round 20 to full at round 100
  (which trains against version 99);
- L_Proxy (Eq. 8-9) is a cosine-softmax CE whose proxies are the global prototypes themselves:
  z_c = s * <f(x)/|f(x)|, P^c/|P^c|>, s default 32, over the classes that have a global
  prototype, for the samples whose class has one (0 before any prototype exists).
Server: per-class uniform mean of the uploaded local prototypes (Eq. 2), FedProto's server.
Prototype inference uses the global prototypes.

Ablations from config (Table 4): ``use_proxy: false`` drops L_Proxy; ``alignment_schedule: null``
makes lambda_t the constant M.

Semi-supervised extension (Sec. 3.6, Eq. 10-14), ``semi_supervised: {...}`` (off by default;
off, nothing above changes). Everything happens inside the client:
- Pool (the paper's regime, Table 3): with ``data.partition.unlabelled_per_client`` the
  partition gives each client a separate pool of its classes, handed over once by the runtime
  (``set_unlabelled_pool``); the whole training split is then labelled and the pool is the
  unlabelled data below (``unlabelled_fraction`` unused).
- Split (without a pool): once, each client hides the labels of ``unlabelled_fraction`` of its training split,
  per class (stratified, at least one labelled sample kept per class: the unlabelled pool holds
  known classes only, the paper's closed-set assumption), seeded by (spec.seed, client_id). The
  mask lives in the client state. Hidden labels are only read to report ``pseudo_accuracy``.
- Supervised phase (version < T_sup = ``supervised_versions``): Eq. 3 on the labelled part only,
  with seeded batches over it drawn from the runtime's batch generator.
- Calibration (Eq. 11): at the first local update with version >= T_sup, on the labelled part
  (eval mode, clean inputs) against the current global bank: among labelled samples whose
  nearest prototype is their own class, M = ``margin_quantile`` (default 0.10) of the margins
  d2 - d1 and D_max = ``distance_quantile`` (default 0.90) of the nearest distances d1
  (cosine distances, torch.quantile's linear interpolation). Kept in the client state; retried
  at the next update when impossible (no bank, or no correctly assigned labelled sample).
- Semi-supervised phase: every step also draws ``unlabelled_batch_ratio`` x batch_size
  unlabelled samples; weak view (eval mode, no grad) -> nearest cosine prototype (Eq. 10) ->
  accepted when d2 - d1 > M and d1 < D_max (Eq. 11) -> L_Cons = mean over the accepted of
  1 - cos(f(strong view), P^pseudo) (Eq. 12), 0 when none; loss = Eq. 3 + lambda_Cons * L_Cons
  (Eq. 13). Weak view: random shift by up to ``weak_shift`` px (replicate pad + crop); strong
  view: shift by up to ``strong_shift`` px, Gaussian noise (``strong_noise_std``), a cutout
  square of side ``cutout_fraction`` of the image; all drawn from the batch generator.
- Upload (Eq. 14): for each class the client holds labels of, (sum of labelled embeddings +
  alpha * sum of embeddings of the samples accepted into that class during this update) /
  (|L_c| + alpha |A_c|), embeddings recomputed in eval mode; counts |L_c| + |A_c|.
- Reported terms (-> MLflow ``train_<term>``): ``pseudo_candidates`` and ``pseudo_accepted``
  (pseudo-labelling decisions this update), ``pseudo_accuracy`` (accepted pseudo-labels equal to
  the hidden label / accepted; NaN when none), ``cons``, and once calibrated
  ``pseudo_margin_threshold`` / ``pseudo_distance_threshold``.

Decisions (the paper leaves them open; ALGORITHMS.md, FedSAP):
- alpha 0.5, lambda_Cons 1 and the calibration quantiles (0.10 of margins, 0.90 of nearest
  distances of correctly assigned labelled samples) are not stated in the paper.
- Eq. 10 takes the argmin over the whole global bank, as printed (``restrict_to_local_classes``
  restricts it to the classes the client holds labels of). Accepted samples whose pseudo-label
  is a class the client holds no labels of still get L_Cons but are left out of the upload.
- Eq. 14 prints h^(s) (strong-view embeddings) and norm(.) around the mix. Embeddings of accepted
  samples are recomputed in eval mode on the clean input, like the labelled ones, and the mix
  is not l2-normalised by default (``normalize_prototypes: true`` normalises every uploaded
  vector in the semi-supervised phase): L_Proto (Eq. 5) is Euclidean to unnormalised means, and
  normalising only the mixed classes would put them at another scale than the rest of the bank.
- ``num_samples`` of the upload is the number of labelled samples plus accepted samples.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import (
    Algorithm,
    ClientAlgorithm,
    Options,
    Pass,
    PrototypeOptions,
    PrototypeServer,
    StepTally,
    TrainBatchIterator,
    UpdateSizes,
    steps_per_epoch,
)
from rayfed_proto.algorithms.common import alignment_loss, bank_tensors, masked_cross_entropy
from rayfed_proto.algorithms.schedules import AlignmentSchedule
from rayfed_proto.messages import ClientUpdate, PrototypeSet


class SemiSupervisedOptions(Options):
    """FedSAP Sec. 3.6: two-phase semi-supervised protocol (see the module docstring)."""

    unlabelled_fraction: float = Field(
        0.5, gt=0, lt=1, description="fraction of each client's training split whose labels are hidden (per class)")
    supervised_versions: int = Field(
        100, ge=0, description="T_sup: server versions of the supervised phase (Table 3: 100)")
    alpha: float = Field(0.5, ge=0, description="alpha: weight of accepted pseudo-labelled embeddings in Eq. 14")
    consistency_weight: float = Field(1.0, ge=0, description="lambda_Cons: weight of L_Cons in Eq. 13")
    margin_quantile: float = Field(
        0.10, ge=0, le=1, description="M = this quantile of d2 - d1 over correctly assigned labelled samples (Eq. 11)")
    distance_quantile: float = Field(
        0.90, ge=0, le=1, description="D_max = this quantile of d1 over correctly assigned labelled samples (Eq. 11)")
    unlabelled_batch_ratio: int = Field(
        1, ge=1, description="unlabelled samples per step = this x the batch size")
    restrict_to_local_classes: bool = Field(
        False, description="pseudo-label among the classes the client holds labels of only (Eq. 10 as printed: whole bank)")
    normalize_prototypes: bool = Field(
        False, description="l2-normalise uploaded prototypes in the semi-supervised phase (Eq. 14's norm)")
    weak_shift: int = Field(2, ge=0, description="weak view: random shift of up to this many pixels")
    strong_shift: int = Field(4, ge=0, description="strong view: random shift of up to this many pixels")
    strong_noise_std: float = Field(0.1, ge=0, description="strong view: std of the additive Gaussian noise")
    cutout_fraction: float = Field(
        0.25, ge=0, le=1, description="strong view: side of the cutout square as a fraction of the image side")


class FedSAPOptions(PrototypeOptions):
    lam: float = Field(0.7, ge=0, description="M: maximum alignment weight, reached at the end of the ramp (Eq. 7)")
    aggregation: Literal["weighted", "uniform"] = Field(
        "uniform", description="per-class mean of uploads: uniform over clients (FedSAP Eq. 2) or sample-weighted")
    # Eq. 5 prints ||f(x) - P^y||_2^2 but the paper calls it "this MSE formulation" and builds on
    # FedProto, whose code computes the term with nn.MSELoss (HtFLlib clientproto.py, loss_mse),
    # i.e. divided by D; "sum" (Eq. 5 as printed) weighs the term D times more (512x at D = 512)
    alignment_reduction: Literal["mean", "sum"] = Field(
        "mean", description="||f - P||^2 averaged over dimensions (nn.MSELoss, as FedProto's code, default) or "
        "summed (Eq. 5 as printed)")
    alignment_schedule: Optional[AlignmentSchedule] = Field(
        AlignmentSchedule(shape="linear", start=20, length=80),  # a copy per instance (pydantic copies defaults)
        description="alignment curriculum (Eq. 7; default linear from round 20 to full at round 100, i.e. versions 19 "
        "to 99 trained against); null: constant M")
    proxy_scale: float = Field(32.0, gt=0, description="s: scale of the cosine proxy logits (Eq. 8-9)")
    use_proxy: bool = Field(True, description="add the proxy separation loss L_Proxy (Eq. 8-9)")
    semi_supervised: Optional[SemiSupervisedOptions] = Field(
        None, description="semi-supervised extension (Sec. 3.6, Eq. 10-14); null: fully supervised")

    def run_issues(self, rounds: int) -> list[tuple[str, Any, str]]:
        ssl = self.semi_supervised
        if ssl is not None and ssl.supervised_versions >= rounds:
            return [("semi_supervised.supervised_versions", ssl.supervised_versions,
                     f"fewer than federation.rounds ({rounds}), or the semi-supervised phase never starts")]
        return []


def proxy_logits(features: torch.Tensor, bank_vectors: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, m) scaled cosine logits z_{i,c} = s * <f_i/|f_i|, P^c/|P^c|> against m bank vectors."""
    h = F.normalize(features, dim=1)  # FedSAP Eq. 8: h_i = f(x_i) / |f(x_i)|
    p = F.normalize(bank_vectors.to(features.dtype), dim=1)  # FedSAP Eq. 8: P^c / |P^c|
    return scale * h @ p.T  # FedSAP Eq. 9: z_{i,c} = s * h_i^T P^c


def proxy_loss(features: torch.Tensor, labels: torch.Tensor, bank: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Cosine-softmax CE against the global prototypes as proxies (FedSAP Eq. 9).

    ``bank`` (C, D) and ``mask`` (C,) are :func:`bank_tensors`' output. The softmax runs over
    the classes present in the bank only; samples whose class is absent are skipped and the
    loss is the mean over the kept samples; 0 (still in the graph) when none is kept.
    """
    if bank.numel() == 0:
        return features.sum() * 0.0
    keep = mask[labels]  # masked, not selected: no host read per step
    logits = proxy_logits(features, bank, scale).masked_fill(~mask.unsqueeze(0), float("-inf"))  # absent classes out
    return masked_cross_entropy(logits, labels, keep)  # FedSAP Eq. 9: -log softmax_y over present classes


# ----------------------------------------------------------------------------- semi-supervised (Sec. 3.6)


def cosine_distances(features: torch.Tensor, bank_vectors: torch.Tensor) -> torch.Tensor:
    """(B, m) cosine distances 1 - <f/|f|, P/|P|> (FedSAP Eq. 10)."""
    return 1.0 - F.normalize(features.float(), dim=1) @ F.normalize(bank_vectors.float(), dim=1).T


def nearest_two(features: torch.Tensor, bank: torch.Tensor, allowed: torch.Tensor):
    """Nearest class, its distance d1 and the second-nearest distance d2 (+inf with one class).

    ``bank`` (C, D) dense, ``allowed`` (C,) bool: the candidate classes (at least one)."""
    classes = torch.nonzero(allowed).squeeze(1)
    d = cosine_distances(features, bank[classes])
    k = min(2, d.shape[1])
    top, pos = torch.topk(d, k, dim=1, largest=False)
    d1 = top[:, 0]
    d2 = top[:, 1] if k == 2 else torch.full_like(d1, math.inf)
    return classes[pos[:, 0]], d1, d2


def accept_pseudo_labels(features: torch.Tensor, bank: torch.Tensor, allowed: torch.Tensor, margin: float,
                         max_distance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(pseudo-labels, accepted mask): nearest cosine prototype (Eq. 10), accepted when
    d2 - d1 > M and d1 < D_max (Eq. 11)."""
    pseudo, d1, d2 = nearest_two(features, bank, allowed)  # FedSAP Eq. 10: argmin_c 1 - cos(h~_u, P^c)
    accept = ((d2 - d1) > margin) & (d1 < max_distance)  # FedSAP Eq. 11
    return pseudo, accept


def calibrate_thresholds(features: torch.Tensor, labels: torch.Tensor, bank: torch.Tensor, allowed: torch.Tensor,
                         margin_quantile: float, distance_quantile: float) -> Optional[tuple[float, float]]:
    """(M, D_max) from labelled embeddings (Eq. 11 calibration).

    Among the labelled samples whose nearest prototype is their own class: M = the
    ``margin_quantile`` of their margins d2 - d1 (0 when no margin is finite: fewer than two
    candidate classes), D_max = the ``distance_quantile`` of their nearest distances d1.
    None when no labelled sample is correctly assigned.
    """
    if len(labels) == 0 or not bool(allowed.any()):
        return None
    pseudo, d1, d2 = nearest_two(features, bank, allowed)
    correct = pseudo == labels
    if not bool(correct.any()):
        return None
    margins = (d2 - d1)[correct]
    margins = margins[torch.isfinite(margins)]
    m = float(torch.quantile(margins, margin_quantile)) if len(margins) else 0.0
    d_max = float(torch.quantile(d1[correct], distance_quantile))
    return m, d_max


def consistency_loss(strong_features: torch.Tensor, bank: torch.Tensor, pseudo: torch.Tensor) -> torch.Tensor:
    """Mean of 1 - cos(f(strong view), P^pseudo) over the given (accepted) samples (Eq. 12); 0 when none."""
    if len(pseudo) == 0:
        return strong_features.sum() * 0.0
    h = F.normalize(strong_features, dim=1)
    p = F.normalize(bank[pseudo].to(strong_features.dtype), dim=1)
    return (1.0 - (h * p).sum(1)).mean()  # FedSAP Eq. 12


def mixed_prototypes(labelled_feats: torch.Tensor, labelled_y: torch.Tensor, pseudo_feats: torch.Tensor,
                     pseudo_y: torch.Tensor, alpha: float, normalize: bool = False) -> PrototypeSet:
    """Per labelled class c: (sum_{L_c} h + alpha sum_{A_c} h) / (|L_c| + alpha |A_c|) (Eq. 14).

    Pseudo-labelled samples of classes without labelled samples are left out; counts are
    |L_c| + |A_c|; ``normalize`` applies Eq. 14's norm(.) to every vector."""
    classes, counts = torch.unique(labelled_y, return_counts=True)
    dim = labelled_feats.shape[1]
    sums = torch.zeros(len(classes), dim).index_add_(0, torch.searchsorted(classes, labelled_y), labelled_feats.float())
    denom = counts.double().clone()
    n_acc = torch.zeros(len(classes), dtype=torch.long)
    if len(pseudo_y):
        keep = torch.isin(pseudo_y, classes)
        pos = torch.searchsorted(classes, pseudo_y[keep])
        sums.index_add_(0, pos, alpha * pseudo_feats[keep].float())
        n_acc.index_add_(0, pos, torch.ones_like(pos))
        denom = denom + alpha * n_acc.double()
    protos = sums / denom.float().unsqueeze(1)  # FedSAP Eq. 14
    if normalize:
        protos = F.normalize(protos, dim=1)
    return PrototypeSet(classes.numpy().astype(np.int64), protos.numpy().astype(np.float32),
                        (counts + n_acc).numpy().astype(np.int64))


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Per-sample translation by up to ``max_shift`` pixels (replicate pad + crop); 4-D only."""
    if x.dim() != 4 or max_shift <= 0:
        return x
    b, _, h, w = x.shape
    offsets = torch.randint(0, 2 * max_shift + 1, (b, 2), generator=generator).tolist()
    padded = F.pad(x, (max_shift,) * 4, mode="replicate")
    return torch.stack([padded[i, :, oy : oy + h, ox : ox + w] for i, (oy, ox) in enumerate(offsets)])


def weak_view(x: torch.Tensor, opts: SemiSupervisedOptions, generator: torch.Generator) -> torch.Tensor:
    return random_shift(x, opts.weak_shift, generator)


def strong_view(x: torch.Tensor, opts: SemiSupervisedOptions, generator: torch.Generator) -> torch.Tensor:
    """Larger shift + additive Gaussian noise + cutout (zero-filled square; images only)."""
    x = random_shift(x, opts.strong_shift, generator)
    if opts.strong_noise_std > 0:
        x = x + opts.strong_noise_std * torch.randn(x.shape, generator=generator).to(x.device, x.dtype)
    if x.dim() == 4 and opts.cutout_fraction > 0:
        b, _, h, w = x.shape
        side = max(1, round(opts.cutout_fraction * min(h, w)))
        cy = torch.randint(0, h, (b, 1, 1), generator=generator).to(x.device)
        cx = torch.randint(0, w, (b, 1, 1), generator=generator).to(x.device)
        ys = torch.arange(h, device=x.device).view(1, h, 1)
        xs = torch.arange(w, device=x.device).view(1, 1, w)
        half = side // 2
        hole = (ys >= cy - half) & (ys < cy - half + side) & (xs >= cx - half) & (xs < cx - half + side)
        x = x.masked_fill(hole.unsqueeze(1), 0.0)
    return x


def stratified_unlabelled_mask(y: torch.Tensor, fraction: float, seed: int, client_id: int) -> np.ndarray:
    """(n,) bool: floor(fraction * n_c) samples of each class c hidden (at most n_c - 1), seeded."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + client_id * 7_919 + 424_242) % (2**63))
    y = y.cpu()
    mask = np.zeros(len(y), dtype=bool)
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).squeeze(1)
        n_hidden = min(int(math.floor(fraction * len(idx))), len(idx) - 1)
        chosen = idx[torch.randperm(len(idx), generator=gen)[:n_hidden]]
        mask[chosen.numpy()] = True
    return mask


@torch.no_grad()
def eval_features(model: torch.nn.Module, x: torch.Tensor, device, batch_size: int = 256) -> torch.Tensor:
    """Embeddings in eval mode, no gradients, on the CPU (the training mode is restored)."""
    was_training = model.training
    model.eval()
    feats = [model.features(x[i : i + batch_size].to(device)).float().cpu() for i in range(0, len(x), batch_size)]
    model.train(was_training)
    return torch.cat(feats) if feats else torch.zeros(0, 0)


class FedSAPClient(ClientAlgorithm):
    """CE + lambda_t * squared distance to P^y + cosine proxy CE against the global prototypes;
    with ``semi_supervised``, Sec. 3.6's two-phase protocol on a hidden-label part of the split."""

    options: FedSAPOptions
    unbatchable_reason = ("its local update (semi_supervised, Sec. 3.6) calibrates thresholds (Eq. 11) and accepts "
                          "pseudo-labels per client, and steps on labelled and unlabelled batches whose sizes and "
                          "presence depend on the client's data: per-client control flow and shapes")

    def __init__(self, options, spec, client_id):
        super().__init__(options, spec, client_id)
        self.unlabelled: Optional[np.ndarray] = None  # (n,) bool over the training split: labels hidden
        self.thresholds: Optional[tuple[float, float]] = None  # (M, D_max), Eq. 11
        self.accepted_idx = np.zeros(0, dtype=np.int64)  # accepted during the last update (split positions)
        self.accepted_label = np.zeros(0, dtype=np.int64)  # their pseudo-labels
        self.pool_x: Optional[torch.Tensor] = None  # the partition's unlabelled pool, when it has one
        self.pool_y: Optional[torch.Tensor] = None  # its true labels: read only for pseudo_accuracy

    def set_unlabelled_pool(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The client's separate unlabelled pool (``data.partition.unlabelled_per_client``, the
        paper's U_q, Table 3: |U| = 600): with it, the whole training split is labelled and the
        pool is the unlabelled data; without it, ``unlabelled_fraction`` of the split is hidden."""
        self.pool_x, self.pool_y = x, y

    def loss(self, model, x, y):
        feats, logits = model.forward_features(x)
        ce = F.cross_entropy(logits, y)  # FedSAP Eq. 4: L_CE
        bank, mask = bank_tensors(self.guidance, self.spec.num_classes, feats.device)
        proto = alignment_loss(feats, y, bank, mask, self.options.alignment_reduction)  # FedSAP Eq. 5: L_Proto
        lam = self.options.alignment_weight(self.version)  # FedSAP Eq. 7: lambda_t at the version trained against
        if self.options.use_proxy:
            proxy = proxy_loss(feats, y, bank, mask, self.options.proxy_scale)  # FedSAP Eq. 8-9: L_Proxy
        else:
            proxy = ce.new_zeros(())
        total = ce + lam * proto + proxy  # FedSAP Eq. 3
        return total, {"ce": ce.detach(), "proto": proto.detach(), "proxy": proxy.detach()}

    # -- semi-supervised ---------------------------------------------------------------------------
    def _sources(self, x: torch.Tensor, y: torch.Tensor):
        """(labelled positions in the split, unlabelled tensors ux and their hidden labels uy,
        unlabelled positions in ux): the separate pool when there is one, else the split's hidden part."""
        if self.pool_x is not None and len(self.pool_y):
            return torch.arange(len(y)), self.pool_x, self.pool_y, torch.arange(len(self.pool_y))
        self._ensure_split(y)
        hidden = torch.from_numpy(self.unlabelled)
        return torch.nonzero(~hidden).squeeze(1), x, y, torch.nonzero(hidden).squeeze(1)

    def _ensure_split(self, y: torch.Tensor) -> None:
        if self.unlabelled is None or len(self.unlabelled) != len(y):
            semi = self.options.semi_supervised
            self.unlabelled = stratified_unlabelled_mask(y, semi.unlabelled_fraction, self.spec.seed, self.client_id)

    def _candidates(self, bank_mask: torch.Tensor, labelled_y: torch.Tensor) -> torch.Tensor:
        allowed = bank_mask.clone()
        if self.options.semi_supervised.restrict_to_local_classes:
            local = torch.zeros_like(allowed)
            local[labelled_y.to(allowed.device)] = True
            allowed &= local
        return allowed

    def in_semi_phase(self) -> bool:
        semi = self.options.semi_supervised
        return semi is not None and self.version >= semi.supervised_versions

    def local_train(self, model, optimizer, batches: TrainBatchIterator, epochs: int, device) -> dict[str, float]:
        semi = self.options.semi_supervised
        if semi is None:
            return super().local_train(model, optimizer, batches, epochs, device)
        lab, ux, uy, unl = self._sources(batches.x, batches.y)
        gen = batches.generator
        labelled = TrainBatchIterator(batches.x[lab], batches.y[lab], batches.batch_size, gen, batches.augment,
                                     batches.drop_last)
        bank, bank_mask = bank_tensors(self.guidance, self.spec.num_classes, device)
        allowed = self._candidates(bank_mask, batches.y[lab]) if bank.numel() else bank_mask
        active = self.in_semi_phase() and len(unl) > 0 and bool(allowed.any())
        if active and self.thresholds is None:  # Eq. 11 calibration, once, at the end of the supervised phase
            feats = eval_features(model, batches.x[lab], device).to(device)
            self.thresholds = calibrate_thresholds(feats, batches.y[lab].to(device), bank, allowed,
                                                   semi.margin_quantile, semi.distance_quantile)
        active = active and self.thresholds is not None
        if self.in_semi_phase():
            self.accepted_idx = np.zeros(0, dtype=np.int64)
            self.accepted_label = np.zeros(0, dtype=np.int64)
        decisions: dict[int, int] = {}  # split position -> pseudo-label (last decision wins; -1 rejected)
        unl_size = min(batches.batch_size * semi.unlabelled_batch_ratio, len(unl))
        order, cursor = None, 0

        model.train()
        tally = StepTally()
        candidates = accepted = correct = 0
        for _ in range(epochs):
            for xb, yb in labelled.epoch():
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss, terms = self.loss(model, xb, yb)  # Eq. 3 on labelled samples only
                if active:
                    if order is None or len(order) - cursor < unl_size:  # a fresh permutation; full batches only
                        order, cursor = unl[torch.randperm(len(unl), generator=gen)], 0
                    idx = order[cursor : cursor + unl_size]
                    cursor += len(idx)
                    xu = ux[idx]
                    weak = weak_view(xu, semi, gen).to(device)
                    strong = strong_view(xu, semi, gen).to(device)
                    was_training = model.training
                    model.eval()
                    with torch.no_grad():
                        weak_feats = model.features(weak).float()
                    model.train(was_training)
                    pseudo, ok = accept_pseudo_labels(weak_feats, bank, allowed, *self.thresholds)  # Eq. 10-11
                    if bool(ok.any()):  # the whole strong batch goes through (BatchNorm needs > 1 sample)
                        cons = consistency_loss(model.features(strong)[ok], bank, pseudo[ok])  # Eq. 12
                    else:
                        cons = loss.new_zeros(())
                    loss = loss + semi.consistency_weight * cons  # Eq. 13
                    hidden_y = uy[idx].to(device)
                    candidates += len(idx)
                    accepted += int(ok.sum())
                    correct += int((pseudo[ok] == hidden_y[ok]).sum())
                    for i, p, a in zip(idx.tolist(), pseudo.tolist(), ok.tolist(), strict=True):
                        decisions[i] = p if a else -1
                    terms["cons"] = cons.detach()
                else:
                    terms["cons"] = 0.0
                tally.step(model, optimizer, loss, terms)
        out = tally.result()
        if decisions:
            kept = sorted((i, p) for i, p in decisions.items() if p >= 0)
            self.accepted_idx = np.array([i for i, _ in kept], dtype=np.int64)
            self.accepted_label = np.array([p for _, p in kept], dtype=np.int64)
        out.update(pseudo_candidates=float(candidates), pseudo_accepted=float(accepted),
                   pseudo_accuracy=correct / accepted if accepted else float("nan"))
        if self.thresholds is not None:
            out.update(pseudo_margin_threshold=self.thresholds[0], pseudo_distance_threshold=self.thresholds[1])
        return out

    @classmethod
    def update_work(cls, options: FedSAPOptions, sizes: UpdateSizes) -> list[Pass]:
        """Fully supervised: the default. Semi-supervised: local epochs of forward-backward over the
        labelled part (the whole split with a separate pool, else the split less its hidden labels)
        and the upload's eval-mode pass over it (Eq. 14); from version T_sup on, every step also
        takes ``unlabelled_batch_ratio`` x batch_size unlabelled samples through a forward-only weak
        view (Eq. 10) and a forward-backward strong view (Eq. 12). Not charged: the one-off
        calibration pass (Eq. 11) and the re-embedding of the accepted samples (data-dependent)."""
        semi = options.semi_supervised
        if semi is None:
            return super().update_work(options, sizes)
        if sizes.unlabelled > 0:
            labelled, pool = sizes.train, sizes.unlabelled
        else:  # the split's hidden part, as stratified_unlabelled_mask hides it
            pool = sum(min(math.floor(semi.unlabelled_fraction * n), n - 1) for n in sizes.train_class_counts if n > 0)
            labelled = sizes.train - pool
        work = [Pass("train", sizes.local_epochs * labelled, backward=True), Pass("train", labelled, backward=False)]
        if pool > 0:
            views = sizes.local_epochs * steps_per_epoch(labelled, sizes.batch_size) * min(
                sizes.batch_size * semi.unlabelled_batch_ratio, pool)
            data = "unlabelled" if sizes.unlabelled > 0 else "train"
            work += [Pass(data, views, backward=False, from_version=semi.supervised_versions),  # weak view
                     Pass(data, views, backward=True, from_version=semi.supervised_versions)]  # strong view
        return work

    def make_update(self, model, x: torch.Tensor, y: torch.Tensor) -> ClientUpdate:
        semi = self.options.semi_supervised
        if semi is None:
            return super().make_update(model, x, y)
        lab, ux, _, _ = self._sources(x, y)
        device = next(model.parameters()).device
        acc = torch.from_numpy(self.accepted_idx) if self.in_semi_phase() else torch.zeros(0, dtype=torch.long)
        lab_feats = eval_features(model, x[lab], device)
        acc_feats = eval_features(model, ux[acc], device) if len(acc) else torch.zeros(0, lab_feats.shape[1])
        acc_y = torch.from_numpy(self.accepted_label) if len(acc) else torch.zeros(0, dtype=torch.long)
        protos = mixed_prototypes(lab_feats, y[lab].cpu(), acc_feats, acc_y, semi.alpha,
                                  normalize=semi.normalize_prototypes and self.in_semi_phase())  # Eq. 14
        return ClientUpdate(client_id=self.client_id, base_version=self.version, num_samples=int(protos.counts.sum()),
                            prototypes=protos)

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.options.semi_supervised is not None:
            state["semi"] = {
                "unlabelled": None if self.unlabelled is None else self.unlabelled.copy(),
                "thresholds": None if self.thresholds is None else list(self.thresholds),
                "accepted_idx": self.accepted_idx.copy(), "accepted_label": self.accepted_label.copy()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        semi = state.get("semi")
        if semi is not None:
            self.unlabelled = None if semi["unlabelled"] is None else np.asarray(semi["unlabelled"], dtype=bool).copy()
            self.thresholds = None if semi["thresholds"] is None else tuple(float(v) for v in semi["thresholds"])
            self.accepted_idx = np.asarray(semi["accepted_idx"], dtype=np.int64).copy()
            self.accepted_label = np.asarray(semi["accepted_label"], dtype=np.int64).copy()


@ALGORITHMS.register("fedsap", help="FedSAP: scheduled prototype alignment plus cosine proxy separation on the prototype bank")
class FedSAP(Algorithm):
    Options = FedSAPOptions
    Client = FedSAPClient
    Server = PrototypeServer
