"""Server rules for the methods that exchange whole models (FedAvg, FedLSA, FedSC).

Plain numpy, no Ray; unit-tested in ``tests/unit/test_server_rules.py``. The runtime hands
``aggregate`` a buffer of K accepted updates (K = ``federation.buffer_size`` in async mode,
the whole round in sync mode) and knows nothing about these rules: they are the method's
options (``algorithm.server_rule`` and the keys below), and the client and the server read
the same options.

Staleness of an update (``staleness``): versions produced while its client trained,
``version - 1 - base_version`` when version ``version`` is being produced -- 0 for an update
trained on the newest model, so every rule's staleness scale is 1 in sync mode.

``mix`` (this platform's rule, the default)::

    x_avg = sum_i s_i n_i x_i / sum_i s_i n_i,     s_i = (1 + staleness_i)^(-a)  (the runtime's weight)
    rate  = eta * sum_i s_i n_i / sum_i n_i        (eta = server_lr)
    x    <- (1 - rate) x + rate x_avg

``fedasync`` (Xie, Koyejo, Gupta 2019, Algorithm 1, server "Updater")::

    alpha_t = alpha * s(t - tau)                   s: constant, polynomial or hinge (Sec. 5.2)
    x_t     = (1 - alpha_t) x_{t-1} + alpha_t x_new

  With K > 1 the buffer is one such step: x_new is the s_i n_i-weighted mean of the buffered
  models and alpha_t = alpha * sum_i s_i n_i / sum_i n_i (exactly the paper's step for K = 1).

``fedbuff`` (Nguyen et al. 2022, Algorithm 1)::

    client:  Delta_i = y_Q - y_0                   (its model after training minus the model it received)
    server:  Delta_bar = sum_i s(tau_i) Delta_i / K ;   x <- x + eta_g Delta_bar

  with the samples weighting (default) Delta_bar = sum_i s_i n_i Delta_i / sum_i n_i, which is
  the printed 1/K when every client holds the same number of samples and FedAvg's weighting
  otherwise. The client computes Delta_i itself and uploads it in ``ClientUpdate.weights``
  (same keys and shapes as the model, so the runtime's border checks apply unchanged).

With staleness 0 everywhere and a whole round in the buffer, ``mix`` with eta = 1, ``fedasync``
with alpha = 1 and ``fedbuff`` with eta_g = 1 and the samples weighting are FedAvg's
sample-weighted average (``fedbuff`` up to float rounding: it adds the mean delta to x).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

ServerRule = Literal["mix", "fedasync", "fedbuff"]
StalenessFunction = Literal["constant", "polynomial", "hinge"]


def staleness_scale(kind: StalenessFunction, staleness: float, exponent: float,
                    hinge_a: float = 10.0, hinge_b: float = 4.0) -> float:
    """s(staleness) of FedAsync Sec. 5.2 (``exponent`` is the polynomial's a).

    constant:   s = 1
    polynomial: s_a(t - tau) = (t - tau + 1)^(-a)       (a = 1/2 is FedBuff's 1/sqrt(1 + tau))
    hinge:      s_{a,b}(t - tau) = 1 if t - tau <= b, else 1 / (a (t - tau - b) + 1)
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if kind == "constant":
        return 1.0  # FedAsync Sec. 5.2, constant: s(t - tau) = 1
    if kind == "polynomial":
        return float((staleness + 1.0) ** (-exponent))  # FedAsync Sec. 5.2: s_a(t - tau) = (t - tau + 1)^(-a)
    if kind == "hinge":
        if staleness <= hinge_b:  # FedAsync Sec. 5.2: s_{a,b}(t - tau) = 1 if t - tau <= b
            return 1.0
        return float(1.0 / (hinge_a * (staleness - hinge_b) + 1.0))  # ... else 1 / (a (t - tau - b) + 1)
    raise ValueError(f"unknown staleness function {kind!r} (constant, polynomial, hinge)")


def average_weights(models: Sequence[dict[str, np.ndarray]], coefs: Sequence[float]) -> dict[str, np.ndarray]:
    """sum_i coef_i W_i / sum_i coef_i per tensor; integer buffers take the rounded average."""
    total = float(sum(coefs))
    out = {}
    for k in models[0]:
        acc = sum(c * m[k].astype(np.float64) for m, c in zip(models, coefs, strict=False)) / total
        dtype = models[0][k].dtype
        out[k] = acc.astype(dtype) if np.issubdtype(dtype, np.floating) else np.rint(acc).astype(dtype)
    return out


def mix_step(global_weights: dict[str, np.ndarray], models: Sequence[dict[str, np.ndarray]],
             scales: Sequence[float], samples: Sequence[int], rate_factor: float) -> tuple[dict[str, np.ndarray], float]:
    """One mixing step: x <- (1 - rate) x + rate x_avg, with x_avg = sum_i s_i n_i x_i / sum_i s_i n_i
    and rate = rate_factor * sum_i s_i n_i / sum_i n_i; returns (new weights, rate).

    ``mix``: rate_factor = eta (server_lr) and s_i the runtime's weights; ``fedasync``:
    rate_factor = alpha and s_i = s(t - tau_i), so that for one update
    rate = alpha_t = alpha s(t - tau) (FedAsync Algorithm 1). A rate >= 1 takes x_avg as it is
    (exactly FedAvg's average in sync mode)."""
    coefs = [float(s) * int(n) for s, n in zip(scales, samples, strict=True)]
    avg = average_weights(models, coefs)  # x_avg = sum_i s_i n_i x_i / sum_i s_i n_i
    rate = rate_factor * sum(coefs) / sum(int(n) for n in samples)  # FedAsync Algorithm 1: alpha_t = alpha * s(t - tau)
    if rate >= 1.0:
        return avg, rate
    # FedAsync Algorithm 1: x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new
    return average_weights([global_weights, avg], [1.0 - rate, rate]), rate


def model_delta(trained: dict[str, np.ndarray], start: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Delta = y_Q - y_0 per tensor, in the tensor's own dtype (FedBuff Algorithm 1, client;
    the sign is ours: the step direction, so the server adds it). Integer buffers give exact
    integer differences."""
    if set(trained) != set(start):
        raise ValueError(f"model keys changed during training: {sorted(set(trained) ^ set(start))[:3]}")
    return {k: np.subtract(v, start[k]).astype(v.dtype, copy=False) for k, v in trained.items()}


def fedbuff_step(global_weights: dict[str, np.ndarray], deltas: Sequence[dict[str, np.ndarray]],
                 scales: Sequence[float], samples: Sequence[int], server_lr: float,
                 weighting: Literal["samples", "uniform"] = "samples") -> tuple[dict[str, np.ndarray], float]:
    """x <- x + eta_g Delta_bar (FedBuff Algorithm 1, server); returns (new weights, eta_g * sum of the
    update coefficients), the step's total scale (1 in sync mode with eta_g = 1).

    samples: Delta_bar = sum_i s_i n_i Delta_i / sum_i n_i; uniform: sum_i s_i Delta_i / K (as
    printed). Accumulated in float64; integer buffers (BatchNorm's num_batches_tracked) take
    round(x + eta_g Delta_bar)."""
    if weighting == "uniform":
        coefs, denom = [float(s) for s in scales], float(len(deltas))
    else:
        coefs, denom = [float(s) * int(n) for s, n in zip(scales, samples, strict=True)], float(sum(int(n) for n in samples))
    out = {}
    for k, x in global_weights.items():
        # FedBuff Algorithm 1: Delta_bar += s(tau_i) Delta_i over the buffer; Delta_bar /= K
        bar = sum(c * d[k].astype(np.float64) for d, c in zip(deltas, coefs, strict=True)) / denom
        new = x.astype(np.float64) + server_lr * bar  # FedBuff Algorithm 1: x <- x + eta_g Delta_bar (our sign)
        out[k] = new.astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else np.rint(new).astype(x.dtype)
    return out, server_lr * sum(coefs) / denom
