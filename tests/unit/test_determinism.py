"""resources.deterministic: the flags and environment every training process sets, and where."""

from __future__ import annotations

import os

import pytest
import torch

from rayfed_proto.config import build_config
from rayfed_proto.runtime.determinism import CUBLAS_WORKSPACE, apply_determinism


def is_deterministic() -> bool:
    """Whether this process runs torch's deterministic kernels now."""
    return torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark


@pytest.fixture
def torch_defaults(monkeypatch):
    """Each test starts and ends with torch's defaults (the flags are process-wide)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    apply_determinism(False)
    torch.use_deterministic_algorithms(False)
    yield
    apply_determinism(False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False


def test_apply_sets_the_flags_and_the_cublas_workspace_then_undoes_them(torch_defaults):
    torch.backends.cudnn.benchmark = True  # as a user's earlier code might leave it
    apply_determinism(True)
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"
    assert is_deterministic()
    apply_determinism(False)  # an in-process run after a deterministic one gets torch's defaults back
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert not is_deterministic()


def test_off_by_default_changes_nothing(torch_defaults, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert build_config({}).resources.deterministic is False
    apply_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled()
    apply_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # a workspace the user chose is kept


def test_in_process_client_runner_applies_the_setting(torch_defaults):
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.runtime.client_core import ClientRunner

    cfg = build_config({}, ["federation.num_clients=2", "model.feature_dim=8", "data.image_size=8",
                            "model.group=HtFE1", "resources.deterministic=true"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 2, cfg.seed, cfg.data.test_fraction)
    ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    assert is_deterministic() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE


_ACTORS_ORDER = """
import json, sys, torch
from rayfed_proto.config import build_config
from rayfed_proto.runtime import actors
from rayfed_proto.runtime.determinism import apply_determinism
from rayfed_proto.runtime.policies import ServerNeeds
from rayfed_proto.runtime.stepping import OnRequest

deterministic = sys.argv[1] == "true"
order = []

def is_deterministic():
    return torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark

def record_apply(enabled):
    order.append(f"apply({enabled})")
    apply_determinism(enabled)

def record_pick():
    order.append("pick_device")
    return torch.device("cpu")

actors.apply_determinism, actors.pick_device = record_apply, record_pick
actors.leave_out_triton_on_cpu = lambda device: True
torch.set_num_threads = lambda n: None
cfg = build_config({}, ["model.group=HtFE1", "algorithm.name=fedproto", "model.feature_dim=8",
                        f"resources.deterministic={sys.argv[1]}"]).to_dict()
actors.ClientActor.__ray_metadata__.modified_class(cfg, 1)
client, client_flag = list(order), is_deterministic()
order.clear()
apply_determinism(False)
actors.ServerActor.__ray_metadata__.modified_class(cfg, 10, 1, 8, ServerNeeds(OnRequest(), 20), 1)
print(json.dumps({"client": client, "client_flag": client_flag, "server": order[:2], "server_flag": is_deterministic()}))
"""


@pytest.mark.parametrize("deterministic", [True, False])
def test_both_actors_apply_it_before_choosing_a_device(deterministic):
    # The actors' own constructors, without Ray: the setting must be in force before the
    # process's first CUDA call, i.e. before pick_device. In a fresh interpreter: in the full suite
    # the session's Ray instance and re-imported modules left in-process patches unread (CI).
    import json
    import subprocess
    import sys

    flag = str(deterministic).lower()
    proc = subprocess.run([sys.executable, "-c", _ACTORS_ORDER, flag], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["client"] == [f"apply({deterministic})", "pick_device"] and got["client_flag"] == deterministic
    assert got["server"] == [f"apply({deterministic})", "pick_device"] and got["server_flag"] == deterministic
