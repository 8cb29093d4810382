"""One worker's local updates, its clients one after another against stepping as one batched model
(``resources.batch_clients``), in one process, no Ray: the sequential single-process loop and the
batched path on the same device, measured in the same run (so the ratio holds on any machine).

The workload: `synthetic` data of MNIST's shape (1x28x28), Dirichlet 0.1 over ``--clients``
clients, batch 10, 1 local epoch, FedProto (lambda 10) or FedAvg, ``--group`` HtFE1 (the FedAvg CNN
for every client) or HtFE8 (8 architectures: clients of one architecture batch together). Every
client is hosted by one :class:`~rayfed_proto.runtime.client_core.ClientHost` (one worker holding all of
them, as ``resources.clients_per_actor`` = clients). Each mode runs ``--rounds`` local updates of
every client against the same empty state after one warm-up round (CUDA context, cuDNN plans,
vmap's first trace); the figure is the median round. On a GPU the peak memory of each mode is
reported, and, with ``--actors A``, whether it fits a 1/A share of the GPU's memory.

``--lanes L`` measures a third mode in the same run, ``batch_clients: lanes`` with L lanes
(continuous batching: the clients of an architecture queue for L rows of the batched model);
``--trailing-batch drop`` drops each epoch's incomplete last batch (HtFLlib's ``drop_last``), so
every step has one shape.

    .venv/bin/python bench/batched_clients.py --device cuda --group HtFE1 --out bench/results/batched_htfe1_gpu
    .venv/bin/python bench/batched_clients.py --device cuda --group HtFE8 --out bench/results/batched_htfe8_gpu
    .venv/bin/python bench/batched_clients.py --device cuda --group HtFE1 --lanes 8 --trailing-batch drop
    .venv/bin/python bench/batched_clients.py --device cpu --clients 4 --samples 800 --rounds 1   # a dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def build(args):
    from rayfed_proto.config import build_config
    from rayfed_proto.data import load_dataset, make_partition

    sets = ["data.name=synthetic", f"data.num_samples={args.samples}", "data.image_size=28", "data.channels=1",
            "data.partition.name=dirichlet", "data.partition.beta=0.1", "data.partition.min_samples=20",
            f"model.group={args.group}", f"algorithm.name={args.method}", "training.batch_size=10",
            "training.local_epochs=1", f"federation.num_clients={args.clients}", "federation.mode=sync",
            f"training.trailing_batch={args.trailing_batch}", f"resources.lanes={max(args.lanes, 1)}",
            "tracking.enabled=false"]
    if args.method == "fedproto":
        sets += ["algorithm.lam=10"]
    cfg = build_config({}, sets)
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, args.clients, cfg.seed, cfg.data.test_fraction)
    return cfg, ds, part


def measure(args, cfg, ds, part, mode: str, device: torch.device) -> dict:
    from rayfed_proto.messages import GlobalState
    from rayfed_proto.runtime.client_core import ClientHost

    cfg = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"batch_clients": mode})})
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    host = ClientHost(cfg, ds, list(part.clients), device)
    state = GlobalState(version=0)
    rounds = []
    for r in range(args.rounds + 1):  # round 0: warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        host.train_group(host.client_ids, state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r > 0:
            rounds.append(time.perf_counter() - t0)
        print(f"  {mode}: round {r} {time.perf_counter() - t0:.2f} s{' (warm-up)' if r == 0 else ''}", flush=True)
    out = {"round_s": statistics.median(rounds), "rounds_s": [round(x, 3) for x in rounds]}
    if device.type == "cuda":
        out["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    del host
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--group", default="HtFE1")
    ap.add_argument("--method", choices=["fedproto", "fedavg"], default="fedproto")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--lanes", type=int, default=0, help="also measure batch_clients=lanes with this many lanes (0: not)")
    ap.add_argument("--trailing-batch", choices=["fold", "drop"], default="fold", help="training.trailing_batch")
    ap.add_argument("--actors", type=int, default=0, help="GPU: check the peak against a 1/ACTORS memory share")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("batched_clients --device cuda: no CUDA GPU on this machine; nothing was measured.")
        sys.exit(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg, ds, part = build(args)
    print(f"batched_clients: {args.clients} clients of {args.group}, {args.method}, {args.samples} samples, "
          f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{args.threads} thread(s)'})",
          flush=True)
    # "off" is the sequential single-process loop (each client's own local_train in turn); "on" batches
    modes = ("off", "on", "lanes") if args.lanes else ("off", "on")
    res = {mode: measure(args, cfg, ds, part, mode, device) for mode in modes}
    row = {"group": args.group, "method": args.method, "clients": args.clients, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "sequential_round_s": round(res["off"]["round_s"], 3), "batched_round_s": round(res["on"]["round_s"], 3),
           "speedup": round(res["off"]["round_s"] / res["on"]["round_s"], 2), "trailing_batch": args.trailing_batch,
           "modes": res, "args": vars(args) | {"out": str(args.out)}}
    if args.lanes:
        row |= {"lanes": args.lanes, "lanes_round_s": round(res["lanes"]["round_s"], 3),
                "lanes_speedup": round(res["off"]["round_s"] / res["lanes"]["round_s"], 2),
                "lanes_vs_batched": round(res["on"]["round_s"] / res["lanes"]["round_s"], 2)}
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**20
        row["gpu_total_mib"] = round(total)
        if args.actors:
            row["share_mib"] = round(total / args.actors)
            row["batched_peak_within_share"] = res["on"]["peak_mib"] <= total / args.actors
    print(json.dumps({k: v for k, v in row.items() if k not in ("modes", "args")}), flush=True)
    print(f"batched_clients: {args.group} x {args.clients}: sequential {row['sequential_round_s']} s, batched "
          f"{row['batched_round_s']} s a round: {row['speedup']}x", flush=True)
    if args.lanes:
        print(f"batched_clients: {args.lanes} lanes {row['lanes_round_s']} s a round: {row['lanes_speedup']}x the "
              f"sequential loop, {row['lanes_vs_batched']}x the batched group", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
