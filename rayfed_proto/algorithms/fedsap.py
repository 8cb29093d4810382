"""FedSAP (Casado-Diez et al. 2026): scheduled alignment and proxy separation, supervised part.

Client (Eq. 3): CE + lambda_t * L_Proto + L_Proxy, where
- L_Proto (Eq. 5) is the squared distance of f(x) to the global prototype of its class, over the
  samples whose class has one;
- lambda_t (Eq. 7 and appendix) = M * g((t - r_start) / t_w), the shared alignment curriculum
  (:mod:`rayfed_proto.algorithms.schedules`) evaluated at the server version t the client
  trained against; defaults M 0.7, linear from version 20 to full at 100;
- L_Proxy (Eq. 8-9) is a cosine-softmax CE whose proxies are the global prototypes themselves:
  z_c = s * <f(x)/|f(x)|, P^c/|P^c|>, s default 32, over the classes that have a global
  prototype, for the samples whose class has one (0 before any prototype exists).
Server: per-class uniform mean of the uploaded local prototypes (Eq. 2), FedProto's server.
Prototype inference uses the global prototypes.

Ablations from config (Table 4): ``use_proxy: false`` drops L_Proxy; ``alignment_schedule: null``
makes lambda_t the constant M.

Not implemented yet: the semi-supervised extension (Sec. 3.6, Eq. 10-14: prototype
pseudo-labels with calibrated margin/distance thresholds, consistency loss, mixed prototypes).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F
from pydantic import Field

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import Algorithm, ClientAlgorithm, PrototypeOptions, PrototypeServer
from rayfed_proto.algorithms.common import alignment_loss, bank_tensors
from rayfed_proto.algorithms.schedules import AlignmentSchedule


class FedSAPOptions(PrototypeOptions):
    lam: float = Field(0.7, ge=0, description="M: maximum alignment weight, reached at the end of the ramp (Eq. 7)")
    aggregation: Literal["weighted", "uniform"] = Field(
        "uniform", description="per-class mean of uploads: uniform over clients (FedSAP Eq. 2) or sample-weighted")
    # Decision: Eq. 5 prints the squared Euclidean norm ||f(x) - P^y||_2^2; the paper's "MSE" is
    # the mean of that per-sample error over the batch (its code is unreleased, so nothing says
    # nn.MSELoss's extra 1/D). The platform implements the paper by default: "sum".
    alignment_reduction: Literal["mean", "sum"] = Field(
        "sum", description="||f - P||^2 summed over dimensions (Eq. 5 as printed, default) or averaged (nn.MSELoss)")
    alignment_schedule: Optional[AlignmentSchedule] = Field(
        AlignmentSchedule(shape="linear", start=20, length=80),  # a copy per instance (pydantic copies defaults)
        description="alignment curriculum (Eq. 7; default linear from version 20 to full at 100); null: constant M")
    proxy_scale: float = Field(32.0, gt=0, description="s: scale of the cosine proxy logits (Eq. 8-9)")
    use_proxy: bool = Field(True, description="add the proxy separation loss L_Proxy (Eq. 8-9)")


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
    keep = mask[labels]
    if not bool(keep.any()):
        return features.sum() * 0.0
    present = torch.nonzero(mask).squeeze(1)
    position = torch.cumsum(mask.long(), 0) - 1  # class id -> column among the present classes
    logits = proxy_logits(features[keep], bank[present], scale)
    return F.cross_entropy(logits, position[labels[keep]])  # FedSAP Eq. 9: -log softmax_y over present classes


class FedSAPClient(ClientAlgorithm):
    """CE + lambda_t * squared distance to P^y + cosine proxy CE against the global prototypes."""

    options: FedSAPOptions

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
        return total, {"ce": ce.item(), "proto": proto.item(), "proxy": proxy.item()}


@ALGORITHMS.register("fedsap", help="FedSAP: scheduled prototype alignment plus cosine proxy separation on the prototype bank")
class FedSAP(Algorithm):
    Options = FedSAPOptions
    Client = FedSAPClient
    Server = PrototypeServer
