"""The metric each paper reports for a method, and the value of a run's history under it."""

from __future__ import annotations

import math

from rayfed_proto.tracking.metric_names import EVAL_GLOBAL_ACC, EVAL_PROTO_ACC

try:  # issue 47 item 8: the platform's own mapping, once it lands
    from rayfed_proto.tracking.paper_metric import paper_metric  # type: ignore[import-not-found]
except ImportError:  # LOCAL FALLBACK until rayfed_proto/tracking/paper_metric.py lands; delete this branch then

    # HtFLlib-based papers (FedSA, FedTGP, FedProtoKD; FedProto as they run it) report prototype accuracy, the best
    # over rounds evaluated every round; FedSC and FedLSA (and FedAvg beside them) the global model on the global
    # test set, at the end
    _PAPER_METRIC = {"fedsa": (EVAL_PROTO_ACC, "best"), "fedtgp": (EVAL_PROTO_ACC, "best"),
                     "fedprotokd": (EVAL_PROTO_ACC, "best"), "fedproto": (EVAL_PROTO_ACC, "best"),
                     "fedsc": (EVAL_GLOBAL_ACC, "final"), "fedlsa": (EVAL_GLOBAL_ACC, "final"),
                     "fedavg": (EVAL_GLOBAL_ACC, "final")}

    def paper_metric(algorithm: str) -> tuple[str, str]:
        """``(metric_key, 'best'|'final')``: the metric the method's paper reports."""
        try:
            return _PAPER_METRIC[algorithm]
        except KeyError:
            raise ValueError(f"no paper metric for algorithm {algorithm!r}; known: {', '.join(sorted(_PAPER_METRIC))}") from None


def domain_metric(key: str, domain: str) -> str:
    """The per-domain form of a global-model metric: ``eval/global_acc`` -> ``eval/global_acc_mnist``
    (``mean``: ``eval/global_acc_domain_mean``, the unweighted mean over domains)."""
    return f"{key}_domain_mean" if domain == "mean" else f"{key}_{domain}"


def history_value(history, key: str, mode: str) -> float:
    """A run's value of ``key``: the last finite one (``final``) or the largest (``best``); NaN
    when the history has none."""
    import numpy as np

    if history is None or key not in history:
        return math.nan
    values = history[key].to_numpy(dtype=float)
    ok = values[np.isfinite(values)]
    if not ok.size:
        return math.nan
    return float(ok[-1]) if mode == "final" else float(ok.max())
