"""Slot utilisation of sync vs async scheduling, and peak memory per client actor.

utilisation = total client busy time / (slots x wall time), measured from the scheduler's start
(actor start-up excluded), where a slot is one client update in flight (``concurrency``).

The workload is sized so that one local update takes about a second on one core: synthetic
32x32 images, the FedAvg CNN, clients of unequal size (Dirichlet partition), so update times
differ, which is what makes synchronous rounds wait for their slowest client.

    python bench/utilisation.py                     # both modes, prints a markdown table
    python bench/utilisation.py --json out.json     # also save the raw figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from rayfed_proto.tracking import metric_names as names


def run(mode: str, args) -> dict:
    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment

    overrides = [
        "data.name=synthetic", f"data.num_samples={args.samples}", "data.image_size=32", "data.num_classes=10",
        "data.partition.name=dirichlet", "data.partition.beta=1.0", "data.partition.min_samples=200",
        "model.group=HtFE1", "model.feature_dim=128", "algorithm.name=fedproto", "training.batch_size=10",
        f"federation.mode={mode}", f"federation.num_clients={args.clients}", f"federation.concurrency={args.slots}",
        f"federation.rounds={args.rounds if mode == 'async' else args.sync_rounds}",
        "federation.buffer_size=2", f"federation.participation={args.slots / args.clients}",
        "tracking.enabled=false", "tracking.output_dir=/tmp/rayfed_bench_runs",
    ]
    overrides.append(f"federation.eval_every={args.rounds if mode == 'async' else args.sync_rounds}")
    cfg = build_config({}, overrides)
    t0 = time.perf_counter()
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    total = time.perf_counter() - t0
    last = result.history[-1]
    updates = last[names.FEDERATION_UPDATES_DISPATCHED]
    return {
        "mode": mode, "slots": args.slots, "versions": result.final_version, "updates": updates,
        "busy_s": last[names.FEDERATION_CLIENT_BUSY_S], "wall_s": last[names.FEDERATION_WALL_S],
        "utilisation": last[names.FEDERATION_SLOT_UTILISATION],
        "mean_update_s": last[names.FEDERATION_CLIENT_BUSY_S] / max(updates, 1), "total_s_incl_startup": total,
        "peak_rss_mib_client_actor": max(p["peak_rss_mib"] for p in result.placements[:-1]),
        "peak_rss_mib_server": result.placements[-1]["peak_rss_mib"],
        "pss_mib_client_actor": max(p["pss_mib"] for p in result.placements[:-1]),
        "final_head_acc": last[names.EVAL_HEAD_ACC], "staleness_mean": last[names.FEDERATION_STALENESS_MEAN],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--slots", type=int, default=2, help="concurrency (client updates in flight)")
    p.add_argument("--samples", type=int, default=12000, help="synthetic images over all clients")
    p.add_argument("--rounds", type=int, default=30, help="async server versions (buffer 2)")
    p.add_argument("--sync-rounds", type=int, default=15, help="sync rounds (slots clients each)")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--json", help="write the raw figures here")
    args = p.parse_args()

    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    rows = [run(mode, args) for mode in ("sync", "async")]
    ray.shutdown()

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; Ray CPUs {args.cpus}; "
          f"python {sys.version.split()[0]}")
    print("| mode | slots | updates | mean update (s) | busy (s) | wall (s) | utilisation | peak RSS / client actor (MiB) | PSS / client actor (MiB) | peak RSS server (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['slots']} | {r['updates']} | {r['mean_update_s']:.2f} | {r['busy_s']:.1f} | "
              f"{r['wall_s']:.1f} | {r['utilisation']:.3f} | {r['peak_rss_mib_client_actor']:.0f} | "
              f"{r['pss_mib_client_actor']:.0f} | {r['peak_rss_mib_server']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2, default=float)
    ok = next(r for r in rows if r["mode"] == "async")["utilisation"] >= 0.9
    print(f"\nasync utilisation target (>= 0.9): {'met' if ok else 'NOT met'}")
    return 0 if np.isfinite(rows[-1]["utilisation"]) else 1


if __name__ == "__main__":
    sys.exit(main())
