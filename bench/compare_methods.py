"""Compare prototype methods on one shared small workload: same partition, seeds and rounds.

For each dataset (embedded digits, a synthetic set) and seed, every method runs on the same
partition (the partition depends only on the data config and the seed) with the same models,
rounds and local training. Reports mean and std over seeds of the final and best accuracy, in
both inference modes (head, nearest prototype).

FedProtoKD (``--methods fedprotokd``) runs with the small server model of the
``fedprotokd_digits`` preset (``cnn``, 5 server epochs, 50 generator epochs) and a public set
of ``--public-size`` samples (300); its default ``data.global_test_fraction`` 0.2 holds out a
global test set on which the server model is evaluated. Both holdouts leave its clients a
smaller pool than the other methods' (the partition differs from theirs). The table then gains
the server model's accuracy (``global_acc``) as extra columns.

    python bench/compare_methods.py                         # 4 methods x 2 datasets x 3 seeds
    python bench/compare_methods.py --methods fedproto fedsa --seeds 0 1 --rounds 20
    python bench/compare_methods.py --out bench/results/compare_methods   # .json and .md
    python bench/compare_methods.py --methods fedprotokd --datasets digits --out bench/results/compare_fedprotokd
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

DATASETS = {
    "digits": ["data.name=digits"],
    "synthetic": ["data.name=synthetic", "data.num_samples=3000", "data.num_classes=10", "data.channels=1"],
}


def method_overrides(method: str, rounds: int, public_size: int = 300) -> list[str]:
    """Settings that differ from a method's defaults, and why (printed with the results)."""
    if method == "fedprotokd":
        # fedprotokd_digits preset: a small server model and public set instead of the paper's
        # ResNet34 and 2,500 samples (which would be larger than digits' whole training pool)
        return ["algorithm.server_arch=cnn", "algorithm.server_epochs=5", "algorithm.generator_epochs=50",
                f"data.public_size={public_size}"]
    if method == "fedsa":
        return ["algorithm.lambda2=1.0"]  # FedSA paper: lambda2 = 1 under model heterogeneity
    if method == "fedsap":
        # the paper ramps from round 20 to full at 100 of 100: the same proportions of this run
        return [f"algorithm.alignment_schedule.start={int(0.2 * rounds)}",
                f"algorithm.alignment_schedule.length={max(1, int(0.8 * rounds))}"]
    return []


def one_run(method: str, dataset: str, seed: int, args) -> dict:
    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment

    overrides = DATASETS[dataset] + method_overrides(method, args.rounds, args.public_size) + [
        f"seed={seed}", f"algorithm.name={method}", "data.partition.name=dirichlet",
        f"data.partition.beta={args.beta}", "data.partition.min_samples=20", "model.group=small_hetero",
        "model.feature_dim=128", "federation.mode=sync", f"federation.num_clients={args.clients}",
        f"federation.rounds={args.rounds}", f"federation.eval_every={args.eval_every}",
        f"resources.clients_per_actor={args.clients_per_actor}",
        f"tracking.tracking_uri={args.tracking_uri}", "tracking.experiment_name=compare_methods",
        f"tracking.run_name={method}-{dataset}-s{seed}", "tracking.output_dir=/tmp/rayfed_compare_runs",
    ] + list(args.set)  # last: --set wins over the settings above
    result = run_experiment(build_config({}, overrides), progress=False, echo=lambda s: None)
    hist = result.history

    def series(key):
        return np.array([h.get(key, math.nan) for h in hist], float)

    head, proto, glob = series("head_acc"), series("proto_acc"), series("global_acc")
    row = {"method": method, "dataset": dataset, "seed": seed,
           "final_head": float(head[-1]), "best_head": float(np.nanmax(head)),
           "final_proto": float(proto[-1]), "best_proto": float(np.nanmax(proto)) if np.isfinite(proto).any() else math.nan,
           "final_silhouette": float(hist[-1].get("silhouette_mean", math.nan)), "run_id": result.run_id}
    if np.isfinite(glob).any():  # a server-held model evaluated on the global test set (FedProtoKD)
        row["final_global"] = float(glob[np.isfinite(glob)][-1])
        row["best_global"] = float(np.nanmax(glob))
    return row


def table(rows: list[dict], methods: list[str], datasets: list[str]) -> str:
    def cell(values):
        v = np.array(values, float) * 100
        return "n/a" if not np.isfinite(v).any() else f"{np.nanmean(v):.1f} ± {np.nanstd(v):.1f}"

    with_global = any("final_global" in r for r in rows)  # extra columns only when a method has a server model
    out = ["| dataset | method | final head | best head | final proto | best proto | final silhouette |"
           + (" final global (server model) | best global |" if with_global else ""),
           "|---|---|---|---|---|---|---|" + ("---|---|" if with_global else "")]
    for d in datasets:
        for m in methods:
            rs = [r for r in rows if r["method"] == m and r["dataset"] == d]
            sil = np.array([r["final_silhouette"] for r in rs], float)
            sil_cell = "n/a" if not np.isfinite(sil).any() else f"{np.nanmean(sil):.3f} ± {np.nanstd(sil):.3f}"
            line = (f"| {d} | {m} | {cell([r['final_head'] for r in rs])} | {cell([r['best_head'] for r in rs])} | "
                    f"{cell([r['final_proto'] for r in rs])} | {cell([r['best_proto'] for r in rs])} | {sil_cell} |")
            if with_global:
                line += (f" {cell([r.get('final_global', math.nan) for r in rs])} |"
                         f" {cell([r.get('best_global', math.nan) for r in rs])} |")
            out.append(line)
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["fedproto", "fedtgp", "fedsa", "fedsap"])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--clients-per-actor", type=int, default=5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--public-size", type=int, default=300, help="FedProtoKD's public set (data.public_size)")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--tracking-uri", default="sqlite:////tmp/rayfed_compare.db")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override added to every run (repeatable), e.g. algorithm.logit_weighting=probability_variance")
    p.add_argument("--out", help="write OUT.json and OUT.md")
    args = p.parse_args()
    from rayfed_proto.config import ConfigError, build_config

    try:  # a bad --set is reported now, not after the first runs
        for method in args.methods:
            build_config({}, [f"algorithm.name={method}", *args.set])
    except ConfigError as e:
        p.error(str(e))

    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    rows, t0 = [], time.perf_counter()
    for dataset in args.datasets:
        for seed in args.seeds:
            for method in args.methods:
                rows.append(one_run(method, dataset, seed, args))
                r = rows[-1]
                print(f"[{time.perf_counter() - t0:6.0f}s] {dataset:<9} seed {seed} {method:<8} "
                      f"final head {r['final_head']:.3f} proto {r['final_proto']:.3f}"
                      + (f" global {r['final_global']:.3f}" if "final_global" in r else ""), flush=True)
    ray.shutdown()
    md = table(rows, args.methods, args.datasets)
    settings = (f"{args.clients} clients (small_hetero), Dirichlet beta {args.beta}, sync, full participation, "
                f"{args.rounds} rounds, 1 local epoch, batch 10, lr 0.01, feature_dim 128, seeds {args.seeds}; "
                + "; ".join(f"{m}: {' '.join(method_overrides(m, args.rounds, args.public_size)) or 'defaults'}"
                            for m in args.methods)
                + (f"; every run: {' '.join(args.set)}" if args.set else ""))
    print("\n" + settings + "\n\n" + md)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        Path(args.out + ".md").write_text(settings + "\n\n" + md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
