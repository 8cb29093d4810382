"""What ``training.memory_format`` buys: milliseconds per SGD step of ``ClientRunner.train`` with
the client model's convolution weights contiguous (NCHW, HtFLlib's layout) and channels_last
(NHWC, the platform's CPU default), at 1 and 2 torch threads, alternating, medians; the ratio
channels_last / contiguous is measured in the same run.

    .venv/bin/python bench/memory_format.py --out bench/results/memory_format                 # FedAvg CNN, MNIST-sized
    .venv/bin/python bench/memory_format.py --group small_hetero --image-size 32 --channels 1  # the digits demo's models

The workload is issue 11's: FedProto (lambda 10, a global bank present), batch 10, 1x28x28
synthetic images, one client holding ``--samples`` of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def runner_for(layout: str, args):
    from rayfed_proto.config import build_config
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.messages import GlobalState
    from rayfed_proto.runtime.core import ClientRunner

    cfg = build_config({}, ["data.name=synthetic", f"data.num_samples={int(args.samples / 0.75) + 10}",
                            f"data.image_size={args.image_size}", f"data.channels={args.channels}", "data.partition.name=iid",
                            "federation.num_clients=1", "federation.mode=sync", f"model.group={args.group}",
                            "algorithm.name=fedproto", "algorithm.lam=10", "training.batch_size=10",
                            f"training.memory_format={layout}"])
    ds = load_dataset(cfg.data, cfg.seed)
    split = make_partition(ds, cfg.data.partition, 1, cfg.seed, cfg.data.test_fraction).clients[0]
    runner = ClientRunner(cfg, split, ds, torch.device("cpu"))
    _, first = runner.train(GlobalState(version=0))  # a bank, so the alignment term is active
    return runner, GlobalState(version=1, prototypes=first.prototypes), len(runner.batches.y) // 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="HtFE1")
    ap.add_argument("--image-size", type=int, default=28)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runners = {layout: runner_for(layout, args) for layout in ("contiguous", "channels_last")}
        ms: dict[str, list[float]] = {layout: [] for layout in runners}
        for _ in range(args.repeats):
            for layout, (runner, state, steps) in runners.items():
                t0 = time.perf_counter()
                runner.train(state)
                ms[layout].append((time.perf_counter() - t0) / steps * 1000)
        med = {layout: statistics.median(v) for layout, v in ms.items()}
        rows.append({"threads": threads, "contiguous_ms": round(med["contiguous"], 2),
                     "channels_last_ms": round(med["channels_last"], 2),
                     "ratio": round(med["channels_last"] / med["contiguous"], 3),
                     "repeats_ms": {k: [round(x, 2) for x in v] for k, v in ms.items()}})
        r = rows[-1]
        print(f"{threads} thread(s): contiguous {r['contiguous_ms']} ms/step, channels_last {r['channels_last_ms']} ms/step, "
              f"ratio {r['ratio']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
