"""FedTGP's ``prototype_model``: which model the uploaded prototypes are computed with.

``trained`` (default): the paper's client, the model after this update's local training.
``before_training``: the authors' code (``clienttgp.py``, ``collect_protos`` reloads the model saved
by the previous ``train()``), i.e. the weights this update starts from. The expected prototypes are
computed here by hand: eval mode, every training sample, per-class mean of ``model.features``.
"""

import copy

import numpy as np
import pytest
import torch

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime.client_core import ClientRunner


def _runner(*extra: str) -> ClientRunner:
    cfg = build_config({}, ["algorithm.name=fedtgp", "federation.num_clients=2", "model.group=HtFE1",
                            "model.feature_dim=8", "data.partition.beta=1.0", "data.image_size=16",
                            "data.num_samples=200", "data.name=synthetic", *extra])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 2, cfg.seed, cfg.data.test_fraction)
    return ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))


@torch.no_grad()
def _class_means(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[int, np.ndarray]:
    model = copy.deepcopy(model).eval()
    feats = model.features(x).float()
    return {int(c): feats[y == c].mean(0).numpy() for c in torch.unique(y)}


def _uploaded(update) -> dict[int, np.ndarray]:
    ps = update.prototypes
    return {int(c): v for c, v in zip(ps.class_ids, ps.vectors, strict=True)}


def _assert_same(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for c in a:
        np.testing.assert_allclose(a[c], b[c], rtol=1e-4, atol=1e-5)


def _differ(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> bool:
    return any(not np.allclose(a[c], b[c], rtol=1e-4, atol=1e-5) for c in a)


def _train_and_capture(runner: ClientRunner, state: GlobalState):
    before = copy.deepcopy(runner.model)
    _, update = runner.train(state)
    x, y = runner.train_x, runner.train_y
    return update, _class_means(before, x, y), _class_means(runner.model, x, y)


def test_before_training_uploads_the_prototypes_of_the_model_this_update_started_from():
    runner = _runner("algorithm.prototype_model=before_training")
    update, untrained, trained = _train_and_capture(runner, GlobalState(version=0))
    assert _differ(untrained, trained)  # local training moved the features: the two sources are told apart
    _assert_same(_uploaded(update), untrained)
    # the next update (against a bank) starts from the model the previous one left, as the authors'
    # collect_protos reloads the model file the previous train() saved
    second, untrained2, trained2 = _train_and_capture(runner, GlobalState(version=1, prototypes=update.prototypes))
    _assert_same(untrained2, trained)
    _assert_same(_uploaded(second), untrained2)
    assert _differ(_uploaded(second), trained2)


def test_default_uploads_the_prototypes_of_the_trained_model():
    runner = _runner()
    assert runner.algorithm.options.prototype_model == "trained"
    update, untrained, trained = _train_and_capture(runner, GlobalState(version=0))
    assert _differ(untrained, trained)
    _assert_same(_uploaded(update), trained)


def test_the_prototype_source_leaves_local_training_unchanged():
    # the extra eval pass draws no random numbers and changes no weight or BatchNorm statistic:
    # both variants train the same model from the same broadcast
    a, b = _runner(), _runner("algorithm.prototype_model=before_training")
    a.train(GlobalState(version=0))
    b.train(GlobalState(version=0))
    for (name, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        torch.testing.assert_close(va, vb, msg=name)


def test_a_bad_prototype_model_names_the_key_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError, match=r"algorithm\.prototype_model") as err:
        build_config({}, ["algorithm.name=fedtgp", "algorithm.prototype_model=after"])
    assert "after" in str(err.value) and "before_training" in str(err.value) and "trained" in str(err.value)
    with pytest.raises(ConfigError, match=r"algorithm\.prototype_model") as err:
        build_config({}, ["algorithm.name=fedtgp", "algorithm.prototype_model=before_training",
                          "algorithm.prototype_source=train"])
    assert "prototype_source 'eval'" in str(err.value)
