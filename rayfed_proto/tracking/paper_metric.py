"""What a run reports: the final and best of a metric's history, and each method's *paper metric*
(the metric and statistic its paper's tables report), in one place.

:func:`final_and_best` is the one reduction of a history to its final value (last finite
evaluation) and best value (max, or min, over its finite evaluations): the seed summary
(``runtime/seeds.py``) and ``rayfed-proto compare`` use it.

:func:`paper_metric` names, per method, what a reproduction reports by default (``compare --metric
paper``, the seed summary's "paper metric" line, ``rayfed-proto reproduce``), each with its source:

* FedSA, FedTGP (and FedProto as their baseline) run on HtFLlib: every round (``-eg 1``) the
  server averages the clients' nearest-prototype accuracy on their own test splits
  (``clientproto.py`` / ``clienttgp.py`` ``test_metrics``), keeps the list, and prints the best
  (``serverbase.py`` ``print_(max(self.rs_test_acc))``, "Best accuracy"); the papers report its
  mean and std over 3 trials (FedSA "Experimental setup": "three trials ... mean and standard
  deviation"). Here: ``eval/proto_acc``, best. FedSAP reports both inference modes (Table 1,
  mean ± std over 3 runs): its prototype mode is taken.
* FedSC reports the global model's test accuracy at the end ("the ACC columns show the final
  test accuracy", Table 3; R = 100 rounds, Sec. 5.1): ``eval/global_acc``, final. FedAvg, the
  global-model baseline, likewise.
* FedLSA reports the global model on each domain's test set and their average (Tables 2-3,
  "average performance on all domains"): ``eval/global_acc_domain_mean``, final, or
  ``eval/global_acc`` where a run has no domains. The paper does not say final or best: final
  (FedSC's reading of the same protocol) is this project's choice.
* FedProtoKD's headline is *server accuracy*, the server model F_G on the global test set (its
  Sec. IV-E "Evaluation Criteria"; Tables I-II), beside personalised client accuracy:
  ``eval/global_acc``. The statistic is not stated: best, as the HtFLlib-style tables it compares
  with (FedTGP), is this project's choice.

A method not listed reports ``eval/head_acc``, final.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rayfed_proto.tracking import metric_names as names

Stat = Literal["final", "best"]


def final_and_best(values: Iterable[float], mode: str = "max") -> tuple[float, float]:
    """(last finite value, max or min of the finite values); (nan, nan) when none is finite."""
    if mode not in ("max", "min"):
        raise ValueError(f"mode {mode!r}: allowed max (best = highest value) or min (best = lowest)")
    v = np.asarray(list(values), dtype=float)
    ok = v[np.isfinite(v)]
    if not ok.size:
        return math.nan, math.nan
    return float(ok[-1]), float(ok.max() if mode == "max" else ok.min())


@dataclass(frozen=True)
class PaperMetric:
    """The metric a method's paper reports: ``keys`` in order of preference (the first one a run
    logged is used), the statistic over a run's evaluations, and where the choice comes from."""

    keys: tuple[str, ...]
    stat: Stat
    source: str

    @property
    def key(self) -> str:
        return self.keys[0]

    def key_in(self, logged: Iterable[str]) -> str | None:
        """The first of ``keys`` among ``logged`` (None: the run has none of them)."""
        have = set(logged)
        return next((k for k in self.keys if k in have), None)

    def label(self, key: str | None = None) -> str:
        return f"{key or self.key} ({self.stat})"

    def __iter__(self):
        """``key, stat = paper_metric("fedsa")``: the preferred key and the statistic."""
        return iter((self.key, self.stat))


_HTFLLIB = ("HtFLlib serverbase.py evaluate/print_: best over per-round evaluations of the clients' prototype "
            "accuracy; mean and std over 3 trials")
PAPER_METRICS: dict[str, PaperMetric] = {
    "fedsa": PaperMetric((names.EVAL_PROTO_ACC,), "best", f"FedSA Sec. Experiments, Tables 1-2; {_HTFLLIB}"),
    "fedtgp": PaperMetric((names.EVAL_PROTO_ACC,), "best", f"FedTGP Tables 1-2; {_HTFLLIB}"),
    "fedproto": PaperMetric((names.EVAL_PROTO_ACC,), "best", f"as the FedSA / FedTGP baselines; {_HTFLLIB}"),
    "fedsap": PaperMetric((names.EVAL_PROTO_ACC,), "best", "FedSAP Table 1 (prototype inference; mean ± std over 3 runs)"),
    "fedsc": PaperMetric((names.EVAL_GLOBAL_ACC,), "final", "FedSC Table 3: 'the ACC columns show the final test accuracy'"),
    "fedavg": PaperMetric((names.EVAL_GLOBAL_ACC,), "final", "global model, as FedSC's and FedLSA's FedAvg baseline"),
    "fedlsa": PaperMetric((names.EVAL_GLOBAL_ACC_DOMAIN_MEAN, names.EVAL_GLOBAL_ACC), "final",
                          "FedLSA Tables 2-3: global model, average over the domains' test sets (final: this "
                          "project's choice, the paper does not say)"),
    "fedprotokd": PaperMetric((names.EVAL_GLOBAL_ACC,), "best",
                              "FedProtoKD Sec. IV-E: server accuracy (server model on the global test set; best: this "
                              "project's choice, the paper does not say)"),
}
DEFAULT_PAPER_METRIC = PaperMetric((names.EVAL_HEAD_ACC,), "final", "no paper metric named for this method")


def paper_metric(algorithm: str) -> PaperMetric:
    """The metric (keys in preference order), statistic and source that ``algorithm``'s paper reports."""
    return PAPER_METRICS.get(algorithm, DEFAULT_PAPER_METRIC)
