"""Pieces every prototype method shares: distances, local prototypes, aggregation, the bank,
the memory of each client's latest upload.

Plain PyTorch / numpy; unit-tested on tiny tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, Optional, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from rayfed_proto.messages import PrototypeSet

T = TypeVar("T")


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

    def as_set(self, version: Optional[int] = None) -> PrototypeSet:
        """Every class with a vector; with ``version``, only those updated by the aggregation
        that produced ``version`` (the reference servers' bank of one round)."""
        present = self.present if version is None else self.present & (self.updated_at == version)
        ids = np.flatnonzero(present).astype(np.int64)
        return PrototypeSet(ids, self.vectors[ids].copy(), np.maximum(self.weight[ids], 1).astype(np.int64))

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"vectors": self.vectors.copy(), "present": self.present.copy(),
                "updated_at": self.updated_at.copy(), "weight": self.weight.copy()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for k in ("vectors", "present", "updated_at", "weight"):
            setattr(self, k, np.array(state[k]))


def subset(ps: Optional[PrototypeSet], class_ids) -> Optional[PrototypeSet]:
    """The rows of ``ps`` whose class is in ``class_ids`` (None stays None)."""
    if ps is None:
        return None
    keep = np.isin(np.asarray(ps.class_ids), np.asarray(class_ids))
    return PrototypeSet(np.asarray(ps.class_ids)[keep], np.asarray(ps.vectors)[keep], np.asarray(ps.counts)[keep])


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


NO_CLASS = -1
"""The prediction of a sample none of whose candidate classes has a bank vector (never correct)."""


def nearest_prototype_predict(features: torch.Tensor, bank: Optional[PrototypeSet],
                              candidates: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Class of the nearest bank vector for each feature (prototype inference mode).

    ``candidates`` (``evaluation.proto_candidates: own_classes``): only the bank vectors of these
    class ids compete, as FedProto's test does (yuetan031/FedProto ``lib/update.py``,
    ``test_inference_new_het_lt``: a class enters the distance matrix when ``j in
    global_protos.keys() and j in classes_list[idx]``, the client's own classes). When no
    candidate has a vector every sample is predicted :data:`NO_CLASS` (the reference fills the
    matrix with 100 and would answer class 0). None: every bank vector competes.
    """
    if bank is None or len(bank) == 0:
        return None
    # torch.tensor copies: arrays from Ray's object store are read-only views
    vecs = torch.tensor(bank.vectors, dtype=features.dtype, device=features.device)
    ids = torch.tensor(bank.class_ids, device=features.device)
    if candidates is not None:
        keep = torch.isin(ids, candidates.to(ids.device))
        if not bool(keep.any()):
            return torch.full((len(features),), NO_CLASS, dtype=ids.dtype, device=features.device)
        vecs, ids = vecs[keep], ids[keep]
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


def prototype_set_fields(ps: PrototypeSet) -> dict[str, np.ndarray]:
    """A ``PrototypeSet`` as the plain arrays a checkpoint holds (copies)."""
    return {"class_ids": np.array(ps.class_ids), "vectors": np.array(ps.vectors), "counts": np.array(ps.counts)}


def prototype_set_from_fields(entry: dict[str, Any]) -> PrototypeSet:
    """The inverse of :func:`prototype_set_fields` (extra keys of the entry are ignored)."""
    return PrototypeSet(np.array(entry["class_ids"]), np.array(entry["vectors"]), np.array(entry["counts"]))


class LatestUploads(Mapping[int, tuple[T, int]]):
    """Each client's newest upload (any payload: a ``PrototypeSet``, public-set logits, ...) with the
    server version it was trained against, its ``base_version`` tau: the memory behind
    ``aggregation_scope: latest`` (``PrototypeServer`` and its subclasses, FedProtoKD, FedSC).

    Guard: :meth:`offer` never replaces a stored upload with one trained against an older version.
    Asynchronous submissions arrive on several threads, so a client's older upload can reach the
    server after its newer one; it is then refused. With the same ``base_version`` the later
    arrival wins (a resubmission replaces the earlier one). The check and the store happen under
    one lock.

    Read as a mapping ``client -> (payload, base_version)``, in first-arrival order of the clients
    (a replaced upload keeps its client's place, as a dict does); :meth:`weighted` adds each
    upload's staleness weight at a version.

    State (:meth:`state_dict`): ``{str(client): {**encode(payload), "trained_on": tau}}``, the layout
    the three servers have always written (``latest``, FedProtoKD's ``latest_logits`` and
    ``latest_protos``), so checkpoints of either age load both ways.
    """

    def __init__(self, staleness_exponent: float = 0.5):
        self.staleness_exponent = staleness_exponent
        self._entries: dict[int, tuple[T, int]] = {}
        self._lock = threading.Lock()

    # -- the guard -------------------------------------------------------------------------------
    def offer(self, client_id: int, payload: T, base_version: int) -> bool:
        """Remember ``payload`` as ``client_id``'s newest upload, trained against ``base_version``,
        unless an upload trained against a newer version is already stored; True when stored."""
        client_id, base_version = int(client_id), int(base_version)
        with self._lock:
            held = self._entries.get(client_id)
            if held is not None and base_version < held[1]:
                return False  # an older upload arriving late never replaces a newer one
            self._entries[client_id] = (payload, base_version)
            return True

    # -- reading -----------------------------------------------------------------------------------
    def __getitem__(self, client_id: int) -> tuple[T, int]:
        return self._entries[client_id]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def weighted(self, version: int) -> list[tuple[int, T, float]]:
        """(client, payload, s) for every stored upload, in first-arrival order of the clients, with
        its staleness weight when ``version`` is being produced (the server's current version is
        t = version - 1): s = (1 + t - tau)^(-a) (ALGORITHMS.md, "Asynchrony"; a =
        ``staleness_exponent``), so an upload's weight shrinks as it ages; 1 for one trained
        against the current version."""
        now = version - 1
        with self._lock:
            entries = list(self._entries.items())
        return [(c, payload, staleness_weight(max(0, now - tau), self.staleness_exponent)) for c, (payload, tau) in entries]

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self, encode: Callable[[T], dict[str, Any]] = prototype_set_fields) -> dict[str, dict[str, Any]]:
        """``{str(client): {**encode(payload), "trained_on": tau}}`` (plain arrays and ints)."""
        with self._lock:
            entries = list(self._entries.items())
        return {str(c): {**encode(payload), "trained_on": int(tau)} for c, (payload, tau) in entries}

    def load_state_dict(self, state: dict[str, dict[str, Any]],
                        decode: Callable[[dict[str, Any]], T] = prototype_set_from_fields) -> None:
        """Replace the memory with ``state`` (:meth:`state_dict`'s layout, the one every server wrote
        before this class existed); the client order is the state's."""
        entries = {int(c): (decode(e), int(e["trained_on"])) for c, e in (state or {}).items()}
        with self._lock:
            self._entries = entries

    def __getstate__(self) -> dict[str, Any]:  # a lock does not pickle or deep-copy
        return {"staleness_exponent": self.staleness_exponent, "_entries": dict(self._entries)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
