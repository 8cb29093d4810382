"""Which figures become MLflow charts: a chart that holds one point or one value says nothing (issue 49).

The run's history (``RunResult.history``, history.csv/.parquet, ``on_eval``, Tune reports) keeps every
figure; this module decides only what goes to MLflow as a *metric series*:

* **one-value figures** (:data:`ONE_VALUE`: the start-up time, measured once per run) are run
  *tags* under the same name (``federation/startup_s``), beside the run's summary table, not
  single-dot charts;
* **held series**: every other figure outside :data:`ALWAYS_CHARTED` is held back while it keeps its
  first value (a counter, :data:`~rayfed_proto.tracking.metric_names.COUNTERS`: while it is 0), and
  logged, with the points held so far (back-filled at their steps), from the first step where it
  differs. So a counter that stays 0 (``reliability/...``,
  ``train/nonfinite_steps``), a sync run's staleness (0 by construction), a figure an algorithm
  reports as a constant (FedSA's ``server/anchor_classes_updated``: every class, every version)
  never make a flat chart, and one that moves is drawn from its first evaluation on;
* **always charted** (:data:`ALWAYS_CHARTED`): the evaluation (``eval/``), the per-client series
  (``zz_client/``) and the sweep parent's best value (``best/``): the figures users compare runs by,
  logged as they come even when flat (a run stuck at chance accuracy is a result), and the
  :data:`FINAL_FIGURES` (``federation/time_to_target_*``, the actors' peak memory
  ``system/actors/...``): one value each, kept metrics because the run list sorts and filters runs
  by a metric as a number and by a tag as text, which is how runs are compared by them.
"""

from __future__ import annotations

from collections.abc import Mapping

from rayfed_proto.tracking import metric_names as names

ONE_VALUE: frozenset[str] = frozenset({names.FEDERATION_STARTUP_S})
ALWAYS_PREFIXES = ("eval/", f"{names.CLIENT_SECTION}/", "best/")
# one value each, kept metrics on purpose: the run list sorts and filters runs by a metric as a number (a tag as text)
FINAL_FIGURES: frozenset[str] = frozenset({
    names.FEDERATION_TIME_TO_TARGET_SIM_S, names.FEDERATION_TIME_TO_TARGET_WALL_S,
    names.SYSTEM_CLIENT_PEAK_RSS_MIB_MAX, names.SYSTEM_CLIENT_PSS_MIB_MAX, names.SYSTEM_CLIENT_PSS_MIB_TOTAL,
    names.SYSTEM_SERVER_PEAK_RSS_MIB, names.SYSTEM_SERVER_PSS_MIB})
ALWAYS_CHARTED = FINAL_FIGURES


def is_one_value(key: str) -> bool:
    return key in ONE_VALUE


def always_charted(key: str) -> bool:
    return key in ALWAYS_CHARTED or key.startswith(ALWAYS_PREFIXES)


def tag_text(value: float) -> str:
    """A one-value figure as a tag: 4 significant digits at least, integers as integers."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class SeriesGate:
    """Sorts each batch of metrics (one step) into what to log now, what to back-fill, and tags.

    ``moving``: keys already charted (a resumed run's existing metrics: they go on as before)."""

    def __init__(self, moving: Mapping[str, object] | set[str] | None = None):
        self.moving: set[str] = set(moving or ())
        self.held: dict[str, list[tuple[int, float]]] = {}  # key -> [(step, value)] while it keeps its first value

    def admit(self, metrics: Mapping[str, float], step: int) -> tuple[dict[str, float], list[tuple[str, float, int]], dict[str, str]]:
        """``(now, backfill, tags)``: ``now`` to log at ``step``; ``backfill`` the held points
        (key, value, step) of series that moved at this step, to log first; ``tags`` the
        one-value figures."""
        now: dict[str, float] = {}
        backfill: list[tuple[str, float, int]] = []
        tags: dict[str, str] = {}
        for key, value in metrics.items():
            if is_one_value(key):
                tags[key] = tag_text(value)
            elif key in self.moving or always_charted(key):
                now[key] = value
            elif value == self._baseline(key, value):
                self.held.setdefault(key, []).append((step, value))
            else:  # moved: its held points first, then this one
                backfill += [(key, v, s) for s, v in self.held.pop(key, [])]
                self.moving.add(key)
                now[key] = value
        return now, backfill, tags

    def _baseline(self, key: str, value: float) -> float:
        """The value a held series keeps until it says something: 0 for a counter (its first
        non-zero value is news), else its first value."""
        if key in names.COUNTERS:
            return 0.0
        return self.held[key][0][1] if key in self.held else value

    def still_held(self) -> dict[str, float]:
        """The figures never charted (each kept one value throughout), with that value."""
        return {k: points[0][1] for k, points in self.held.items()}
