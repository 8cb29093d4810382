"""Plain-text run summary and history helpers: the end-of-run table, byte/duration formatting, a DataFrame view.

Why: a run should end with one table a person can read in a terminal, a log or an MLflow text
artifact without opening a notebook. This module only builds strings and frames; uploading them is
the tracking layer's job, so nothing here imports Ray or MLflow.

The history is a list of dicts, one per evaluation, keyed by the names of
:mod:`rayfed_proto.tracking.metric_names` (see :func:`summary_rows` for the keys used).
Missing keys, ``None`` and NaN are gaps, never errors: a FedAvg run has no prototype metrics, an
early evaluation may precede the first prototype bank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rayfed_proto.tracking import metric_names as names

History = Sequence[Mapping[str, Any]]

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def metric_series(history: History, key: str) -> np.ndarray:
    """``history[i][key]`` as a float array; missing, ``None`` or non-numeric entries become NaN."""
    out = np.full(len(history), np.nan)
    for i, row in enumerate(history):
        try:
            out[i] = float(row.get(key))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
    return out


def human_bytes(n: float) -> str:
    """Binary units: ``"0 B"``, ``"512 B"``, ``"1.5 KiB"``, ``"2.0 MiB"``; whole bytes below 1 KiB, one decimal above."""
    if not math.isfinite(n):
        return "n/a"
    sign = "-" if n < 0 else ""
    value, unit = abs(float(n)), _BYTE_UNITS[0]
    for bigger in _BYTE_UNITS[1:]:
        if round(value, 0 if unit == "B" else 1) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{sign}{value:.0f} B" if unit == "B" else f"{sign}{value:.1f} {unit}"


def human_duration(seconds: float) -> str:
    """``"3.2s"`` under a minute, ``"2m 05s"`` under an hour, ``"1h 02m 05s"`` beyond (whole seconds from 1 min)."""
    if not math.isfinite(seconds):
        return "n/a"
    sign = "-" if seconds < 0 else ""
    s = abs(float(seconds))
    if round(s, 1) < 60:
        return f"{sign}{s:.1f}s"
    hours, rest = divmod(round(s), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{sign}{hours}h {minutes:02d}m {secs:02d}s"
    return f"{sign}{minutes}m {secs:02d}s"


def _pct(fraction: float) -> str:
    return f"{100.0 * fraction:.2f}%"


def _num(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "n/a"


def _at(version: np.ndarray, i: int) -> str:
    """Where evaluation ``i`` happened: its server version, or its position when the version is missing."""
    return f"v{int(version[i])}" if math.isfinite(version[i]) else f"evaluation {i + 1}"


def _last_finite(*series: np.ndarray) -> int | None:
    """Index of the last evaluation where any of ``series`` is finite."""
    ok = np.flatnonzero(np.logical_or.reduce([np.isfinite(s) for s in series]))
    return int(ok[-1]) if ok.size else None


SERVER_DOMINATES = 0.5  # server/train_s over federation/wall_s from which the summary explains the slot utilisation


def _server_share_note(history: History, i: int) -> str:
    """Beside the slot utilisation of evaluation ``i``: when the server spent at least
    :data:`SERVER_DOMINATES` of the wall time training (FedTGP's prototype generator), the clients
    waited on it for much of the run (sync rounds, or backpressure in async mode), and the note says
    so beside the figure: the low utilisation comes from the method, not from the resource plan.
    Both figures are run-cumulative."""
    train, wall = metric_series(history, names.SERVER_TRAIN_S), metric_series(history, names.FEDERATION_WALL_S)
    if i >= len(train) or not (np.isfinite(train[i]) and np.isfinite(wall[i]) and wall[i] > 0):
        return ""
    share = float(train[i] / wall[i])
    return f" (the server's training took {100.0 * min(share, 1.0):.0f}% of the wall time)" if share >= SERVER_DOMINATES else ""


def _accuracy_rows(label: str, acc: np.ndarray, version: np.ndarray) -> list[tuple[str, str]]:
    """``final`` (last finite value) and ``best`` (first occurrence of the maximum) with their versions."""
    ok = np.flatnonzero(np.isfinite(acc))
    if ok.size == 0:
        return []
    last, best = int(ok[-1]), int(ok[np.argmax(acc[ok])])
    return [(f"{label} (final)", f"{_pct(acc[last])} @ {_at(version, last)}"),
            (f"{label} (best)", f"{_pct(acc[best])} @ {_at(version, best)}")]


def time_to_target(history: History, target: float, key: str = names.EVAL_HEAD_ACC,
                   time_key: str = names.FEDERATION_SIM_TIME_S) -> tuple[float, int] | None:
    """``(time, version)`` of the first evaluation whose ``key`` reaches ``target``, with its
    ``time_key`` (simulated or wall seconds); None when the run never reaches it."""
    acc, t, v = metric_series(history, key), metric_series(history, time_key), metric_series(history, names.VERSION)
    hit = np.flatnonzero(np.isfinite(acc) & (acc >= target) & np.isfinite(t))
    if hit.size == 0:
        return None
    i = int(hit[0])
    return float(t[i]), int(v[i])


def _target_rows(history: History, target: float | None) -> list[tuple[str, str]]:
    if target is None:
        return []
    label = f"time to {_pct(target)} head accuracy"
    found = [(name, time_to_target(history, target, time_key=key)) for name, key in (("simulated", names.FEDERATION_SIM_TIME_S),
                                                                                            ("wall", names.FEDERATION_WALL_S))
             if np.isfinite(metric_series(history, key)).any()]
    if not found:
        return []
    if all(hit is None for _, hit in found):
        return [(label, "not reached")]
    return [(label, ", ".join(f"{name} {human_duration(hit[0])} @ version {hit[1]}" for name, hit in found if hit is not None))]


def summary_rows(history: History, target_accuracy: float | None = None) -> list[tuple[str, str]]:
    """The run summary as ``(label, value)`` rows; a row is left out when its metrics never appear.

    Keys read (the names of :mod:`rayfed_proto.tracking.metric_names`): ``version``, ``eval/head_acc``,
    ``eval/proto_acc``, ``eval/head_acc_mean``/``_std`` (across clients), ``eval/global_acc...``,
    ``server/proto_margin_min``/``_mean``, ``federation/wall_s``, ``federation/sim_time_s``,
    ``federation/bytes_up``/``_down``, ``federation/staleness_mean``/``_max``,
    ``federation/updates_dropped``/``updates_refused``, ``federation/slot_utilisation`` (with
    ``server/train_s``: :func:`_server_share_note`), ``reliability/...``.
    Accuracies are fractions in [0, 1]. Wall time, bytes, dropped/refused and slot utilisation are
    run-cumulative, so their last value is the run's; staleness is per evaluation window, so the
    table shows the average of the window means and the maximum of the window maxima.
    """
    rows: list[tuple[str, str]] = []
    v = metric_series(history, names.VERSION)
    rows += _accuracy_rows("head accuracy", metric_series(history, names.EVAL_HEAD_ACC), v)
    rows += _accuracy_rows("prototype accuracy", metric_series(history, names.EVAL_PROTO_ACC), v)
    rows += _accuracy_rows("global model accuracy", metric_series(history, names.EVAL_GLOBAL_ACC), v)
    rows += _accuracy_rows("global model, domain mean", metric_series(history, names.EVAL_GLOBAL_ACC_DOMAIN_MEAN), v)

    mean, std = metric_series(history, names.EVAL_HEAD_ACC_MEAN), metric_series(history, names.EVAL_HEAD_ACC_STD)
    ok = np.flatnonzero(np.isfinite(mean) & np.isfinite(std))
    if ok.size:
        i = int(ok[-1])
        rows.append(("per-client head accuracy (final)", f"{_pct(mean[i])} ± {_pct(std[i])} @ {_at(v, i)}"))

    m_min, m_mean = metric_series(history, names.SERVER_PROTO_MARGIN_MIN), metric_series(history, names.SERVER_PROTO_MARGIN_MEAN)
    i = _last_finite(m_min, m_mean)
    if i is not None:
        rows.append(("prototype margin (final)", f"min {_num(m_min[i])} / mean {_num(m_mean[i])} @ {_at(v, i)}"))

    if np.isfinite(v).any():
        rows.append(("server versions", str(int(np.nanmax(v)))))
    rows.append(("evaluations", str(len(history))))

    wall = metric_series(history, names.FEDERATION_WALL_S)
    i = _last_finite(wall)
    if i is not None:
        rows.append(("wall time", human_duration(wall[i])))
    sim = metric_series(history, names.FEDERATION_SIM_TIME_S)
    i = _last_finite(sim)
    if i is not None:
        rows.append(("simulated time", human_duration(sim[i])))
    rows += _target_rows(history, target_accuracy)

    up, down = metric_series(history, names.FEDERATION_BYTES_UP), metric_series(history, names.FEDERATION_BYTES_DOWN)
    i = _last_finite(up, down)
    if i is not None:
        rows.append(("bytes up / down", f"{human_bytes(up[i])} / {human_bytes(down[i])}"))

    s_mean, s_max = metric_series(history, names.FEDERATION_STALENESS_MEAN), metric_series(history, names.FEDERATION_STALENESS_MAX)
    if np.isfinite(s_mean).any() or np.isfinite(s_max).any():
        avg = f"{np.nanmean(s_mean):.2f}" if np.isfinite(s_mean).any() else "n/a"
        top = str(int(np.nanmax(s_max))) if np.isfinite(s_max).any() else "n/a"
        rows.append(("staleness mean / max (versions)", f"{avg} / {top}"))

    dropped, refused = metric_series(history, names.FEDERATION_UPDATES_DROPPED), metric_series(history, names.FEDERATION_UPDATES_REFUSED)
    i = _last_finite(dropped, refused)
    if i is not None:
        counts = [str(int(c)) if math.isfinite(c) else "n/a" for c in (dropped[i], refused[i])]
        rows.append(("updates dropped / refused", " / ".join(counts)))

    util = metric_series(history, names.FEDERATION_SLOT_UTILISATION)
    i = _last_finite(util)
    if i is not None:
        rows.append(("slot utilisation", f"{100.0 * util[i]:.1f}%{_server_share_note(history, i)}"))

    failures = [(label, metric_series(history, key)) for label, key in (
        ("client actor failures", names.RELIABILITY_CLIENT_FAILURES), ("server restarts", names.RELIABILITY_SERVER_RESTARTS),
        ("updates lost to client failures", names.RELIABILITY_UPDATES_LOST_CLIENT),
        ("updates lost to server restarts", names.RELIABILITY_UPDATES_LOST_SERVER),
        ("clients excluded", names.RELIABILITY_CLIENTS_EXCLUDED))]
    shown = [f"{label} {int(series[-1])}" for label, series in failures if series.size and np.isfinite(series[-1]) and series[-1] > 0]
    if shown:
        rows.append(("failures survived", ", ".join(shown)))
    return rows


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return " ".join(text.split())  # one line, so the box stays aligned


def format_summary_table(history: History, title: str = "Run summary", extra: Mapping[str, Any] | None = None,
                         target_accuracy: float | None = None) -> str:
    """An ASCII box (``+``, ``-``, ``|``) of ``extra`` rows (algorithm, dataset, run id...) then :func:`summary_rows`.

    Example::

        +-----------------------------+
        | Run summary                 |
        +----------------+------------+
        | algorithm      | fedproto   |
        +----------------+------------+
        | head accuracy  | 81.00% ... |
        +----------------+------------+
    """
    head = [(_cell(k), _cell(v)) for k, v in (extra or {}).items()]
    body = summary_rows(history, target_accuracy)
    every = head + body
    kw = max((len(k) for k, _ in every), default=0)
    vw = max((len(v) for _, v in every), default=0)
    vw = max(vw, len(title) - kw - 3)  # the title spans both columns
    rule = f"+{'-' * (kw + 2)}+{'-' * (vw + 2)}+"
    lines = [f"+{'-' * (kw + vw + 5)}+", f"| {title.ljust(kw + vw + 3)} |", rule]
    for block in (head, body):
        if block:
            lines += [f"| {k.ljust(kw)} | {v.ljust(vw)} |" for k, v in block]
            lines.append(rule)
    return "\n".join(lines)


def history_to_frame(history: History) -> pd.DataFrame:
    """One row per evaluation, in history order; columns sorted by name with ``version`` first."""
    frame = pd.DataFrame.from_records(list(history))
    return frame[sorted(frame.columns, key=lambda c: (c != "version", str(c)))]
