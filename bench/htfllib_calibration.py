"""Calibrate ``bench/_htfllib.py``'s model of the HtFLlib FedProto loop against the real HtFLlib
code, on ``bench/round_time.py``'s FedProto workload, the rounds interleaved in one process.

The real code is not part of this repository: point ``--htfllib`` at a checkout of
github.com/TsingZ0/HtFLlib (its ``system/flcore/servers/serverbase.py``, ``serverproto.py``,
``system/flcore/clients/clientbase.py``, ``clientproto.py`` and ``system/utils/data_utils.py``
are imported and run unchanged). Three things are supplied from here, none inside the timed work:

- the data: ``round_time.py``'s partition (same seed, clients, splits) written into the
  checkout's ``dataset/<name>/{train,test}/<id>.npz`` as HtFLlib's ``save_file`` writes them;
- the model: ``flcore.trainmodel.models.BaseHeadSplit`` is replaced (in ``sys.modules``) by a
  shim that builds this repo's client model with ``bench/_htfllib.py``'s seeds, ``.base`` =
  backbone + projection and ``.head`` = head, so both loops run the same network from the same
  weights (HtFLlib's own FedAvgCNN has an ``AdaptiveAvgPool1d`` where ours has the 512x512
  projection, and ``main.py`` has no 1-channel model family);
- ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: HtFLlib's ``load_item`` calls a bare ``torch.load`` of
  whole modules, which torch >= 2.6 refuses by default; ``h5py`` is stubbed if missing (it is only
  used by ``save_results``, after training).

One real round is the body of ``serverproto.py`` ``FedProto.train``'s loop, called as it is
there and timed as its ``Budget`` is (``time.time()`` around ``select_clients``, ``evaluate()``,
every selected client's ``train()`` and ``receive_protos()``). Each round, the real round and one
round of each model flavour run back to back, their order rotated from round to round; the
calibration is the median over rounds 2..R of the per-round ratio model / real (round 1 has no
prototypes in either). The real loop's test accuracy (``rs_test_acc``) and the htfllib
flavour's ``evaluate()`` must agree: same batches (``shuffle=False``), same initial weights.

    .venv/bin/python bench/htfllib_calibration.py --htfllib /tmp/htfllib_real --rounds 6 --threads 1 \\
        --out bench/results/htfllib_calibration   # the 2026-11-26 headline run

(the committed JSON also holds, under ``supporting_runs``, four more runs of this script, and
``real_code``: the commits of the files run; both were added by hand after the runs.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
BENCH = Path(__file__).resolve().parent  # bench/: _htfllib, _plain
sys.path.insert(0, str(BENCH))

import _htfllib as H  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from round_time import workload  # noqa: E402
from torch import nn  # noqa: E402

from rayfed_proto.config import build_config  # noqa: E402
from rayfed_proto.models import build_client_model  # noqa: E402


def write_partition(cfg, root: Path) -> None:
    """``round_time.py``'s partition as HtFLlib's dataset files (``dataset_utils.py`` ``save_file``)."""
    ds, part = H._workload(cfg)
    for split in part.clients:
        for sub, idx in (("train", split.train_idx), ("test", split.test_idx)):
            (root / sub).mkdir(parents=True, exist_ok=True)
            x, y = ds.tensors(idx)
            with open(root / sub / f"{split.client_id}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": x.numpy(), "y": y.numpy()})


def install_shims(cfg, ds_channels: int, image_size: int, num_classes: int) -> None:
    m = cfg.model

    class BaseHeadSplit(nn.Module):
        """SHIM for HtFLlib's ``BaseHeadSplit(args, cid)``: our client model, _htfllib.py's seeds."""

        def __init__(self, args, cid=0, feature_dim=None, is_global=False):
            super().__init__()
            torch.manual_seed(cfg.seed * 100_003 + cid)
            model = build_client_model(m.group, cid, ds_channels, image_size, num_classes, m.feature_dim, m.projector,
                                       m.normalize_features, shared_seed=cfg.seed if m.init == "shared" else None)
            assert not model.normalize
            self.base = nn.Sequential(model.backbone, model.projection)
            self.head = model.head

        def forward(self, x):
            return self.head(self.base(x))

    import flcore.trainmodel  # noqa: F401  (namespace or regular package of the checkout)

    shim = types.ModuleType("flcore.trainmodel.models")
    BaseHeadSplit.__module__, BaseHeadSplit.__qualname__ = shim.__name__, "BaseHeadSplit"  # picklable
    shim.BaseHeadSplit = BaseHeadSplit
    sys.modules[shim.__name__] = shim
    sys.modules["flcore.trainmodel"].models = shim
    try:
        import h5py  # noqa: F401
    except ImportError:
        stub = types.ModuleType("h5py")
        stub.File = None  # save_results is never called here
        sys.modules["h5py"] = stub


def real_server(cfg, dataset: str, log):
    from flcore.servers.serverproto import FedProto  # the real code

    t = cfg.training
    args = argparse.Namespace(  # main.py's defaults, the workload's values
        goal="test", device="cpu", device_id="0", dataset=dataset, num_classes=10, model_family="HtFE1-rayfed",
        models=["shim"], batch_size=t.batch_size, local_learning_rate=t.lr, learning_rate_decay=False,
        learning_rate_decay_gamma=0.99, global_rounds=cfg.federation.rounds, top_cnt=100,
        local_epochs=t.local_epochs, algorithm="FedProto", join_ratio=cfg.federation.participation,
        random_join_ratio=False, num_clients=cfg.federation.num_clients, prev=0, times=1, eval_gap=1,
        save_folder_name="temp", auto_break=False, feature_dim=cfg.model.feature_dim, client_drop_rate=0.0,
        train_slow_rate=0.0, send_slow_rate=0.0, time_select=False, time_threthold=10000,
        lamda=float(cfg.algorithm_options().lam))
    with contextlib.redirect_stdout(log):
        return FedProto(args, 0)


def real_round(server, i: int, log) -> float:
    """One iteration of serverproto.py ``FedProto.train``'s loop (its auto_break check is off)."""
    with contextlib.redirect_stdout(log):
        s_t = time.time()
        server.selected_clients = server.select_clients()
        if i % server.eval_gap == 0:
            print(f"\n-------------Round number: {i}-------------")
            print("\nEvaluate personalized models")
            server.evaluate()
        for client in server.selected_clients:
            client.train()
        server.receive_protos()
        server.Budget.append(time.time() - s_t)
        print("-" * 50, server.Budget[-1])
    return server.Budget[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--htfllib", type=Path, required=True, help="root of an HtFLlib checkout (holds system/)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples", type=int, default=70_000)
    ap.add_argument("--flavours", nargs="+", default=["htfllib", "pfllib"], choices=H.FLAVOURS)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's default, as main.py)")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = argparse.Namespace(samples=args.samples, clients=args.clients, rounds=args.rounds, device="cpu", set=[])
    cfg = build_config({}, workload(ns, "fedproto", Path(tempfile.mkdtemp())))
    name = f"rfp_synth_{args.samples}_{args.clients}"
    root = args.htfllib.resolve()
    data_dir = root / "dataset" / name
    if not (data_dir / "test" / f"{args.clients - 1}.npz").exists():
        print(f"writing the partition to {data_dir} ...", flush=True)
        write_partition(cfg, data_dir)
    sys.path.insert(0, str(root / "system"))
    os.chdir(root / "system")  # data_utils reads '../dataset/<name>/...', items go to system/temp/...
    ds, _ = H._workload(cfg)
    install_shims(cfg, ds.channels, ds.image_size, ds.num_classes)
    log = open(root / f"calibration_{name}.log", "w")  # noqa: SIM115
    loops = {"real": real_server(cfg, name, log)}
    for f in args.flavours:
        loops[f] = H.make_loop(cfg, "cpu", f)
    names = list(loops)
    times = {k: [] for k in names}  # wall: Budget / the model's round time
    cpu = {k: [] for k in names}  # this process's CPU time over the same span (all threads): less sensitive to load
    acc = {"real_rs_test_acc": [], "htfllib_eval_acc": []}
    load = []
    print(f"torch threads {torch.get_num_threads()}; loops {names}", flush=True)
    try:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                load.append(os.getloadavg()[0])
                c0 = time.process_time()
                times[k].append(real_round(loops[k], r, log) if k == "real" else loops[k].round())
                cpu[k].append(time.process_time() - c0)
            acc["real_rs_test_acc"].append(loops["real"].rs_test_acc[-1])
            if "htfllib" in loops:
                acc["htfllib_eval_acc"].append(loops["htfllib"].eval_acc)
            print(f"round {r + 1} (order {order}): " + ", ".join(f"{k} {times[k][-1]:.1f} s (cpu {cpu[k][-1]:.1f})"
                                                                  for k in names)
                  + f"; load {load[-1]:.1f}", flush=True)
    finally:
        shutil.rmtree(loops["real"].save_folder_name, ignore_errors=True)
        for k in args.flavours:
            loops[k].close()
    res = {"method": "fedproto", "measured": time.strftime("%Y-%m-%d"),
           "args": {k: str(v) for k, v in vars(args).items()}, "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "rounds_s": {k: [round(x, 2) for x in v] for k, v in times.items()},
           "load_avg_1min": [round(x, 2) for x in load], "accuracy": acc}
    res["cpu_s"] = {k: [round(x, 2) for x in v] for k, v in cpu.items()}
    for f in args.flavours:
        for what, d in (("wall", times), ("cpu", cpu)):
            per = [m / t for m, t in zip(d[f][1:], d["real"][1:], strict=True)]
            res[f"{f}_model_over_real_{what}"] = c = {
                "per_round": [round(x, 3) for x in per], "median_of_ratios": round(statistics.median(per), 3),
                "ratio_of_medians": round(statistics.median(d[f][1:]) / statistics.median(d["real"][1:]), 3)}
            print(f"{f} model / real, {what} (rounds 2..{args.rounds}): per round {c['per_round']}, median "
                  f"{c['median_of_ratios']}, ratio of medians {c['ratio_of_medians']}", flush=True)
    print(f"real rs_test_acc {acc['real_rs_test_acc']}\nhtfllib model evaluate {acc['htfllib_eval_acc']}")
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
