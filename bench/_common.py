"""What the comparison scripts in bench/ share: the run loop, the ``--set`` option, the mean ± std
cells, final/best of a metric's history, and writing OUT.json / OUT.md."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rayfed_proto.tracking.paper_metric import final_and_best


def add_common_args(p: argparse.ArgumentParser, tracking_uri: str) -> None:
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--tracking-uri", default=tracking_uri)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override added to every run (repeatable), e.g. algorithm.logit_weighting=probability_variance")
    p.add_argument("--out", help="write OUT.json and OUT.md")


def check_configs(p: argparse.ArgumentParser, override_lists: Iterable[list[str]]) -> None:
    """Every run's config (a bad ``--set`` above all) is checked before the first run, not after
    hours of them."""
    from rayfed_proto.config import ConfigError, build_config

    try:
        for overrides in override_lists:
            build_config({}, overrides)
    except ConfigError as e:
        p.error(str(e))


def run_all(cpus: int, jobs: Iterable[tuple[Any, ...]], one: Callable[..., dict], describe: Callable[[dict], str]) -> list[dict]:
    """``one(*job)`` for every job on one local Ray instance, a progress line after each."""
    import ray

    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    rows, t0 = [], time.perf_counter()
    try:
        for job in jobs:
            started = time.perf_counter()
            rows.append(one(*job))
            rows[-1].setdefault("seconds", time.perf_counter() - started)
            print(f"[{time.perf_counter() - t0:6.0f}s] {describe(rows[-1])} ({rows[-1]['seconds']:.0f}s)", flush=True)
    finally:
        ray.shutdown()
    return rows


def series(history: list[dict], key: str) -> np.ndarray:
    return np.array([h.get(key, math.nan) for h in history], float)


def final_best(history: list[dict], key: str) -> tuple[float, float]:
    """The last finite value of ``key`` and its best (max); NaN when it was never logged
    (``tracking.paper_metric.final_and_best``, the platform's one reduction)."""
    return final_and_best(series(history, key))


def cell(values, scale: float = 100.0) -> str:
    """Mean ± std over seeds, in % by default; 'n/a' when no value is finite."""
    v = np.array(values, float) * scale
    return "n/a" if not np.isfinite(v).any() else f"{np.nanmean(v):.1f} ± {np.nanstd(v):.1f}"


def write_results(args: argparse.Namespace, rows: list[dict], settings: str, md: str) -> None:
    print("\n" + settings + "\n\n" + md)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        Path(args.out + ".md").write_text(settings + "\n\n" + md + "\n")
