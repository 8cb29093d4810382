"""Where a version's evaluation runs on each worker, measured (issue 23: evaluations that measure
exactly their version).

Both placements evaluate exactly the same client states (the workers keep the state each
evaluation asks for, docs/architecture.md "The evaluation invariant"), so their accuracies must be
equal to the last digit; what differs is the wall time:

* ``after`` (the runtime's choice): a version's evaluation is sent after the next round's updates,
  so on each worker it queues behind them and runs while the server aggregates the round;
* ``before`` (the alternative: order each worker's queue): sent before the next round's updates,
  so the round starts later by the evaluation's time, and the workers sit idle while the server
  aggregates.

Sync rounds, every version evaluated, the default experiment's workload (20 clients of small
heterogeneous CNNs on the embedded digits); FedTGP (the server trains a generator each version)
and FedProto (the server only averages). The reference is ``before`` measured in the same run, in
alternating order. A third figure is the cost of keeping a client's state before each local update
(what makes ``after`` exact), against the local update itself, in-process.

    .venv/bin/python bench/eval_placement.py --rounds 10 --repeats 2 --out bench/results/eval_placement
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rayfed_proto.tracking import metric_names as names


def one_run(method: str, placement: str, rounds: int) -> dict:
    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.scheduler import Scheduler

    cfg = build_config({}, [f"algorithm.name={method}", "federation.mode=sync", f"federation.rounds={rounds}",
                            "federation.eval_every=1", "checkpoint.every=0", "tracking.enabled=false",
                            "tracking.output_dir=/tmp/rayfed_bench_runs"])
    Scheduler.evaluate_first = placement == "before"
    try:
        result = run_experiment(cfg, progress=False, echo=lambda s: None)
    finally:
        Scheduler.evaluate_first = False
    last = result.history[-1]
    return {"method": method, "placement": placement, "wall_s": last[names.FEDERATION_WALL_S],
            "head_acc": [h[names.EVAL_HEAD_ACC] for h in result.history],
            "server_train_s": last[names.SERVER_TRAIN_S], "client_busy_s": last[names.FEDERATION_CLIENT_BUSY_S]}


def keep_cost(updates: int = 3) -> dict:
    """Seconds of ``ClientRunner.eval_state()`` (the copy a worker keeps before an update) against
    one local update, over the default experiment's 20 clients, in this process (one thread)."""
    import torch

    from rayfed_proto.config import build_config
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.messages import GlobalState
    from rayfed_proto.runtime.core import ClientRunner

    torch.set_num_threads(1)
    cfg = build_config({}, [])
    ds = load_dataset(cfg.data, cfg.seed)
    d = cfg.data
    part = make_partition(ds, d.partition, cfg.federation.num_clients, cfg.seed, d.test_fraction,
                          global_test_fraction=d.global_test_fraction, public_size=d.public_size)
    train_s = keep_s = 0.0
    for split in part.clients:
        runner = ClientRunner(cfg, split, ds, torch.device("cpu"))
        for _ in range(updates):
            t0 = time.perf_counter()
            runner.eval_state()
            t1 = time.perf_counter()
            runner.train(GlobalState(version=0))
            keep_s, train_s = keep_s + t1 - t0, train_s + time.perf_counter() - t1
    return {"keep_s": keep_s, "train_s": train_s, "ratio": keep_s / train_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["fedtgp", "fedproto"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for method in args.methods:
            for i in range(args.repeats):
                for placement in (("before", "after") if i % 2 == 0 else ("after", "before")):
                    rows.append(one_run(method, placement, args.rounds))
                    print(f"{method} {placement}: {rows[-1]['wall_s']:.1f} s, final head acc "
                          f"{rows[-1]['head_acc'][-1]:.4f}", flush=True)
    finally:
        ray.shutdown()
    table = []
    for method in args.methods:
        by = {p: [r for r in rows if r["method"] == method and r["placement"] == p] for p in ("before", "after")}
        same = all(r["head_acc"] == by["before"][0]["head_acc"] for r in by["before"] + by["after"])
        before, after = (statistics.median(r["wall_s"] for r in by[p]) for p in ("before", "after"))
        table.append({"method": method, "before_s": before, "after_s": after, "ratio": after / before,
                      "server_train_s": statistics.median(r["server_train_s"] for r in by["after"]),
                      "accuracies_equal": same})
    keep = keep_cost()
    print("\n| method | evaluate before the next updates (s) | after them, on kept states (s) | ratio | server training (s) "
          "| accuracies equal |")
    print("|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['method']} | {t['before_s']:.1f} | {t['after_s']:.1f} | {t['ratio']:.3f} | {t['server_train_s']:.1f} "
              f"| {t['accuracies_equal']} |")
    print(f"\nkeeping a client's state before each update: {keep['keep_s'] * 1e3:.1f} ms against "
          f"{keep['train_s'] * 1e3:.0f} ms of local updates ({keep['ratio']:.4f})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows, "table": table, "keep": keep}, indent=1))


if __name__ == "__main__":
    main()
