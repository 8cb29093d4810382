"""Why FedProto's prototype accuracy is low under partial participation (issue 24, item 6).

The ``async_sim_digits`` preset (50 clients on the embedded digits, Dirichlet 0.5, FedProto
lambda 1, participation 0.2) ends near 80 % head accuracy but under 30 % prototype accuracy.
This script runs the preset's workload in **sync mode, in process, without Ray**: the platform's
own pieces (``ClientRunner``: model, optimizer, batches, RNG streams, local update and
evaluation; the algorithm's server; ``SyncRounds``' seeded sample of ceil(rho N) clients per
round; the round aggregated in client order), so its head and prototype accuracies are the
platform's sync run's (checked against ``rayfed-proto run async_sim_digits --set
federation.mode=sync --set federation.rounds=40``: 79.45 % / 29.14 % at seed 0). It runs the
same setting in ``bench/_htfllib.py``'s model of the HtFLlib/PFLlib loop (``select_clients``,
``proto_aggregation`` over the round's participants, the result sent to every client): its
PFLlib flavour copied here with the bookkeeping a per-client breakdown needs, its HtFLlib flavour
through ``run_htfllib`` (pooled figures). At the last version it
scores every client's test split with several prototype banks and class sets, to separate the
hypotheses:

(a) the bank: the platform's (``aggregation_scope: buffer``, a class keeps its last vector),
    every client's latest upload (``latest``), HtFLlib's (the round's participants only);
(b) lambda 1 vs 10;
(c) all 10 classes vs only the classes the client trains on; clients by updates made and by
    versions since their last update; untrained clients;
(d) the evaluation: pooled vs per-client mean; the client's own prototypes and the bank it last
    trained against as inference banks (post hoc, no retraining);
plus full participation (every client in every round) on the same data, and the preset as it
ships (async, virtual clock) through the whole runtime with Ray, with either bank (variants
``async``, ``async_latest``: pooled figures only).

    .venv/bin/python bench/proto_partial.py --out bench/results/proto_partial     # sync variants, ~20 min here
    .venv/bin/python bench/proto_partial.py --seeds 0 --variants async async_latest --append \
        --out bench/results/proto_partial                                       # adds the runtime rows
    .venv/bin/python bench/proto_partial.py --seeds 0 --rounds 20 --variants preset htfllib
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rayfed_proto.algorithms.base import ROUND_IDS
from rayfed_proto.algorithms.common import prototype_margin, subset
from rayfed_proto.config import load_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.preset_files import resolve_config_arg

PRESET = "async_sim_digits"

_ASYNC = ["federation.mode=async", "federation.rounds=2*ROUNDS", "federation.eval_every=2*EVAL",
          "tracking.output_dir=/tmp/rayfed_proto_partial_runs", "checkpoint.every=0", "tracking.system_metrics=false"]

# name -> (loop, config overrides on top of the preset in sync mode, what it tests)
VARIANTS: dict[str, tuple[str, list[str], str]] = {
    "preset": ("platform", [], "the preset in sync mode: lambda 1, aggregation_scope buffer (a class's vector = mean "
               "over the round's uploaders of the class; a class nobody uploaded keeps its vector)"),
    "latest": ("platform", ["algorithm.aggregation_scope=latest"], "(a) aggregation_scope latest: every client's latest "
               "upload, weighted (1 + t - tau)^-0.5"),
    "lam10": ("platform", ["algorithm.lam=10"], "(b) lambda 10"),
    "lam10_latest": ("platform", ["algorithm.lam=10", "algorithm.aggregation_scope=latest"], "(a)+(b)"),
    "full": ("platform", ["federation.participation=1.0"], "participation 1: all 50 clients in each of the rounds "
             "(5 x the updates)"),
    "full_same_updates": ("platform", ["federation.participation=1.0", "federation.rounds=ROUNDS/5"],
                          "participation 1 for rounds / 5 rounds: the same number of local updates"),
    "htfllib": ("pfllib", [], "bench/_htfllib.py's loop, PFLlib flavour (in-memory clients, shuffled loaders): "
                "bank = mean over the round's participants only (proto_aggregation; a class nobody uploaded "
                "vanishes), lambda 1"),
    "htfllib_lam10": ("pfllib", ["algorithm.lam=10"], "the same, lambda 10"),
    "htfllib_disk": ("htfllib", [], "bench/_htfllib.py's HtFLlib flavour (run_htfllib: items on disk, unshuffled "
                     "loaders), lambda 1; pooled figures only"),
    # the preset as it ships (async, virtual clock), through the runtime (Ray): 2 x ROUNDS versions of
    # 5 updates = the sync variants' number of updates; pooled figures only (no per-client breakdown)
    "async": ("runtime", _ASYNC, "the preset as it ships (async, "
              "aggregation_scope buffer: each version's 5 updates, staleness-weighted), 2 x rounds versions"),
    "async_latest": ("runtime", _ASYNC + ["algorithm.aggregation_scope=latest"], "the same, aggregation_scope latest"),
}


def make_config(variant: str, seed: int, rounds: int, extra: list[str], eval_every: int = 4):
    _, overrides, _ = VARIANTS[variant]
    overrides = [o.replace("ROUNDS/5", str(max(1, rounds // 5))).replace("2*ROUNDS", str(2 * rounds))
                 .replace("2*EVAL", str(min(2 * eval_every, 2 * rounds))) for o in overrides]
    base = ["federation.mode=sync", f"federation.rounds={rounds}", "federation.eval_every=1", f"seed={seed}",
            "tracking.enabled=false"]  # eval_every: this script evaluates on its own (--eval-every)
    return load_config(resolve_config_arg(PRESET), base + overrides + list(extra))


def workload(cfg):
    ds = load_dataset(cfg.data, cfg.seed)
    d = cfg.data
    part = make_partition(ds, d.partition, cfg.federation.num_clients, cfg.seed, d.test_fraction,
                          global_test_fraction=d.global_test_fraction, public_size=d.public_size,
                          long_tail_ratio=d.long_tail_ratio)
    return ds, part


# ------------------------------------------------------------------------------------ scoring


def _nearest(feats: torch.Tensor, ids: np.ndarray, vecs: np.ndarray, allowed: Optional[np.ndarray] = None) -> torch.Tensor:
    """Class of the nearest vector (Euclidean), optionally only among the ``allowed`` classes."""
    ids, vecs = np.asarray(ids), np.asarray(vecs, np.float32)
    if allowed is not None:
        keep = np.isin(ids, allowed)
        ids, vecs = ids[keep], vecs[keep]
    if len(ids) == 0:
        return torch.full((len(feats),), -1, dtype=torch.long)
    d = torch.cdist(feats.float(), torch.as_tensor(vecs))
    return torch.as_tensor(ids)[d.argmin(1)]


def _own_prototypes(model, x: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The client's class means of its training split, eval mode (its own prototypes now)."""
    with torch.no_grad():
        f = model.features(x).float()
    cls = torch.unique(y)
    return cls.numpy(), torch.stack([f[y == c].mean(0) for c in cls]).numpy()


@torch.no_grad()
def score_client(model, tx, ty, x, y, bank: Optional[tuple[np.ndarray, np.ndarray]],
                 trained_bank: Optional[tuple[np.ndarray, np.ndarray]], latest_bank: Optional[tuple[np.ndarray, np.ndarray]],
                 num_classes: int) -> dict[str, Any]:
    """Correct counts of one client's test split under several inference rules (model in eval mode)."""
    was = model.training
    model.eval()
    feats, logits = model.forward_features(tx)
    feats = feats.float()
    held = torch.unique(y).numpy()
    out: dict[str, Any] = {"n": len(ty), "held": len(held), "test_outside_held": int((~np.isin(ty.numpy(), held)).sum())}
    out["head"] = int((logits.argmax(1) == ty).sum())
    mask = torch.full((num_classes,), float("-inf"))
    mask[torch.as_tensor(held)] = 0.0
    out["head_held"] = int(((logits + mask).argmax(1) == ty).sum())
    own = _own_prototypes(model, x, y)
    out["own"] = int((_nearest(feats, *own) == ty).sum())
    for name, b in (("proto", bank), ("trained", trained_bank), ("latest", latest_bank)):
        if b is None or len(b[0]) == 0:
            out[name] = out[name + "_held"] = None
            continue
        out[name] = int((_nearest(feats, *b) == ty).sum())
        out[name + "_held"] = int((_nearest(feats, *b, allowed=held) == ty).sum())
    if bank is not None and len(bank[0]):
        # geometry: distance of a test feature to its class's global vector against the nearest other one
        ids, vecs = bank
        dense = torch.full((num_classes, vecs.shape[1]), float("nan"))
        dense[torch.as_tensor(ids)] = torch.as_tensor(vecs, dtype=torch.float32)
        d = torch.cdist(feats, torch.nan_to_num(dense, nan=1e6))
        has = torch.isfinite(dense[:, 0])[ty]
        own_d = d[torch.arange(len(ty)), ty]
        d_other = d.clone()
        d_other[torch.arange(len(ty)), ty] = float("inf")
        out["d_own_class"] = float(own_d[has].mean()) if has.any() else math.nan
        out["d_nearest_other"] = float(d_other.min(1).values[has].mean()) if has.any() else math.nan
        own_ids, own_vecs = own
        common = np.intersect1d(own_ids, ids)
        if len(common):  # how far the client's own class means sit from the global ones
            gi = {int(c): i for i, c in enumerate(ids)}
            oi = {int(c): i for i, c in enumerate(own_ids)}
            out["own_to_global"] = float(np.mean([np.linalg.norm(own_vecs[oi[int(c)]] - vecs[gi[int(c)]]) for c in common]))
        out["feat_norm"] = float(feats.norm(dim=1).mean())
    model.train(was)
    return out


def latest_uniform_bank(latest: dict[int, tuple[np.ndarray, np.ndarray]], num_classes: int):
    """Per-class plain mean over every client's latest upload (post hoc, no staleness weights)."""
    sums: dict[int, list] = {}
    for ids, vecs in latest.values():
        for c, v in zip(ids, vecs, strict=True):
            s = sums.setdefault(int(c), [0.0, 0])
            s[0] = s[0] + np.asarray(v, np.float64)
            s[1] += 1
    ids = np.array(sorted(sums), np.int64)
    return (ids, np.stack([sums[int(c)][0] / sums[int(c)][1] for c in ids]).astype(np.float32)) if len(ids) else None


def bank_drift(before, after) -> float:
    """Mean over the classes in both banks of how far a class's vector moved in one version
    (``PrototypeSet`` or (ids, vectors)); NaN when no class is in both."""
    if before is None or after is None or len(before) == 0 or len(after) == 0:
        return math.nan
    a = before.as_dict() if hasattr(before, "as_dict") else dict(zip(map(int, before[0]), before[1], strict=True))
    b = after.as_dict() if hasattr(after, "as_dict") else dict(zip(map(int, after[0]), after[1], strict=True))
    common = sorted(set(a) & set(b))
    return float(np.mean([np.linalg.norm(np.asarray(a[c]) - np.asarray(b[c])) for c in common])) if common else math.nan


# ------------------------------------------------------------------------------------ the loops


def run_platform(cfg, eval_every: int) -> dict[str, Any]:
    """SyncRounds + ServerCore's sync step, in process: the platform's clients and server."""
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.runtime.core import ClientRunner, federation_spec

    ds, part = workload(cfg)
    dev = torch.device("cpu")
    runners = [ClientRunner(cfg, s, ds, dev) for s in part.clients]
    spec = federation_spec(cfg, ds.num_classes, ds.channels, ds.image_size, None, dev)
    server = ALGORITHMS.get(cfg.algorithm.name).Server(cfg.algorithm_options(), spec, dev)
    fed = cfg.federation
    n = fed.num_clients
    per_round = max(1, math.ceil(fed.participation * n))
    rng = np.random.default_rng([cfg.seed, 0x5C4ED])  # policies.make_policy's client sampling stream
    state = server.broadcast(0)
    last_trained: dict[int, int] = {}  # client -> version it last trained against
    trained_bank: dict[int, Any] = {}
    latest: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    curve, rounds_info = [], []
    for v in range(1, fed.rounds + 1):
        chosen = rng.choice(n, size=per_round, replace=False) if per_round < n else np.arange(n)
        updates = []
        for c in chosen:
            _, up = runners[c].train(state)
            last_trained[int(c)] = state.version
            p = state.prototypes
            trained_bank[int(c)] = (np.array(p.class_ids), np.array(p.vectors)) if p is not None and len(p) else None
            latest[int(c)] = (np.array(up.prototypes.class_ids), np.array(up.prototypes.vectors))
            updates.append(up)
        updates.sort(key=lambda u: u.client_id)  # ServerCore._step: a sync round in client order
        classes = [set(map(int, u.prototypes.class_ids)) for u in updates]
        rounds_info.append({"classes_uploaded": len(set().union(*classes)),
                            "uploaders_per_class": float(np.mean([sum(c in s for s in classes)
                                                                  for c in set().union(*classes)]))})
        server.aggregate(updates, [1.0] * len(updates), v)
        before, state = state, server.broadcast(v)
        rounds_info[-1]["drift"] = bank_drift(before.prototypes, state.prototypes)
        if v % eval_every == 0 or v == fed.rounds:
            res = [r.evaluate(state) for r in runners]
            nn = sum(r["n"] for r in res)
            curve.append({"version": v, "head": sum(r["head_correct"] for r in res) / nn,
                          "proto": sum(r["proto_correct"] for r in res) / nn})
    # the platform's inference bank: the broadcast bank, or only this round's classes with
    # algorithm.inference_memory round (the sync default of FedProto since issue 35)
    infer = state.prototypes
    if ROUND_IDS in state.extras:
        infer = subset(infer, state.extras[ROUND_IDS])
    bank = (np.array(infer.class_ids), np.array(infer.vectors))
    lat = latest_uniform_bank(latest, ds.num_classes)
    clients = []
    for c, r in enumerate(runners):
        plat = r.evaluate(state)  # the platform's own figures (and receive(): the model sees the final bank)
        row = score_client(r.model, r.test_x, r.test_y, r.train_x, r.train_y, bank, trained_bank.get(c), lat,
                           ds.num_classes)
        assert row["head"] == plat["head_correct"] and row["proto"] == plat["proto_correct"], (c, row, plat)
        row.update(client=c, updates=r.updates, train_n=len(r.train_y), batch_size=cfg.training.batch_size, since=(fed.rounds - last_trained[c] - 1) if c in last_trained else None)
        clients.append(row)
    return {"curve": curve, "rounds": rounds_info, "clients": clients, "bank_classes": len(bank[0]),
            "bank_margin": prototype_margin(bank[1])[1]}


def run_htfllib_model(cfg, eval_every: int) -> dict[str, Any]:
    """``bench/_htfllib.py``'s ``run_htfllib`` in its HtFLlib flavour: pooled figures per round."""
    import _htfllib as H

    r = H.run_htfllib(cfg, echo=lambda s: None, flavour="htfllib")
    curve = [{"version": i + 1, "head": h, "proto": p} for i, (h, p) in enumerate(zip(r.head_acc, r.proto_acc, strict=True))
             if (i + 1) % eval_every == 0 or i + 1 == len(r.head_acc)]
    return {"curve": curve, "rounds": [], "clients": []}


def run_htfllib_loop(cfg, eval_every: int) -> dict[str, Any]:
    """``bench/_htfllib.py``'s PFLlib-flavour round loop (``_PflLoop``: its clients,
    ``select_clients``, ``evaluate``, ``train``, ``proto_aggregation``, ``set_protos``), timing left
    out, with the bookkeeping this diagnosis needs; the same figures as ``run_htfllib(cfg,
    flavour="pfllib")``."""
    import _htfllib as H

    ds, part = workload(cfg)
    dev = torch.device("cpu")
    clients = H._clients(cfg, ds, part, dev)
    np_rng = np.random.RandomState(cfg.seed)
    torch.manual_seed(cfg.seed)
    n_join = max(1, int(len(clients) * cfg.federation.participation))
    global_protos = None
    last_trained: dict[int, int] = {}
    trained_bank: dict[int, Any] = {}
    counts = {c.id: 0 for c in clients}
    curve, rounds_info = [], []

    def as_bank(gp):
        if not gp:
            return None
        keys = sorted(k for k, v in gp.items() if not isinstance(v, list))
        return np.array(keys, np.int64), torch.stack([gp[k] for k in keys]).cpu().numpy()

    for rnd in range(cfg.federation.rounds):
        selected = [clients[i] for i in np_rng.choice(len(clients), n_join, replace=False)]
        H.evaluate(clients)  # kept: its loaders draw from torch's RNG, so the shuffles stay run_htfllib's
        for c in selected:
            trained_bank[c.id] = as_bank(c.global_protos)
            last_trained[c.id] = rnd
            c.train()
            counts[c.id] += 1
        before, global_protos = as_bank(global_protos), H.proto_aggregation([c.protos for c in selected])
        classes = [set(c.protos.keys()) for c in selected]
        rounds_info.append({"classes_uploaded": len(global_protos),
                            "uploaders_per_class": float(np.mean([sum(k in s for s in classes) for k in global_protos]))})
        rounds_info[-1]["drift"] = bank_drift(before, as_bank(global_protos))
        for c in clients:
            c.set_protos(global_protos)
        if (rnd + 1) % eval_every == 0 or rnd + 1 == cfg.federation.rounds:
            head, proto = H._accuracy(clients, None, global_protos)
            curve.append({"version": rnd + 1, "head": head, "proto": proto})
    bank = as_bank(global_protos)
    # a client with fewer training samples than a batch never trains there (drop_last=True): no prototypes
    lat = latest_uniform_bank({c.id: b for c in clients if (b := as_bank(c.protos)) is not None}, ds.num_classes)
    rows = []
    for c in clients:
        row = score_client(c.model, c.tx, c.ty, c.x, c.y, bank, trained_bank.get(c.id), lat, ds.num_classes)
        row.update(client=c.id, updates=counts[c.id], train_n=len(c.y), batch_size=c.batch_size,
                   since=(cfg.federation.rounds - last_trained[c.id] - 1) if c.id in last_trained else None)
        rows.append(row)
    return {"curve": curve, "rounds": rounds_info, "clients": rows, "bank_classes": len(bank[0]),
            "bank_margin": prototype_margin(bank[1])[1]}


def run_runtime(cfg, eval_every: int) -> dict[str, Any]:
    """The whole runtime (``run_experiment``: Ray actors, the virtual clock's asynchrony): the
    pooled and per-client-mean accuracies of its evaluations."""
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.tracking import metric_names as names

    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    curve = [{"version": int(h["version"]), "head": h[names.EVAL_HEAD_ACC], "proto": h.get(names.EVAL_PROTO_ACC),
              "head_mean": h.get(names.EVAL_HEAD_ACC_MEAN), "proto_mean": h.get(names.EVAL_PROTO_ACC_MEAN),
              "margin_mean": h.get(names.SERVER_PROTO_MARGIN_MEAN), "staleness_max": h.get(names.FEDERATION_STALENESS_MAX)}
             for h in result.history if h.get(names.EVAL_HEAD_ACC) is not None]
    return {"curve": curve, "rounds": [], "clients": []}


# ------------------------------------------------------------------------------------ summaries


def pooled(rows: list[dict], key: str) -> float:
    rs = [r for r in rows if r.get(key) is not None]
    n = sum(r["n"] for r in rs)
    return sum(r[key] for r in rs) / n if n else math.nan


def client_mean(rows: list[dict], key: str) -> float:
    rs = [r[key] / r["n"] for r in rows if r.get(key) is not None and r["n"] > 0]
    return float(np.mean(rs)) if rs else math.nan


def summarise(run: dict[str, Any]) -> dict[str, float]:
    rows = run["clients"]
    if not rows:  # a runtime run: its last evaluation's pooled figures
        last = run["curve"][-1]
        return {"head": last["head"], "proto": last["proto"], "head_client_mean": last.get("head_mean", math.nan),
                "proto_client_mean": last.get("proto_mean", math.nan), "bank_margin": last.get("margin_mean", math.nan),
                "staleness_max": max(c.get("staleness_max") or 0 for c in run["curve"])}
    s = {k: pooled(rows, k) for k in ("head", "proto", "head_held", "proto_held", "own", "trained", "trained_held",
                                      "latest", "latest_held")}
    s["proto_client_mean"] = client_mean(rows, "proto")
    s["head_client_mean"] = client_mean(rows, "head")
    for k in ("d_own_class", "d_nearest_other", "own_to_global", "feat_norm"):
        s[k] = float(np.nanmean([r.get(k, math.nan) for r in rows]))
    s["never_trained"] = sum(1 for r in rows if r["updates"] == 0)
    s["updates_mean"] = float(np.mean([r["updates"] for r in rows]))
    s["test_outside_held"] = sum(r["test_outside_held"] for r in rows) / sum(r["n"] for r in rows)
    s["classes_per_round"] = float(np.mean([r["classes_uploaded"] for r in run["rounds"]]))
    s["uploaders_per_class"] = float(np.mean([r["uploaders_per_class"] for r in run["rounds"]]))
    s["bank_classes"] = run["bank_classes"]
    s["bank_margin"] = run["bank_margin"]  # mean distance of a class vector to its nearest other one
    s["drift"] = float(np.nanmean([r["drift"] for r in run["rounds"][len(run["rounds"]) // 2:]]))  # second half
    s["small_clients"] = sum(1 for r in rows if r["train_n"] < r["batch_size"])
    return s


SINCE_BINS = [(0, 0), (1, 4), (5, 9), (10, 10_000)]
UPDATE_BINS = [(0, 0), (1, 5), (6, 8), (9, 11), (12, 10_000)]


def by_bin(rows: list[dict], field: str, bins) -> list[dict]:
    out = []
    for lo, hi in bins:
        rs = [r for r in rows if r[field] is not None and lo <= r[field] <= hi]
        out.append({"bin": f"{lo}" if lo == hi else (f"{lo}+" if hi >= 10_000 else f"{lo}-{hi}"), "clients": len(rs),
                    "head": pooled(rs, "head"), "proto": pooled(rs, "proto"), "own": pooled(rs, "own"),
                    "trained": pooled(rs, "trained")})
    return out


def pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def mean_std(vals: list[float], scale: float = 100.0, digits: int = 1) -> str:
    v = np.array([x for x in vals if x is not None and not math.isnan(x)], float)
    if not len(v):
        return "n/a"
    return f"{scale * v.mean():.{digits}f}" + (f" ± {scale * v.std():.{digits}f}" if len(v) > 1 else "")


def reference(variant: str) -> str:
    """What a variant's difference is measured against, in the same invocation set: the preset in
    sync mode (in process), or the preset as it ships for the runtime rows."""
    return "async" if VARIANTS[variant][0] == "runtime" else "preset"


def versus(results: dict[str, list[dict]], v: str) -> str:
    """Head and prototype accuracy minus the reference's, in points, mean over the seeds both have."""
    ref = reference(v)
    if ref not in results or v == ref:
        return "reference"
    mine, theirs = ({r["seed"]: r["summary"] for r in results[x]} for x in (v, ref))
    seeds = sorted(set(mine) & set(theirs))
    if not seeds:
        return "n/a"
    d = [100 * np.mean([mine[s][k] - theirs[s][k] for s in seeds]) for k in ("head", "proto")]
    return f"{d[0]:+.1f}, {d[1]:+.1f} (vs {ref}, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"


class _Summary(dict):
    """A run's summary; a figure a runtime run does not have reads NaN."""

    def __missing__(self, key):
        return math.nan


def _num(vals: list[float]) -> str:
    v = [x for x in vals if not math.isnan(x)]
    return f"{np.mean(v):.1f}" if v else "n/a"


def tables(results: dict[str, list[dict]]) -> str:
    """Markdown: accuracies per variant (mean ± std over seeds), then the per-client breakdown."""
    md = ["| variant | loop | head | proto (platform rule) | head, proto vs reference (points) | proto, per-client mean | proto, held classes only "
          "| head, held classes only | own prototypes | bank last trained against | bank of every client's latest upload (post hoc, unweighted) "
          "| local updates per client | never trained |",
          "|" + "---|" * 13]
    for v, runs in results.items():
        ss = [_Summary(r["summary"]) for r in runs]
        md.append(f"| {v} | {VARIANTS[v][0]} | {mean_std([s['head'] for s in ss])} | {mean_std([s['proto'] for s in ss])} | "
                  f"{versus(results, v)} | "
                  f"{mean_std([s['proto_client_mean'] for s in ss])} | {mean_std([s['proto_held'] for s in ss])} | "
                  f"{mean_std([s['head_held'] for s in ss])} | {mean_std([s['own'] for s in ss])} | "
                  f"{mean_std([s['trained'] for s in ss])} | {mean_std([s['latest'] for s in ss])} | "
                  f"{_num([s['updates_mean'] for s in ss])} | {_num([s['never_trained'] for s in ss])} |")
    md += ["", "| variant | classes uploaded per round | uploaders per class per round | bank classes at the end "
           "| bank margin (mean distance to the nearest other class vector) | a class vector's move per version (2nd half) | d(feature, own class vector) | d(feature, nearest other vector) "
           "| d(own class mean, global vector) | feature norm | test samples of classes the client does not train on "
           "| clients with fewer training samples than a batch |",
           "|" + "---|" * 12]
    for v, runs in results.items():
        if not runs[0]["clients"]:
            continue
        ss = [r["summary"] for r in runs]
        md.append(f"| {v} | {np.mean([s['classes_per_round'] for s in ss]):.1f} | "
                  f"{np.mean([s['uploaders_per_class'] for s in ss]):.1f} | {np.mean([s['bank_classes'] for s in ss]):.1f} | "
                  f"{np.mean([s['bank_margin'] for s in ss]):.2f} | {np.mean([s['drift'] for s in ss]):.2f} | {np.mean([s['d_own_class'] for s in ss]):.2f} | {np.mean([s['d_nearest_other'] for s in ss]):.2f} | "
                  f"{np.mean([s['own_to_global'] for s in ss]):.2f} | {np.mean([s['feat_norm'] for s in ss]):.2f} | "
                  f"{pct(float(np.mean([s['test_outside_held'] for s in ss])))} % | {np.mean([s['small_clients'] for s in ss]):.1f} |")
    for field, bins, title in (("since", SINCE_BINS, "versions since the client's last update"),
                               ("updates", UPDATE_BINS, "local updates the client made")):
        for v in ("preset", "htfllib"):
            if v not in results:
                continue
            rows = [row for r in results[v] for row in r["clients"]]
            md += ["", f"{v} (all seeds pooled), by {title}:", "",
                   "| " + title + " | clients | head | proto | own prototypes | bank last trained against |", "|---|---|---|---|---|---|"]
            for b in by_bin(rows, field, bins):
                md.append(f"| {b['bin']} | {b['clients']} | {pct(b['head'])} | {pct(b['proto'])} | {pct(b['own'])} | "
                          f"{pct(b['trained'])} |")
    return "\n".join(md)


def report(results: dict[str, list[dict]], rounds: int) -> str:
    """The header (workload, variants, seeds) and the tables."""
    lines = [f"{PRESET}, {rounds * 10} local updates per run: loop `platform` = sync mode in process ({rounds} rounds "
             f"of 10 sampled clients), `pfllib` / `htfllib` = bench/_htfllib.py's loop in either flavour on the same "
             f"setting (participation 0.2: select_clients), `runtime` = the whole "
             f"runtime with Ray (async on the virtual clock, {2 * rounds} versions of 5 updates). Accuracies in % of "
             "every client's test split at the last version, pooled over clients unless said; mean ± std over seeds.", ""]
    lines += [f"- `{v}` ({VARIANTS[v][0]}, seeds {', '.join(str(r['seed']) for r in runs)}): {VARIANTS[v][2]}"
              for v, runs in results.items()]
    return "\n".join(lines) + "\n\n" + tables(results)


def _rounded(obj):
    if isinstance(obj, float):
        return obj if not math.isfinite(obj) else float(f"{obj:.5g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def dump_json(data: dict) -> str:
    """One line per run (floats to 5 significant digits): the per-client rows make it large."""
    head = {k: v for k, v in data.items() if k != "runs"}
    runs = ",\n".join(json.dumps(_rounded(r), separators=(",", ":")) for r in data["runs"])
    return json.dumps(head, indent=1)[:-2] + ',\n "runs": [\n' + runs + "\n]}\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=40, help="sync rounds (40 x 10 clients = async_vs_sync's 400 updates)")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   default=[v for v, (loop, _, _) in VARIANTS.items() if loop in ("platform", "pfllib")],
                   help="default: the variants with a per-client breakdown (name the others: the runtime ones start Ray)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the box is shared)")
    p.add_argument("--out", help="write OUT.json and OUT.md")
    p.add_argument("--append", action="store_true", help="keep OUT.json's runs of the variants not run now, and "
                   "write the tables of all")
    p.add_argument("--render", action="store_true", help="no runs: rewrite OUT.md (and OUT.json's variant notes) "
                   "from OUT.json")
    args = p.parse_args()
    if args.render:
        out = Path(args.out)
        data = json.loads(out.with_suffix(".json").read_text())
        results: dict[str, list[dict]] = {}
        for r in data["runs"]:
            results.setdefault(r["variant"], []).append(r)
        results = {v: sorted(results[v], key=lambda r: r["seed"]) for v in VARIANTS if v in results}
        data["variants"] = {v: VARIANTS[v][2] for v in results}
        out.with_suffix(".json").write_text(dump_json(data))
        out.with_suffix(".md").write_text(report(results, args.rounds) + "\n")
        return 0
    torch.set_num_threads(args.threads)
    configs = {(v, seed): make_config(v, seed, args.rounds, args.set, args.eval_every)  # bad --set: refused first
               for v in args.variants for seed in args.seeds}
    results = {}
    invocations = [{k: v for k, v in vars(args).items()}]
    if args.append and args.out and Path(args.out).with_suffix(".json").exists():
        old = json.loads(Path(args.out).with_suffix(".json").read_text())
        invocations = (old["args"] if isinstance(old["args"], list) else [old["args"]]) + invocations
        for r in old["runs"]:
            if r["variant"] not in args.variants:
                results.setdefault(r["variant"], []).append(r)
    loops = {"platform": run_platform, "pfllib": run_htfllib_loop, "htfllib": run_htfllib_model, "runtime": run_runtime}
    t0 = time.perf_counter()
    for v in args.variants:
        for seed in args.seeds:
            cfg = configs[(v, seed)]
            started = time.perf_counter()
            run = loops[VARIANTS[v][0]](cfg, args.eval_every)
            run["summary"] = summarise(run)
            run.update(variant=v, seed=seed, seconds=time.perf_counter() - started)
            results.setdefault(v, []).append(run)
            s = _Summary(run["summary"])
            print(f"[{time.perf_counter() - t0:5.0f}s] {v} seed {seed}: head {pct(s['head'])}, proto {pct(s['proto'])}, "
                  f"proto held {pct(s['proto_held'])}, own {pct(s['own'])}, trained-against {pct(s['trained'])} "
                  f"({run['seconds']:.0f}s)", flush=True)
    results = {v: sorted(results[v], key=lambda r: r["seed"]) for v in VARIANTS if v in results}
    md = report(results, args.rounds)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(dump_json(
            {"args": invocations,
             "variants": {v: VARIANTS[v][2] for v in results},
             "runs": [{k: r[k] for k in ("variant", "seed", "seconds", "summary", "curve", "rounds", "clients")}
                      for runs in results.values() for r in runs]}))
        out.with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
