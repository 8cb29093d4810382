"""Why FedProtoKD's server model can collapse: what Eq. 7 makes of the clients' public logits.

Runs FedProtoKD with the settings of ``compare_methods.py`` (digits, Dirichlet 0.1, 10 clients,
seed 0 by default: the seed whose server model fell from 80 % to 19 %) keeping a checkpoint at
every version, or reads an existing run folder that has them (``--run-dir``). For each
checkpointed version it takes the public-set logits the server held (every client's latest,
those Eq. 7 combined into that version's target) and reports, against the public set's true
labels (which the method never sees):

- how often the argmax of the Eq. 7 target is right (``logit_variance``, the paper), of the
  ``probability_variance`` target (this platform's option), and of the plain mean of the logits;
- each client's share of the Eq. 7 weight (mean over public samples of var_k / sum_j var_j) and
  the scale of its logits (mean over samples of their std over the classes).

    python bench/fedprotokd_eq7.py --out bench/results/fedprotokd_eq7      # 2.5 min on 2 cores
    python bench/fedprotokd_eq7.py --run-dir /tmp/rayfed_eq7_runs/<run> --out ...   # no new run
"""

from __future__ import annotations

import argparse
import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch

from rayfed_proto.tracking import metric_names as names


def run_with_checkpoints(seed: int, rounds: int, out_root: str) -> Path:
    import compare_methods as cm
    import ray

    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment

    # one version more than reported: a run writes no periodic checkpoint at its last version, and
    # sync runs are deterministic, so versions 1..rounds are those of a run of ``rounds`` versions
    args = Namespace(rounds=rounds + 1, eval_every=5, clients=10, clients_per_actor=5, beta=0.1, public_size=300,
                     tracking_uri="sqlite:////tmp/rayfed_compare.db",
                     set=["checkpoint.every=1", f"checkpoint.keep={rounds + 1}", f"tracking.output_dir={out_root}",
                          "tracking.enabled=false"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = run_experiment(build_config({}, cm.run_overrides("fedprotokd", "digits", seed, args)),
                                progress=False, echo=print)
    finally:
        ray.shutdown()
    return Path(result.output_dir)


def analyse(run_dir: Path) -> list[dict]:
    """One row per checkpointed version of ``run_dir`` (see the module docstring)."""
    from rayfed_proto.algorithms.fedprotokd import variance_weighted_logits
    from rayfed_proto.config import load_config
    from rayfed_proto.data import Partition
    from rayfed_proto.data.datasets import load_dataset
    from rayfed_proto.runtime.driver import checkpoint_store

    cfg = load_config(run_dir / "config.yaml")
    dataset = load_dataset(cfg.data, cfg.seed)
    partition = Partition.load_parquet(run_dir / "partition.parquet")
    truth = torch.as_tensor(np.asarray(dataset.labels)[partition.public_idx])
    history = {}
    if (run_dir / "history.parquet").exists():  # written at the end of a run
        import pyarrow.parquet as pq

        history = {int(h["version"]): h for h in pq.read_table(run_dir / "history.parquet").to_pylist()}
    rows = []
    for path in checkpoint_store(cfg, run_dir).complete():
        version = int(path.name[1:])
        state = torch.load(path / "server.pt", map_location="cpu", weights_only=False)["core"]["algorithm"]
        latest = state.get("latest_logits") or {}
        if not latest:
            continue
        clients = sorted(latest, key=int)
        logits = torch.tensor(np.stack([latest[c]["logits"] for c in clients]), dtype=torch.float32)  # (K, P, C)
        var = logits.var(dim=2, unbiased=False)  # FedProtoKD Eq. 7: sigma^2(F_k(x_i))
        share = (var / var.sum(0, keepdim=True).clamp_min(1e-12)).mean(1)
        scale = logits.std(dim=2, unbiased=False).mean(1)

        def acc(target: torch.Tensor) -> float:
            return float((target.argmax(1) == truth).float().mean())

        top = int(share.argmax())
        rows.append({
            "version": version,
            "target_acc_logit_variance": acc(variance_weighted_logits(logits)),
            "target_acc_probability_variance": acc(variance_weighted_logits(logits, variance_of="probabilities")),
            "target_acc_plain_mean": acc(logits.mean(0)),
            "top_client": int(clients[top]), "top_client_share": float(share[top]),
            "top_client_logit_std": float(scale[top]), "top_client_public_acc": acc(logits[top]),
            "median_logit_std_others": float(np.median(np.delete(scale.numpy(), top))),
            "global_acc": history.get(version, {}).get(names.EVAL_GLOBAL_ACC),
        })
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", help="an existing FedProtoKD run folder with checkpoints (skips the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--runs-root", default="/tmp/rayfed_eq7_runs")
    p.add_argument("--out", help="write OUT.json, OUT.md and OUT.png")
    args = p.parse_args()

    run_dir = Path(args.run_dir) if args.run_dir else run_with_checkpoints(args.seed, args.rounds, args.runs_root)
    rows = [r for r in analyse(run_dir) if args.run_dir or r["version"] <= args.rounds]
    if not rows:
        p.error(f"no checkpoint with public logits under {run_dir} (a FedProtoKD run with checkpoint.every=1?)")
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}"  # noqa: E731
    md = ["| version | Eq. 7 target right (%) | probability_variance target (%) | plain mean (%) | top client | "
          "its weight share (%) | its logit std | others' median std | its public acc (%) | server global_acc (%) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['version']} | {pct(r['target_acc_logit_variance'])} | {pct(r['target_acc_probability_variance'])} | "
                  f"{pct(r['target_acc_plain_mean'])} | {r['top_client']} | {pct(r['top_client_share'])} | "
                  f"{r['top_client_logit_std']:.1f} | {r['median_logit_std_others']:.1f} | "
                  f"{pct(r['top_client_public_acc'])} | {pct(r['global_acc'])} |")
    text = f"run: {run_dir}\n\n" + "\n".join(md)
    print(text)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"run_dir": str(run_dir), "rows": rows}, indent=2))
        Path(args.out + ".md").write_text(text + "\n")
        v = [r["version"] for r in rows]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.plot(v, [r["target_acc_logit_variance"] for r in rows], label="Eq. 7 target (logit variance)")
        ax.plot(v, [r["target_acc_probability_variance"] for r in rows], label="probability_variance target")
        ax.plot(v, [r["target_acc_plain_mean"] for r in rows], label="plain mean of logits", linestyle=":")
        ax.plot(v, [r["top_client_share"] for r in rows], label="largest client weight share", linestyle="--")
        g = [(r["version"], r["global_acc"]) for r in rows if r["global_acc"] is not None]
        if g:
            ax.plot([x for x, _ in g], [y for _, y in g], "o-", label="server model global_acc")
        ax.set_xlabel("server version")
        ax.set_ylim(0, 1)
        ax.set_title("FedProtoKD: public-set pseudo-labels right, and who Eq. 7 listens to")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
