"""Aten ops and host syncs per optimizer step of ``resources.batch_clients``: the batched (vmapped)
path against the per-client path times the number of clients, counted on the CPU (no GPU needed).

At batch 10 the zoo's models are launch-bound on a GPU, so what a batched step costs there is the
number of ops it issues (each op one or more kernel launches) and the host syncs that stall the
launch queue; both are device-independent and counted here with a ``TorchDispatchMode`` (what
reaches the kernels, after vmap's batching rules: an op that falls back to vmap's per-slice loop
shows as one op per client, and torch's fallback warning is recorded too). Columns:

* ``ops``: every aten op dispatched; ``kernels``: the ops that are not views or metadata-only
  (``detach``, ``empty``...): the ones that launch work on a GPU;
* ``syncs``: host reads of device data: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``,
  ``float(t)``) and ``Tensor.tolist``; ``uploads``: tensors built from host data
  (``torch.tensor(list)``: a host->device copy on a GPU).

Per architecture group (one batched group, N clients): ``per-client xN`` is the per-client path's
count per step of one client times N (what N clients stepping one after another issue for one step
each), ``batched`` the batched path's count per group step. The ``steps`` column gives the steps
each path took in the round: per-client steps are one client's each, batched ones a whole
group's, so ``seq steps / batched steps`` bounds the batched path's gain on a launch-bound device
(the longest client's steps are sequential; a trailing batch of another size steps apart). The
distinct (clients, batch size) shapes of the batched steps are listed too: on a GPU each is a new
set of kernel shapes (cuDNN execution plans for every convolution), built the first time it occurs.

The per-client path on the CPU uses ``optim.LeanSGD`` (one op per parameter); on a GPU the runtime
uses ``torch.optim``'s foreach kernels, so its optimizer issues fewer ops there than counted here.

    PYTHONPATH=. .venv/bin/python bench/batched_ops.py --group HtFE1
    PYTHONPATH=. .venv/bin/python bench/batched_ops.py --group HtFE8 --clients 16 --samples 800
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

_FREE = {"detach", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
         "_local_scalar_dense", "alias", "_unsafe_view", "set_", "resize_", "_to_copy_noop"}


class Counter(TorchDispatchMode):
    """Counts the aten ops that reach the kernels, by the tag of the work in progress."""

    def __init__(self):
        super().__init__()
        self.tag = None
        self.ops: collections.Counter = collections.Counter()  # (tag, kind) -> count
        self.names: dict = collections.defaultdict(collections.Counter)  # tag -> op name -> count
        self.drawing = False  # inside TrainBatchIterator.epoch
        self.shapes: dict = collections.defaultdict(set)  # tag -> {(clients, batch size)} of the group steps

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tag is None:
            return out
        if self.drawing:  # drawing batches from a client's data (on the host in a GPU run too)
            self.ops[self.tag, "host"] += 1
            return out
        name = func._schema.name.split("::")[-1]
        self.ops[self.tag, "ops"] += 1
        self.names[self.tag][str(func)] += 1
        if not func.is_view and name not in _FREE:
            self.ops[self.tag, "kernels"] += 1
        if name == "_local_scalar_dense":
            self.ops[self.tag, "syncs"] += 1
        if name == "lift_fresh":
            self.ops[self.tag, "uploads"] += 1
        return out

    def bump(self, kind: str, n: int = 1) -> None:
        if self.tag is not None:
            self.ops[self.tag, kind] += n


@contextlib.contextmanager
def instrumented(counter: Counter):
    """Tag the work by architecture and count steps and ``tolist`` reads while it runs."""
    from rayfed_proto.algorithms import base
    from rayfed_proto.runtime import client_core as core
    from rayfed_proto.training import batched

    saved = (core.ClientRunner.train, batched.train_together, base.StepTally.step,
             batched.BatchedUpdate._step_group, torch.Tensor.tolist, base.TrainBatchIterator.epoch)

    def epoch(self):
        batches = saved[5](self)
        while True:
            counter.drawing = True
            try:
                xb, yb = next(batches)
            except StopIteration:
                return
            finally:
                counter.drawing = False
            yield xb, yb

    def runner_train(self, state):
        counter.tag = ("seq", self.model.arch)
        try:
            return saved[0](self, state)
        finally:
            counter.tag = None

    def train_together(members, epochs, device):
        counter.tag = ("batched", members[0].model.arch)
        counter.bump("clients", len(members))
        try:
            return saved[1](members, epochs, device)
        finally:
            counter.tag = None

    def tally_step(self, *a, **k):
        counter.bump("steps")
        return saved[2](self, *a, **k)

    def step_group(self, group):
        counter.bump("steps")
        if counter.tag is not None:  # (clients, batch size): each a new set of kernel shapes (cuDNN plans)
            counter.shapes[counter.tag].add((len(group), len(group[0][1][1])))
        return saved[3](self, group)

    def tolist(self):
        counter.bump("syncs")
        return saved[4](self)

    core.ClientRunner.train, batched.train_together, base.StepTally.step = runner_train, train_together, tally_step
    batched.BatchedUpdate._step_group, torch.Tensor.tolist = step_group, tolist
    base.TrainBatchIterator.epoch = epoch
    try:
        yield
    finally:
        (core.ClientRunner.train, batched.train_together, base.StepTally.step,
         batched.BatchedUpdate._step_group, torch.Tensor.tolist, base.TrainBatchIterator.epoch) = saved


def round_counts(args, cfg, ds, part, mode: str) -> tuple[Counter, list[str]]:
    from rayfed_proto.messages import GlobalState
    from rayfed_proto.runtime.client_core import ClientHost

    cfg = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"batch_clients": mode})})
    host = ClientHost(cfg, ds, list(part.clients), torch.device("cpu"))
    state = GlobalState(version=0)
    for _ in range(args.warmup):
        host.train_group(host.client_ids, state)
    counter = Counter()
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught, instrumented(counter), counter:
            warnings.simplefilter("always")
            host.train_group(host.client_ids, state)
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    fallbacks = sorted({str(w.message).split("\n")[0] for w in caught if "fall" in str(w.message).lower()})
    return counter, fallbacks


def main() -> None:
    from batched_clients import build

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="HtFE1")
    ap.add_argument("--method", choices=["fedproto", "fedavg"], default="fedproto")
    ap.add_argument("--clients", type=int, default=0, help="default: 6 for HtFE1, 2 per architecture otherwise")
    ap.add_argument("--samples", type=int, default=0, help="default: 200 per client")
    ap.add_argument("--warmup", type=int, default=0, help="rounds before the counted one")
    ap.add_argument("--top", type=int, default=0, help="also list the TOP most frequent batched ops per group")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    from rayfed_proto.models.zoo import MODEL_GROUPS

    archs = list(MODEL_GROUPS.get(args.group))
    if not args.clients:
        args.clients = 6 if args.group == "HtFE1" else 2 * len(archs)
    args.samples = args.samples or 200 * args.clients
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg, ds, part = build(args)
    seq, _ = round_counts(args, cfg, ds, part, "off")
    bat, fallbacks = round_counts(args, cfg, ds, part, "on")
    kinds = ("ops", "kernels", "syncs", "uploads", "host")
    rows = []
    print(f"batched_ops: {args.group}, {args.clients} clients, {args.method}, {args.samples} samples, batch 10, "
          f"one round (torch {torch.__version__}, CPU)")
    print(f"{'arch':<13}{'N':>3} {'path':<14}{'steps':>6}" + "".join(f"{k + '/step':>15}" for k in kinds))
    for (_, arch) in sorted({t for t, _ in bat.ops if t[0] == "batched"}, key=lambda t: t[1]):
        n = bat.ops[("batched", arch), "clients"]
        s_steps, b_steps = seq.ops[("seq", arch), "steps"], bat.ops[("batched", arch), "steps"]
        row = {"arch": arch, "clients": n, "seq_steps": s_steps, "batched_steps": b_steps}
        for path, c, tag, steps, mult in (("per-client xN", seq, ("seq", arch), s_steps, n),
                                          ("batched", bat, ("batched", arch), b_steps, 1)):
            vals = [mult * c.ops[tag, k] / max(steps, 1) for k in kinds]
            row[path] = dict(zip(kinds, [round(v, 1) for v in vals], strict=True))
            print(f"{arch:<13}{n:>3} {path:<14}{steps:>6}" + "".join(f"{v:>15.1f}" for v in vals))
        row["batched_shapes"] = sorted(bat.shapes[("batched", arch)])
        print(f"{'':<17}batched step shapes (clients, batch): {len(row['batched_shapes'])}: "
              + " ".join(f"{m}x{b}" for m, b in row["batched_shapes"]))
        rows.append(row)
        if args.top:
            for name, cnt in bat.names[("batched", arch)].most_common(args.top):
                print(f"{'':<17}{cnt / max(b_steps, 1):>8.1f}/step  {name}")
    alone = sorted({t[1] for t, _ in bat.ops if t[0] == "seq"})
    if alone:
        print(f"not batched (each client alone in both modes): {', '.join(alone)}")
    print("vmap fallbacks: " + ("; ".join(fallbacks) if fallbacks else "none"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"group": args.group, "clients": args.clients, "samples": args.samples, "rows": rows,
             "alone": alone, "fallbacks": fallbacks}, indent=1))


if __name__ == "__main__":
    main()
