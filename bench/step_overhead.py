"""Framework overhead per SGD step, in-process: ``ClientRunner.train`` (the platform's local update:
receive, guarded step, loss terms, prototypes from the training passes, upload) against a plain
loop over the same model, batches and loss (forward, CE + lambda * MSE to the global prototypes,
backward, SGD step, prototypes summed from the same forward passes), in one process with the
same thread count. Alternating repeats; the ratio of medians is printed.

    .venv/bin/python bench/step_overhead.py --out bench/results/step_overhead
    .venv/bin/python bench/step_overhead.py --method fedproto --samples 3000 --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="fedproto", choices=["fedproto", "fedavg"])
    ap.add_argument("--samples", type=int, default=3000, help="training samples of the client (MNIST-sized images)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from rayfed_proto.config import build_config
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.messages import GlobalState
    from rayfed_proto.runtime.client_core import ClientRunner

    cfg = build_config({}, ["data.name=synthetic", f"data.num_samples={int(args.samples / 0.75) + 10}", "data.image_size=28",
                            "data.partition.name=iid", "federation.num_clients=1", "federation.mode=sync", "model.group=HtFE1",
                            f"algorithm.name={args.method}", "training.batch_size=10"]
                       + (["algorithm.lam=10"] if args.method == "fedproto" else []))
    ds = load_dataset(cfg.data, cfg.seed)
    split = make_partition(ds, cfg.data.partition, 1, cfg.seed, cfg.data.test_fraction).clients[0]
    runner = ClientRunner(cfg, split, ds, torch.device("cpu"))
    # a global bank (FedProto) so the alignment term is active from the first step, as after round 1
    _, first = runner.train(GlobalState(version=0))
    state = GlobalState(version=1, prototypes=first.prototypes) if first.prototypes is not None else GlobalState(version=1)
    steps = len(runner.batches.y) // cfg.training.batch_size
    lam = 10.0 if args.method == "fedproto" else 0.0

    t = cfg.training  # the plain loop steps with torch.optim.SGD itself (the platform: rayfed_proto.optim on the CPU)
    plain_opt = torch.optim.SGD(runner.model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def plain_epoch() -> None:
        model, opt = runner.model, plain_opt
        bank = torch.zeros(ds.num_classes, cfg.model.feature_dim)
        mask = torch.zeros(ds.num_classes, dtype=torch.bool)
        if state.prototypes is not None:
            bank[torch.as_tensor(state.prototypes.class_ids)] = torch.as_tensor(state.prototypes.vectors)
            mask[torch.as_tensor(state.prototypes.class_ids)] = True
        sums = torch.zeros(ds.num_classes, cfg.model.feature_dim)
        counts = torch.zeros(ds.num_classes)
        model.train()
        for xb, yb in runner.batches.epoch():
            opt.zero_grad()
            feats, logits = model.forward_features(xb)
            loss = F.cross_entropy(logits, yb)
            if lam:
                keep = mask[yb]
                loss = loss + lam * F.mse_loss(feats[keep], bank[yb[keep]])
            loss.backward()
            opt.step()
            if lam:
                sums.index_add_(0, yb, feats.detach())
                counts.index_add_(0, yb, torch.ones(len(yb)))

    ours, plain = [], []
    for r in range(args.repeats + 1):
        t0 = time.perf_counter()
        runner.train(state)
        t1 = time.perf_counter()
        plain_epoch()
        t2 = time.perf_counter()
        if r:  # the first pair warms allocators up
            ours.append((t1 - t0) / steps)
            plain.append((t2 - t1) / steps)
        print(f"repeat {r}: platform {1000 * (t1 - t0) / steps:.2f} ms/step, plain {1000 * (t2 - t1) / steps:.2f} ms/step",
              flush=True)
    o, p = statistics.median(ours), statistics.median(plain)
    row = {"method": args.method, "threads": args.threads, "steps": steps, "platform_ms": round(1000 * o, 3),
           "plain_ms": round(1000 * p, 3), "overhead_pct": round(100 * (o / p - 1), 1)}
    print(f"median per step: platform {row['platform_ms']} ms, plain {row['plain_ms']} ms, overhead {row['overhead_pct']} %")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "row": row, "platform_s": ours, "plain_s": plain}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
