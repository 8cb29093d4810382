"""FedProto's accuracy per round under each ``model.init`` x ``model.projector``, on the workload
of ``bench/round_time.py``'s FedProto row (synthetic MNIST-shaped 1x28x28 images, Dirichlet 0.1
over 20 clients, the FedAvg CNN for every client (HtFE1), lambda 10, the uniform server mean,
batch 10, 1 local epoch, sync, full participation), fewer samples.

Each setting runs ``bench/_plain.py``'s loop (the platform's partition, initial models, batch
order and loss: its accuracy is the platform's, ``tests/integration/test_eval_invariant.py``)
and, with ``--reference``, ``bench/_htfllib.py``'s model of HtFLlib's FedProto loop (a model of
the reference loop, not its code: drop_last loaders without shuffling, per-sample prototype
collection, MSE-argmin prototype accuracy) on the same initial models.

    .venv/bin/python bench/init_fidelity.py --samples 10000 --rounds 5 --out bench/results/init_fidelity
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plain import run_plain, write_results  # noqa: E402

from rayfed_proto.config import build_config  # noqa: E402

SETTINGS = [("per_client", "linear"), ("shared", "linear"), ("per_client", "pool"), ("shared", "pool")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reference", action="store_true", help="also run the model of HtFLlib's loop per setting")
    ap.add_argument("--settings", nargs="+", default=[f"{i}:{p}" for i, p in SETTINGS],
                    help="INIT:PROJECTOR pairs to run (default: all four)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = ["data.name=synthetic", f"data.num_samples={args.samples}", "data.image_size=28", "data.channels=1",
            "data.partition.name=dirichlet", "data.partition.beta=0.1", "data.partition.min_samples=20",
            "model.group=HtFE1", "algorithm.name=fedproto", "algorithm.lam=10", "algorithm.aggregation=uniform",
            "training.batch_size=10", "training.local_epochs=1", "federation.num_clients=20",
            "federation.mode=sync", "federation.participation=1.0", f"federation.rounds={args.rounds}"]
    rows = []
    for init, projector in (s.split(":") for s in args.settings):
        cfg = build_config({}, base + [f"model.init={init}", f"model.projector={projector}"])
        loops = [("plain (= platform)", run_plain)]
        if args.reference:
            from _htfllib import run_htfllib

            loops.append(("HtFLlib model", lambda c, echo: run_htfllib(c, echo=echo, flavour="htfllib")))
        for name, run in loops:
            t0 = time.perf_counter()
            res = run(cfg, echo=lambda s: None)
            rows.append({"init": init, "projector": projector, "loop": name,
                         "proto_acc_per_round": " / ".join(f"{100 * a:.1f}" for a in res.proto_acc),
                         "head_acc_per_round": " / ".join(f"{100 * a:.1f}" for a in res.head_acc),
                         "wall_s": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
    write_results(rows, list(rows[0]), args)


if __name__ == "__main__":
    main()
