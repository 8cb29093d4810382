"""SGD and Adam for the clients' and servers' models: ``torch.optim`` itself on accelerators, and on
the CPU the same arithmetic without the import of ``torch._dynamo`` that ``torch.optim`` makes.

Why: every ``torch.optim.Optimizer`` imports ``torch._dynamo`` the first time it adds a parameter
group or takes a step (its methods are wrapped in ``torch._disable_dynamo``). That import brings
about 800 modules (SymPy, ``torch.distributed``, ``torch.fx``...) and costs each process about
72 MiB of private memory (torch 2.14.1, CPU; docs/benchmarks.md, "Startup and peak memory"), in
every worker and the server, for a compiler these processes never run. On the CPU, torch's own
default is the single-tensor form of each update (``foreach`` is chosen only for CUDA tensors),
and :class:`LeanSGD` and :class:`LeanAdam` below are those forms line for line (torch 2.14.1's
``_single_tensor_sgd`` and ``_single_tensor_adam`` without the options this project never sets,
as :func:`sgd_direction` and :func:`adam_direction`, which the batched clients'
``training.batched.StackedOptimizer`` applies too),
so a run gives bit for bit the numbers ``torch.optim`` gives (``tests/unit/test_optim.py``
compares them step by step). Their ``state_dict`` has ``torch.optim``'s layout and keys, so
checkpoints load in either direction.

On a GPU (any parameter off the CPU) :func:`sgd` and :func:`adam` return ``torch.optim.SGD`` and
``torch.optim.Adam`` themselves, with their foreach kernels. No Ray here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

# Hyperparameters as torch.optim's param groups hold them (same keys and defaults), so that a
# state_dict moves between LeanSGD/LeanAdam and torch.optim.SGD/Adam.
_SGD_DEFAULTS = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
                 "maximize": False, "foreach": None, "differentiable": False, "fused": None}
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                  "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                  "decoupled_weight_decay": False}
# Settings torch.optim has and these classes do not implement: refused rather than ignored.
_UNSUPPORTED = {"maximize": False, "foreach": None, "differentiable": False, "fused": None, "capturable": False,
                "amsgrad": False, "decoupled_weight_decay": False}


# ----------------------------------------------------------------------------- the update rules
# torch.optim's SGD and Adam updates on tensors (torch 2.14.1's ``_single_tensor_sgd`` and
# ``_single_tensor_adam``, without the options this project never sets), op for op, so that the
# numbers are torch's bit for bit. One definition for both users: LeanSGD and LeanAdam below apply
# them to each parameter, in place on its own state (``inplace=True``), and
# ``training.batched.StackedOptimizer`` to the stacked (clients, total) rows of clients stepping as
# one model, out of place (it keeps the old rows of a client whose step was not applied) with a
# step count per row. The parameter update itself (``p -= lr * direction``) is the caller's: a
# float step size (one optimizer) or a tensor of one per row (stacked clients).


def sgd_direction(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, group: dict[str, Any], *,
                  started: torch.Tensor | None = None, inplace: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``torch.optim.SGD``: the direction ``d`` of ``p <- p - lr * d`` and the momentum buffer
    after the step (None without momentum). g <- g + wd * p (coupled weight decay); with momentum
    mu: b <- g on the first step (``buf`` None), else b <- mu * b + (1 - dampening) * g; d = g + mu * b
    with Nesterov, else b. ``started`` (stacked rows): where False, a row's b <- g (its first step)."""
    if group["weight_decay"] != 0:
        grad = grad.add(p, alpha=group["weight_decay"])
    momentum = group["momentum"]
    if momentum == 0:
        return grad, None
    if buf is None:
        buf = grad.detach().clone()
    else:
        moved = (buf.mul_(momentum) if inplace else buf.mul(momentum)).add_(grad, alpha=1 - group["dampening"])
        buf = moved if started is None else torch.where(started, moved, grad)
    return (grad.add(buf, alpha=momentum) if group["nesterov"] else buf), buf


def adam_direction(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   group: dict[str, Any], bias_correction2_sqrt: float | torch.Tensor, *,
                   inplace: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.optim.Adam`` (Kingma & Ba, Alg. 1, with coupled L2 weight decay): the moments after
    the step and the denominator, ``(m, v, denom)``, of ``p <- p - lr / (1 - beta1^t) * m / denom``.
    g <- g + wd * p; m <- beta1 * m + (1 - beta1) * g (a lerp, as torch); v <- beta2 * v + (1 - beta2) * g^2;
    denom = sqrt(v) / sqrt(1 - beta2^t) + eps (``bias_correction2_sqrt``: a float, or one per row)."""
    beta1, beta2 = group["betas"]
    if group["weight_decay"] != 0:
        grad = grad.add(p, alpha=group["weight_decay"])
    m = exp_avg.lerp_(grad, 1 - beta1) if inplace else exp_avg.lerp(grad, 1 - beta1)
    v = (exp_avg_sq.mul_(beta2) if inplace else exp_avg_sq.mul(beta2)).addcmul_(grad, grad, value=1 - beta2)
    return m, v, (v.sqrt() / bias_correction2_sqrt).add_(group["eps"])


class LeanOptimizer:
    """What the runtime and the methods use of ``torch.optim.Optimizer``: ``param_groups``,
    ``state``, ``zero_grad``, ``step``, ``state_dict`` and ``load_state_dict`` in its format."""

    _defaults: dict[str, Any] = {}

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], **hyper: Any):
        unknown = sorted(set(hyper) - set(self._defaults))
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown option(s) {', '.join(unknown)}; "
                            f"allowed: {', '.join(sorted(self._defaults))}")
        self.defaults = {**self._defaults, **hyper}
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        for group in (params if isinstance(params[0], dict) else [{"params": params}]):
            self.add_param_group(dict(group))

    def add_param_group(self, group: dict[str, Any]) -> None:
        group["params"] = list(group["params"])
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        for key, allowed in _UNSUPPORTED.items():
            if key in group and group[key] != allowed:
                raise ValueError(f"{type(self).__name__}: {key}={group[key]!r} is not supported (only {allowed!r}); "
                                 f"use torch.optim for it")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False).zero_()

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict``'s layout: parameters numbered in group order."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: s for p, s in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this class or by the matching ``torch.optim`` class (which is
        what checkpoints written before this module hold). Tensors are moved to each parameter's
        device and, except Adam's ``step`` counter (kept as float32 on the CPU, as torch does),
        cast to its dtype."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups, strict=True)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters than "
                             f"this {type(self).__name__}")
        by_index = {i: p for s, g in zip(saved, self.param_groups, strict=True) for i, p in zip(s["params"], g["params"], strict=True)}
        self.state = defaultdict(dict)
        for i, values in state_dict["state"].items():
            p = by_index[int(i)]
            self.state[p] = {k: self._cast(k, v, p) for k, v in values.items()}
        groups = []
        for s, g in zip(saved, self.param_groups, strict=True):
            group = {**{k: v for k, v in s.items() if k != "params"}, "params": g["params"]}
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            groups.append(group)
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient (``closure``: as in ``torch.optim``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    @staticmethod
    def _cast(key: str, value: Any, p: torch.Tensor) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if key == "step":
            return value.to(dtype=torch.float32, device="cpu")
        return value.to(dtype=p.dtype, device=p.device)


class LeanSGD(LeanOptimizer):
    """``torch.optim.SGD`` on the CPU: momentum, dampening, Nesterov and (coupled) weight decay."""

    _defaults = _SGD_DEFAULTS

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        # no state without momentum (as torch.optim.SGD: the defaultdict is not touched)
        buf = self.state[p].get("momentum_buffer") if group["momentum"] != 0 else None
        direction, buf = sgd_direction(p, grad, buf, group)
        if buf is not None:
            self.state[p]["momentum_buffer"] = buf
        p.add_(direction, alpha=-group["lr"])


class LeanAdam(LeanOptimizer):
    """``torch.optim.Adam`` on the CPU (Kingma & Ba, Alg. 1) with coupled (L2) weight decay."""

    _defaults = _ADAM_DEFAULTS

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:  # torch's lazy state: a CPU float32 step counter and zero moments
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"].item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = group["lr"] / bias_correction1
        exp_avg, _, denom = adam_direction(p, grad, state["exp_avg"], state["exp_avg_sq"], group, bias_correction2**0.5)
        p.addcdiv_(exp_avg, denom, value=-step_size)


def _on_cpu(params: list) -> bool:
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return all(t.device.type == "cpu" for t in tensors)


def sgd(params: Iterable, **hyper: Any):
    """SGD over ``params``: :class:`LeanSGD` when they are all on the CPU, ``torch.optim.SGD`` otherwise."""
    params = list(params)
    return LeanSGD(params, **hyper) if _on_cpu(params) else torch.optim.SGD(params, **hyper)


def adam(params: Iterable, **hyper: Any):
    """Adam over ``params``: :class:`LeanAdam` when they are all on the CPU, ``torch.optim.Adam`` otherwise."""
    params = list(params)
    return LeanAdam(params, **hyper) if _on_cpu(params) else torch.optim.Adam(params, **hyper)
