"""The metric each paper reports for a method, and the value of a run's history under it."""

from __future__ import annotations

import math

from rayfed_proto.tracking.paper_metric import final_and_best, paper_metric

__all__ = ["domain_metric", "history_value", "paper_metric"]


def domain_metric(key: str, domain: str) -> str:
    """The per-domain form of a global-model metric: ``eval/global_acc`` -> ``eval/global_acc_mnist``
    (``mean``: ``eval/global_acc_domain_mean``, the unweighted mean over domains)."""
    return f"{key}_domain_mean" if domain == "mean" else f"{key}_{domain}"


def history_value(history, key: str, mode: str) -> float:
    """A run's value of ``key``: the last finite one (``final``) or the largest (``best``); NaN
    when the history has none."""
    if history is None or key not in history:
        return math.nan
    final, best = final_and_best(history[key].to_numpy(dtype=float))
    return final if mode == "final" else best
