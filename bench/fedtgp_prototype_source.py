"""FedTGP: prototypes of the trained model (paper) vs the authors' ``collect_protos`` (issue 24, item 3).

The authors' client (``TsingZ0/FedTGP``, HtFLlib ``system/flcore/clients/clienttgp.py``) uploads the
prototypes of the model as it was before the round's local training; the paper, and this platform
by default, those of the trained model. ``algorithm.prototype_model`` switches between the two
(``trained``, ``before_training``). Both variants run on the same MNIST-sized synthetic workload
(1 x 28 x 28 images, 10 classes), with the same seed, partition, models and local batches, through
the path ``compare_methods.py`` uses (``run_overrides``: ``small_hetero``, Dirichlet beta 0.1,
sync, full participation, 1 local epoch, batch 10, lr 0.01, ``feature_dim`` 128). Sync-mode
accuracies are deterministic for a seed, so the load of the machine does not change them.

Writes OUT.json (rows: head and prototype accuracy per evaluated version, per variant and seed)
and OUT.md (per version: both variants and their difference; final and best per variant).

    python bench/fedtgp_prototype_source.py --out bench/results/fedtgp_prototype_source
    python bench/fedtgp_prototype_source.py --clients 20 --rounds 30 --num-samples 6000 --seeds 0 1
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

import numpy as np
from _common import add_common_args, cell, check_configs, final_best, run_all, series, write_results
from compare_methods import run_overrides

from rayfed_proto.tracking import metric_names as names

VARIANTS = {"trained": "paper, default", "before_training": "authors' collect_protos"}


def variant_overrides(variant: str, args) -> list[str]:
    """The MNIST-sized synthetic set and the variant, on top of compare_methods' run settings."""
    return ["data.image_size=28", f"data.num_samples={args.num_samples}", f"algorithm.prototype_model={variant}",
            "tracking.experiment_name=fedtgp_prototype_source", *args.set]


def overrides(variant: str, seed: int, args) -> list[str]:
    run_args = copy.copy(args)
    run_args.set = variant_overrides(variant, args)  # last in run_overrides: wins over its settings
    return run_overrides("fedtgp", "synthetic", seed, run_args) + [f"tracking.run_name=fedtgp-{variant}-s{seed}"]


def one_run(variant: str, seed: int, args) -> dict:
    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment

    result = run_experiment(build_config({}, overrides(variant, seed, args)), progress=False, echo=lambda s: None)
    hist = [h for h in result.history if math.isfinite(h.get(names.EVAL_HEAD_ACC, math.nan))]
    (final_head, best_head), (final_proto, best_proto) = final_best(hist, names.EVAL_HEAD_ACC), final_best(hist, names.EVAL_PROTO_ACC)
    return {"variant": variant, "seed": seed, "versions": [int(h["version"]) for h in hist],
            "head": series(hist, names.EVAL_HEAD_ACC).tolist(), "proto": series(hist, names.EVAL_PROTO_ACC).tolist(),
            "final_head": final_head, "best_head": best_head, "final_proto": final_proto, "best_proto": best_proto,
            "run_id": result.run_id}


def _pct(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.1f}"


def _diff(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:+.1f}"


def tables(rows: list[dict], seeds: list[int]) -> str:
    by = {(r["variant"], r["seed"]): r for r in rows}
    out = ["| variant | final head | best head | final proto | best proto |", "|---|---|---|---|---|"]
    for v, why in VARIANTS.items():
        rs = [by[(v, s)] for s in seeds]
        out.append(f"| `{v}` ({why}) | {cell([r['final_head'] for r in rs])} | {cell([r['best_head'] for r in rs])} | "
                   f"{cell([r['final_proto'] for r in rs])} | {cell([r['best_proto'] for r in rs])} |")
    out += ["", "Per evaluated version (accuracy %, mean over seeds; difference = before_training - trained, points):", "",
            "| version | head trained | head before_training | difference | proto trained | proto before_training | difference |",
            "|---|---|---|---|---|---|---|"]
    versions = by[("trained", seeds[0])]["versions"]
    for i, ver in enumerate(versions):
        m = {(v, k): 100 * float(np.mean([by[(v, s)][k][i] for s in seeds])) for v in VARIANTS for k in ("head", "proto")}
        out.append(f"| {ver} | {_pct(m['trained', 'head'])} | {_pct(m['before_training', 'head'])} | "
                   f"{_diff(m['before_training', 'head'] - m['trained', 'head'])} | {_pct(m['trained', 'proto'])} | "
                   f"{_pct(m['before_training', 'proto'])} | {_diff(m['before_training', 'proto'] - m['trained', 'proto'])} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--clients-per-actor", type=int, default=10)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--num-samples", type=int, default=6000, help="synthetic images (1 x 28 x 28, 10 classes)")
    p.add_argument("--public-size", type=int, default=300, help=argparse.SUPPRESS)  # read by run_overrides, unused
    add_common_args(p, tracking_uri="sqlite:////tmp/rayfed_fedtgp_source.db")
    args = p.parse_args()
    jobs = [(v, seed, args) for seed in args.seeds for v in VARIANTS]
    check_configs(p, (overrides(*job) for job in jobs))
    rows = run_all(args.cpus, jobs, one_run, lambda r: (
        f"seed {r['seed']} {r['variant']:<15} final head {r['final_head']:.3f} proto {r['final_proto']:.3f}"))
    settings = (f"FedTGP defaults, synthetic 1x28x28, 10 classes, {args.num_samples} images; {args.clients} clients "
                f"(small_hetero), Dirichlet beta {args.beta}, sync, full participation, {args.rounds} rounds, 1 local "
                f"epoch, batch 10, lr 0.01, feature_dim 128, seeds {args.seeds}"
                + (f"; every run: {' '.join(args.set)}" if args.set else ""))
    write_results(args, rows, settings, tables(rows, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
