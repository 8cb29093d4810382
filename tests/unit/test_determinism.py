"""resources.deterministic: the flags and environment every training process sets, and where."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from rayfed_proto.config import build_config
from rayfed_proto.runtime.determinism import CUBLAS_WORKSPACE, apply_determinism, is_deterministic


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
    from rayfed_proto.runtime.core import ClientRunner

    cfg = build_config({}, ["federation.num_clients=2", "model.feature_dim=8", "data.image_size=8",
                            "model.group=HtFE1", "resources.deterministic=true"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 2, cfg.seed, cfg.data.test_fraction)
    ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    assert is_deterministic() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE


@pytest.mark.parametrize("deterministic", [True, False])
def test_both_actors_apply_it_before_choosing_a_device(torch_defaults, monkeypatch, deterministic):
    # The actors' own constructors, without Ray: the setting must be in force before the
    # process's first CUDA call, i.e. before pick_device.
    # the module as imported now: other test files drop rayfed_proto modules from sys.modules and
    # import them afresh (test_lean_runtime), and the actor classes read the globals of their own
    actors = importlib.import_module("rayfed_proto.runtime.actors")
    order: list[str] = []

    def record_apply(enabled: bool) -> None:
        order.append(f"apply({enabled})")
        apply_determinism(enabled)

    def record_pick() -> torch.device:
        order.append("pick_device")
        return torch.device("cpu")

    # patch the globals the constructors really read: those of the module their code was compiled in
    # (after another test file re-imports rayfed_proto modules, sys.modules may name a newer copy)
    constructor_globals = actors.ClientActor.__ray_metadata__.modified_class.__ray_actor_class__.__init__.__globals__
    assert constructor_globals is (
        actors.ServerActor.__ray_metadata__.modified_class.__ray_actor_class__.__init__.__globals__)
    monkeypatch.setitem(constructor_globals, "apply_determinism", record_apply)
    monkeypatch.setitem(constructor_globals, "pick_device", record_pick)
    monkeypatch.setitem(constructor_globals, "leave_out_triton_on_cpu", lambda device: True)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    cfg = build_config({}, ["model.group=HtFE1", "algorithm.name=fedproto", "model.feature_dim=8",
                            f"resources.deterministic={str(deterministic).lower()}"]).to_dict()
    actors.ClientActor.__ray_metadata__.modified_class(cfg, 1)
    assert order == [f"apply({deterministic})", "pick_device"]
    assert is_deterministic() == deterministic
    order.clear()
    apply_determinism(False)
    from rayfed_proto.runtime.policies import ServerNeeds

    actors.ServerActor.__ray_metadata__.modified_class(cfg, 10, 1, 8, ServerNeeds(None, False, 20), 1)
    assert order[:2] == [f"apply({deterministic})", "pick_device"]
    assert is_deterministic() == deterministic
