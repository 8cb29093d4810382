"""20 HtFE8 clients sharing one GPU through fractional shares: per-actor GPU memory and training
throughput, against one process training the 20 clients in turn on the same GPU.

The platform side runs the papers' layout, one actor per client (`resources.clients_per_actor: 1`,
each with the planner's GPU share beside the server: 0.04 on one GPU, the
1/21 rounded down), and, for comparison, the default packed layout
(`clients_per_actor: auto`). Throughput = training samples processed per second over rounds
2..R; GPU memory = each actor's `torch.cuda.max_memory_allocated`. The reference is
`bench/_plain.py` on the same GPU (each client in turn), in the same run.

    .venv/bin/python bench/gpu_share.py --out bench/results/gpu_share      # needs a CUDA GPU
    .venv/bin/python bench/gpu_share.py --rounds 3 --samples 20000

Without a CUDA GPU it says so and measures nothing. Without MLflow installed (a bare GPU machine
given only the wheels of bench/gpu_check.sh) the runs go with ``tracking.enabled=false``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plain import run_plain, write_results  # noqa: E402

from rayfed_proto.tracking import metric_names as names  # noqa: E402


class _GpuSampler:
    """The whole GPU's used memory (CUDA contexts included, which torch's peak leaves out), sampled
    every 0.2 s through NVML while the block runs: whether every actor fits, beside the total."""

    def __enter__(self):
        import threading

        self.peak = self.total = self.procs = float("nan")
        self._stop = threading.Event()
        try:
            try:
                import pynvml
            except ImportError:
                from ray._private.thirdparty import pynvml
            pynvml.nvmlInit()
            self._nvml, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            self.total = pynvml.nvmlDeviceGetMemoryInfo(self._h).total / 2**20
            self.peak = self.procs = 0
        except Exception as e:  # no NVML: the fields stay NaN
            print(f"gpu_share: NVML unavailable ({e}); no whole-GPU memory figures", flush=True)
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.2):
            try:
                used = self._nvml.nvmlDeviceGetMemoryInfo(self._h).used / 2**20
                if used > self.peak:
                    self.peak = used
                    self.procs = len(self._nvml.nvmlDeviceGetComputeRunningProcesses(self._h))
            except Exception:
                pass

    def __exit__(self, *exc):
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join()
        return False

    def fields(self) -> dict:
        fits = bool(self.peak < self.total) if self.peak == self.peak and self.total == self.total else None  # None: unknown
        return {"gpu_used_mib_peak": round(self.peak, 1), "gpu_total_mib": round(self.total, 1),
                "gpu_procs_at_peak": self.procs, "all_fit": fits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--samples", type=int, default=30_000, help="synthetic CIFAR-shaped images (3x32x32)")
    ap.add_argument("--method", default="fedproto")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_share: no CUDA GPU on this machine; nothing was measured (run it where `nvidia-smi` lists a GPU).")
        return
    import tempfile

    import ray

    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment

    base = ["data.name=synthetic", f"data.num_samples={args.samples}", "data.image_size=32", "data.channels=3",
            "data.partition.name=dirichlet", "data.partition.beta=0.1", "data.partition.min_samples=20",
            "model.group=HtFE8", f"algorithm.name={args.method}", "training.batch_size=10",
            "federation.num_clients=20", "federation.mode=sync", "federation.participation=1.0",
            f"federation.rounds={args.rounds}", "federation.eval_every=1", "checkpoint.every=0"]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        track = [f"tracking.tracking_uri=sqlite:///{d}/mlflow.db", f"tracking.output_dir={d}/runs"]
        if importlib.util.find_spec("mlflow") is None:  # a bare GPU machine: measure without tracking
            track.append("tracking.enabled=false")
        from rayfed_proto.data import load_dataset, make_partition

        cfg0 = build_config({}, base + track)
        ds = load_dataset(cfg0.data, cfg0.seed)
        part = make_partition(ds, cfg0.data.partition, 20, cfg0.seed, cfg0.data.test_fraction)
        samples = sum(len(c.train_idx) for c in part.clients)
        ray.init(num_gpus=1, include_dashboard=False)
        for layout in ("1", "auto"):
            cfg = build_config({}, base + track + [f"resources.clients_per_actor={layout}"])
            try:
                with _GpuSampler() as smi:
                    res = run_experiment(cfg, progress=True)
            except Exception as e:  # one layout failing (placement, CUDA in the actors) still leaves the others
                import traceback

                traceback.print_exc()
                rows.append({"layout": f"clients_per_actor={layout}", "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            walls = [h[names.FEDERATION_WALL_S] for h in res.history]
            rounds = [b - a for a, b in zip(walls, walls[1:], strict=False)]  # version v exists at wall_s[v]
            per_round = statistics.median(rounds[1:] or rounds)
            gpu = [p.get("gpu_peak_mib", float("nan")) for p in res.placements[:-1]]
            rows.append({"layout": f"clients_per_actor={layout}", "actors": res.resource_plan["num_actors"],
                         "gpu_share": res.resource_plan["client_num_gpus"],
                         "samples_per_s": round(samples / per_round, 1),
                         "gpu_peak_mib_per_actor_max": round(max(gpu), 1), "gpu_peak_mib_total": round(sum(gpu), 1),
                         **smi.fields(), "head_acc": round(res.history[-1][names.EVAL_HEAD_ACC], 4),
                         "devices": ",".join(sorted({str(p.get("device")) for p in res.placements})),
                         "cuda_visible_devices": ",".join(sorted({str(p.get("cuda_visible_devices"))
                                                                  for p in res.placements})),
                         "rounds_s": [round(r, 2) for r in rounds]})
            print(rows[-1], flush=True)
        ray.shutdown()
        with _GpuSampler() as smi:
            plain = run_plain(build_config({}, base + track), device="cuda")
        med = statistics.median(plain.round_s[1:] or plain.round_s)
        rows.append({"layout": "plain loop, one process", "actors": 0, "gpu_share": 1.0,
                     "samples_per_s": round(samples / med, 1),
                     "gpu_peak_mib_per_actor_max": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                     "gpu_peak_mib_total": round(torch.cuda.max_memory_allocated() / 2**20, 1), **smi.fields(),
                     "head_acc": round(plain.head_acc[-1], 4), "devices": "cuda",
                     "rounds_s": [round(r, 2) for r in plain.round_s]})
    ref = rows[-1]["samples_per_s"]
    for r in rows:
        r["throughput_vs_plain"] = round(r["samples_per_s"] / ref, 3) if "samples_per_s" in r else None
    cols = [c for c in rows[-1] if c != "rounds_s"] + (["error"] if any("error" in r for r in rows) else [])
    rows = [{c: r.get(c, "") for c in dict.fromkeys(list(r) + cols)} for r in rows]
    write_results(rows, cols, args)


if __name__ == "__main__":
    main()
