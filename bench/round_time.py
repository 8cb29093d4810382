"""Seconds per synchronous round and startup, the platform against a plain sequential PyTorch
loop, measured in the same run (so the ratio holds on any machine).

The workload (issue 11): `synthetic` data of MNIST's size and shape (70,000 images 1x28x28),
Dirichlet 0.1 over 20 clients with min_samples 20, the FedAvg CNN for every client (HtFE1),
FedProto with lambda 10 and FedAvg, batch 10, 1 local epoch, full participation, sync,
evaluation every round. For each method the plain loop runs in this process (`bench/_plain.py`:
each client in turn trains, collects its prototypes, is evaluated; torch's default thread count),
then the platform (a fresh `rayfed-proto run` process, default resources: `clients_per_actor:
auto`), then the plain loop again; the ratio is the platform's median round over rounds 2..R
against the median of both plain runs' rounds 2..R (``--no-bracket``: one plain run, after).
``--reference htfllib`` (or ``both``) measures against a MODEL of HtFLlib/PFLlib's own loop instead
(or too): `bench/_htfllib.py`, their code re-written over this workload (per-sample Python loops,
DataLoaders, evaluate-before-train, for FedProto HtFLlib's disk round trips), run once after the
platform at the thread count of this process; its ratio is the platform's median over its median,
rounds 2..R. It is not the real HtFLlib code: every line and field for it says "model", and the
calibration of the model against the real code (model / real round time on this workload,
`bench/results/htfllib_calibration.json`, made by `bench/htfllib_calibration.py` with a
checkout of HtFLlib) is printed and recorded beside it, where one was measured for that flavour.

    .venv/bin/python bench/round_time.py --out bench/results/round_time            # both methods, 10 rounds
    .venv/bin/python bench/round_time.py --methods fedproto --rounds 3 --samples 10000   # a quick look
    .venv/bin/python bench/round_time.py --device cuda                               # on a GPU machine
    .venv/bin/python bench/round_time.py --reference both                            # and HtFLlib's loop
    .venv/bin/python bench/round_time.py --batched --reference none --rounds 4       # batch_clients on against off

Startup: the platform's is from its process start to the first local update returned (metric
`startup_s`: Ray start, actors, data into the object store, model builds); the plain loop's is
from the call to its first client update (imports excluded, which favours the plain loop).
Without MLflow installed (a bare GPU machine given only bench/gpu_check.sh's wheels) the platform
runs with ``tracking.enabled=false`` and its startup and actor count are read from its output.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _htfllib import FLAVOURS, default_flavour, run_htfllib  # noqa: E402
from _plain import run_plain, write_results  # noqa: E402


def _have_mlflow() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlflow") is not None


def workload(args, method: str, tmp: Path) -> list[str]:
    sets = [
        "data.name=synthetic", f"data.num_samples={args.samples}", "data.image_size=28", "data.channels=1",
        "data.partition.name=dirichlet", "data.partition.beta=0.1", "data.partition.min_samples=20",
        "model.group=HtFE1", f"algorithm.name={method}", "training.batch_size=10", "training.local_epochs=1",
        f"federation.num_clients={args.clients}", "federation.mode=sync", "federation.participation=1.0",
        f"federation.rounds={args.rounds}", "federation.eval_every=1", "checkpoint.every=0",
        f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"tracking.output_dir={tmp / 'runs'}",
        f"tracking.experiment_name=round_time_{method}",
    ]
    if method == "fedproto":  # lambda 10 (FedTGP's scripts); the reference's uniform server mean, as the plain loop
        sets += ["algorithm.lam=10", "algorithm.aggregation=uniform"]
    if args.device == "cuda":
        sets += ["resources.num_gpus=1"]
    if not _have_mlflow():  # a bare GPU machine given only bench/gpu_check.sh's wheels: no tracking
        sets += ["tracking.enabled=false"]
    sets += args.set
    return sets


def run_platform(args, method: str, tmp: Path, extra: tuple[str, ...] = ()) -> dict:
    import pandas as pd

    cmd = [sys.executable, "-m", "rayfed_proto.cli", "run"] + [f"--set={s}" for s in workload(args, method, tmp)
                                                               + list(extra)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"platform run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = max((tmp / "runs").glob(f"*-{method}-synthetic"), key=lambda d: d.stat().st_mtime)  # this run's folder
    hist = pd.read_parquet(out / "history.parquet").sort_values("version")
    wall = hist["federation/wall_s"].tolist()
    rounds = [b - a for a, b in zip(wall, wall[1:], strict=False)]  # version v exists at wall_s[v]
    if _have_mlflow():
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
        run = client.search_runs([client.get_experiment_by_name(f"round_time_{method}").experiment_id])[0]
        startup = float(run.data.tags.get("federation/startup_s", run.data.metrics.get("federation/startup_s", "nan")))
        actors = int(float(run.data.params.get("plan.num_actors", "nan")))
    else:  # tracking disabled: the same figures from the run's summary.txt and the run's own output
        import re

        found = re.search(r"startup \(run start to first update\)\s*\|\s*([0-9.]+) s", (out / "summary.txt").read_text())
        startup = float(found.group(1)) if found else float("nan")
        found = re.search(r"starting (\d+) client actors", proc.stdout + proc.stderr)
        actors = int(found.group(1)) if found else -1
    return {"round_s": rounds, "startup_s": startup,
            "process_s": time.time() - t0, "head_acc": float(hist["eval/head_acc"].iloc[-1]),
            "proto_acc": float(hist["eval/proto_acc"].iloc[-1]) if "eval/proto_acc" in hist else float("nan"),
            "num_actors": actors,
            "utilisation": float(hist["federation/slot_utilisation"].iloc[-1])}


COLS = ["method", "rounds", "platform_round_s", "batched_round_s", "batched_speedup", "batched_acc_diff_pp",
        "plain_round_s", "ratio", "platform_startup_s", "plain_startup_s",
        "platform_head_acc", "plain_head_acc", "acc_diff_pp", "platform_actors", "htfllib_model_flavour",
        "htfllib_model_round_s", "htfllib_model_ratio", "htfllib_model_over_real", "htfllib_model_head_acc"]
CALIBRATION = Path(__file__).resolve().parent / "results" / "htfllib_calibration.json"


def calibration(method: str, flavour: str) -> dict | None:
    """The model's measured round time over the real code's, for ``method`` in ``flavour``, from
    ``bench/results/htfllib_calibration.json`` (None where that pair was never calibrated: the
    file holds HtFLlib's FedProto; FedAvg's model was never run against the real PFLlib)."""
    if not CALIBRATION.exists():
        return None
    import json

    cal = json.loads(CALIBRATION.read_text())
    if cal.get("method") != method:
        return None
    wall = cal.get(f"{flavour}_model_over_real_wall")
    if wall is None:
        return None
    cpu = cal.get(f"{flavour}_model_over_real_cpu") or {}
    return {"model_over_real": wall["median_of_ratios"], "model_over_real_cpu": cpu.get("median_of_ratios"),
            "threads": cal.get("torch_threads"), "samples": cal.get("args", {}).get("samples"),
            "measured": cal.get("measured"), "source": "bench/results/htfllib_calibration.json"}


def _measure(args, method: str):
    """(platform, plain runs, HtFLlib run or None): the plain loop before (``--bracket``) and after the
    platform, the HtFLlib loop once after it, each as ``--reference`` asks."""
    from rayfed_proto.config import build_config

    echo = lambda s: print(s, flush=True)  # noqa: E731
    use_plain = args.reference in ("plain", "both")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = build_config({}, workload(args, method, tmp))
        plains = []
        if use_plain and args.bracket:  # the plain loop before and after the platform: a slow phase of the machine
            print(f"[{method}] plain loop (before) ...", flush=True)  # cannot land on one side only
            plains.append(run_plain(cfg, device=args.device, echo=echo, channels_last=args.plain_channels_last))
        print(f"[{method}] platform run ({args.rounds} rounds) ...", flush=True)
        ours = run_platform(args, method, tmp)
        print(f"  platform rounds: {', '.join(f'{r:.1f}' for r in ours['round_s'])} s; startup {ours['startup_s']:.1f} s",
              flush=True)
        if use_plain:
            print(f"[{method}] plain loop{' (after)' if args.bracket else ''} ...", flush=True)
            plains.append(run_plain(cfg, device=args.device, echo=echo, channels_last=args.plain_channels_last))
        if args.batched:  # the same platform run with clients stepping as one batched model, in the same process
            print(f"[{method}] platform run, resources.batch_clients=on ...", flush=True)
            ours["batched"] = run_platform(args, method, tmp, ("resources.batch_clients=on",))
            print(f"  batched rounds: {', '.join(f'{r:.1f}' for r in ours['batched']['round_s'])} s", flush=True)
        ht = None
        if args.reference in ("htfllib", "both"):
            flavour = args.htfllib_flavour or default_flavour(cfg)
            print(f"[{method}] model of the {'HtFLlib' if flavour == 'htfllib' else 'PFLlib'} loop (bench/_htfllib.py, "
                  f"flavour {flavour}) ...", flush=True)
            ht = run_htfllib(cfg, device=args.device, echo=echo, flavour=flavour)
    return ours, plains, ht


def _plain_fields(ours: dict, ours_med: float, plains: list) -> dict:
    plain = plains[-1]
    plain_med = statistics.median([r for p in plains for r in (p.round_s[1:] or p.round_s)])  # rounds 2..R of each
    return {"plain_round_s": round(plain_med, 2), "ratio": round(ours_med / plain_med, 3),
            "plain_startup_s": round(plain.startup_s, 1), "plain_head_acc": round(plain.head_acc[-1], 4),
            "acc_diff_pp": round(100 * (ours["head_acc"] - plain.head_acc[-1]), 2),
            "plain_rounds_s": [[round(r, 2) for r in p.round_s] for p in plains]}


def _htfllib_fields(method: str, ours_med: float, ht) -> dict:
    """The model's figures: every key says ``htfllib_model``; the calibration against the real code beside them."""
    ht_med = ht.median_round()  # rounds 2..R
    cal = calibration(method, ht.flavour)
    return {"htfllib_model_flavour": ht.flavour, "htfllib_model_threads": ht.threads,
            "htfllib_model_round_s": round(ht_med, 2), "htfllib_model_ratio": round(ours_med / ht_med, 3),
            "htfllib_model_over_real": cal["model_over_real"] if cal else "not calibrated",
            "htfllib_model_calibration": cal, "htfllib_model_head_acc": round(ht.head_acc[-1], 4),
            "htfllib_model_rounds_s": [round(r, 2) for r in ht.round_s]}


def _row(args, method: str, ours: dict, plains: list, ht) -> dict:
    ours_med = statistics.median(ours["round_s"][1:] or ours["round_s"])
    r = {"method": method, "rounds": args.rounds, "platform_round_s": round(ours_med, 2),
         "platform_startup_s": round(ours["startup_s"], 1), "platform_head_acc": round(ours["head_acc"], 4),
         "platform_actors": ours["num_actors"], "platform_utilisation": round(ours["utilisation"], 3),
         "platform_rounds_s": [round(x, 2) for x in ours["round_s"]]}
    head = f"[{method}] median round (2..{args.rounds}): platform {r['platform_round_s']} s"
    if "batched" in ours:
        b = ours["batched"]
        b_med = statistics.median(b["round_s"][1:] or b["round_s"])
        r.update({"batched_round_s": round(b_med, 2), "batched_speedup": round(ours_med / b_med, 3),
                  "batched_head_acc": round(b["head_acc"], 4),
                  "batched_acc_diff_pp": round(100 * (b["head_acc"] - ours["head_acc"]), 2),
                  "batched_rounds_s": [round(x, 2) for x in b["round_s"]]})
        print(f"[{method}] batch_clients on: median round {r['batched_round_s']} s against off {r['platform_round_s']} s: "
              f"speed-up {r['batched_speedup']}x; head acc {r['batched_head_acc']} ({r['batched_acc_diff_pp']:+} pp)",
              flush=True)
    if plains:
        r.update(_plain_fields(ours, ours_med, plains))
        print(f"{head}, plain {r['plain_round_s']} s, ratio {r['ratio']}; head acc {r['platform_head_acc']} vs "
              f"{r['plain_head_acc']} ({r['acc_diff_pp']:+} pp)", flush=True)
    if ht is not None:
        r.update(_htfllib_fields(method, ours_med, ht))
        cal = r["htfllib_model_calibration"]
        cal_s = (f"calibrated: model / real HtFLlib round {cal['model_over_real']} ({cal['source']})" if cal
                 else "not calibrated against the real code")
        lib = "HtFLlib" if r["htfllib_model_flavour"] == "htfllib" else "PFLlib"
        print(f"{head}, model of the {lib} loop ({r['htfllib_model_flavour']}, {r['htfllib_model_threads']} torch "
              f"threads) {r['htfllib_model_round_s']} s, ratio vs the model {r['htfllib_model_ratio']} [{cal_s}]; "
              f"head acc {r['platform_head_acc']} vs {r['htfllib_model_head_acc']}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["fedproto", "fedavg"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples", type=int, default=70_000)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for the platform's run")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--no-bracket", dest="bracket", action="store_false",
                    help="run the plain loop once, after the platform (default: before and after, ratio against the "
                    "median of both runs' rounds)")
    ap.add_argument("--plain-channels-last", action="store_true",
                    help="the plain loop's models in channels_last (the platform's CPU default, training.memory_format) "
                    "instead of HtFLlib's contiguous layout: what the ratio owes to the layout alone")
    ap.add_argument("--batched", action="store_true",
                    help="also run the platform with resources.batch_clients=on (after the default run, same "
                    "process): batched_round_s and batched_speedup (off's median round over on's)")
    ap.add_argument("--reference", choices=["plain", "htfllib", "both", "none"], default="plain",
                    help="the loop(s) the platform is measured against: bench/_plain.py's (bracketed), "
                    "bench/_htfllib.py's model of the HtFLlib/PFLlib loop (once, after the platform), or both")
    ap.add_argument("--htfllib-flavour", choices=FLAVOURS, default=None,
                    help="the model's flavour (default: htfllib for FedProto, pfllib for FedAvg; see bench/_htfllib.py)")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("round_time --device cuda: no CUDA GPU on this machine; nothing was measured.")
            sys.exit(0)
    rows = [_row(args, method, *_measure(args, method)) for method in args.methods]
    cols = [c for c in COLS if c in rows[0]]
    write_results(rows, cols, args)


if __name__ == "__main__":
    main()
