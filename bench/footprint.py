"""Startup and peak memory of a whole run: the `rayfed-proto run` process and every process it
starts (Ray's GCS and raylet, the worker actors), sampled twice a second.

Memory is the sum of PSS over the process tree (proportional set size: shared pages, such as
libtorch's, are divided among the processes that share them, so the sum is the real footprint;
RSS would count libtorch once per process) and, beside it, the sum of RSS. Startup is the
run's own `startup_s` metric: from the process start to the first local update returned.

    .venv/bin/python bench/footprint.py demo --out bench/results/footprint_demo       # `make demo`'s experiment
    .venv/bin/python bench/footprint.py scale --out bench/results/footprint_scale     # 1,000 clients, participation 0.05
    .venv/bin/python bench/footprint.py demo --set resources.clients_per_actor=1      # the old layout, for comparison

With ``--out``, the JSON also holds every sample (``timeline``: seconds, total PSS and PSS per
process) and a PNG beside it stacks PSS per process group (driver, workers, server, Ray's own
processes) over the run, with the 3 GB line of issue 11.

`scale`: 1,000 clients, participation 0.05, sync, synthetic data of MNIST's size and shape
(70,000 images 1x28x28, iid), HtFE1 (the FedAvg CNN), FedProto, 5 rounds, evaluation at the
last; idle clients are parked (`resources.park_idle_clients: auto`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

SCALE = ["algorithm.name=fedproto", "algorithm.lam=10", "data.name=synthetic", "data.num_samples=70000", "data.image_size=28",
         "data.partition.name=iid", "model.group=HtFE1", "federation.num_clients=1000", "federation.mode=sync",
         "federation.participation=0.05", "federation.rounds=5", "federation.eval_every=5", "training.batch_size=10"]


def label(p: psutil.Process) -> str:
    """A short name for a process of the run: the Ray actor or worker title (``ray::ClientActor``),
    or the program or script it runs (``raylet``, ``log_monitor.py``, ``rayfed-proto``)."""
    cmd = p.cmdline()
    if not cmd:
        return p.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    scripts = [Path(a).name for a in cmd[:3] if a.endswith(".py") or "rayfed-proto" in a]
    return scripts[0] if scripts else Path(cmd[0]).name


def tree_memory(root: psutil.Process, by_process: dict | None = None) -> tuple[float, float, int]:
    """(sum PSS MiB, sum RSS MiB, processes) over ``root`` and its descendants; with
    ``by_process``, also fills it with PSS MiB per process label (summed over equal labels)."""
    pss = rss = 0.0
    procs = [root]
    try:
        procs += root.children(recursive=True)
    except psutil.Error:
        pass
    n = 0
    for p in procs:
        try:
            info = p.memory_full_info()
            pss += getattr(info, "pss", info.rss) / 2**20
            rss += info.rss / 2**20
            n += 1
            if by_process is not None:
                name = label(p)
                by_process[name] = by_process.get(name, 0.0) + getattr(info, "pss", info.rss) / 2**20
        except psutil.Error:
            continue
    return pss, rss, n


def run_sampled(cmd: list[str], every_s: float = 0.5) -> tuple[int, str, dict, list[dict], float]:
    """Run ``cmd`` and sample its process tree's memory every ``every_s`` seconds: (return code,
    output, the peak sample, every sample (seconds, total PSS and PSS per process label, MiB),
    seconds)."""
    t0 = time.time()
    proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = {"pss": 0.0, "rss": 0.0, "procs": 0, "by_process": {}}
    timeline: list[dict] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            parts: dict[str, float] = {}
            pss, rss, n = tree_memory(proc, parts)
            timeline.append({"t": round(time.time() - t0, 2), "pss": round(pss), "by": {k: round(v) for k, v in parts.items()}})
            if pss > peak["pss"]:
                peak.update(pss=pss, rss=max(peak["rss"], rss), procs=n, by_process=parts, at_s=time.time() - t0)
            peak["rss"] = max(peak["rss"], rss)
            time.sleep(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    proc.wait()
    done.set()
    sampler.join()
    return proc.returncode, output, peak, timeline, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["demo", "scale"])
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for the run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sets = (SCALE if args.which == "scale" else []) + [
            f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"tracking.output_dir={tmp / 'runs'}",
            f"tracking.experiment_name=footprint_{args.which}"] + args.set
        cmd = [str(Path(sys.executable).parent / "rayfed-proto"), "run"] + [f"--set={s}" for s in sets]
        returncode, output, peak, timeline, total_s = run_sampled(cmd)
        if returncode != 0:
            sys.exit(f"run failed ({returncode}):\n{output[-4000:]}")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
        run = client.search_runs([client.get_experiment_by_name(f"footprint_{args.which}").experiment_id])[0]
        m, p = run.data.metrics, run.data.params
    row = {"which": args.which, "clients": p.get("federation.num_clients"), "client_actors": p.get("plan.num_actors"),
           "startup_s": round(float(run.data.tags.get("federation/startup_s", m.get("federation/startup_s", "nan"))), 1),
           "total_s": round(total_s, 1),
           "peak_pss_gib": round(peak["pss"] / 1024, 2), "peak_rss_sum_gib": round(peak["rss"] / 1024, 2),
           "processes_at_peak": peak["procs"], "peak_at_s": round(peak.get("at_s", float("nan")), 1), "head_acc": round(m.get("eval/head_acc", float("nan")), 4),
           "pss_client_actors_total_mib": round(m.get("system/actors/client_pss_mib_total", float("nan")), 0),
           "pss_at_peak_mib_by_process": {k: round(v) for k, v in sorted(peak["by_process"].items(), key=lambda kv: -kv[1])}}
    print(json.dumps(row, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "row": row, "timeline": timeline}, indent=1))
        plot_timeline(timeline, args.out.with_suffix(".png"), f"{args.which}: PSS over the run (peak {row['peak_pss_gib']} GiB)")


GROUPS = {"driver (rayfed-proto)": ("rayfed-proto",), "workers": ("ray::ClientActor",), "server": ("ray::ServerActor",)}


def group_of(label_: str) -> str:
    for group, prefixes in GROUPS.items():
        if label_.startswith(prefixes):
            return group
    return "Ray's own processes"


def plot_timeline(timeline: list[dict], path: Path, title: str) -> None:
    """Stacked PSS per process group over the run, with the 3 GB (2.79 GiB) line of issue 11."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(GROUPS) + ["Ray's own processes"]
    ts = [s["t"] for s in timeline]
    stacks = {g: [0.0] * len(timeline) for g in names}
    for i, s in enumerate(timeline):
        for lbl, mib in s["by"].items():
            stacks[group_of(lbl)][i] += mib / 1024
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.stackplot(ts, [stacks[g] for g in names], labels=names, alpha=0.85)
    ax.axhline(3e9 / 2**30, color="k", ls="--", lw=1, label="3 GB")
    top = max([sum(stacks[g][i] for g in names) for i in range(len(timeline))] + [3e9 / 2**30])
    ax.set(xlabel="seconds since the command started", ylabel="PSS (GiB)", title=title, ylim=(0, top * 1.25))
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
