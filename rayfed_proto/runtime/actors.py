"""Ray actors: thin shells around :mod:`rayfed_proto.runtime.client_core` and :mod:`~rayfed_proto.runtime.server_core`.

No actor reads the dataset from disk: the driver loads it once and puts its arrays in the
object store once; an actor's ``setup`` receives them as zero-copy read-only numpy views and
its clients build their own shards from them (so on a multi-node cluster the data needs to
exist only where the driver runs). Actors are created before their data is ready (they start
while the driver partitions) and receive it in ``setup``. Devices: CUDA when Ray assigned a GPU
and CUDA is really available, CPU otherwise (logical GPUs on a CPU machine are placed but
compute stays on the CPU).
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
from typing import Any

import ray
import torch

from rayfed_proto.config import ExperimentConfig, resolved_config
from rayfed_proto.data import ArrayDataset, ClientSplit
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime.client_core import ClientHost, corrupt_update
from rayfed_proto.runtime.core import EvalSet
from rayfed_proto.runtime.determinism import apply_determinism
from rayfed_proto.runtime.parking import ParkedStates
from rayfed_proto.runtime.policies import ServerNeeds
from rayfed_proto.runtime.server_core import ServerCore


def pick_device() -> torch.device:
    if ray.get_gpu_ids() and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def leave_out_triton_on_cpu(device: torch.device) -> bool:
    """Keep this process from importing Triton when it computes on the CPU; True when it will not.

    PyPI's CUDA build of torch ships Triton, and whatever imports ``torch._dynamo`` (a
    ``torch.optim`` optimizer's first step, ``torch.compile``, a plug-in) imports ``triton`` just
    to learn whether it is installed (``torch.utils._triton.has_triton_package``). A CPU process
    never runs a Triton kernel, yet that import maps about 69 MiB of library pages and 7 MiB of
    private memory into it (``bench/import_cost.py``, torch 2.14.1; docs/benchmarks.md, "Startup and peak
    memory"). The built-in methods step with :mod:`rayfed_proto.optim`, which imports neither;
    this guard covers everything else. Marking the module absent
    (``sys.modules["triton"] = None``, Python's own way to say "not installed") makes torch behave
    as it does without Triton: optimizers are unchanged and ``torch.compile`` still works on the
    CPU through Inductor's C++ backend. A process with a CUDA device is left alone, as is one
    where something imported Triton already."""
    if device.type != "cpu":
        return False
    if "triton" not in sys.modules:
        sys.modules["triton"] = None  # type: ignore[assignment]
    return sys.modules["triton"] is None


def _triton_loaded() -> bool:
    return sys.modules.get("triton") is not None


def _placement() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "assigned": ctx.get_assigned_resources(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "cuda_available": torch.cuda.is_available(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
            "triton_loaded": _triton_loaded(), "dynamo_loaded": "torch._dynamo" in sys.modules}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _gpu_peak_mib(device: torch.device) -> float:
    """Peak CUDA memory this process allocated through torch (NaN without a GPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


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
    """A worker hosting one or more clients (:class:`ClientHost`)."""

    def __init__(self, cfg_dict: dict, torch_threads: int):
        logging.basicConfig(level=logging.WARNING)
        torch.set_num_threads(torch_threads)
        self.cfg: ExperimentConfig = resolved_config(cfg_dict)
        apply_determinism(self.cfg.resources.deterministic)  # before this process's first CUDA call
        self.device = pick_device()
        leave_out_triton_on_cpu(self.device)
        self.host: ClientHost | None = None
        self.faults = self.cfg.faults

    def setup(self, dataset: ArrayDataset, splits: list[ClientSplit], public_idx=None) -> list[int]:
        """Take this worker's clients; ``dataset`` arrives from the object store (zero-copy)."""
        # the public proxy set: images only (labels dropped), one tensor shared by this worker's clients
        public_x = dataset.tensors(public_idx)[0] if public_idx is not None and len(public_idx) else None
        res, num_clients = self.cfg.resources, self.cfg.federation.num_clients
        park = res.parks_clients(num_clients)
        parked = ParkedStates.on_disk(res.park_dir) if park and res.parks_on_disk(num_clients) else None
        self.host = ClientHost(self.cfg, dataset, splits, self.device, public_x, park=park, parked=parked)
        return self.host.client_ids

    def train(self, client_id: int, state: GlobalState, keep_from: int | None = None, undoable: bool = False):
        """A local update; ``keep_from``: the oldest state of the client an evaluation may still ask
        for; ``undoable``: it may be lost, keep the state before it (``discard``)."""
        return self._faulty(client_id, *self.host.train(client_id, state, keep_from, undoable))

    def train_group(self, client_ids: list[int], state: GlobalState, keep_from: list[int | None]):
        """Local updates of several clients against one state (``resources.batch_clients`` on or auto):
        (meta, update) of each client in order, flattened, one return value each (the caller
        asks for ``num_returns=2 * len(client_ids)``), each what :meth:`train` returns."""
        results = self.host.train_group(client_ids, state, keep_from)
        return tuple(x for c, (meta, update) in zip(client_ids, results, strict=True)
                     for x in self._faulty(c, meta, update))

    def _faulty(self, client_id: int, meta: dict[str, Any], update):
        if client_id in self.faults.corrupt_clients:  # fault injection (tests, chaos drills)
            update = corrupt_update(update, self.faults.corrupt_kind)
            meta["corrupted"] = True
        return meta, update

    def discard(self, client_id: int) -> bool:
        """The client's latest local update was lost: its state goes back to before it."""
        return self.host.discard(client_id)

    def snapshot(self, keep_from: dict[int, int | None] | None = None) -> tuple[list[int], torch.Tensor]:
        """The hosted clients that have a state (for checkpoints, which fetch them in chunks with
        :meth:`client_states`: :class:`RemoteStates`) and this process's torch RNG (kept in the
        format for older checkpoints; each client carries its own stream now); ``keep_from``: the
        oldest state of each client an evaluation may still ask for (the others are dropped first)."""
        if keep_from is not None:
            self.host.drop_kept(keep_from)
        return self.host.stateful_clients(), torch.get_rng_state()

    def client_states(self, client_ids: list[int]) -> dict[int, dict[str, Any]]:
        return self.host.client_states(client_ids)

    def close(self) -> None:
        """The run ends: remove the parked states' folder (the process is killed next)."""
        if self.host is not None:
            self.host.parked.close()

    def restore(self, states: dict[int, dict[str, Any] | bytes], rng: torch.Tensor | None = None) -> list[int]:
        """Load checkpointed client states (clients without one keep their fresh initialisation):
        a state dict, or a state file's bytes as the driver read and checked them."""
        from rayfed_proto.runtime.checkpoint import load_client_bytes  # the restore is rare: off the import path

        self.host.load_state_dicts({c: load_client_bytes(f"clients/{c}.pt", st) if isinstance(st, bytes) else st
                                    for c, st in states.items()})
        if rng is not None:
            torch.set_rng_state(rng)
        return sorted(states)

    def adopt_files(self, files: dict[int, tuple[str, int, str]], rng: torch.Tensor | None = None) -> list[int]:
        """Park checkpointed states straight from their files where this worker can reach them
        (``client -> (path, size, sha256)``), each checked as it is linked; returns the clients
        whose bytes the driver must send (:meth:`restore`)."""
        left = self.host.adopt_files(files)
        if rng is not None:
            torch.set_rng_state(rng)
        return left

    def evaluate(self, client_ids: list[int], state: GlobalState, as_of: dict[int, int] | None = None) -> list[dict[str, Any]]:
        """Each client after ``as_of[c]`` local updates (its newest without), against ``state``."""
        return self.host.evaluate(client_ids, state, as_of)

    def update_counts(self) -> dict[int, int]:
        """Local updates each hosted client has done (the name of its current state)."""
        return self.host.update_counts()

    def export_model(self, client_id: int, state: GlobalState) -> tuple[torch.nn.Module, dict[str, Any]]:
        """A CPU copy of the client's model as an evaluation against ``state`` scores it, with
        that evaluation (MLflow model logging)."""
        return self.host.export_model(client_id, state)

    def info(self) -> dict[str, Any]:
        hosted = self.host.client_ids if self.host is not None else []
        live = self.host.live_count() if self.host is not None else 0
        return {**_placement(), "device": str(self.device), "clients": hosted, "live_clients": live,
                "materialised": self.host.materialised if self.host is not None else 0,
                "torch_threads": torch.get_num_threads(), "peak_rss_mib": _peak_rss_mib(), "pss_mib": _pss_mib(),
                "gpu_peak_mib": _gpu_peak_mib(self.device)}


class RemoteStates:
    """A worker's client states for a checkpoint, fetched ``chunk`` clients at a time as they are
    iterated: the checkpoint writes each chunk before the next is asked for, so the driver holds a
    chunk, not every client's state (10,000 clients with 3 MiB models are 33 GB). Iterable again
    (a checkpoint write that failed is retried)."""

    def __init__(self, actor, clients: list[int], index: int = -1, chunk: int = 32):
        self.actor, self.clients, self.index, self.chunk = actor, list(clients), index, chunk

    def __len__(self) -> int:
        return len(self.clients)

    def items(self):
        for i in range(0, len(self.clients), self.chunk):
            try:
                states = ray.get(self.actor.client_states.remote(self.clients[i : i + self.chunk]))
            except ray.exceptions.RayActorError as err:
                err.actor_index = self.index  # which worker to recreate (Recovery.checkpoint)
                raise
            yield from states.items()


@ray.remote(max_concurrency=4)  # threaded: submissions, version waits and stats run beside training
class ServerActor:
    """The server. In async mode a training thread aggregates whenever the buffer is full, so
    intake (``submit``) never queues behind server training; the driver learns of new versions
    through ``wait_versions``. In sync mode the driver calls ``step`` when a round is complete."""

    def __init__(self, cfg_dict: dict, num_classes: int, in_channels: int, image_size: int, needs: ServerNeeds,
                 torch_threads: int, dataset: ArrayDataset | None = None, global_test_idx=None, public_idx=None):
        """``needs``: what the federation policy asks of the server (its stepping strategy, the
        staleness bound); ``dataset``: the object store's arrays (zero-copy), from which the server
        takes only what it holds (global test set, public set); never read from disk here."""
        logging.basicConfig(level=logging.WARNING)
        torch.set_num_threads(torch_threads)
        cfg = resolved_config(cfg_dict)
        apply_determinism(cfg.resources.deterministic)  # before this process's first CUDA call
        self.device = pick_device()
        leave_out_triton_on_cpu(self.device)
        global_test = public_x = None
        if dataset is not None and global_test_idx is not None and len(global_test_idx):
            global_test = EvalSet.from_dataset(dataset, global_test_idx)
        if dataset is not None and public_idx is not None and len(public_idx):
            public_x = dataset.tensors(public_idx)[0]
        self.core = ServerCore(cfg, num_classes, in_channels, image_size, self.device, needs,
                               global_test=global_test, public_x=public_x)
        self._versions_cond = threading.Condition()
        self._new_versions: list[tuple[int, Any]] = []  # (version, state ref) not yet handed out
        self._stop = threading.Event()
        self.error: BaseException | None = None
        needs.stepping.start(self._train_loop)  # async in real time: a training thread aggregates beside intake

    def _publish(self, receipt: dict[str, Any]) -> dict[str, Any]:
        # A new version's state is put in the object store once, here; its ref is what every
        # client and that version's evaluation receive.
        receipt["state_ref"] = ray.put(receipt.pop("state"))
        return receipt

    def _train_loop(self) -> None:
        try:
            while not self._stop.is_set():
                receipt = self.core.wait_and_step(timeout=0.5)
                if receipt is not None:
                    receipt = self._publish(receipt)
                    with self._versions_cond:
                        self._new_versions.append((receipt["new_version"], receipt["state_ref"]))
                        self._versions_cond.notify_all()
        except BaseException as e:  # surfaced to the driver by wait_versions
            self.error = e
            with self._versions_cond:
                self._versions_cond.notify_all()

    def wait_versions(self, timeout: float = 2.0) -> dict[str, Any]:
        """Versions produced since the last call, each with its state ref (none on timeout), and
        the number of accepted updates still waiting in the buffer (for backpressure)."""
        with self._versions_cond:
            self._versions_cond.wait_for(lambda: self._new_versions or self.error is not None, timeout)
            if self.error is not None:
                raise RuntimeError(f"server training failed: {self.error!r}") from self.error
            out, self._new_versions = self._new_versions, []
        with self.core.cond:
            backlog, version = len(self.core.buffer), self.core.version
        return {"versions": out, "backlog": backlog, "version": version}

    def submit(self, update) -> dict[str, Any]:
        receipt = self.core.submit(update)
        return self._publish(receipt) if "state" in receipt else receipt

    def step(self) -> dict[str, Any]:
        return self._publish(self.core.step())

    def global_state(self) -> GlobalState:
        """The state of the version this server was built or restored at: what the driver starts
        from (the scheduler's start, a recreated server), even if the training thread has stepped
        since; later versions travel as refs in receipts and ``wait_versions``."""
        return self.core.start_state

    def snapshot(self) -> dict[str, Any]:
        """The server's whole state between two aggregations, plus its torch RNG (checkpoints)."""
        return {"core": self.core.state_dict(), "torch_rng": torch.get_rng_state()}

    def restore(self, snapshot: dict[str, Any]) -> int:
        self.core.load_state_dict(snapshot["core"])
        torch.set_rng_state(snapshot["torch_rng"])
        with self._versions_cond:
            self._new_versions = []
        return self.core.version

    def stats(self, version: int | None = None) -> dict[str, Any]:
        return self.core.read_stats(version)

    def guidance_bank(self):
        return self.core.algorithm.guidance_bank()

    def export_model(self) -> tuple[torch.nn.Module | None, dict[str, Any]]:
        """A CPU copy of the server's model (None for methods without one) and the server metrics
        of the current version (global_acc...), for MLflow model logging."""
        import copy

        with self.core.step_lock:
            self.core.settle()  # the current version's global-test figures complete
            model = self.core.algorithm.global_model()
            model = None if model is None else copy.deepcopy(model).cpu().eval()
            return model, dict(self.core.version_metrics.get(self.core.version, {}))

    def stop(self) -> None:
        self._stop.set()

    def info(self) -> dict[str, Any]:
        return {**_placement(), "device": str(self.device), "peak_rss_mib": _peak_rss_mib(), "pss_mib": _pss_mib()}
