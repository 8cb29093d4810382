"""The reference every speed figure is divided by: a plain, sequential, single-process PyTorch
federated loop, the way HtFLlib/PFLlib-style simulators run one (each client in turn trains,
computes its prototypes, is evaluated; then the server aggregates), with torch's default thread
count and nothing of this platform's runtime (no Ray, no guarded step, no checkpoints, no MLflow).

It runs the same workload as the platform: the same partition, the same initial
models (same seeds), the same batch order (the same seeded permutation per client), the same
loss (CE, plus lambda times the mean squared distance to the global prototype for FedProto) and
the same SGD, so its accuracy is the one the platform must match. Prototypes are collected from
the training forward passes, as FedProto's reference client does (vectorised here, where the
reference appends one feature at a time: the fairer, faster reference).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rayfed_proto.config import ExperimentConfig
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.models import build_client_model


@dataclass
class PlainResult:
    startup_s: float  # from the call to the first client update done (imports excluded)
    round_s: list[float] = field(default_factory=list)
    head_acc: list[float] = field(default_factory=list)
    proto_acc: list[float] = field(default_factory=list)

    def median_round(self, skip_first: bool = True) -> float:
        rounds = self.round_s[1:] if skip_first and len(self.round_s) > 1 else self.round_s
        return statistics.median(rounds)


def _batches(n: int, batch_size: int, gen: torch.Generator):
    order = torch.randperm(n, generator=gen)
    chunks = list(torch.split(order, batch_size))
    if len(chunks) > 1 and len(chunks[-1]) < batch_size:  # as the platform: an incomplete last batch joins the previous
        last = chunks.pop()
        chunks[-1] = torch.cat([chunks[-1], last])
    return chunks


def run_plain(cfg: ExperimentConfig, device: str = "cpu", echo=print, channels_last: bool = False) -> PlainResult:
    """The plain loop over ``cfg``'s workload; its models are contiguous (NCHW), as HtFLlib's,
    unless ``channels_last`` (the layout the platform uses on CPU by default)."""
    t0 = time.perf_counter()
    layout = torch.channels_last if channels_last else torch.contiguous_format
    dev = torch.device(device)
    method = cfg.algorithm.name
    lam = float(getattr(cfg.algorithm_options(), "lam", 0.0))
    ds = load_dataset(cfg.data, cfg.seed)
    # the driver's partition exactly (FedAvg holds out a global test set by default: the clients get the rest)
    part = make_partition(ds, cfg.data.partition, cfg.federation.num_clients, cfg.seed, cfg.data.test_fraction,
                          global_test_fraction=cfg.data.global_test_fraction, public_size=cfg.data.public_size,
                          long_tail_ratio=cfg.data.long_tail_ratio)
    m, t = cfg.model, cfg.training
    clients = []
    for split in part.clients:
        torch.manual_seed(cfg.seed * 100_003 + split.client_id)  # the platform's initialisation (ClientRunner)
        model = build_client_model(m.group, split.client_id, ds.channels, ds.image_size, ds.num_classes, m.feature_dim,
                                   m.projector, m.normalize_features, shared_seed=cfg.seed if m.init == "shared" else None,
                                   ).to(dev, memory_format=layout)
        opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        x, y = ds.tensors(split.train_idx)
        tx, ty = ds.tensors(split.test_idx)
        clients.append({"model": model, "opt": opt, "x": x, "y": y, "tx": tx, "ty": ty,
                        "gen": torch.Generator().manual_seed(cfg.seed * 7919 + split.client_id)})
    global_weights = None
    if method == "fedavg":  # the platform server's initial global model: the same seed, the same builder
        from rayfed_proto.runtime.core import federation_spec

        torch.manual_seed(cfg.seed)
        init = federation_spec(cfg, ds.num_classes, ds.channels, ds.image_size).build_model()
        global_weights = {k: v.detach().clone().to(dev) for k, v in init.state_dict().items()}
    bank = None  # FedProto: (C, D) global prototypes and a (C,) mask
    out = PlainResult(startup_s=float("nan"))
    for rnd in range(cfg.federation.rounds):
        r0 = time.perf_counter()
        uploads = []
        for i, c in enumerate(clients):
            model, opt = c["model"], c["opt"]
            if global_weights is not None:
                model.load_state_dict(global_weights)
            model.train()
            sums = torch.zeros(ds.num_classes, m.feature_dim, device=dev)
            counts = torch.zeros(ds.num_classes, device=dev)
            for _ in range(t.local_epochs):
                for idx in _batches(len(c["y"]), t.batch_size, c["gen"]):
                    xb, yb = c["x"][idx].to(dev), c["y"][idx].to(dev)
                    opt.zero_grad()
                    feats, logits = model.forward_features(xb)
                    loss = F.cross_entropy(logits, yb)
                    if bank is not None:
                        sel = bank[1][yb]
                        if sel.any():
                            loss = loss + lam * F.mse_loss(feats[sel], bank[0][yb[sel]])
                    loss.backward()
                    opt.step()
                    if method != "fedavg":
                        sums.index_add_(0, yb, feats.detach())
                        counts.index_add_(0, yb, torch.ones(len(yb), device=dev))
            if rnd == 0 and i == 0:
                out.startup_s = time.perf_counter() - t0
            if method == "fedavg":
                uploads.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, len(c["y"])))
            else:
                uploads.append((sums, counts))
        # server
        if method == "fedavg":
            total = sum(n for _, n in uploads)
            global_weights = {k: sum(w[k].float() * (n / total) for w, n in uploads).to(uploads[0][0][k].dtype)
                              for k in uploads[0][0]}
        else:  # per-class mean over the clients holding the class (FedProto's server, uniform over clients)
            held = torch.stack([cnt > 0 for _, cnt in uploads])
            means = torch.stack([s / cnt.clamp(min=1).unsqueeze(1) for s, cnt in uploads])
            k = held.sum(0)
            proto = (means * held.unsqueeze(2)).sum(0) / k.clamp(min=1).unsqueeze(1)
            bank = (proto, k > 0)
        # evaluation of every client on its test split
        head = proto_correct = n = 0
        with torch.no_grad():
            for c in clients:
                model = c["model"]
                if global_weights is not None:
                    model.load_state_dict(global_weights)
                model.eval()
                feats, logits = model.forward_features(c["tx"].to(dev))
                ty = c["ty"].to(dev)
                head += int((logits.argmax(1) == ty).sum())
                if bank is not None:
                    d = torch.cdist(feats, bank[0])
                    d[:, ~bank[1]] = float("inf")
                    proto_correct += int((d.argmin(1) == ty).sum())
                n += len(ty)
        out.round_s.append(time.perf_counter() - r0)
        out.head_acc.append(head / n)
        out.proto_acc.append(proto_correct / n if bank is not None else float("nan"))
        echo(f"  plain round {rnd + 1}: {out.round_s[-1]:.1f} s, head acc {out.head_acc[-1]:.4f}")
    return out


def write_results(rows: list[dict], cols: list[str], args) -> None:
    """Print ``rows`` as a markdown table of ``cols``; with ``args.out``, also OUT.json (every
    field, and the arguments) and OUT.md."""
    import json

    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    print("\n".join(md))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
