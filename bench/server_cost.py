"""The server step's declared work against its real time (issue 39 item 1): how well the virtual
clock's server cost (``ServerAlgorithm.server_work``, charged at ``system.server``'s speed) matches
what the step really does, measured the same way as the clients' declared work.

For each method: K clients of the digits federation train once (``ClientRunner.train``, timed),
their updates go to a ``ServerCore`` whose step is timed (aggregation and server training, not the
global-test evaluation). Each is divided into its declared seconds at ``reference_flops`` (1 GFLOP/s
for speed 1.0): the achieved FLOP/s of the client's update and of the server's step on this
machine. Their ratio (server / client) is the factor by which the clock over- (> 1) or under-
charges (< 1) the server's step relative to a client's update; 1 would be as accurate as the
clients' own calibration. One torch thread, medians of ``--repeats``.

    .venv/bin/python bench/server_cost.py --out bench/results/server_cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.runtime.client_core import ClientRunner
from rayfed_proto.runtime.policies import make_policy
from rayfed_proto.runtime.preparation import system_model as _system_model
from rayfed_proto.runtime.server_core import ServerCore

COMMON = ["data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20", "model.group=small_hetero",
          "federation.num_clients=8", "federation.mode=async", "federation.buffer_size=4",
          "federation.concurrency=4", "training.local_epochs=1", "data.public_size=100", "system.speed.kind=constant"]
METHODS = {
    "fedtgp": ["algorithm.name=fedtgp", "algorithm.aggregation_scope=buffer"],
    "fedprotokd": ["algorithm.name=fedprotokd", "algorithm.server_epochs=2", "algorithm.server_arch=cnn"],
    "fedproto": ["algorithm.name=fedproto"],
}


def measure(name: str, repeats: int, feature_dim: int) -> dict:
    cfg = build_config({}, COMMON + METHODS[name] + [f"model.feature_dim={feature_dim}"])
    ds = load_dataset(cfg.data, cfg.seed)
    d = cfg.data
    part = make_partition(ds, d.partition, cfg.federation.num_clients, cfg.seed, d.test_fraction,
                          global_test_fraction=d.global_test_fraction, public_size=d.public_size)
    system = _system_model(cfg, part, ds.num_classes, ds.channels, ds.image_size)
    public_x = ds.tensors(part.public_idx)[0] if len(part.public_idx) else None
    k = cfg.federation.buffer_size
    client_rates, server_rates, server_s, declared_s = [], [], [], []
    for _ in range(repeats):
        policy = make_policy(cfg.federation, system, seed=cfg.seed, real_slots=1)
        server = ServerCore(cfg, ds.num_classes, ds.channels, ds.image_size, torch.device("cpu"), policy.needs,
                            public_x=public_x)
        for c in range(k):
            runner = ClientRunner(cfg, part.clients[c], ds, torch.device("cpu"), public_x)
            t0 = time.perf_counter()
            _, update = runner.train(server.state)
            client_rates.append(system.compute_at(c, 0) * 1e9 / (time.perf_counter() - t0))
            server.submit(update)
        receipt = server.step()
        declared = system.server_step_s(k, k)
        server_s.append(receipt["server_s"])
        declared_s.append(declared)
        server_rates.append(declared * 1e9 / receipt["server_s"] if declared > 0 else float("nan"))
    client, srv = statistics.median(client_rates), statistics.median(server_rates)
    return {"method": name, "client_gflops": client / 1e9, "server_gflops": srv / 1e9,
            "server_step_s": statistics.median(server_s), "declared_step_s_at_1_gflops": statistics.median(declared_s),
            "server_over_client": srv / client if np.isfinite(srv) else float("nan")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--feature-dim", type=int, nargs="+", default=[64, 512], help="model.feature_dim (generator width)")
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(m, args.repeats, d) | {"feature_dim": d} for d in args.feature_dim for m in args.methods]
    lines = ["| method | feature_dim | client update, GFLOP/s achieved | server step, GFLOP/s achieved | server step s (real) | "
             "declared s at 1 GFLOP/s | server / client |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['feature_dim']} | {r['client_gflops']:.2f} | {r['server_gflops']:.2f} | {r['server_step_s']:.4f} | "
                     f"{r['declared_step_s_at_1_gflops']:.4f} | {r['server_over_client']:.2f} |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
