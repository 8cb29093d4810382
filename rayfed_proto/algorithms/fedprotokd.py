"""FedProtoKD (Siddika et al.): dual distillation through a public set, with trainable global
prototypes under class-wise adaptive margins (papers/fedprotokd.md).

Features (Eq. 3): z_k(x) = vec(h_phi_k(F_k(x))), a learnable projection h_phi_k trained with the
client's model maps each architecture's feature map to the shared dimension d. The method's
default is ``model.projector: linear`` (``config_defaults``; a user's value wins): one learnable
``nn.Linear(backbone_dim, d)`` on the extractor's pooled output. The paper projects the map
before flattening; the zoo's extractors end in a global pool, and at the paper's 32x32 inputs the
ImageNet-stem ResNets' last map is 1x1 already, where a 1x1 projection then flattening is this
Linear. HtFLlib's parameter-free ``pool`` (the other methods' reference) is not the paper's.

Public data: an unlabelled proxy set D_p (``spec.public_x``, ``data.public_size`` samples held
out before partitioning, 2,500 by default), identical on every client and on the server.

Client (Algorithm 1, Sec. III-A and III-F), one local update against server version t:
  1. Distillation on D_p from the server's logits F_G (broadcast ``extras["server_logits"]``;
     none at version 0): y~^s = argmax F_G(x) (Eq. 13) and
     gamma KL(softmax F_G || softmax F_c) + (1 - gamma) CE(F_c, y~^s) (Eq. 14).
     **Decision**: before the private epochs (``client_distill: before_local``), the order of
     Algorithm 1 and Sec. III-F ("each client first trains using the public data"): the KD of
     round t precedes the local training of round t + 1; ``after_local`` is offered.
  2. Private epochs: CE only at version 0 (Eq. 2); afterwards CE + epsilon MSE(f(x), P~^y)
     (Eq. 15), over the samples whose class has a generated prototype.
  3. Upload: local prototypes (Eq. 1; ``common.local_prototypes``) and the logits on D_p,
     ``extras["public_logits"]`` (P, C) float32, eval mode. The per-class sample counts are
     sent only with ``prototype_mean: weighted``, which uses them; by default (uniform class
     centres, the paper's count-free aggregation) every count is 1.

Server, one aggregation (Algorithm 1):
  1. Logits: L^(x_i) = sum_k s_k var_k(x_i) F_k(x_i) / sum_j s_j var_j(x_i) (Eq. 7), var_k(x_i)
     the variance of client k's logit vector on x_i over the C classes, s_k its staleness weight.
  2. ACTP: class centres Q^c (mean of the client prototypes), margins
     xi^c = min(min_{c' != c} d(Q^c, Q^c'), zeta) (Eq. 5), generator P~^c = G(P^^c) (Eq. 4)
     trained ``generator_epochs`` on the (P_k^c, c) pairs with Eq. 6.
  3. Pseudo-labels y~ = argmax L^ (Eq. 8) and sample importance I_i (Eq. 9) from the distance of
     the server model's feature of x_i to P~^{y~_i}.
  4. Server model F_G (``server_arch``, same feature_dim) trained ``server_epochs`` on D_p with
     Upsilon L_kd + (1 - Upsilon) L_pl (Eq. 10-12).
  5. Broadcast P~ (classes ever uploaded) and F_G's logits on D_p.

Asynchrony (this platform's, not the paper's): the server remembers the latest upload of every
client seen so far (logits and prototypes, with the version each was trained against;
``common.LatestUploads``: an older upload arriving late never replaces a newer one) and
aggregates all of them each version, each weighted by (1 + t - tau_k)^(-a), t the server's
current version; so a public sample's target mixes however many clients have reported, the
staler ones counting less (``aggregation_scope: latest``, the default in async mode).
``aggregation_scope: buffer`` uses only the buffered updates: the paper's S_t, and the default
whenever the federation runs in rounds (``Algorithm.defaults_for``); config refuses ``latest`` in
rounds with participation < 1, where it would mix in the uploads of clients not sampled.

Ablations (Table XI): ``uniform_margin: true`` is FedProtoKD-zeta (one FedTGP margin
min(max_c gap_c, zeta) for every class); ``sample_importance: false`` sets I_i = 1.
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from rayfed_proto import optim
from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import (
    Algorithm,
    ClientAlgorithm,
    FederationSpec,
    Options,
    Pass,
    ServerAlgorithm,
    ServerPass,
    ServerSizes,
    StepTally,
    TrainBatchIterator,
    UpdateSizes,
    guarded_step,
)
from rayfed_proto.algorithms.common import (
    LatestUploads,
    PrototypeBank,
    aggregate_prototypes,
    alignment_loss,
    bank_tensors,
    local_prototypes,
    safe_cdist,
)
from rayfed_proto.algorithms.fedtgp import PrototypeGenerator, adaptive_margin, generator_work
from rayfed_proto.algorithms.schedules import AlignmentSchedule
from rayfed_proto.messages import ClientUpdate, GlobalState, PrototypeSet
from rayfed_proto.models import ARCHITECTURES

PUBLIC_LOGITS = "public_logits"
SERVER_LOGITS = "server_logits"


class FedProtoKDOptions(Options):
    # client
    epsilon: float = Field(0.5, ge=0, description="weight of the prototype MSE on private data (Eq. 15)")
    gamma: float = Field(0.5, ge=0, le=1, description="KL vs pseudo-label CE in the client distillation (Eq. 14)")
    client_distill: Literal["before_local", "after_local"] = Field(
        "before_local", description="public-set distillation before the private epochs (Algorithm 1) or after them")
    client_distill_epochs: int = Field(1, ge=0, description="passes over the public set per local update (Eq. 14); 0: none")
    alignment_reduction: Literal["mean", "sum"] = Field(
        "mean", description="MSE of Eq. 11/15: per dimension (nn.MSELoss, default) or summed over dimensions")
    alignment_schedule: Optional[AlignmentSchedule] = Field(
        None, description="curriculum for epsilon (FedSAP Eq. 7); none: the constant epsilon")
    kd_temperature: float = Field(1.0, gt=0, description="softmax temperature of both KL terms (KL scaled by T^2)")
    # server: logits, margins, generator
    zeta: float = Field(50.0, gt=0, description="margin growth threshold: xi^c <= zeta (Eq. 5)")
    uniform_margin: bool = Field(False, description="FedProtoKD-zeta: one margin min(max_c gap_c, zeta) for all classes")
    prototype_mean: Literal["uniform", "weighted"] = Field(
        "uniform", description="class centres Q^c (Eq. 5): mean over clients (no counts, the paper) or sample-weighted")
    logit_weighting: Literal["logit_variance", "probability_variance"] = Field(
        "logit_variance", description="Eq. 7 weight: variance of the client's logits (the paper) or of its softmax")
    aggregation_scope: Literal["latest", "buffer"] = Field(
        "latest", description="every client's latest logits and prototypes (staleness-weighted; the default in async "
        "mode) or the buffer only (this round's uploads, the paper's S_t; the default in sync mode)")
    generator_epochs: int = Field(100, ge=0, description="ACTP generator epochs per version (paper ep_tsp = 100)")
    generator_lr: float = Field(0.01, gt=0, description="generator SGD learning rate")
    generator_batch_size: int = Field(10, ge=1, description="generator mini-batch of (prototype, class) pairs")
    hidden_dim: int = Field(0, ge=0, description="generator hidden width (0: feature_dim)")
    # server: sample importance
    sample_importance: bool = Field(True, description="weight the pseudo-label CE by I_i (Eq. 9); off: I_i = 1")
    importance_phi: float = Field(0.5, ge=0, le=1, description="phi of Eq. 9")
    importance_steepness: float = Field(10.0, gt=0, description="k of Eq. 9 (sigmoid steepness)")
    importance_form: Literal["text", "printed"] = Field(
        "text", description="Eq. 9 sigmoid decreasing in distance as the text says (default) or as printed")
    # server model
    server_arch: str = Field("resnet34", description="architecture of the server model F_G (paper: ResNet34)")
    upsilon: float = Field(0.5, ge=0, le=1, description="Upsilon: L_kd vs L_pl in the server loss (Eq. 12)")
    server_epochs: int = Field(10, ge=0, description="server model epochs on the public set per version (ep_s)")
    server_batch_size: int = Field(32, ge=1, description="server model mini-batch")
    server_optimizer: Literal["sgd", "adam"] = Field("sgd", description="server model optimizer")
    server_lr: float = Field(0.01, gt=0, description="server model learning rate")
    server_momentum: float = Field(0.9, ge=0, lt=1, description="server model SGD momentum")
    server_weight_decay: float = Field(0.0, ge=0, description="server model weight decay")

    @field_validator("server_arch")
    @classmethod
    def _known_arch(cls, v: str) -> str:
        if v not in ARCHITECTURES:  # checked with the config, before anything starts
            raise ValueError(f"unknown architecture {v!r}; one of {', '.join(ARCHITECTURES.names())}")
        return v

    def alignment_weight(self, version: int) -> float:
        """epsilon_t: ``epsilon`` scaled by the schedule at the version trained against."""
        return self.epsilon * (self.alignment_schedule.at_version(version) if self.alignment_schedule else 1.0)


def require_public_x(spec: FederationSpec) -> torch.Tensor:
    if spec.public_x is None or len(spec.public_x) == 0:
        raise ValueError("FedProtoKD needs a public unlabelled set: set data.public_size > 0 "
                         "(the method's default is 2500); spec.public_x is empty")
    return spec.public_x


# ----------------------------------------------------------------------------- the equations


def class_margins(class_means: torch.Tensor, zeta: float, uniform: bool = False) -> torch.Tensor:
    """xi^c = min(min_{c' != c} d(Q^c, Q^c'), zeta) for each row of ``class_means`` (Eq. 5).

    ``class_means`` holds one row per class present. A class with no other class present has no
    nearest neighbour: its margin is zeta (the clip; FedTGP's code reaches the same value).
    ``uniform`` (FedProtoKD-zeta): every class gets FedTGP's min(max_c gap_c, zeta).
    """
    n = len(class_means)
    if uniform:
        return torch.full((n,), adaptive_margin(class_means, zeta))
    if n < 2:
        return torch.full((n,), float(zeta))
    d = safe_cdist(class_means, class_means)
    d.fill_diagonal_(float("inf"))
    return torch.clamp(d.min(1).values, max=zeta)  # FedProtoKD Eq. 5: min(min_{c' != c} delta(Q^c, Q^c'), zeta)


def actp_loss(protos: torch.Tensor, labels: torch.Tensor, generated: torch.Tensor, margins: torch.Tensor,
              weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq. 6 per pair (P_k^c, c): -log e^{-(D(P_k^c, P~^c) + xi^c)} / (e^{-(D + xi^c)} + sum_{c'!=c} e^{-D(P_k^c, P~^c')}).

    ``generated`` (C, D) holds P~ of every class, ``margins`` (C,) xi^c (0 where unused). The
    pairs are averaged (weighted by ``weights``, the staleness weights, when given) rather than
    summed as printed, so the step size does not grow with the number of clients (FedTGP's code).
    """
    dist = safe_cdist(protos, generated)  # FedProtoKD Eq. 6: Delta(P_k^c, P~^c') (Euclidean)
    dist = dist + margins[labels].unsqueeze(1) * F.one_hot(labels, generated.shape[0]).to(dist.dtype)  # + xi^c on c' = c
    per_pair = F.cross_entropy(-dist, labels, reduction="none")  # FedProtoKD Eq. 6
    if weights is None:
        return per_pair.mean()
    return (per_pair * weights).sum() / weights.sum()


def variance_weighted_logits(logits: torch.Tensor, weights: Optional[torch.Tensor] = None,
                             variance_of: str = "logits") -> torch.Tensor:
    """L^(x_i) = sum_k w_k var_k(x_i) F_k(x_i) / sum_j w_j var_j(x_i) (Eq. 7).

    ``logits`` (K, P, C): client k's logits on public sample i; var_k(x_i) is the variance of that
    C-vector (population or sample variance give the same ratios). ``weights`` (K,): staleness
    weights (this platform's extension; 1 in sync mode). A sample on which every client's logits
    are constant (sum of variances 0) falls back to the w-weighted mean. One client: its logits.
    ``variance_of="probabilities"`` (option ``logit_weighting: probability_variance``, not the
    paper's): var_k(x_i) is the variance of softmax(F_k(x_i)) instead, bounded by (C - 1) / C^2,
    so a client's weight no longer grows with the square of its logits' scale; the weighted sum
    is still over the raw logits.
    """
    k = logits.shape[0]
    w = torch.ones(k, dtype=logits.dtype, device=logits.device) if weights is None else weights.to(logits)
    scored = logits.softmax(dim=2) if variance_of == "probabilities" else logits
    var = scored.var(dim=2, unbiased=False)  # FedProtoKD Eq. 7: sigma^2(F_k(x_i)), (K, P)
    coef = w.unsqueeze(1) * var
    total = coef.sum(0, keepdim=True)
    flat = total <= 1e-12
    coef = torch.where(flat, w.unsqueeze(1).expand_as(coef), coef)
    total = torch.where(flat, w.sum().expand_as(total), total)
    return ((coef / total).unsqueeze(2) * logits).sum(0)  # FedProtoKD Eq. 7


def sample_importance(distances: torch.Tensor, phi: float, steepness: float, form: str = "text",
                      eps: float = 1e-6) -> torch.Tensor:
    """I_i of Eq. 9 from d(x_i), the distance of sample i's feature to P~^{y~_i}.

    d~ = 1 / (d + eps) (inverse distance, Sec. III-D); d^ = min-max normalised d~ over the public
    set, in [0, 1], 1 for the nearest sample (**Decision**: the paper says "normalised" only);
    c_d = median of d^. A NaN distance (pseudo-label without a generated prototype) counts as the
    farthest sample (d^ = 0).
    ``printed``: I = phi (1 + d^) + (1 - phi) (1 - sigmoid(k (d^ - c_d))), Eq. 9 letter for letter:
        its second term then grows with distance, against the text.
    ``text`` (default): the sigmoid acts on the normalised *distance* 1 - d^ centred on its
        median, as the text says ("a sigmoid ... centred on the normalised median distance c_d
        suppresses distant samples"): 1 - sigmoid(k ((1 - d^) - (1 - c_d))) = sigmoid(k (d^ - c_d)),
        so I decreases with distance in both terms.
    """
    inv = 1.0 / (distances + eps)  # FedProtoKD Sec. III-D: d~(x_i) = 1 / (d(x_i) + eps)
    known = torch.isfinite(inv)
    if not bool(known.any()):
        return torch.ones_like(distances)
    lo, hi = inv[known].min(), inv[known].max()
    norm = (inv - lo) / (hi - lo) if float(hi - lo) > 0 else torch.ones_like(inv)
    norm = torch.where(known, norm, torch.zeros_like(norm))
    center = norm.median()  # c_d
    sig = torch.sigmoid(steepness * (norm - center))
    second = sig if form == "text" else 1.0 - sig
    return phi * (1.0 + norm) + (1.0 - phi) * second  # FedProtoKD Eq. 9


def kd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)) * T^2, mean over samples (Eq. 10, 14)."""
    t = temperature
    log_p = F.log_softmax(student_logits / t, dim=1)
    q = F.softmax(teacher_logits / t, dim=1)
    return F.kl_div(log_p, q, reduction="batchmean") * (t * t)


def client_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, gamma: float,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, kl, ce) of Eq. 14 on a batch of public samples, y~^s = argmax of the server's logits (Eq. 13)."""
    pseudo = teacher_logits.argmax(1)  # FedProtoKD Eq. 13
    kl = kd_kl(student_logits, teacher_logits, temperature)
    ce = F.cross_entropy(student_logits, pseudo)
    return gamma * kl + (1.0 - gamma) * ce, kl, ce  # FedProtoKD Eq. 14


def server_kd_loss(feats: torch.Tensor, logits: torch.Tensor, target_logits: torch.Tensor, importance: torch.Tensor,
                   protos: torch.Tensor, proto_mask: torch.Tensor, upsilon: float, temperature: float = 1.0,
                   reduction: str = "mean") -> tuple[torch.Tensor, dict[str, float]]:
    """Upsilon L_kd + (1 - Upsilon) L_pl on a batch of public samples (Eq. 10-12)."""
    pseudo = target_logits.argmax(1)  # FedProtoKD Eq. 8: y~_i = argmax L^(x_i)
    kl = kd_kl(logits, target_logits, temperature)  # Eq. 10, first term
    ce = (F.cross_entropy(logits, pseudo, reduction="none") * importance).mean()  # Eq. 10, CE * I_i
    l_kd = kl + ce  # FedProtoKD Eq. 10
    l_pl = alignment_loss(feats, pseudo, protos, proto_mask, reduction)  # FedProtoKD Eq. 11: MSE(V(x_i), P~^{y~_i})
    loss = upsilon * l_kd + (1.0 - upsilon) * l_pl  # FedProtoKD Eq. 12
    return loss, {"kd_kl": kl.item(), "kd_ce": ce.item(), "kd": l_kd.item(), "pl": l_pl.item()}


@torch.no_grad()
def eval_outputs(model: torch.nn.Module, x: torch.Tensor, device, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, logits) of ``model`` on ``x`` in eval mode, without gradients, on ``device``."""
    was_training = model.training
    model.eval()
    feats, logits = [], []
    for i in range(0, len(x), batch_size):
        f, z = model.forward_features(x[i : i + batch_size].to(device))
        feats.append(f.float())
        logits.append(z.float())
    model.train(was_training)
    return torch.cat(feats), torch.cat(logits)


def _index_batches(n: int, batch_size: int, generator: torch.Generator):
    """Shuffled index batches; a trailing single sample joins the previous batch (BatchNorm)."""
    chunks = list(torch.split(torch.randperm(n, generator=generator), batch_size))
    if len(chunks) > 1 and len(chunks[-1]) == 1:
        last = chunks.pop()
        chunks[-1] = torch.cat([chunks[-1], last])
    return chunks


# ----------------------------------------------------------------------------- client


class FedProtoKDClient(ClientAlgorithm):
    options: FedProtoKDOptions
    unbatchable_reason = ("its local update adds distillation epochs on the public set against the server's logits "
                          "(Eq. 13-14) before or after the private epochs: a second loss over other batches, outside "
                          "the one loss a lane steps")

    def __init__(self, options, spec, client_id):
        super().__init__(options, spec, client_id)
        self.public_x = require_public_x(spec)
        self.server_logits: Optional[torch.Tensor] = None

    def receive(self, state: GlobalState, model: torch.nn.Module) -> None:
        super().receive(state, model)
        logits = state.extras.get(SERVER_LOGITS)
        self.server_logits = None if logits is None else torch.tensor(np.asarray(logits), dtype=torch.float32)

    def loss(self, model, x, y):
        feats, logits = model.forward_features(x)
        ce = F.cross_entropy(logits, y)  # FedProtoKD Eq. 2
        if self.version == 0 or self.guidance is None or len(self.guidance) == 0:
            return ce, {"ce": ce.detach(), "mse": 0.0}  # version 0: Eq. 2 only
        targets, mask = bank_tensors(self.guidance, self.spec.num_classes, feats.device)
        mse = alignment_loss(feats, y, targets, mask, self.options.alignment_reduction)  # MSE(V(x), P~^y)
        eps = self.options.alignment_weight(self.version)
        return ce + eps * mse, {"ce": ce.detach(), "mse": mse.detach()}  # FedProtoKD Eq. 15

    def distill(self, model, optimizer, generator: torch.Generator, batch_size: int, device) -> dict[str, float]:
        """Eq. 13-14 on the public set against the server's logits; {} when there are none."""
        opts = self.options
        if self.server_logits is None or opts.client_distill_epochs == 0:
            return {}
        model.train()
        tally = StepTally()
        for _ in range(opts.client_distill_epochs):
            for idx in _index_batches(len(self.public_x), batch_size, generator):
                xb = self.public_x[idx].to(device, non_blocking=True)
                teacher = self.server_logits[idx].to(device)
                optimizer.zero_grad(set_to_none=True)
                loss, kl, ce = client_distill_loss(model.forward_features(xb)[1], teacher, opts.gamma, opts.kd_temperature)
                tally.step(model, optimizer, loss, {"kl": kl.detach(), "ce": ce.detach()})
        return {f"distill_{k}": v for k, v in tally.result().items()}

    def local_train(self, model, optimizer, batches: TrainBatchIterator, epochs: int, device) -> dict[str, float]:
        before = self.options.client_distill == "before_local"
        kd = self.distill(model, optimizer, batches.generator, batches.batch_size, device) if before else {}
        terms = super().local_train(model, optimizer, batches, epochs, device)  # Eq. 2 or Eq. 15
        if not before:
            kd = self.distill(model, optimizer, batches.generator, batches.batch_size, device)
        if kd:
            terms["nonfinite_steps"] += kd.pop("distill_nonfinite_steps")
        return {**terms, **kd}

    @classmethod
    def update_work(cls, options: FedProtoKDOptions, sizes: UpdateSizes) -> list[Pass]:
        """Private epochs (forward-backward over the training split); ``client_distill_epochs``
        forward-backward passes over the public set (Eq. 13-14), from version 1 on (version 0's
        broadcast has no server logits to distil from); the upload's eval-mode passes: logits on
        the public set and the local prototypes over the training split (Eq. 1)."""
        work = [Pass("train", sizes.local_epochs * sizes.train, backward=True)]
        if options.client_distill_epochs > 0:
            work.append(Pass("public", options.client_distill_epochs * sizes.public, backward=True, from_version=1))
        work += [Pass("public", sizes.public, backward=False), Pass("train", sizes.train, backward=False)]
        return work

    def make_update(self, model, x, y) -> ClientUpdate:
        device = next(model.parameters()).device
        _, logits = eval_outputs(model, self.public_x, device)
        protos = local_prototypes(model, x, y)  # FedProtoKD Eq. 1
        if self.options.prototype_mean == "uniform":
            # count-free aggregation (the paper's privacy property): the per-class counts are unused,
            # so none are sent; the message format needs one positive count per class: all 1
            protos = PrototypeSet(protos.class_ids, protos.vectors, np.ones(len(protos.class_ids), np.int64))
        # no num_samples: the server never reads it, and the paper replaces counts so that the
        # clients' data sizes stay private (count-free class centres, Eq. 5)
        return ClientUpdate(client_id=self.client_id, base_version=self.version,
                            prototypes=protos, extras={PUBLIC_LOGITS: logits.cpu().numpy().astype(np.float32)})


# ----------------------------------------------------------------------------- server


def _cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor detached, cloned and on the CPU (state must not alias live tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _client(entry: tuple) -> int:
    return entry[0]


def _logits_fields(logits: np.ndarray) -> dict[str, np.ndarray]:
    return {"logits": logits.copy()}


def _logits_from_fields(entry: dict[str, Any]) -> np.ndarray:
    return np.array(entry["logits"])


class FedProtoKDServer(ServerAlgorithm):
    options: FedProtoKDOptions

    def __init__(self, options: FedProtoKDOptions, spec: FederationSpec, device: torch.device):
        super().__init__(options, spec, device)
        public = require_public_x(spec)
        if spec.build_arch is None:
            raise ValueError("FedProtoKD's server needs spec.build_arch to build its server model")
        self.public_x = public.to(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.server_model = spec.build_arch(options.server_arch, spec.feature_dim).to(device)
            self.generator = PrototypeGenerator(spec.num_classes, spec.feature_dim,
                                                options.hidden_dim or spec.feature_dim).to(device)
        self.generator_opt = optim.sgd(self.generator.parameters(), lr=options.generator_lr)
        if options.server_optimizer == "adam":
            self.server_opt: torch.optim.Optimizer = optim.adam(
                self.server_model.parameters(), lr=options.server_lr, weight_decay=options.server_weight_decay)
        else:
            self.server_opt = optim.sgd(self.server_model.parameters(), lr=options.server_lr,
                                        momentum=options.server_momentum, weight_decay=options.server_weight_decay)
        self.bank = PrototypeBank(spec.num_classes, spec.feature_dim)  # P~ of the classes ever uploaded
        self.seen = np.zeros(spec.num_classes, bool)
        self.margins = np.full(spec.num_classes, np.nan, np.float32)  # xi^c of the last aggregation
        # client -> (its latest logits on D_p / prototypes, version trained on); an upload without
        # prototypes leaves the client's stored prototypes as they are
        self.latest_logits: LatestUploads[np.ndarray] = LatestUploads(spec.staleness_exponent)
        self.latest_protos: LatestUploads[PrototypeSet] = LatestUploads(spec.staleness_exponent)
        self.server_logits: Optional[np.ndarray] = None  # F_G on D_p, broadcast
        self.shuffle = torch.Generator().manual_seed(spec.seed)

    @classmethod
    def server_work(cls, options: FedProtoKDOptions, sizes: ServerSizes) -> list[ServerPass]:
        """ACTP's generator (:func:`~rayfed_proto.algorithms.fedtgp.generator_work`), then the server
        model: an eval pass over the public set (sample importance), ``server_epochs`` training epochs
        on it, and an eval pass for the broadcast logits (``_train_server_model``)."""
        work = generator_work(sizes, options.generator_epochs, options.generator_batch_size, options.hidden_dim,
                              options.aggregation_scope)
        evals = 2 if options.sample_importance else 1
        return work + [ServerPass("server_model", options.server_epochs * sizes.public, backward=True,
                                  arch=options.server_arch),
                       ServerPass("server_model", evals * sizes.public, backward=False, arch=options.server_arch)]

    # -- interface ---------------------------------------------------------------------------
    def extras_shapes(self) -> dict[str, tuple[int, ...]]:
        return {PUBLIC_LOGITS: (len(self.public_x), self.spec.num_classes)}

    def global_model(self) -> torch.nn.Module:
        return self.server_model.eval()

    def guidance_bank(self) -> PrototypeSet:
        return self.bank.as_set()

    def broadcast(self, version: int) -> GlobalState:
        extras = {} if self.server_logits is None else {SERVER_LOGITS: self.server_logits.copy()}
        bank = self.bank.as_set()
        return GlobalState(version=version, prototypes=bank if len(bank) else None, extras=extras)

    # -- aggregation ----------------------------------------------------------------------------
    def _collect(self, updates: list[ClientUpdate], weights: list[float], version: int):
        """(logit arrays, their weights, prototype sets, their weights) by ``aggregation_scope``."""
        if self.options.aggregation_scope == "buffer":
            logits = [(np.asarray(u.extras[PUBLIC_LOGITS], np.float32), w) for u, w in zip(updates, weights, strict=True)]
            protos = [(u.prototypes, w) for u, w in zip(updates, weights, strict=True)
                      if u.prototypes is not None and len(u.prototypes)]
        else:
            for u in updates:
                self.latest_logits.offer(u.client_id, np.array(u.extras[PUBLIC_LOGITS], np.float32), u.base_version)
                if u.prototypes is not None and len(u.prototypes):
                    self.latest_protos.offer(u.client_id, u.prototypes, u.base_version)
            # in client order; s = (1 + t - tau)^(-a), t = version - 1 the server's current version
            logits = [(a, w) for _, a, w in sorted(self.latest_logits.weighted(version), key=_client)]
            protos = [(ps, w) for _, ps, w in sorted(self.latest_protos.weighted(version), key=_client)]
        return logits, protos

    def aggregate(self, updates, weights, version):
        logits, protos = self._collect(updates, weights, version)
        if not logits:
            return {}
        metrics: dict[str, float] = {"logit_clients": float(len(logits)), "prototype_clients": float(len(protos))}
        stacked = torch.tensor(np.stack([a for a, _ in logits]), device=self.device)
        variance_of = "probabilities" if self.options.logit_weighting == "probability_variance" else "logits"
        target = variance_weighted_logits(stacked, torch.tensor([w for _, w in logits], device=self.device),
                                          variance_of)  # FedProtoKD Eq. 7
        if protos:
            metrics.update(self._train_generator([ps for ps, _ in protos], [w for _, w in protos], version))
        metrics.update(self._train_server_model(target))
        metrics.update(self._margin_metrics())
        return metrics

    def _train_generator(self, sets: list[PrototypeSet], ws: list[float], version: int) -> dict[str, float]:
        opts = self.options
        means = aggregate_prototypes(sets, ws, opts.prototype_mean)  # Q^c: mean of the client prototypes
        classes = sorted(means)
        q = torch.tensor(np.stack([means[c][0] for c in classes]))
        xi = class_margins(q, opts.zeta, opts.uniform_margin)  # FedProtoKD Eq. 5 (or the uniform FedTGP margin)
        self.margins[:] = np.nan
        self.margins[classes] = xi.numpy()
        margins = torch.zeros(self.spec.num_classes, device=self.device)
        margins[classes] = xi.to(self.device)
        protos = torch.tensor(np.concatenate([ps.vectors for ps in sets]), dtype=torch.float32, device=self.device)
        labels = torch.tensor(np.concatenate([ps.class_ids for ps in sets]), dtype=torch.long, device=self.device)
        pair_w = torch.tensor(np.concatenate([np.full(len(ps), w, np.float32) for ps, w in zip(sets, ws, strict=True)]),
                              device=self.device)
        all_classes = torch.arange(self.spec.num_classes, device=self.device)
        self.generator.train()
        total, steps = 0.0, 0
        for _ in range(opts.generator_epochs):
            order = torch.randperm(len(labels), generator=self.shuffle).to(self.device)
            for i in range(0, len(order), opts.generator_batch_size):
                idx = order[i : i + opts.generator_batch_size]
                generated = self.generator(all_classes)  # FedProtoKD Eq. 4: P~^c = W2 ReLU(W1 P^^c + b1) + b2
                loss = actp_loss(protos[idx], labels[idx], generated, margins, pair_w[idx])  # Eq. 6
                self.generator_opt.zero_grad(set_to_none=True)
                if guarded_step(self.generator, self.generator_opt, loss):
                    total, steps = total + loss.item(), steps + 1
        self.seen[classes] = True
        self.generator.eval()
        with torch.no_grad():
            ids = np.flatnonzero(self.seen)
            gen = self.generator(torch.as_tensor(ids, device=self.device)).cpu().numpy()
        self.bank.update({int(c): (gen[i], 1.0) for i, c in enumerate(ids)}, version)
        return {"generator_loss": total / max(steps, 1), "xi_mean": float(xi.mean()), "xi_min": float(xi.min())}

    def _train_server_model(self, target: torch.Tensor) -> dict[str, float]:
        opts = self.options
        protos, mask = bank_tensors(self.bank.as_set(), self.spec.num_classes, self.device)
        pseudo = target.argmax(1)  # FedProtoKD Eq. 8
        if opts.sample_importance and protos.numel():
            feats, _ = eval_outputs(self.server_model, self.public_x, self.device)
            dist = torch.full((len(pseudo),), float("nan"), device=self.device)
            has = mask[pseudo]
            dist[has] = (feats[has] - protos[pseudo[has]]).norm(dim=1)  # d(x_i) = ||V_G(x_i) - P~^{y~_i}||
            importance = sample_importance(dist, opts.importance_phi, opts.importance_steepness, opts.importance_form)
        else:
            importance = torch.ones(len(pseudo), device=self.device)  # W/O I (Table XI)
        if not protos.numel():
            protos = torch.zeros(self.spec.num_classes, self.spec.feature_dim, device=self.device)
        self.server_model.train()
        tally = StepTally()
        for _ in range(opts.server_epochs):
            for idx in _index_batches(len(self.public_x), opts.server_batch_size, self.shuffle):
                idx = idx.to(self.device)
                feats, logits = self.server_model.forward_features(self.public_x[idx])
                self.server_opt.zero_grad(set_to_none=True)
                loss, terms = server_kd_loss(feats, logits, target[idx], importance[idx], protos, mask, opts.upsilon,
                                             opts.kd_temperature, opts.alignment_reduction)  # Eq. 10-12
                tally.step(self.server_model, self.server_opt, loss, terms)
        _, server_logits = eval_outputs(self.server_model, self.public_x, self.device)
        self.server_logits = server_logits.cpu().numpy().astype(np.float32)
        out = {f"server_{k}": v for k, v in tally.result().items()}
        out.update(importance_mean=float(importance.mean()), importance_min=float(importance.min()),
                   importance_max=float(importance.max()),
                   server_pseudo_agreement=float((server_logits.argmax(1) == pseudo).float().mean()))
        return out

    def _margin_metrics(self) -> dict[str, float]:
        """Per-class margin of the generated prototypes, min_{c' != c} d(P~^c, P~^c') (Figure 6), and xi^c."""
        bank = self.bank.as_set()
        out: dict[str, float] = {}
        if len(bank) >= 2:
            v = torch.tensor(bank.vectors)
            d = safe_cdist(v, v)
            d.fill_diagonal_(float("inf"))
            nearest = d.min(1).values
            for c, m in zip(bank.class_ids.tolist(), nearest.tolist(), strict=True):
                out[f"margin_class_{c}"] = m
            out["margin_mean"] = float(nearest.mean())
        for c in np.flatnonzero(np.isfinite(self.margins)):
            out[f"xi_class_{c}"] = float(self.margins[c])
        return out

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything, as copies (the runtime keeps this to roll a version back)."""
        return {
            "server_model": _cpu_copy(self.server_model.state_dict()),
            "server_opt": _cpu_copy(self.server_opt.state_dict()),
            "generator": _cpu_copy(self.generator.state_dict()),
            "generator_opt": _cpu_copy(self.generator_opt.state_dict()),
            "bank": self.bank.state_dict(), "seen": self.seen.copy(), "margins": self.margins.copy(),
            "latest_logits": self.latest_logits.state_dict(_logits_fields),
            "latest_protos": self.latest_protos.state_dict(),
            "server_logits": None if self.server_logits is None else self.server_logits.copy(),
            "shuffle": self.shuffle.get_state().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server_model.load_state_dict(_cpu_copy(state["server_model"]))
        self.server_opt.load_state_dict(_cpu_copy(state["server_opt"]))
        self.generator.load_state_dict(_cpu_copy(state["generator"]))
        self.generator_opt.load_state_dict(_cpu_copy(state["generator_opt"]))
        self.bank.load_state_dict(state["bank"])
        self.seen = np.array(state["seen"])
        self.margins = np.array(state["margins"])
        self.latest_logits.load_state_dict(state["latest_logits"], _logits_from_fields)
        self.latest_protos.load_state_dict(state["latest_protos"])
        logits = state["server_logits"]
        self.server_logits = None if logits is None else np.array(logits)
        self.shuffle.set_state(torch.as_tensor(state["shuffle"]).clone())


@ALGORITHMS.register("fedprotokd", help="FedProtoKD: dual distillation on public data with adaptive-margin trainable prototypes")
class FedProtoKD(Algorithm):
    Options = FedProtoKDOptions
    Client = FedProtoKDClient
    Server = FedProtoKDServer
    # model.projector linear: the learnable projection h_phi_k of Eq. 3 (see the module docstring)
    config_defaults = {"data.public_size": 2500, "data.global_test_fraction": 0.2, "model.projector": "linear"}
