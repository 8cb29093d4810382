"""Per-architecture size and CPU cost of one SGD step, as a markdown table.

Used to pick models for CPU demos: a round's wall time is set by the slowest client, so the
step time of each architecture in a group matters more than the group's average.

    .venv/bin/python bench/model_speed.py [--batch 10] [--size 32] [--channels 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rayfed_proto.models import ARCHITECTURES, build_model


def step_seconds(arch: str, batch: int, size: int, channels: int, repeats: int) -> tuple[int, float]:
    """(parameter count, median seconds of forward + backward + SGD update)."""
    torch.manual_seed(0)
    model = build_model(arch, channels, size, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, channels, size, size), torch.randint(0, 10, (batch,))
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i:  # the first step pays one-off allocation costs
            times.append(time.perf_counter() - start)
    return sum(p.numel() for p in model.parameters()), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--archs", nargs="*", default=ARCHITECTURES.names())
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"{args.channels}x{args.size}x{args.size}, feature_dim 512, median of {args.repeats} steps\n")
    print("| architecture | parameters | ms / SGD step |")
    print("|---|---:|---:|")
    for arch in args.archs:
        params, seconds = step_seconds(arch, args.batch, args.size, args.channels, args.repeats)
        print(f"| {arch} | {params:,} | {seconds * 1000:.1f} |")


if __name__ == "__main__":
    main()
