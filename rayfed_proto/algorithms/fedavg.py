"""FedAvg (McMahan et al. 2017): sample-weighted average of client weights.

The reference point for homogeneous models and the weight-exchange path that FedLSA and FedSC
build on. How a buffer of (possibly stale) models enters the global model is the option
``server_rule`` (``algorithms/async_weights.py``, docs/algorithms.md "Asynchronous
aggregation"):

- ``mix`` (default, this platform's rule): the buffered models are averaged with weights
  s_i n_i (s_i the runtime's staleness weight) and mixed into the global model with rate
  eta * sum_i s_i n_i / sum_i n_i;
- ``fedasync``: FedAsync's x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new, alpha_t = alpha s(t - tau)
  with a constant, polynomial or hinge staleness function (Xie et al. 2019);
- ``fedbuff``: clients upload their delta y_Q - y_0 and the server adds eta_g times the
  staleness-scaled mean delta (Nguyen et al. 2022).

In sync mode (staleness 0, the whole round in the buffer) each is FedAvg's average when its
rate (server_lr, fedasync_alpha, server_lr) is 1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.async_weights import (
    ServerRule,
    StalenessFunction,
    average_weights,  # noqa: F401 (re-exported: imported from here by tests and older code)
    fedbuff_step,
    mix_step,
    model_delta,
    staleness_scale,
)
from rayfed_proto.algorithms.base import (
    Algorithm,
    ClientAlgorithm,
    Options,
    Pass,
    ServerAlgorithm,
    UpdateSizes,
    as_numpy_state,
    load_numpy_state,
)
from rayfed_proto.messages import ClientUpdate, GlobalState


@dataclass(frozen=True)
class _BothNames:
    """``async_policy`` and ``server_rule`` both set, to different rules."""

    old: Any
    new: Any

    def __repr__(self) -> str:  # the value an error names
        return f"async_policy={self.old!r}, server_rule={self.new!r}"


class FedAvgOptions(Options):
    """Options of FedAvg, inherited by FedLSA and FedSC: how the buffered models enter the global model."""

    server_rule: ServerRule = Field(
        "mix", description="server rule for a buffer of (possibly stale) updates: 'mix' (this platform's "
        "staleness-weighted mixing, default), 'fedasync' (Xie et al. 2019) or 'fedbuff' (Nguyen et al. 2022; "
        "clients upload their model delta)")
    server_lr: float = Field(
        1.0, gt=0, description="mix: eta, the mixing rate of the averaged buffer (<= 1); fedbuff: eta_g, the server "
        "learning rate applied to the mean delta; not used by fedasync (fedasync_alpha)")
    fedasync_alpha: float = Field(
        0.6, gt=0, le=1, description="fedasync: alpha, the mixing weight before staleness scaling "
        "(alpha_t = alpha s(t - tau); the paper's experiments use 0.6 and 0.9)")
    staleness_function: StalenessFunction = Field(
        "polynomial", description="fedasync and fedbuff: s(staleness); constant 1, polynomial "
        "(1 + staleness)^(-a) with a = federation.staleness_exponent (0.5: FedBuff's 1/sqrt(1 + staleness)), "
        "or hinge (1 up to hinge_b, then 1 / (hinge_a (staleness - hinge_b) + 1)); mix uses the runtime's weight")
    hinge_a: float = Field(10.0, gt=0, description="a of the hinge staleness function (FedAsync experiments: 10)")
    hinge_b: float = Field(4.0, ge=0, description="b of the hinge staleness function: staleness up to b is not "
                           "discounted (FedAsync experiments: 4)")
    fedbuff_weighting: Literal["samples", "uniform"] = Field(
        "samples", description="fedbuff: mean delta weighted by s_i n_i / sum n_i (FedAvg's weighting; reduces to "
        "FedAvg in sync mode) or by s_i / K (the paper's Algorithm 1 as printed)")

    @model_validator(mode="before")
    @classmethod
    def _old_key(cls, data: Any) -> Any:
        """``async_policy`` (before 0.9) is ``server_rule``: it still works, with a warning; both set is an error."""
        if isinstance(data, dict) and "async_policy" in data:
            data = dict(data)
            old = data.pop("async_policy")
            if "server_rule" in data and data["server_rule"] != old:
                data["server_rule"] = _BothNames(old, data["server_rule"])  # refused under server_rule's name
            else:
                warnings.warn("algorithm.async_policy is now algorithm.server_rule (the federation's policies are "
                              "federation.mode); the old key still works", FutureWarning, stacklevel=2)
                data["server_rule"] = old
        return data

    @field_validator("server_rule", mode="before")
    @classmethod
    def _not_both(cls, v: Any) -> Any:
        if isinstance(v, _BothNames):
            raise ValueError(f"set once: async_policy={v.old!r} is the old name of server_rule={v.new!r}")
        return v

    def run_issues(self, rounds: int) -> list[tuple[str, Any, str]]:
        if self.server_lr > 1 and self.server_rule != "fedbuff":
            return [("server_lr", self.server_lr, f"0 < server_lr <= 1 with server_rule {self.server_rule!r} "
                     "(a mixing rate); a server learning rate above 1 needs server_rule 'fedbuff'")]
        return []


class FedAvgClient(ClientAlgorithm):
    """Loads the global weights; uploads its model, or with ``server_rule: fedbuff`` its delta
    y_Q - y_0 against the model it started the local update from (FedBuff Algorithm 1)."""

    options: FedAvgOptions

    def __init__(self, options, spec, client_id):
        super().__init__(options, spec, client_id)
        # y_0 of the update in progress (fedbuff only): taken when local training starts, dropped
        # by make_update, so it never outlives one train call and is never part of a checkpoint
        self._start: dict[str, np.ndarray] | None = None

    def receive(self, state: GlobalState, model) -> None:
        super().receive(state, model)
        if state.weights is not None:
            load_numpy_state(model, state.weights)

    batchable = True  # CE on the received weights; FedLSA's and FedSC's losses read only the broadcast too

    def begin_local_train(self, model, batches):
        # y_0: the model as received and loaded (receive runs before evaluation too, so the
        # snapshot is taken here, where only a training call comes)
        self._start = as_numpy_state(model) if self.options.server_rule == "fedbuff" else None

    @classmethod
    def update_work(cls, options, sizes: UpdateSizes) -> list[Pass]:
        """Local epochs of forward-backward over the training split; the upload is the weights
        (no prototype pass)."""
        return [Pass("train", sizes.local_epochs * sizes.train, backward=True)]

    def make_update(self, model, x, y) -> ClientUpdate:
        weights = as_numpy_state(model)
        if self.options.server_rule == "fedbuff":
            start, self._start = self._start, None
            if start is None:
                raise RuntimeError("server_rule 'fedbuff' uploads y_Q - y_0, but no local_train call recorded y_0 "
                                   "(a subclass that overrides local_train or begin_local_train must call FedAvgClient.begin_local_train)")
            weights = model_delta(weights, start)  # FedBuff Algorithm 1: Delta_i = y_Q - y_0 (our sign)
        return ClientUpdate(client_id=self.client_id, base_version=self.version, num_samples=len(y), weights=weights)

    def inference_bank(self):
        return None


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

    def staleness_scales(self, updates: list[ClientUpdate], version: int) -> list[float]:
        """s(t - tau_i) of each update under ``staleness_function``, staleness counted as the versions
        produced while the client trained (``version - 1 - base_version``, 0 in sync mode)."""
        o = self.options
        return [staleness_scale(o.staleness_function, max(0, version - 1 - u.base_version), self.spec.staleness_exponent,
                                o.hinge_a, o.hinge_b) for u in updates]

    def aggregate(self, updates: list[ClientUpdate], weights: list[float], version: int) -> dict[str, float]:
        pairs = [(u, w) for u, w in zip(updates, weights, strict=False) if u.weights is not None]
        if not pairs:
            return {}
        o = self.options
        ups = [u for u, _ in pairs]
        samples = [u.num_samples for u in ups]
        if None in samples:
            missing = [u.client_id for u in ups if u.num_samples is None]
            raise ValueError(f"FedAvg weights each upload by its client's sample count, but the updates of clients "
                             f"{missing} carry no num_samples")
        if o.server_rule == "fedbuff":
            # FedBuff Algorithm 1: x <- x + eta_g sum_i s(tau_i) Delta_i / K (uploads are deltas)
            self.global_weights, rate = fedbuff_step(self.global_weights, [u.weights for u in ups],
                                                     self.staleness_scales(ups, version), samples, o.server_lr,
                                                     o.fedbuff_weighting)
        elif o.server_rule == "fedasync":
            # FedAsync Algorithm 1: x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new, alpha_t = alpha s(t - tau)
            self.global_weights, rate = mix_step(self.global_weights, [u.weights for u in ups],
                                                 self.staleness_scales(ups, version), samples, o.fedasync_alpha)
        else:
            # mix: FedAvg's sum_i s_i n_i W_i / sum_i s_i n_i with the runtime's weights, mixed in at
            # rate eta * sum_i s_i n_i / sum_i n_i
            self.global_weights, rate = mix_step(self.global_weights, [u.weights for u in ups],
                                                 [w for _, w in pairs], samples, o.server_lr)
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
