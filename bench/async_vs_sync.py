"""Asynchronous vs synchronous FL in simulated time: time to a target accuracy with heterogeneous clients.

50 clients whose speeds are lognormal (sigma 1: the slowest of 50 is typically 10-20 times slower
than the median), on the embedded digits (or synthetic data). Every run uses the virtual clock, so
the figures are simulated seconds and do not depend on this machine. Rows:

* ``sync``: rounds of ceil(0.2 x 50) = 10 sampled clients; a round lasts as long as its slowest;
* ``async``: 10 clients training at once (the same concurrency), a version every 5 updates
  (buffer 5); prototype methods use their staleness-weighted banks, FedAvg its default server rule;
* ``fedbuff`` (weight-sharing methods only): the same, with FedBuff's server rule;
* ``fedasync`` (weight-sharing methods only): FedAsync's mixing, one update per version.

Every row does the same number of local updates (rounds x updates per version), so async is
not given more work. Reports, per row, the simulated time to reach the target head accuracy
(mean over seeds; a seed that never reaches it counts as not reached), the final accuracy and the
simulated time of the whole run, and writes a plot of accuracy vs simulated time.

    python bench/async_vs_sync.py                                    # fedproto + fedavg, 2 seeds
    python bench/async_vs_sync.py --out bench/results/async_vs_sync  # .json, .md and .png
    python bench/async_vs_sync.py --methods fedproto --seeds 0 --updates 200 --target 0.8

``--scenario trace``: the same 50 clients, but their devices and availability come from a
FedScale-format trace that the script writes first (``fedscale_traces``: a device-capacity pickle
``{id: {"computation": ms per sample, "communication": kbit/s}}`` and a behaviour pickle
``{id: {"active": [...], "inactive": [...], "finish_time": T, ...}}``, plain dicts, drawn from
``--trace-seed``), read with ``system.speed/bandwidth/availability.kind=fedscale``. Each run's seed
maps trace clients to run clients differently (simulation.md). Updates of a client that goes
offline before they finish are lost (``federation/updates_dropped_offline``). Default rows:
``sync``, ``sync_deadline`` (sync with ``federation.round_deadline_s`` = ``--deadline`` for the
method and ``federation.over_selection`` = ``--over-selection``: FedScale's rounds), ``async`` and
``fedbuff``. How rows stay comparable: every row produces the same number of *versions* from the
same number of *slots* (sync and sync_deadline: ``--updates / 10`` rounds keeping at most 10 updates
each; async: ``--updates / 5`` versions of 5 accepted updates), so async delivers exactly
``--updates`` updates and a sync round delivers 10 minus what it lost; the table reports the updates
dispatched (the work done), the ones the server accepted and the ones dropped (offline, after the
deadline, beyond the first K of an over-selected round): dropped updates are work lost, not work
saved.

    python bench/async_vs_sync.py --scenario trace --out bench/results/async_vs_sync_trace
    python bench/async_vs_sync.py --write-trace /tmp/trace   # only write the two pickles (docs/simulation.md)
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import add_common_args, check_configs, final_best, run_all, series, write_results

from rayfed_proto.tracking import metric_names as names

# mode -> overrides; {per} = updates per version, rounds follow from the total updates
MODES = {
    "sync": {"per": 10, "set": ["federation.mode=sync", "federation.participation=0.2"]},
    # FedScale's rounds: over-select, keep the first 10 to finish by the deadline (--deadline, --over-selection)
    "sync_deadline": {"per": 10, "set": ["federation.mode=sync", "federation.participation=0.2"], "deadline": True},
    "async": {"per": 5, "set": ["federation.mode=async", "federation.buffer_size=5", "federation.participation=0.2"]},
    "fedbuff": {"per": 5, "set": ["federation.mode=async", "federation.buffer_size=5", "federation.participation=0.2",
                                  "algorithm.server_rule=fedbuff"], "weights_only": True},
    "fedasync": {"per": 1, "set": ["federation.mode=async", "federation.buffer_size=1", "federation.participation=0.2",
                                   "algorithm.server_rule=fedasync"], "weights_only": True},
}
# --scenario trace: FedScale-format device and behaviour traces (fedscale_traces) instead of lognormal speeds
SCENARIO_MODES = {"lognormal": ["sync", "async", "fedbuff"], "trace": ["sync", "sync_deadline", "async", "fedbuff"]}
TRACE_FILES = ("client_device_capacity.pkl", "client_behave_trace.pkl")
DEVICE_MODELS = ("SM-G960F", "Pixel 3", "Redmi Note 8", "iPhone-ish", "SM-A505F", "Moto G7", "ONEPLUS A6003")


def fedscale_traces(num_clients: int, seed: int, session_s: float = 60.0, period_s: float = 3600.0) -> tuple[dict, dict]:
    """A FedScale-format device-capacity and behaviour trace for ``num_clients`` trace clients (ids from
    1, as FedScale's), a function of ``seed`` only; plain dicts of Python floats, lists and strings (what
    the project's pickle loader accepts: no NumPy scalar).

    Shapes follow FedScale's traces: ``computation`` (ms per sample) lognormal around 150 ms (sigma 0.6,
    clipped to [15, 3000]); ``communication`` (kbit/s) lognormal around 5 Mbit/s (sigma 1.0, clipped to
    [100, 200000]): mobile links spread over orders of magnitude. Behaviour: each client is online a
    fraction ``a ~ Beta(2, 2)`` (clipped to [0.1, 0.95]) of the time, in sessions whose lengths are
    lognormal (median ``session_s``, sigma 1) separated by offline gaps (median ``session_s x (1 - a) / a``,
    sigma 1), starting online at 0 with probability ``a``; ``active``/``inactive`` list the sessions'
    starts and ends within one period ``finish_time = period_s``, after which the pattern repeats.
    FedScale's real sessions last minutes to hours for updates of minutes; here updates take
    seconds, so ``session_s`` compresses the time scale to keep that ratio (a few percent of updates
    outlive their session), not FedScale's absolute durations."""
    rng = np.random.default_rng([seed, 0xFED5CA1E])
    device, behave = {}, {}
    for k in range(1, num_clients + 1):
        comp = float(np.clip(rng.lognormal(math.log(150.0), 0.6), 15.0, 3000.0))
        comm = float(np.clip(rng.lognormal(math.log(5000.0), 1.0), 100.0, 200000.0))
        device[k] = {"computation": round(comp, 1), "communication": round(comm, 3)}
    for k in range(1, num_clients + 1):
        frac = float(np.clip(rng.beta(2.0, 2.0), 0.1, 0.95))
        gap_median = session_s * (1.0 - frac) / frac
        t = 0.0 if rng.random() < frac else float(rng.random() * rng.lognormal(math.log(gap_median), 1.0))
        active, inactive = [], []
        while t < period_s - 1.0:
            end = min(t + max(1.0, float(rng.lognormal(math.log(session_s), 1.0))), period_s)
            active.append(round(t, 3))
            inactive.append(round(end, 3))
            t = end + max(1.0, float(rng.lognormal(math.log(gap_median), 1.0)))
        behave[k] = {"duration": float(period_s), "active": active, "inactive": inactive,
                     "finish_time": float(period_s), "model": DEVICE_MODELS[k % len(DEVICE_MODELS)]}
    return device, behave


def write_traces(folder, num_clients: int, seed: int, session_s: float = 60.0, period_s: float = 3600.0) -> tuple[Path, Path]:
    """:func:`fedscale_traces` pickled into ``folder`` as FedScale's two files (``.pkl`` suffix: the
    loader picks the format by it); returns their paths (device, behaviour)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = tuple(folder / name for name in TRACE_FILES)
    for path, obj in zip(paths, fedscale_traces(num_clients, seed, session_s, period_s), strict=True):
        path.write_bytes(pickle.dumps(obj, protocol=4))
    return paths


def trace_overrides(device: Path, behave: Path) -> list[str]:
    return ["system.speed.kind=fedscale", f"system.speed.path={device}", "system.bandwidth.kind=fedscale",
            f"system.bandwidth.path={device}", "system.availability.kind=fedscale", f"system.availability.path={behave}"]


WEIGHT_METHODS = {"fedavg", "fedlsa", "fedsc"}
DATASETS = {
    "digits": ["data.name=digits"],
    "synthetic": ["data.name=synthetic", "data.num_samples=6000", "data.num_classes=10", "data.channels=1"],
}


def run_overrides(method: str, mode: str, dataset: str, seed: int, args) -> list[str]:
    m = MODES[mode]
    rounds = max(1, args.updates // m["per"])
    if args.scenario == "trace":
        system = trace_overrides(*args.trace_paths)
    else:
        system = ["system.speed.kind=lognormal", f"system.speed.sigma={args.sigma}"]
    if m.get("deadline"):
        system += [f"federation.round_deadline_s={deadline_for(args, method)}",
                   f"federation.over_selection={args.over_selection}"]
    return DATASETS[dataset] + m["set"] + system + [
        f"seed={seed}", f"algorithm.name={method}", "data.partition.name=dirichlet", f"data.partition.beta={args.beta}",
        "data.partition.min_samples=10", "model.group=HtFE1", "model.feature_dim=64",
        f"training.local_epochs={args.local_epochs}", f"training.lr={args.lr}",
        f"federation.num_clients={args.clients}", f"federation.rounds={rounds}",
        f"federation.eval_every={max(1, rounds // args.evals)}", "federation.max_staleness=1000",
        f"tracking.target_accuracy={args.target}",
        f"tracking.tracking_uri={args.tracking_uri}", "tracking.experiment_name=async_vs_sync",
        f"tracking.run_name={method}-{mode}-{dataset}-{args.scenario}-s{seed}",
        "tracking.output_dir=/tmp/rayfed_async_vs_sync_runs",
        "tracking.system_metrics=false",
    ] + list(args.set)


def deadline_for(args, method: str) -> float:
    """``--deadline``: ``S`` for every method or ``METHOD=S`` pairs (the rest: DEFAULT_DEADLINE_S)."""
    named, every = {}, None
    for item in args.deadline:
        name, _, value = item.rpartition("=")
        if name:
            named[name] = float(value)
        else:
            every = float(value)
    return named.get(method, every if every is not None else DEFAULT_DEADLINE_S.get(method, 60.0))


# sync_deadline's deadline, per method since their update durations differ: FedAvg moves its 3.6 MB model
# each way over the trace's links (durations, seed 0: median 13 s, 75th percentile 31 s, max 124 s), FedProto
# about 2 KB of prototypes (median 2.0 s, 75th percentile 3.2 s, 90th 6.0 s, max 9 s); see --deadline
DEFAULT_DEADLINE_S = {"fedavg": 30.0, "fedproto": 5.0}


# Counters of the trace rows (cumulative: their last logged value is the run's)
COUNTERS = {"dispatched": names.FEDERATION_UPDATES_DISPATCHED, "accepted": names.FEDERATION_UPDATES_ACCEPTED,
            "dropped_offline": names.FEDERATION_UPDATES_DROPPED_OFFLINE,
            "dropped_deadline": names.FEDERATION_UPDATES_DROPPED_DEADLINE,
            "dropped_over_selection": names.FEDERATION_UPDATES_DROPPED_OVER_SELECTION,
            "versions_empty": names.FEDERATION_VERSIONS_EMPTY}


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
    counters = {k: final_best(h, key)[0] for k, key in COUNTERS.items()}
    return {"method": method, "mode": mode, "dataset": dataset, "seed": seed, "scenario": args.scenario, **counters,
            "time_to_target": time_to(h, args.target),
            "final_head": float(series(h, names.EVAL_HEAD_ACC)[-1]), "sim_time": float(series(h, names.FEDERATION_SIM_TIME_S)[-1]),
            "staleness_max": float(np.nanmax(series(h, names.FEDERATION_STALENESS_MAX))),
            "curve": [[float(x), float(y)] for x, y in zip(series(h, names.FEDERATION_SIM_TIME_S), series(h, names.EVAL_HEAD_ACC), strict=True)],
            "run_id": result.run_id}


def _mean(rows: list[dict], key: str) -> str:
    v = np.array([r.get(key, math.nan) for r in rows], float)
    return f"{np.mean(v):.0f}" if np.isfinite(v).all() else "n/a"


def table(rows: list[dict], target: float) -> str:
    trace = any(r.get("scenario") == "trace" for r in rows)
    extra = ["dispatched", "accepted", "dropped_offline", "dropped_deadline", "dropped_over_selection"] if trace else []
    out = [f"| dataset | method | mode | time to {100 * target:.0f}% (sim s) | vs sync | final head | run's sim time (s) "
           "| max staleness |" + "".join(f" {k.replace('_', ' ')} |" for k in extra),
           "|---|---|---|---|---|---|---|---|" + "---|" * len(extra)]
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
                       f"{np.mean([r['sim_time'] for r in mr]):.0f} | {max(r['staleness_max'] for r in mr):.0f} |"
                       + "".join(f" {_mean(mr, k)} |" for k in extra))
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
    p.add_argument("--scenario", default="lognormal", choices=list(SCENARIO_MODES),
                   help="lognormal speeds, everyone always online; or trace: a FedScale-format device and behaviour trace")
    p.add_argument("--modes", nargs="+", choices=list(MODES), help="default: " + "; ".join(
        f"{k}: {' '.join(v)}" for k, v in SCENARIO_MODES.items()))
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
    p.add_argument("--deadline", nargs="+", default=[], metavar="[METHOD=]S",
                   help="sync_deadline's federation.round_deadline_s, for every method or per method "
                        f"(default {' '.join(f'{k}={v:g}' for k, v in DEFAULT_DEADLINE_S.items())})")
    p.add_argument("--over-selection", type=float, default=1.3, help="sync_deadline's federation.over_selection")
    p.add_argument("--trace-seed", type=int, default=0, help="seed of the generated trace (the runs' seeds map it)")
    p.add_argument("--session-s", type=float, default=60.0, help="median online session of the generated trace")
    p.add_argument("--period-s", type=float, default=3600.0, help="the behaviour trace's finish_time (its period)")
    p.add_argument("--write-trace", metavar="DIR", help="only write the trace's two pickles into DIR, then exit")
    add_common_args(p, tracking_uri="sqlite:////tmp/rayfed_async_vs_sync.db")
    args = p.parse_args()
    if args.write_trace:
        for path in write_traces(args.write_trace, args.clients, args.trace_seed, args.session_s, args.period_s):
            print(path)
        return 0
    args.modes = args.modes or SCENARIO_MODES[args.scenario]
    args.trace_paths = None
    if args.scenario == "trace":  # beside the results (kept with them), else in a temporary folder
        folder = args.out + "_fedscale" if args.out else tempfile.mkdtemp(prefix="async_vs_sync_trace_")
        args.trace_paths = [str(x) for x in write_traces(folder, args.clients, args.trace_seed, args.session_s,
                                                         args.period_s)]
    jobs = [(m, mode, d, s, args) for d in args.datasets for m in args.methods for mode in args.modes
            for s in args.seeds if not (MODES[mode].get("weights_only") and m not in WEIGHT_METHODS)]
    check_configs(p, (run_overrides(*job) for job in jobs))
    rows = run_all(args.cpus, jobs, one_run, lambda r: (
        f"{r['dataset']:<9} {r['method']:<8} {r['mode']:<8} seed {r['seed']} time to target {r['time_to_target']:.0f} s "
        f"final head {r['final_head']:.3f}"))
    md = table(rows, args.target)
    profile = (f"lognormal speeds sigma {args.sigma}" if args.scenario == "lognormal" else
               f"FedScale-format trace (seed {args.trace_seed}, median session {args.session_s:g} s, period "
               f"{args.period_s:g} s: {' '.join(args.trace_paths)}), sync_deadline: over-selection "
               f"{args.over_selection:g}, deadline {', '.join(f'{m} {deadline_for(args, m):g} s' for m in args.methods)}")
    settings = (f"{args.clients} clients (HtFE1 CNN), Dirichlet beta {args.beta}, {profile}, "
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
