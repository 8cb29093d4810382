"""FedProto (Tan et al. AAAI 2022), as restated in FedSA Eq. 2-4.

Client: CE(h(f(x)), y) + lambda * ||f(x) - P^y||^2 over samples whose class has a global
prototype (FedSA Eq. 4); lambda 10 by default, as the FedSA and FedTGP experiments run FedProto
as a baseline (lokinko/FedSA ``system/total.sh``, TsingZ0/HtFLlib ``system/examples.sh``). Server: per-class plain mean of the uploaded prototypes over the clients
holding the class (``aggregation: uniform``, default), as the reference server does
(``TsingZ0/HtFLlib``, ``system/flcore/servers/serverproto.py``, ``proto_aggregation``, from
``yuetan031/fedproto`` ``lib/utils.py``); ``weighted`` is the sample-weighted mean (FedSA Eq. 3).
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from pydantic import Field

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import Algorithm, ClientAlgorithm, PrototypeOptions, PrototypeServer
from rayfed_proto.algorithms.common import alignment_loss, bank_tensors


class FedProtoOptions(PrototypeOptions):
    # lambda 10: how the FedSA and FedTGP tables ran FedProto (lokinko/FedSA system/total.sh and
    # TsingZ0/HtFLlib system/examples.sh: -algo FedProto -lam 10), so a baseline run is theirs
    lam: float = Field(10.0, ge=0, description="alignment weight lambda (default 10: the FedSA / FedTGP scripts, "
                       "HtFLlib's -lam 10)")
    aggregation: Literal["weighted", "uniform"] = Field(
        "uniform", description="per-class mean of uploads: plain mean over clients (FedProto reference server, "
        "default) or sample-weighted (FedSA Eq. 3)")
    # FedProto's reference client (HtFLlib clientproto.py) collects the prototypes from the
    # train-mode forward passes of the local epoch; no eval-mode pass after training
    prototype_source: Literal["train", "eval"] = Field("train", description="uploaded prototypes: training passes "
                                                       "(reference code, default) or an eval-mode pass after training")
    # the reference server replaces its bank with each round's aggregate (HtFLlib serverproto.py:
    # global_protos = proto_aggregation(uploaded_protos)) and clientproto.py test_metrics scores
    # against it; async mode defaults to last_seen (FedProto.roundless_config_defaults: no rounds there)
    inference_memory: Literal["round", "last_seen"] = Field(
        "round", description="nearest-prototype inference against the classes of the latest aggregation only "
        "(reference code, default in sync mode) or every class's last vector (default in async mode)")


class PrototypeAlignmentClient(ClientAlgorithm):
    """CE plus lambda times the squared distance to the broadcast vector of each sample's class."""

    options: FedProtoOptions
    batchable = True  # the loss reads the broadcast bank only (masked: no host reads)

    def loss(self, model, x, y):
        feats, logits = model.forward_features(x)
        ce = F.cross_entropy(logits, y)  # L_S of FedSA Eq. 4
        targets, mask = bank_tensors(self.guidance, self.spec.num_classes, feats.device)
        align = alignment_loss(feats, y, targets, mask, self.options.alignment_reduction)  # L_R, FedSA Eq. 4
        lam = self.options.alignment_weight(self.version)  # constant, or the curriculum of FedSAP Eq. 7
        return ce + lam * align, {"ce": ce.detach(), "align": align.detach()}


@ALGORITHMS.register("fedproto", help="FedProto: align features to aggregated class prototypes")
class FedProto(Algorithm):
    Options = FedProtoOptions
    Client = PrototypeAlignmentClient
    Server = PrototypeServer
    # a version of K buffered updates is no round of the sampled clients: keep every class's last vector
    roundless_config_defaults = {"algorithm.inference_memory": "last_seen"}
