"""The driver's checkpoint work when a large run resumes, timed phase by phase (issue 39, item 3).

Writes (once, with the real writer, ``CheckpointStore.save``) a checkpoint shaped as the
10,000-client run's (bench/scale_clients.py) at its middle version: ``--states`` client states of
about 3.3 MiB each (the FedAvg CNN on 28x28 grey images, its optimizer, the
RNG states; 1,000 states: 3.3 GiB), then times what a resume does with
it in the driver, each phase apart:

* ``find``: ``CheckpointStore.latest()``, the newest complete checkpoint checked against its manifest;
* ``scan``: ``Checkpoint.check_loadable()``, every file scanned for code, the server and driver states loaded;
* ``read``: every client state read as the restore reads it (``Checkpoint.client_state``).

The first two run before Ray starts; the third while the workers are restored. The page cache is
dropped between phases when possible (``--cold``, needs root), else the files are as the writer
left them (mostly cached).

    .venv/bin/python bench/checkpoint_startup.py --dir /tmp/ckpt-bench --states 1000
    .venv/bin/python bench/checkpoint_startup.py --dir /tmp/ckpt-bench --states 1000 --keep-files   # reuse next time
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from rayfed_proto.models.zoo import build_model
from rayfed_proto.runtime.checkpoint import CheckpointStore


def client_state(seed: int) -> dict:
    """A state as ``ClientRunner.state_dict`` returns it for the scale run's clients (FedProto, HtFE1, 62 classes)."""
    torch.manual_seed(seed)
    model = build_model("cnn", 1, 28, 62)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # training.momentum=0: no buffers
    loss = model(torch.randn(4, 1, 28, 28))
    loss = (loss[0] if isinstance(loss, tuple) else loss).float().sum()
    loss.backward()
    opt.step()
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict(),
            "algorithm": {"version": 50},  # a FedProto client's own state
            "batch_rng": torch.Generator().manual_seed(seed).get_state(), "last_loss": 1.5,
            "torch_rng": torch.get_rng_state(), "cuda_rng": None, "updates": 1}


def write(folder: Path, states: int) -> Path:
    store = CheckpointStore(folder, keep=1)
    base = client_state(0)

    def clients():
        for c in range(states):  # each its own tensors (the same values: the bytes on disk are what matters)
            yield c * 10, {**base, "model": {k: v.clone() for k, v in base["model"].items()}, "updates": c}

    server = {"version": 50, "modules": {"head": torch.randn(62, 512)}, "torch_rng": torch.get_rng_state()}
    driver = {"scheduler": {"version": 50, "rng": np.random.default_rng(0).bit_generator.state},
              "history": [{"version": v, "eval/head_acc": 0.02} for v in (0, 50)]}
    return store.save(50, server=server, clients=clients(), actor_rng={0: torch.get_rng_state()}, driver=driver,
                      run_id="bench")


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="checkpoint folder (written when it holds no checkpoint)")
    ap.add_argument("--states", type=int, default=1000, help="client states in the checkpoint")
    ap.add_argument("--keep-files", action="store_true", help="leave the checkpoint for the next call")
    args = ap.parse_args()
    store = CheckpointStore(args.dir, keep=1)
    written = None
    if not store.complete():
        path, written = timed(lambda: write(args.dir, args.states))
        print(f"wrote {path} in {written:.1f} s", flush=True)
    def find():  # what a resume calls (the code before issue 39.3 had no client_states argument)
        try:
            return store.latest(client_states=False)
        except TypeError:
            return store.latest()

    ckpt, find_s = timed(find)
    _, scan_s = timed(ckpt.check_loadable)
    ids = ckpt.manifest["clients"]
    _, read_s = timed(lambda: [ckpt.client_state(c) for c in ids])
    size = sum(p.stat().st_size for p in ckpt.path.rglob("*.pt"))
    out = {"states": len(ids), "checkpoint_gib": round(size / 2**30, 2), "find_s": round(find_s, 1),
           "scan_s": round(scan_s, 1), "before_ray_s": round(find_s + scan_s, 1), "read_s": round(read_s, 1),
           "write_s": round(written, 1) if written else None}
    print(json.dumps(out))
    if not args.keep_files:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
