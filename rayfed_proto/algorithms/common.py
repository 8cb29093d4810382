"""Pieces every prototype method shares: distances, local prototypes, aggregation, the bank.

Plain PyTorch / numpy; unit-tested on tiny tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F

from rayfed_proto.messages import PrototypeSet


def safe_cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise d(a_i, b_j) = sqrt(max(||a_i - b_j||^2, 1e-12)) (ALGORITHMS.md notation).

    The clamp keeps the gradient finite when a feature coincides with a prototype.
    """
    sq = (a * a).sum(1, keepdim=True) - 2 * a @ b.T + (b * b).sum(1).unsqueeze(0)
    return torch.sqrt(torch.clamp(sq, min=1e-12))


def staleness_weight(staleness: float, exponent: float) -> float:
    """(1 + staleness)^(-a): this platform's asynchrony rule (ALGORITHMS.md, "Asynchrony")."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return float((1.0 + staleness) ** (-exponent))


@torch.no_grad()
def local_prototypes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> PrototypeSet:
    """Mean feature per class over the whole local training split (FedSA Eq. 2).

    Decision (ALGORITHMS.md): after local training, eval mode, no gradients; only classes the
    client holds are returned, with their sample counts.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    feats = torch.cat([model.features(x[i : i + batch_size].to(device)).float().cpu() for i in range(0, len(x), batch_size)])
    model.train(was_training)
    classes, counts = torch.unique(y, return_counts=True)
    sums = torch.zeros(len(classes), feats.shape[1]).index_add_(0, torch.searchsorted(classes, y), feats)
    protos = sums / counts.unsqueeze(1).float()  # FedSA Eq. 2: P_i^c = mean of f_i(x) over D_{i,c}
    return PrototypeSet(classes.numpy().astype(np.int64), protos.numpy().astype(np.float32), counts.numpy().astype(np.int64))


def aggregate_prototypes(
    sets: Iterable[PrototypeSet],
    weights: Iterable[float],
    mode: Literal["weighted", "uniform"] = "weighted",
) -> dict[int, tuple[np.ndarray, float]]:
    """Per-class weighted mean of uploaded prototypes -> {class: (vector, total weight)}.

    ``weighted`` (default): sum_i w_i n_i^c P_i^c / sum_i w_i n_i^c, the sample-weighted mean of
    FedSA Eq. 3 (the paper prints an extra 1/|N_c| factor that would shrink prototypes of
    classes held by many clients; ALGORITHMS.md reads it as the weighted mean). ``uniform``:
    sum_i w_i P_i^c / sum_i w_i (FedProto code, FedSAP Eq. 2). ``w_i`` is the update's
    staleness weight (1 in sync mode).
    """
    acc: dict[int, list] = {}
    for ps, w in zip(sets, weights, strict=False):
        for c, vec, n in zip(ps.class_ids, ps.vectors, ps.counts, strict=False):
            coef = float(w) * (float(n) if mode == "weighted" else 1.0)
            slot = acc.setdefault(int(c), [np.zeros_like(vec, dtype=np.float64), 0.0])
            slot[0] += coef * vec.astype(np.float64)
            slot[1] += coef
    # FedSA Eq. 3 (as a weighted mean): P^c = sum_i coef_i P_i^c / sum_i coef_i
    return {c: ((s / tot).astype(np.float32), tot) for c, (s, tot) in acc.items() if tot > 0}


class PrototypeBank:
    """Global bank: one vector per class plus the server version that last updated it.

    Decision (ALGORITHMS.md): a class nobody uploaded keeps its last vector; a class that never
    had one is absent (skipped in losses and in nearest-prototype prediction).
    """

    def __init__(self, num_classes: int, dim: int):
        self.num_classes, self.dim = num_classes, dim
        self.vectors = np.zeros((num_classes, dim), np.float32)
        self.present = np.zeros(num_classes, bool)
        self.updated_at = np.full(num_classes, -1, np.int64)
        self.weight = np.zeros(num_classes, np.float64)

    def update(self, new: dict[int, tuple[np.ndarray, float]], version: int) -> None:
        for c, (vec, w) in new.items():
            self.vectors[c] = vec
            self.present[c] = True
            self.updated_at[c] = version
            self.weight[c] = w

    def as_set(self) -> PrototypeSet:
        ids = np.flatnonzero(self.present).astype(np.int64)
        return PrototypeSet(ids, self.vectors[ids].copy(), np.maximum(self.weight[ids], 1).astype(np.int64))

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"vectors": self.vectors.copy(), "present": self.present.copy(),
                "updated_at": self.updated_at.copy(), "weight": self.weight.copy()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for k in ("vectors", "present", "updated_at", "weight"):
            setattr(self, k, np.array(state[k]))


def prototype_margin(vectors: np.ndarray) -> tuple[float, float]:
    """(min, mean) over classes of the distance to the nearest other class vector.

    The "prototype margin" tracked per evaluation: how separable the guidance bank is.
    Needs at least two vectors; returns (nan, nan) otherwise.
    """
    if len(vectors) < 2:
        return float("nan"), float("nan")
    v = torch.as_tensor(np.asarray(vectors, np.float32))
    d = safe_cdist(v, v)
    d.fill_diagonal_(float("inf"))
    nearest = d.min(1).values
    return float(nearest.min()), float(nearest.mean())


def nearest_prototype_predict(features: torch.Tensor, bank: Optional[PrototypeSet]) -> Optional[torch.Tensor]:
    """Class of the nearest bank vector for each feature (prototype inference mode)."""
    if bank is None or len(bank) == 0:
        return None
    # torch.tensor copies: arrays from Ray's object store are read-only views
    vecs = torch.tensor(bank.vectors, dtype=features.dtype, device=features.device)
    ids = torch.tensor(bank.class_ids, device=features.device)
    return ids[safe_cdist(features, vecs).argmin(1)]


_BANK_CACHE: list = []  # [(bank, num_classes, device, (dense, mask))], the last few banks densified


def bank_tensors(bank: Optional[PrototypeSet], num_classes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (C, D) tensor of bank vectors and a (C,) bool mask of the classes present.

    Built once per received bank, not once per batch: the result is cached by the bank
    object's identity (a broadcast's arrays are read-only object-store views, never changed in
    place), so every step of a local update reuses it. Callers must not modify the tensors.
    """
    for cached, k, dev, out in _BANK_CACHE:
        if cached is bank and k == num_classes and dev == str(device):
            return out
    if bank is None or len(bank) == 0:
        out = (torch.zeros(num_classes, 0, device=device), torch.zeros(num_classes, dtype=torch.bool, device=device))
    else:
        dense = torch.zeros(num_classes, bank.vectors.shape[1], device=device)
        ids = torch.tensor(bank.class_ids, device=device)  # copies: object-store arrays are read-only
        dense[ids] = torch.tensor(bank.vectors, device=device)
        mask = torch.zeros(num_classes, dtype=torch.bool, device=device)
        mask[ids] = True
        out = (dense, mask)
    if bank is not None:
        _BANK_CACHE[:] = [(bank, num_classes, str(device), out)] + _BANK_CACHE[:3]
    return out


def alignment_loss(
    features: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
    reduction: Literal["sum", "mean"] = "mean",
) -> torch.Tensor:
    """||f(x) - P^y||^2 averaged over the samples whose class has a target (FedSA Eq. 4, L_R).

    ``reduction="sum"``: the squared Euclidean norm over dimensions, as printed.
    ``reduction="mean"``: divided by D, i.e. ``nn.MSELoss`` as in the FedProto and FedTGP
    public code, whose lambda values (1, 10) were tuned at that scale.
    """
    if targets.numel() == 0:
        return features.sum() * 0.0
    # masked mean instead of selecting rows: no host/device synchronisation per step
    keep = mask[labels].to(features.dtype)
    diff = features - targets[labels]
    per_sample = (diff * diff).sum(1)
    if reduction == "mean":
        per_sample = per_sample / features.shape[1]
    return (per_sample * keep).sum() / keep.sum().clamp(min=1.0)


def masked_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the rows where ``keep`` is true (0, still in the graph, when none
    is). Weighting instead of selecting (``values[keep]``) reads nothing on the host: no
    host/device synchronisation in a training step."""
    w = keep.to(values.dtype)
    return (values * w).sum() / w.sum().clamp(min=1.0)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits[keep], labels[keep])`` without selecting rows: the rows not kept
    get neutral (zero) logits, so their loss and gradient stay finite even when ``logits`` hold
    -inf columns, and weight 0 (:func:`masked_mean`)."""
    logits = torch.where(keep.unsqueeze(1), logits, torch.zeros_like(logits))
    return masked_mean(F.cross_entropy(logits, labels, reduction="none"), keep)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)

