"""FedLSA (Fu et al. AAAI 2025): learnable semantic anchors with hyperspherical contrast
(papers/fedlsa.md).

Homogeneous clients: encoder psi -> 2-layer projector phi -> h = phi(z) / |phi(z)| (unit sphere)
-> classifier. The config defaults turn on ``model.projector: mlp`` and
``model.normalize_features: true`` so that ``ProtoModel.features`` is h.

Server, each version: FedAvg of the uploaded weights (``FedAvgServer``, with its
``server_rule``), then anchor learning (Eq. 3-5) against the classifier of the new global model,
frozen:
    A = nor(Theta(R)),  R in R^{C x I} learnable, Theta a 2-layer MLP I -> H -> L
    L_LSA = L_ACE + alpha L_SEP                                             (Eq. 5)
    L_ACE = mean_i CE(phi_glo(a_i), i)                                      (Eq. 3)
    L_SEP = mean_i log( 1/(C-1) sum_{j != i} exp(a_i . a_j / tau) )         (Eq. 4)
for ``server_epochs`` full-batch steps (E_s, paper 500). R, Theta and their optimizer persist
across versions (Algorithm 1: R^e <- R^{e-1}). The anchors are L2-normalised (ALGORITHMS.md
**Decision**: they are vMF mean directions, Eq. 6) and tau sits inside the exp of Eq. 4
(ALGORITHMS.md). The broadcast carries the global weights and the C anchors as a
``PrototypeSet`` (every class, from version 0), which is also the nearest-anchor inference bank.

Client (Eq. 8-10): L_HC = CE(phi(h), y) + lambda L_COM, L_COM = CE(A h / tau, y); uploads its
weights (FedAvg path). ``compactness: l2`` replaces L_COM by mean ||h - a_y||^2, the paper's
ablation row "L_SEP without L_COM" (Tables 4-5).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from rayfed_proto import optim
from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import Algorithm
from rayfed_proto.algorithms.common import bank_tensors, masked_cross_entropy, masked_mean
from rayfed_proto.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from rayfed_proto.messages import GlobalState, PrototypeSet


class FedLSAOptions(FedAvgOptions):
    # server_lr (inherited from FedAvg with server_rule and its keys) is eta, the mixing rate
    # of the averaged weights (eta_g with fedbuff); the anchors' own learning rate is anchor_lr.
    lam: float = Field(0.7, ge=0, description="lambda: weight of L_COM (Eq. 10; paper grid {0.1, 0.7}); 0 turns it off")
    alpha: float = Field(0.4, ge=0, description="weight of L_SEP in the anchor loss (Eq. 5; paper grid {0.02, 0.4}); 0 turns it off")
    tau: float = Field(0.1, gt=0, description="temperature of L_SEP (Eq. 4) and L_COM (Eq. 7-8); paper grid {0.1, 0.2}")
    server_epochs: int = Field(500, ge=0, description="E_s: full-batch anchor steps per server version (paper 500)")
    anchor_input_dim: int = Field(0, ge=0, description="I: width of the learnable R in R^{C x I} (0: feature_dim)")
    anchor_hidden_dim: int = Field(0, ge=0, description="hidden width of the 2-layer MLP Theta (0: feature_dim)")
    anchor_optimizer: Literal["sgd", "adam"] = Field("sgd", description="optimizer of R and Theta (paper: SGD)")
    anchor_lr: float = Field(0.01, gt=0, description="learning rate of R and Theta")
    anchor_momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum of R and Theta")
    compactness: Literal["vmf", "l2"] = Field(
        "vmf", description="client term weighted by lam: L_COM (Eq. 8) or the squared L2 distance to the class anchor "
        "(the paper's ablation row 'L_SEP without L_COM', Tables 4-5)")


# ----------------------------------------------------------------------------- the equations


class AnchorMapping(torch.nn.Module):
    """R (learnable, N(0, 1) init) and Theta = Linear(I, H) - ReLU - Linear(H, L); anchors
    A = nor(Theta(R)) (FedLSA Eq. 3 text, normalised: ALGORITHMS.md Decision)."""

    def __init__(self, num_classes: int, input_dim: int, hidden_dim: int, anchor_dim: int):
        super().__init__()
        self.R = torch.nn.Parameter(torch.randn(num_classes, input_dim))  # FedLSA: R = [r_1; ...; r_C], random
        self.theta = torch.nn.Sequential(torch.nn.Linear(input_dim, hidden_dim), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden_dim, anchor_dim))

    def forward(self) -> torch.Tensor:
        return F.normalize(self.theta(self.R), dim=1)  # FedLSA: A = Theta(R), on the unit sphere


def separation_loss(anchors: torch.Tensor, tau: float) -> torch.Tensor:
    """L_SEP = mean_i log( (1/(C-1)) sum_{j != i} exp(a_i . a_j / tau) ) (FedLSA Eq. 4).

    tau inside the exp (ALGORITHMS.md); 0 with fewer than two anchors (no pair)."""
    c = anchors.shape[0]
    if c < 2:
        return anchors.sum() * 0.0
    sim = anchors @ anchors.T / tau
    off = ~torch.eye(c, dtype=torch.bool, device=anchors.device)
    sim = sim.masked_fill(~off, float("-inf"))
    # FedLSA Eq. 4: log sum_{j != i} exp(a_i a_j^T / tau) - log(C - 1), averaged over i
    return (torch.logsumexp(sim, dim=1) - np.log(c - 1)).mean()


def anchor_ce_loss(anchors: torch.Tensor, head_weight: torch.Tensor, head_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """L_ACE = mean_i CE(phi_glo(a_i), i) with the global classifier frozen (FedLSA Eq. 3)."""
    logits = F.linear(anchors, head_weight.detach(), None if head_bias is None else head_bias.detach())  # rho_i = phi_glo(a_i)
    return F.cross_entropy(logits, torch.arange(anchors.shape[0], device=anchors.device))  # FedLSA Eq. 3


def compactness_loss(h: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, tau: float,
                     mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """L_COM = -log exp(a_y . h / tau) / sum_j exp(a_j . h / tau), mean over samples (FedLSA Eq. 8).

    ``mask`` (C,) marks classes with an anchor (all of them in FedLSA); absent classes leave the
    softmax and samples of absent classes are skipped."""
    if anchors.numel() == 0:
        return h.sum() * 0.0
    if mask is None:
        mask = torch.ones(anchors.shape[0], dtype=torch.bool, device=h.device)
    keep = mask[labels]  # masked, not selected: no host read per step
    logits = (h @ anchors.T / tau).masked_fill(~mask.unsqueeze(0), float("-inf"))  # FedLSA Eq. 7: a_j^T h / tau
    return masked_cross_entropy(logits, labels, keep)  # FedLSA Eq. 8


def anchor_l2_loss(h: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """||h - a_y||^2, mean over the samples whose class has an anchor: the L2 pull that replaces
    L_COM in the paper's ablation (Tables 4-5, "L_SEP without L_COM")."""
    if anchors.numel() == 0:
        return h.sum() * 0.0
    keep = mask[labels] if mask is not None else torch.ones_like(labels, dtype=torch.bool)
    diff = h - anchors[labels]
    return masked_mean((diff * diff).sum(1), keep)


def train_anchors(mapping: AnchorMapping, optimizer: torch.optim.Optimizer, head_weight: torch.Tensor,
                  head_bias: Optional[torch.Tensor], alpha: float, tau: float, epochs: int) -> dict[str, float]:
    """``epochs`` full-batch steps of L_LSA = L_ACE + alpha L_SEP on R and Theta (FedLSA Eq. 5,
    Algorithm 1 lines 16-25). Returns the terms of the last step (before it), or of the current
    anchors when ``epochs`` is 0."""
    mapping.train()
    terms = {}
    for _ in range(max(epochs, 0)):
        anchors = mapping()
        ace = anchor_ce_loss(anchors, head_weight, head_bias)  # FedLSA Eq. 3
        sep = separation_loss(anchors, tau)  # FedLSA Eq. 4
        loss = ace + alpha * sep  # FedLSA Eq. 5
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        terms = {"anchor_loss": loss.item(), "anchor_ace": ace.item(), "anchor_sep": sep.item()}
    if not terms:
        with torch.no_grad():
            anchors = mapping()
            ace, sep = anchor_ce_loss(anchors, head_weight, head_bias), separation_loss(anchors, tau)
            terms = {"anchor_loss": (ace + alpha * sep).item(), "anchor_ace": ace.item(), "anchor_sep": sep.item()}
    return terms


def _to_numpy_tree(obj: Any) -> Any:
    """Optimizer state as plain data: tensors become numpy copies (checkpoints, rollback)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _to_numpy_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy_tree(v) for v in obj)
    return obj


def _to_tensor_tree(obj: Any, device) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.tensor(obj, device=device)
    if isinstance(obj, dict):
        return {k: _to_tensor_tree(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_tensor_tree(v, device) for v in obj)
    return obj


# ----------------------------------------------------------------------------- server and client


class FedLSAServer(FedAvgServer):
    """FedAvg of the weights, then E_s steps of anchor learning against the global classifier."""

    options: FedLSAOptions

    def __init__(self, options: FedLSAOptions, spec, device):
        super().__init__(options, spec, device)
        d = spec.feature_dim
        with torch.random.fork_rng(devices=[]):  # seeded, and the global RNG left as it was
            torch.manual_seed(spec.seed + 1)
            self.mapping = AnchorMapping(spec.num_classes, options.anchor_input_dim or d,
                                         options.anchor_hidden_dim or d, d).to(device)
        self.optimizer = self._make_optimizer()
        self.anchor_metrics: dict[str, float] = {}
        # Decision: the anchors of version 0 are learnt too, against the initial global model's
        # classifier (the one every client starts from), so that the anchors broadcast at any
        # version v are those learnt against the classifier of global model v.
        self._learn_anchors()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.options
        if o.anchor_optimizer == "adam":
            return optim.adam(self.mapping.parameters(), lr=o.anchor_lr)
        return optim.sgd(self.mapping.parameters(), lr=o.anchor_lr, momentum=o.anchor_momentum)

    def _learn_anchors(self) -> dict[str, float]:
        head = self.global_model().head  # phi_glo: the averaged model's classifier, frozen
        weight = head.weight.detach().clone().to(self.device)
        bias = head.bias.detach().clone().to(self.device) if head.bias is not None else None
        self.anchor_metrics = train_anchors(self.mapping, self.optimizer, weight, bias, self.options.alpha,
                                            self.options.tau, self.options.server_epochs)
        with torch.no_grad():
            self.anchors = self.mapping().cpu().numpy().astype(np.float32)
        return self.anchor_metrics

    def aggregate(self, updates, weights, version):
        metrics = super().aggregate(updates, weights, version)  # FedAvg (sample- and staleness-weighted)
        if not metrics:
            return {}
        metrics.update(self._learn_anchors())  # FedLSA Eq. 3-5 against the new global classifier
        return metrics

    def anchor_set(self) -> PrototypeSet:
        c = self.spec.num_classes
        return PrototypeSet(np.arange(c, dtype=np.int64), self.anchors.copy(), np.ones(c, np.int64))

    def broadcast(self, version: int) -> GlobalState:
        return GlobalState(version=version, weights=self.global_weights, prototypes=self.anchor_set())

    def guidance_bank(self) -> Optional[PrototypeSet]:
        return self.anchor_set()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            anchor_mapping={k: v.detach().cpu().numpy().copy() for k, v in self.mapping.state_dict().items()},
            anchor_optimizer=_to_numpy_tree(self.optimizer.state_dict()),
            anchors=self.anchors.copy(),
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.mapping.load_state_dict({k: torch.tensor(v, device=self.device) for k, v in state["anchor_mapping"].items()})
        self.optimizer = self._make_optimizer()
        self.optimizer.load_state_dict(_to_tensor_tree(state["anchor_optimizer"], self.device))
        self.anchors = np.array(state["anchors"], np.float32)


class FedLSAClient(FedAvgClient):
    """Loads the global weights; L_HC = CE + lambda L_COM against the broadcast anchors."""

    options: FedLSAOptions

    def loss(self, model, x, y):
        h, logits = model.forward_features(x)  # h = nor(phi(psi(x))) with model.normalize_features
        ce = F.cross_entropy(logits, y)  # FedLSA Eq. 9
        anchors, mask = bank_tensors(self.guidance, self.spec.num_classes, h.device)
        anchors = anchors.to(h.dtype)  # the model's float type (broadcasts are float32)
        lam = self.options.lam
        with torch.set_grad_enabled(torch.is_grad_enabled() and lam > 0):
            # F.normalize is the identity on unit h; it keeps Eq. 8 on the sphere if a user turns
            # model.normalize_features off
            h_unit = F.normalize(h, dim=1)
            if self.options.compactness == "l2":
                com = anchor_l2_loss(h_unit, y, anchors, mask)  # ablation (Tables 4-5): ||h - a_y||^2
            else:
                com = compactness_loss(h_unit, y, anchors, self.options.tau, mask)  # FedLSA Eq. 8
        total = ce + lam * com if lam > 0 else ce  # FedLSA Eq. 10: L_HC = L_CE + lambda L_COM
        return total, {"ce": ce.detach(), "com": com.detach()}

    def inference_bank(self) -> Optional[PrototypeSet]:
        return self.guidance  # nearest anchor (unit h and unit anchors: nearest = most cosine-similar)


@ALGORITHMS.register("fedlsa", help="FedLSA: FedAvg plus server-learnt hyperspherical semantic anchors (domain skew)")
class FedLSA(Algorithm):
    Options = FedLSAOptions
    Client = FedLSAClient
    Server = FedLSAServer
    requires_homogeneous_models = True
    config_defaults = {"model.projector": "mlp", "model.normalize_features": True, "data.global_test_fraction": 0.2}
