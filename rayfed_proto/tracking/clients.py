"""Per-client series (``zz_client/head_acc/client_<id>`` ...) and the final per-client table.

Why a limit: MLflow draws one chart per metric key, so 1000 clients x 4 series would bury the
run page. Up to ``tracking.client_series_limit`` clients every client gets its series; above it,
a seeded sample of ``tracking.client_series_sample`` clients is logged live, and at the end the
``EXTREMES`` worst and best clients by final head accuracy get their whole series back-filled
(their rows are kept in memory while the run goes on: a few floats per client and evaluation).
Which clients were logged is written to the run tag ``rayfed_proto.client_series``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import pandas as pd

from rayfed_proto.tracking.metric_names import CLIENT_SERIES, client_series

EXTREMES = 3  # worst and best clients added to a sample


def client_row(result: dict[str, Any]) -> dict[str, float]:
    """One client's evaluation as the series values (accuracies are fractions), by series
    (``metric_names.CLIENT_SERIES``; the metric is ``client_series(client_id, series)``), and
    ``samples``, the test-split size: constant, kept for the table and never logged as a metric
    (it is the run parameter ``client.test_samples``)."""
    n = int(result.get("n", 0))
    row = {"samples": float(n)}
    if n > 0:
        row["head_acc"] = result["head_correct"] / n
        if result.get("proto_correct") is not None:
            row["proto_acc"] = result["proto_correct"] / n
    loss = result.get("train_loss")
    if isinstance(loss, (int, float)) and math.isfinite(loss):
        row["train_loss"] = float(loss)
    return row


class ClientSeries:
    def __init__(self, num_clients: int, limit: int, sample: int, seed: int):
        self.num_clients = num_clients
        self.every = num_clients <= limit
        if self.every:
            self.chosen = list(range(num_clients))
        else:
            rng = np.random.default_rng([seed, 0xC11E47])  # its own stream: sampling of clients is unaffected
            self.chosen = sorted(int(c) for c in rng.choice(num_clients, size=min(sample, num_clients), replace=False))
        self._chosen = set(self.chosen)
        self.kept: dict[int, list[tuple[int, dict[str, float]]]] = {}  # not chosen: (step, row), for back-filling
        self.last: dict[int, dict[str, float]] = {}  # every client's latest row

    def metrics(self, step: int, results: Sequence[dict[str, Any]]) -> dict[str, float]:
        """The ``zz_client/<series>/client_<id>`` metrics of the chosen clients at this evaluation."""
        out: dict[str, float] = {}
        for r in results:
            c = int(r["client_id"])
            row = client_row(r)
            self.last[c] = row
            if c in self._chosen:
                out.update({client_series(c, k): v for k, v in row.items() if k in CLIENT_SERIES})
            else:
                self.kept.setdefault(c, []).append((step, row))
        return out

    def extremes(self) -> tuple[list[int], list[int]]:
        """(worst, best) clients by their latest head accuracy, ``EXTREMES`` each, ties by id."""
        scored = sorted((row["head_acc"], c) for c, row in self.last.items() if "head_acc" in row)
        k = min(EXTREMES, len(scored) // 2) if len(scored) > 1 else len(scored)
        return [c for _, c in scored[:k]], [c for _, c in reversed(scored[len(scored) - k:])]

    def backfill(self) -> tuple[list[tuple[str, float, int]], str]:
        """(key, value, step) of the whole series of the worst and best clients that were not in
        the sample, and the description for the run tag."""
        if self.every:
            return [], f"all {self.num_clients} clients"
        worst, best = self.extremes()
        points = [(client_series(c, k), v, step) for c in dict.fromkeys(worst + best) if c not in self._chosen
                  for step, row in self.kept.get(c, []) for k, v in row.items() if k in CLIENT_SERIES]
        return points, (f"seeded sample of {len(self.chosen)} of {self.num_clients} clients {self.chosen}; "
                        f"worst {worst} and best {best} by final head accuracy")


class ClientHistory:
    """Every client's :func:`client_row` at every evaluation, as one frame (``version``,
    ``client_id`` and the :data:`CLIENT_SERIES`): ``client_history.parquet``. A few floats per
    client and evaluation, kept whether or not the series are logged as MLflow metrics."""

    def __init__(self):
        self._parts: list[pd.DataFrame] = []

    def add(self, version: int, results: Sequence[dict[str, Any]]) -> None:
        rows = [{"version": int(version), "client_id": int(r["client_id"]),
                 **{k: v for k, v in client_row(r).items() if k in CLIENT_SERIES}} for r in results]
        if rows:
            self._parts.append(pd.DataFrame(rows))

    def frame(self) -> pd.DataFrame:
        columns = ["version", "client_id", *CLIENT_SERIES]
        if not self._parts:
            return pd.DataFrame(columns=columns)
        frame = pd.concat(self._parts, ignore_index=True)
        return frame.reindex(columns=[c for c in columns if c in frame]).sort_values(["version", "client_id"],
                                                                                     ignore_index=True)


def test_samples_param(test_sizes: Sequence[int]) -> str:
    """The run parameter ``client.test_samples``: each client's test-split size, by client id
    (``[30, 28, ...]``); MLflow caps a param at 6000 characters, so a longer list ends in ``...``
    (every size is in ``tables/clients.json``)."""
    text = "[" + ", ".join(str(int(n)) for n in test_sizes) + "]"
    return text if len(text) <= 6000 else text[:5990].rsplit(",", 1)[0] + ", ...]"


def client_table(last: dict[int, dict[str, float]], label_counts: np.ndarray, class_names: Sequence[str],
                 archs: Optional[Sequence[str]] = None) -> pd.DataFrame:
    """One row per client: architecture, training samples (``label_counts``: per client and class,
    train split), test samples, final accuracies and loss, training samples per class."""
    rows = []
    for c in range(len(label_counts)):
        counts = np.asarray(label_counts[c])
        total = int(counts.sum())
        row: dict[str, Any] = {"client_id": c}
        if archs is not None:
            row["architecture"] = archs[c]
        row.update({"train_samples": total, "classes_present": int((counts > 0).sum()),
                    "majority_class_share": float(counts.max() / total) if total else float("nan")})
        final = last.get(c, {})
        row.update({f"final_{k}": final.get(k, float("nan")) for k in ("head_acc", "proto_acc", "train_loss")})
        row["test_samples"] = int(final.get("samples", 0))
        row.update({f"n_{name}": int(n) for name, n in zip(class_names, counts, strict=True)})
        rows.append(row)
    return pd.DataFrame(rows)
