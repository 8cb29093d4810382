"""Why evaluation batches are 256 on CPU (``runtime.core.eval_batch_size``): seconds for a
no-grad forward pass of the FedAvg CNN over ``--samples`` MNIST-sized images at several batch
sizes, channels_last (the platform's CPU layout) and contiguous, one torch thread, alternating,
medians; each size's ratio against 512 (the earlier default) is measured in the same run.

    .venv/bin/python bench/eval_batch.py --out bench/results/eval_batch
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rayfed_proto.models import build_client_model


def forward_s(model, x: torch.Tensor, batch: int) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(x), batch):
            model.forward_features(x[i : i + batch])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1930, help="test images (1,930: the round-time workload's largest client)")
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.samples, 1, 28, 28)
    rows = []
    for name, layout in (("channels_last", torch.channels_last), ("contiguous", torch.contiguous_format)):
        model = build_client_model("HtFE1", 0, 1, 28, 10, 512).to(memory_format=layout).eval()
        forward_s(model, x, 256)  # warm-up
        times: dict[int, list[float]] = {b: [] for b in args.batches}
        for _ in range(args.repeats):
            for b in args.batches:
                times[b].append(forward_s(model, x, b))
        ref = statistics.median(times[512]) if 512 in times else float("nan")
        for b, v in times.items():
            med = statistics.median(v)
            rows.append({"layout": name, "batch": b, "ms": round(1000 * med, 1), "vs_512": round(med / ref, 3)})
            print(f"{name:13s} batch {b:5d}: {1000 * med:6.1f} ms ({med / ref:.3f} of batch 512)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
