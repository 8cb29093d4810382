"""10,000 clients with personal models: peak memory, start-up and runtime overhead per update
against the same run with 100 clients (issue 28, item 5).

Data: synthetic FEMNIST-like, written as an ``.npz`` in the real format the ``npz`` loader reads
(``images`` uint8 28x28 grey, ``labels`` over 62 classes, ``client_ids`` one writer per client,
about 20 samples each; the ``natural`` partition replays the writers). Each writer has its own
style (a shift, a stroke weight) and its own skewed class mix, as FEMNIST's writers do.

Run: FedProto (HtFE1, the FedAvg CNN, every client), async on the virtual clock (lognormal client
speeds), 20 clients training at once, a version every 20 updates, 2,000 updates, evaluation of
every client at the end only; clients not training are parked on local disk
(``resources.park_idle_clients``). Each row is one ``rayfed-proto run`` in a subprocess; memory is
the PSS summed over the run's process tree (driver, Ray, workers, server), sampled twice a second
(``bench/footprint.py``).

Runtime overhead per update: the wall time of the updates (the first version's formation to the
last one's), divided by the updates, minus the same for the 100-client run: both rows do the same
work per update (the same model, about 20 samples per client, one local epoch), so what differs is
what the runtime spends on its clients. The ratio 10,000 / 100 of the wall time per update is
printed (target <= 1.2).

    .venv/bin/python bench/scale_clients.py --out bench/results/scale_clients
    .venv/bin/python bench/scale_clients.py --clients 100 1000 --updates 400       # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rayfed_proto.tracking import metric_names as names  # noqa: E402


def femnist_like(path: Path, clients: int, classes: int = 62, mean_samples: int = 20, seed: int = 0) -> dict:
    """Write a FEMNIST-shaped ``.npz`` (uint8 28x28, ``client_ids`` per writer); returns its sizes.

    Class templates are smooth random strokes; a writer shifts them by up to 2 pixels, thickens or
    thins them and draws its classes from its own Dirichlet(0.5) mix over the 62 classes; every
    writer has at least 8 samples (so each has a test share)."""
    rng = np.random.default_rng(seed)
    side = 28
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
    templates = np.zeros((classes, side, side), np.float32)
    for k in range(classes):  # 3 gaussian strokes per class
        for _ in range(3):
            cy, cx = rng.uniform(6, 22, 2)
            sy, sx = rng.uniform(1.5, 5, 2)
            templates[k] += np.exp(-((yy - cy) ** 2 / (2 * sy**2) + (xx - cx) ** 2 / (2 * sx**2)))
    templates /= templates.max(axis=(1, 2), keepdims=True)
    sizes = np.maximum(8, rng.poisson(mean_samples, clients))
    n = int(sizes.sum())
    client_ids = np.repeat(np.arange(clients, dtype=np.int32), sizes)
    mixes = rng.dirichlet(np.full(classes, 0.5), clients)
    labels = np.empty(n, np.int16)
    start = 0
    for c, s in enumerate(sizes):
        labels[start:start + s] = rng.choice(classes, s, p=mixes[c])
        start += s
    shift = rng.integers(-2, 3, (clients, 2))
    weight = rng.uniform(0.7, 1.4, clients).astype(np.float32)
    images = np.empty((n, side, side), np.uint8)
    for lo in range(0, n, 20_000):  # in chunks: a few hundred MB at most in float
        hi = min(n, lo + 20_000)
        w = client_ids[lo:hi]
        img = templates[labels[lo:hi]]
        for dy in range(-2, 3):
            for dx in range(-2, 3):
                sel = (shift[w, 0] == dy) & (shift[w, 1] == dx)
                if sel.any():
                    img[sel] = np.roll(img[sel], (dy, dx), axis=(1, 2))
        img = img ** (1.0 / weight[w][:, None, None])  # stroke weight: > 1 thickens, < 1 thins
        img = np.clip(img + rng.normal(0, 0.15, img.shape).astype(np.float32), 0, 1)
        images[lo:hi] = (img * 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, images=images, labels=labels.astype(np.int64), client_ids=client_ids.astype(np.int64))
    return {"clients": clients, "samples": n, "classes": classes, "mean_per_client": round(n / clients, 1)}


ROW_KINDS = {  # label -> (clients from --clients: "small" or "large", park_to, resume check)
    "small, disk": ("small", "disk", False),
    "large, disk": ("large", "disk", False),
    "large, memory": ("large", "memory", False),
    "large, disk, stopped + resumed": ("large", "disk", True),
}


def run_config(npz: Path, clients: int, updates: int, park_to: str, tmp: Path, park_dir: Path | None = None) -> list[str]:
    per = 20  # a version every 20 updates, 20 clients training at once
    return ["algorithm.name=fedproto", "data.name=npz", f"data.path={npz}", "data.image_size=28",
            "data.partition.name=natural", "model.group=HtFE1", f"federation.num_clients={clients}",
            "federation.mode=async", "federation.concurrency=20", f"federation.buffer_size={per}",
            f"federation.rounds={updates // per}", f"federation.eval_every={updates // per}",
            "system.speed.kind=lognormal", "system.speed.sigma=1.0", "resources.park_idle_clients=true",
            f"resources.park_to={park_to}", f"resources.park_dir={park_dir or tmp / 'parked'}", "checkpoint.every=0",
            f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"tracking.output_dir={tmp / 'runs'}",
            "tracking.experiment_name=scale_clients", "tracking.log_models=none"]


def child(spec: dict) -> None:
    """One run in this process (``--child``): prints a RESULT line with the output folder, the
    wall time at which each version formed (``on_version``) and the summary's start-up."""
    import re
    import time

    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.signals import RunInterrupted

    t0, formed = time.perf_counter(), {}
    kwargs = {"progress": False, "on_version": lambda v: formed.setdefault(int(v), time.perf_counter() - t0)}
    if spec.get("resume"):
        kwargs["resume_dir"] = Path(spec["resume"])
    try:
        res = run_experiment(build_config({}, spec["sets"]), **kwargs)
        out_dir, summary = res.output_dir, res.summary
    except RunInterrupted as stop:
        out_dir, summary = stop.output_dir, ""
    m = re.search(r"startup \(run start to first update\)\s*\|\s*([\d.]+) s", summary)
    print("RESULT " + json.dumps({"out_dir": str(out_dir), "formed": formed, "startup_s": float(m.group(1)) if m else None}))


def one_run(sets: list[str], resume: Path | None = None) -> dict:
    """A run in a child process with its process tree's memory sampled (``bench/footprint.py``)."""
    import pandas as pd
    from footprint import run_sampled

    spec = json.dumps({"sets": sets, "resume": str(resume) if resume else None})
    code, output, peak, timeline, total_s = run_sampled([sys.executable, __file__, "--child", spec])
    result = next((json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")), None)
    if code != 0 or result is None:
        raise SystemExit(f"run failed ({code}):\n{output[-4000:]}")
    path = Path(result["out_dir"]) / "history.parquet"  # a stopped run writes none
    hist = pd.read_parquet(path) if path.exists() else None
    return {**result, "formed": {int(k): v for k, v in result["formed"].items()}, "peak": peak, "timeline": timeline,
            "total_s": total_s, "history": hist}


def update_phase(formed: dict[int, float], per: int = 20) -> tuple[float, int]:
    """(seconds, updates) from version 1's formation to the last version's: the updates alone,
    without the start, the evaluation of version 0 (every client) and the final one."""
    last = max(formed)
    return formed[last] - formed[1], (last - 1) * per


def measure(label: str, npz: Path, clients: int, updates: int, park_to: str, resume_check: bool, tmp: Path,
            park_dir: Path | None = None) -> dict:
    sets = run_config(npz, clients, updates, park_to, tmp, park_dir)
    if resume_check:  # stopped at the middle version after a checkpoint, then resumed to the end
        half = updates // 20 // 2
        first = one_run(sets + [f"checkpoint.every={half}", f"faults.stop_at_version={half}"])
        ckpt_bytes = sum(p.stat().st_size for p in Path(first["out_dir"], "checkpoints").rglob("*") if p.is_file())
        run = one_run(sets + [f"checkpoint.every={half}"], resume=Path(first["out_dir"]))
        peak_gib = max(first["peak"]["pss"], run["peak"]["pss"]) / 1024
        extra = {"checkpoint_gib": round(ckpt_bytes / 2**30, 2), "stopped_run_s": round(first["total_s"], 1)}
    else:
        run = one_run(sets)
        peak_gib, extra = run["peak"]["pss"] / 1024, {}
    hist = run["history"]
    row = {"row": label, "clients": clients, "park_to": park_to, "updates": updates,
           "peak_pss_gib": round(peak_gib, 2), "startup_s": run["startup_s"], "total_s": round(run["total_s"], 1)}
    if not resume_check:
        secs, n = update_phase(run["formed"])
        row.update(update_phase_s=round(secs, 1), ms_per_update=round(1000 * secs / n, 1))
    final = hist.sort_values("version").iloc[-1]
    row.update(final_version=int(final["version"]), head_acc=round(float(final[names.EVAL_HEAD_ACC]), 4), **extra)
    row["timeline"] = run["timeline"]
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        ax.plot([s["t"] for s in r["timeline"]], [s["pss"] / 1024 for s in r["timeline"]], label=f"{r['row']} ({r['clients']:,})")
    ax.axhline(8e9 / 2**30, color="k", ls="--", lw=1, label="8 GB target")
    ax.set(xlabel="seconds since the run started", ylabel="PSS of the run's processes (GiB)",
           title="Memory over the run: clients parked on disk vs in memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs=2, default=[100, 10_000], metavar=("SMALL", "LARGE"))
    ap.add_argument("--updates", type=int, default=2000, help="local updates per run (a multiple of 40)")
    ap.add_argument("--rows", nargs="+", default=list(ROW_KINDS), choices=list(ROW_KINDS))
    ap.add_argument("--data-only", type=Path, default=None, help="only write the large .npz here")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json, OUT.md and OUT.png")
    ap.add_argument("--park-dir", type=Path, default=None,
                    help="resources.park_dir for the disk rows (default: a folder in the run's temp folder)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.data_only:
        print(femnist_like(args.data_only, args.clients[1]))
        return
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = {size: femnist_like(tmp / f"femnist_{n}.npz", n) | {"path": tmp / f"femnist_{n}.npz"}
                for size, n in zip(("small", "large"), args.clients, strict=True)}
        for label in args.rows:
            size, park_to, resume_check = ROW_KINDS[label]
            print(f"[{label}] {args.clients[size == 'large']:,} clients, parked in {park_to}"
                  + (", stopped at the middle and resumed" if resume_check else ""), flush=True)
            row = measure(label, data[size]["path"], data[size]["clients"], args.updates, park_to, resume_check, tmp,
                          args.park_dir)
            print(json.dumps({k: v for k, v in row.items() if k != "timeline"}), flush=True)
            rows.append(row)
    by = {r["row"]: r for r in rows}
    ratio = None
    if "small, disk" in by and "large, disk" in by:
        ratio = by["large, disk"]["ms_per_update"] / by["small, disk"]["ms_per_update"]
        print(f"wall time per update, {args.clients[1]:,} / {args.clients[0]:,} clients: {ratio:.2f} (target <= 1.2)")
    if "large, disk, stopped + resumed" in by and "large, disk" in by:
        same = by["large, disk, stopped + resumed"]["head_acc"] == by["large, disk"]["head_acc"]
        print(f"resumed run's final head accuracy equals the uninterrupted run's: {same}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "data": {k: {kk: str(vv) for kk, vv in v.items()}
             for k, v in data.items()}, "ratio_per_update": ratio, "rows": rows}, indent=1))
        cols = [c for c in ("row", "clients", "park_to", "peak_pss_gib", "startup_s", "ms_per_update", "update_phase_s",
                            "total_s", "final_version", "head_acc", "checkpoint_gib") if any(c in r for r in rows)]
        md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
        args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
        plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
