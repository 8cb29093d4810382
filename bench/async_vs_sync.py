"""Asynchronous vs synchronous FL in simulated time: time to a target accuracy with heterogeneous clients.

50 clients whose speeds are lognormal (sigma 1: the slowest of 50 is typically 10-20 times slower
than the median), on the embedded digits (or synthetic data). Every run uses the virtual clock, so
the figures are simulated seconds and do not depend on this machine. Rows:

* ``sync``: rounds of ceil(0.2 x 50) = 10 sampled clients; a round lasts as long as its slowest;
* ``async``: 10 clients training at once (the same concurrency), a version every 5 updates
  (buffer 5); prototype methods use their staleness-weighted banks, FedAvg its default policy;
* ``fedbuff`` (weight-sharing methods only): the same, with FedBuff's server policy;
* ``fedasync`` (weight-sharing methods only): FedAsync's mixing, one update per version.

Every row does the same number of local updates (rounds x updates per version), so async is
not given more work. Reports, per row, the simulated time to reach the target head accuracy
(mean over seeds; a seed that never reaches it counts as not reached), the final accuracy and the
simulated time of the whole run, and writes a plot of accuracy vs simulated time.

    python bench/async_vs_sync.py                                    # fedproto + fedavg, 2 seeds
    python bench/async_vs_sync.py --out bench/results/async_vs_sync  # .json, .md and .png
    python bench/async_vs_sync.py --methods fedproto --seeds 0 --updates 200 --target 0.8
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
from _common import add_common_args, check_configs, run_all, series, write_results

from rayfed_proto.tracking import metric_names as names

# mode -> overrides; {per} = updates per version, rounds follow from the total updates
MODES = {
    "sync": {"per": 10, "set": ["federation.mode=sync", "federation.participation=0.2"]},
    "async": {"per": 5, "set": ["federation.mode=async", "federation.buffer_size=5", "federation.participation=0.2"]},
    "fedbuff": {"per": 5, "set": ["federation.mode=async", "federation.buffer_size=5", "federation.participation=0.2",
                                  "algorithm.async_policy=fedbuff"], "weights_only": True},
    "fedasync": {"per": 1, "set": ["federation.mode=async", "federation.buffer_size=1", "federation.participation=0.2",
                                   "algorithm.async_policy=fedasync"], "weights_only": True},
}
WEIGHT_METHODS = {"fedavg", "fedlsa", "fedsc"}
DATASETS = {
    "digits": ["data.name=digits"],
    "synthetic": ["data.name=synthetic", "data.num_samples=6000", "data.num_classes=10", "data.channels=1"],
}


def run_overrides(method: str, mode: str, dataset: str, seed: int, args) -> list[str]:
    m = MODES[mode]
    rounds = max(1, args.updates // m["per"])
    return DATASETS[dataset] + m["set"] + [
        f"seed={seed}", f"algorithm.name={method}", "data.partition.name=dirichlet", f"data.partition.beta={args.beta}",
        "data.partition.min_samples=10", "model.group=HtFE1", "model.feature_dim=64",
        f"training.local_epochs={args.local_epochs}", f"training.lr={args.lr}",
        f"federation.num_clients={args.clients}", f"federation.rounds={rounds}",
        f"federation.eval_every={max(1, rounds // args.evals)}", "federation.max_staleness=1000",
        "system.speed.kind=lognormal", f"system.speed.sigma={args.sigma}", f"tracking.target_accuracy={args.target}",
        f"tracking.tracking_uri={args.tracking_uri}", "tracking.experiment_name=async_vs_sync",
        f"tracking.run_name={method}-{mode}-{dataset}-s{seed}", "tracking.output_dir=/tmp/rayfed_async_vs_sync_runs",
        "tracking.system_metrics=false",
    ] + list(args.set)


def time_to(history: list[dict], target: float) -> float:
    acc, t = series(history, names.EVAL_HEAD_ACC), series(history, names.FEDERATION_SIM_TIME_S)
    hit = np.flatnonzero(np.isfinite(acc) & (acc >= target))
    return float(t[hit[0]]) if hit.size else math.nan


def one_run(method: str, mode: str, dataset: str, seed: int, args) -> dict:
    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment

    result = run_experiment(build_config({}, run_overrides(method, mode, dataset, seed, args)), progress=False,
                            echo=lambda s: None)
    h = result.history
    return {"method": method, "mode": mode, "dataset": dataset, "seed": seed, "time_to_target": time_to(h, args.target),
            "final_head": float(series(h, names.EVAL_HEAD_ACC)[-1]), "sim_time": float(series(h, names.FEDERATION_SIM_TIME_S)[-1]),
            "staleness_max": float(np.nanmax(series(h, names.FEDERATION_STALENESS_MAX))),
            "curve": [[float(x), float(y)] for x, y in zip(series(h, names.FEDERATION_SIM_TIME_S), series(h, names.EVAL_HEAD_ACC), strict=True)],
            "run_id": result.run_id}


def table(rows: list[dict], target: float) -> str:
    out = [f"| dataset | method | mode | time to {100 * target:.0f}% (sim s) | vs sync | final head | run's sim time (s) "
           "| max staleness |", "|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["dataset"], r["method"]) for r in rows})
    for d, m in keys:
        rs = [r for r in rows if r["dataset"] == d and r["method"] == m]
        sync = [r["time_to_target"] for r in rs if r["mode"] == "sync"]
        sync_t = float(np.mean(sync)) if sync and np.isfinite(sync).all() else math.nan
        for mode in MODES:
            mr = [r for r in rs if r["mode"] == mode]
            if not mr:
                continue
            tt = np.array([r["time_to_target"] for r in mr])
            reached = np.isfinite(tt).all()
            t_cell = f"{tt.mean():.0f}" if reached else f"not reached ({int(np.isfinite(tt).sum())}/{len(tt)} seeds)"
            ratio = f"{tt.mean() / sync_t:.2f}" if reached and math.isfinite(sync_t) else "n/a"
            out.append(f"| {d} | {m} | {mode} | {t_cell} | {ratio} | {100 * np.mean([r['final_head'] for r in mr]):.1f} | "
                       f"{np.mean([r['sim_time'] for r in mr]):.0f} | {max(r['staleness_max'] for r in mr):.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in rows})
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4.2), squeeze=False)
    for ax, m in zip(axes[0], methods, strict=True):
        for i, mode in enumerate(MODES):
            for j, r in enumerate(r for r in rows if r["method"] == m and r["mode"] == mode):
                xy = np.array(r["curve"])
                ax.plot(xy[:, 0], xy[:, 1], color=f"C{i}", alpha=0.85, label=mode if j == 0 else None)
        ax.axhline(target, color="0.4", linestyle=":", linewidth=1.0, label=f"target {100 * target:.0f}%")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("head accuracy")
        ax.set_title(m)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["fedproto", "fedavg"])
    p.add_argument("--modes", nargs="+", default=["sync", "async", "fedbuff"], choices=list(MODES))
    p.add_argument("--datasets", nargs="+", default=["digits"], choices=list(DATASETS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--updates", type=int, default=400, help="local updates per run (every row does as many)")
    p.add_argument("--evals", type=int, default=20, help="evaluations per run")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the client speeds")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--target", type=float, default=0.75, help="head accuracy to reach")
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    add_common_args(p, tracking_uri="sqlite:////tmp/rayfed_async_vs_sync.db")
    args = p.parse_args()
    jobs = [(m, mode, d, s, args) for d in args.datasets for m in args.methods for mode in args.modes
            for s in args.seeds if not (MODES[mode].get("weights_only") and m not in WEIGHT_METHODS)]
    check_configs(p, (run_overrides(*job) for job in jobs))
    rows = run_all(args.cpus, jobs, one_run, lambda r: (
        f"{r['dataset']:<9} {r['method']:<8} {r['mode']:<8} seed {r['seed']} time to target {r['time_to_target']:.0f} s "
        f"final head {r['final_head']:.3f}"))
    md = table(rows, args.target)
    settings = (f"{args.clients} clients (HtFE1 CNN), Dirichlet beta {args.beta}, lognormal speeds sigma {args.sigma}, "
                f"{args.local_epochs} local epochs, lr {args.lr}, batch 10, "
                f"{args.updates} local updates per run, sync participation 0.2 (10 per round), async concurrency 10, "
                f"target head accuracy {args.target}, seeds {args.seeds}"
                + (f"; every run: {' '.join(args.set)}" if args.set else ""))
    write_results(args, [{k: v for k, v in r.items() if k != "curve"} for r in rows], settings, md)
    if args.out:
        plot(rows, args.target, args.out + ".png")
        print(f"plot: {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
