"""What ``resources.deterministic: true`` costs a local update: the same client's update timed
with the setting off and on, alternated in one process (so load from other processes hits both).

    .venv/bin/python bench/deterministic_cost.py                      # CPU, HtFE1 (FedAvg CNN)
    .venv/bin/python bench/deterministic_cost.py --group HtFE8 --client 3 --device cuda

Prints the median seconds of each and their ratio, and whether the two settings' updates gave
the same prototypes (they should on the CPU, where torch's kernels are deterministic anyway).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime.client_core import ClientRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="HtFE1")
    ap.add_argument("--client", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = ["data.name=synthetic", f"data.num_samples={args.samples}", "data.image_size=28", "data.channels=1",
            f"model.group={args.group}", "algorithm.name=fedproto", "federation.num_clients=10"]
    times: dict[bool, list[float]] = {False: [], True: []}
    protos: dict[bool, np.ndarray] = {}
    for _ in range(args.repeats):
        for det in (False, True):
            cfg = build_config({}, base + [f"resources.deterministic={str(det).lower()}"])
            ds = load_dataset(cfg.data, cfg.seed)
            part = make_partition(ds, cfg.data.partition, 10, cfg.seed, cfg.data.test_fraction)
            runner = ClientRunner(cfg, part.clients[args.client], ds, torch.device(args.device))
            t0 = time.perf_counter()
            _, update = runner.train(GlobalState(version=0))
            times[det].append(time.perf_counter() - t0)
            protos[det] = update.prototypes.vectors
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(json.dumps({"group": args.group, "client": args.client, "device": args.device,
                      "train_samples": len(part.clients[args.client].train_idx), "median_s_off": round(off, 3),
                      "median_s_on": round(on, 3), "on_over_off": round(on / off, 3),
                      "same_prototypes": bool(np.array_equal(protos[False], protos[True])),
                      "times_off": [round(t, 3) for t in times[False]], "times_on": [round(t, 3) for t in times[True]]}))


if __name__ == "__main__":
    main()
