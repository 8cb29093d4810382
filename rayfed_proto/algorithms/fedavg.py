"""FedAvg (McMahan et al. 2017): sample-weighted average of client weights.

The reference point for homogeneous models and the weight-exchange path that FedLSA and FedSC
build on. Asynchronous extension (this platform's, FedAsync-style): the buffered models are
averaged with weights s_i * n_i (s_i the staleness weight) and mixed into the global model with
rate eta * sum_i s_i n_i / sum_i n_i, so that in sync mode (s_i = 1, eta = 1) it is exactly FedAvg
and stale buffers move the global model less.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import (
    Algorithm,
    ClientAlgorithm,
    Options,
    ServerAlgorithm,
    as_numpy_state,
    load_numpy_state,
)
from rayfed_proto.messages import ClientUpdate, GlobalState


class FedAvgOptions(Options):
    server_lr: float = Field(1.0, gt=0, le=1, description="eta: mixing rate of the averaged buffer into the global model")


class FedAvgClient(ClientAlgorithm):
    def receive(self, state: GlobalState, model) -> None:
        super().receive(state, model)
        if state.weights is not None:
            load_numpy_state(model, state.weights)

    def make_update(self, model, x, y) -> ClientUpdate:
        return ClientUpdate(client_id=self.client_id, base_version=self.version, num_samples=len(y),
                            weights=as_numpy_state(model))

    def inference_bank(self):
        return None


def average_weights(models: list[dict[str, np.ndarray]], coefs: list[float]) -> dict[str, np.ndarray]:
    """sum_i coef_i W_i / sum_i coef_i per tensor; integer buffers take the rounded average."""
    total = float(sum(coefs))
    out = {}
    for k in models[0]:
        acc = sum(c * m[k].astype(np.float64) for m, c in zip(models, coefs, strict=False)) / total
        out[k] = np.rint(acc).astype(models[0][k].dtype) if not np.issubdtype(models[0][k].dtype, np.floating) else acc.astype(models[0][k].dtype)
    return out


class FedAvgServer(ServerAlgorithm):
    options: FedAvgOptions

    def __init__(self, options, spec, device):
        super().__init__(options, spec, device)
        if spec.build_model is None:
            raise ValueError("FedAvg needs a homogeneous model group (FederationSpec.build_model is None)")
        torch.manual_seed(spec.seed)
        self.global_weights = as_numpy_state(spec.build_model())
        self._model: torch.nn.Module | None = None  # built on first global_model() call

    def weight_shapes(self):
        return {k: tuple(v.shape) for k, v in self.global_weights.items()}

    def aggregate(self, updates: list[ClientUpdate], weights: list[float], version: int) -> dict[str, float]:
        pairs = [(u, w) for u, w in zip(updates, weights, strict=False) if u.weights is not None]
        if not pairs:
            return {}
        coefs = [w * u.num_samples for u, w in pairs]
        avg = average_weights([u.weights for u, _ in pairs], coefs)  # FedAvg: sum_i s_i n_i W_i / sum_i s_i n_i
        rate = self.options.server_lr * sum(coefs) / sum(u.num_samples for u, _ in pairs)
        if rate >= 1.0:
            self.global_weights = avg
        else:
            self.global_weights = average_weights([self.global_weights, avg], [1.0 - rate, rate])
        return {"server_mixing_rate": rate}

    def broadcast(self, version: int) -> GlobalState:
        return GlobalState(version=version, weights=self.global_weights)

    def global_model(self) -> torch.nn.Module:
        if self._model is None:
            self._model = self.spec.build_model().to(self.device)
        load_numpy_state(self._model, self.global_weights)
        return self._model.eval()

    def state_dict(self) -> dict[str, Any]:
        return {"global_weights": {k: v.copy() for k, v in self.global_weights.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_weights = {k: np.array(v) for k, v in state["global_weights"].items()}


@ALGORITHMS.register("fedavg", help="FedAvg: sample-weighted average of client weights (homogeneous models)")
class FedAvg(Algorithm):
    Options = FedAvgOptions
    Client = FedAvgClient
    Server = FedAvgServer
    requires_homogeneous_models = True
    config_defaults = {"data.global_test_fraction": 0.2}
