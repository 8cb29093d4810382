"""What both sides of the federation share, without Ray: the model spec, evaluation sets.

The client side is :mod:`rayfed_proto.runtime.client_core` (a worker's clients), the server side
:mod:`rayfed_proto.runtime.server_core` (intake, versions); the Ray actors in
:mod:`rayfed_proto.runtime.actors` are thin shells around them, so the whole update path (train ->
message -> validate -> buffer -> aggregate -> broadcast) can be tested in-process. Nothing here
names an algorithm: the registry resolves ``algorithm.name``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from rayfed_proto.algorithms import FederationSpec
from rayfed_proto.config import ExperimentConfig, group_is_homogeneous
from rayfed_proto.data import ArrayDataset
from rayfed_proto.models import MODEL_GROUPS, build_model

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
