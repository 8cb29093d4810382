"""Where a local step's time goes, for the round-time reading in docs/benchmarks.md: the
speed-up a second torch thread gives ``ClientRunner.train`` (what bounds two one-thread workers
against a two-thread plain loop), the share of the step spent in convolution and matmul kernels
(torch.profiler), and an eager step against one whose model forward is ``torch.compile``d. All
three measured in one run, alternating, medians. Workload as bench/memory_format.py (issue 11's
FedProto client, FedAvg CNN, batch 10, MNIST-sized images, the platform's channels_last layout).

    .venv/bin/python bench/step_cost.py --out bench/results/step_cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_format import runner_for  # noqa: E402

KERNELS = ("aten::mm", "aten::addmm", "aten::convolution_backward", "aten::mkldnn_convolution")


def ms_per_step(runner, state, steps: int) -> float:
    t0 = time.perf_counter()
    runner.train(state)
    return (time.perf_counter() - t0) / steps * 1000


def thread_speedup(args) -> dict:
    runner, state, steps = runner_for("channels_last", args)
    ms: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeats):
        for threads in ms:
            torch.set_num_threads(threads)
            ms[threads].append(ms_per_step(runner, state, steps))
    torch.set_num_threads(1)
    med = {t: statistics.median(v) for t, v in ms.items()}
    return {"one_thread_ms": round(med[1], 2), "two_threads_ms": round(med[2], 2),
            "speedup": round(med[1] / med[2], 2), "repeats_ms": {t: [round(x, 2) for x in v] for t, v in ms.items()}}


def kernel_share(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    runner, state, _ = runner_for("channels_last", args)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.train(state)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kern = sum(e.self_cpu_time_total for e in events if e.key in KERNELS)
    return {"kernels": list(KERNELS), "kernel_share": round(kern / total, 3)}


def compiled_vs_eager(args) -> dict:
    eager, state, steps = runner_for("channels_last", args)
    compiled, state_c, _ = runner_for("channels_last", args)
    compiled.model.forward_features = torch.compile(compiled.model.forward_features, dynamic=False)
    compiled.train(state_c)  # compiles (the last, shorter batch recompiles once)
    ms: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        ms["eager"].append(ms_per_step(eager, state, steps))
        ms["compiled"].append(ms_per_step(compiled, state_c, steps))
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {"eager_ms": round(med["eager"], 2), "compiled_ms": round(med["compiled"], 2),
            "ratio": round(med["compiled"] / med["eager"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="HtFE1")
    ap.add_argument("--image-size", type=int, default=28)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile comparison")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"threads": thread_speedup(args)}
    print(f"ClientRunner.train: 1 thread {out['threads']['one_thread_ms']} ms/step, 2 threads "
          f"{out['threads']['two_threads_ms']} ms/step: speed-up {out['threads']['speedup']}", flush=True)
    out["profile"] = kernel_share(args)
    print(f"conv + matmul kernels: {100 * out['profile']['kernel_share']:.0f} % of the step (1 thread)", flush=True)
    if args.compile:
        out["compile"] = compiled_vs_eager(args)
        print(f"eager {out['compile']['eager_ms']} ms/step, compiled forward {out['compile']['compiled_ms']} ms/step: "
              f"ratio {out['compile']['ratio']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             **out}, indent=1))


if __name__ == "__main__":
    main()
