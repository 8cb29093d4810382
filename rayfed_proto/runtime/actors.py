"""Ray actors: thin shells around :mod:`rayfed_proto.runtime.core`.

A client actor loads the dataset itself (from disk or the embedded set) and keeps only its
clients' shards; the driver ships indices, never images. Devices: CUDA when Ray assigned a GPU
and CUDA is really available, CPU otherwise (logical GPUs on a CPU machine are placed but
compute stays on the CPU).
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

import ray
import torch

from rayfed_proto.config import ExperimentConfig, build_config
from rayfed_proto.data import ClientSplit, load_dataset
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime.core import ClientRunner, ServerCore


def pick_device() -> torch.device:
    if ray.get_gpu_ids() and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _placement() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "assigned": ctx.get_assigned_resources(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "cuda_available": torch.cuda.is_available(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _pss_mib() -> float:
    """Proportional set size: RSS with shared pages (libtorch, CUDA libraries) divided among the
    processes sharing them, so summing it over actors gives the real footprint. NaN off Linux."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


@ray.remote
class ClientActor:
    def __init__(self, cfg_dict: dict, splits: list[ClientSplit], torch_threads: int):
        logging.basicConfig(level=logging.WARNING)
        torch.set_num_threads(torch_threads)
        cfg: ExperimentConfig = build_config(cfg_dict)
        self.device = pick_device()
        dataset = load_dataset(cfg.data, cfg.seed)
        self.runners = {s.client_id: ClientRunner(cfg, s, dataset, self.device) for s in splits}
        del dataset  # keep only the shards

    def train(self, client_id: int, state: GlobalState):
        return self.runners[client_id].train(state)

    def evaluate(self, client_ids: list[int], state: GlobalState) -> list[dict[str, Any]]:
        return [self.runners[c].evaluate(state) for c in client_ids]

    def info(self) -> dict[str, Any]:
        return {**_placement(), "device": str(self.device), "clients": sorted(self.runners),
                "torch_threads": torch.get_num_threads(), "peak_rss_mib": _peak_rss_mib(), "pss_mib": _pss_mib()}


@ray.remote
class ServerActor:
    def __init__(self, cfg_dict: dict, num_classes: int, in_channels: int, image_size: int, buffer_size, torch_threads: int):
        logging.basicConfig(level=logging.WARNING)
        torch.set_num_threads(torch_threads)
        self.device = pick_device()
        self.core = ServerCore(build_config(cfg_dict), num_classes, in_channels, image_size, self.device, buffer_size)

    def _with_state_ref(self, receipt: dict[str, Any]) -> dict[str, Any]:
        # A new version's state is put in the object store once, here, and its ref travels in
        # the receipt: every client and evaluation of that version reads exactly that object.
        if receipt.get("new_version") is not None:
            receipt["state_ref"] = ray.put(self.core.state)
        return receipt

    def submit(self, update) -> dict[str, Any]:
        return self._with_state_ref(self.core.submit(update))

    def step(self) -> dict[str, Any]:
        return self._with_state_ref(self.core.step())

    def global_state(self) -> GlobalState:
        return self.core.state

    def stats(self, version: int | None = None) -> dict[str, Any]:
        return self.core.read_stats(version)

    def guidance_bank(self):
        return self.core.algorithm.guidance_bank()

    def info(self) -> dict[str, Any]:
        return {**_placement(), "device": str(self.device), "peak_rss_mib": _peak_rss_mib(), "pss_mib": _pss_mib()}
