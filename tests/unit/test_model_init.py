"""model.init (shared | per_client initial weights) and model.projector: pool (HtFLlib's BaseHeadSplit)."""

from __future__ import annotations

import pytest
import torch

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState
from rayfed_proto.models import build_client_model, build_model
from rayfed_proto.runtime.client_core import ClientRunner

CPU = torch.device("cpu")


def _setup(*overrides: str):
    # small_hetero with 8 clients: clients 0 and 4 are both the FedAvg CNN, 1 and 5 cnn_narrow
    cfg = build_config({}, ["algorithm.name=fedproto", "federation.num_clients=8", "model.feature_dim=16",
                            "data.partition.beta=1.0", "data.image_size=16", *overrides])
    ds = load_dataset(cfg.data, cfg.seed)
    return cfg, ds, make_partition(ds, cfg.data.partition, 8, cfg.seed, cfg.data.test_fraction)


def _weights(runner: ClientRunner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in runner.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_defaults_are_the_references() -> None:
    cfg = build_config({})
    assert (cfg.model.init, cfg.model.projector) == ("shared", "pool")
    with pytest.raises(ConfigError, match="model.init"):
        build_config({}, ["model.init=per_model"])
    with pytest.raises(ConfigError, match="model.projector"):
        build_config({}, ["model.projector=avg"])


def test_shared_init_gives_clients_of_one_architecture_equal_weights_at_version_0() -> None:
    cfg, ds, part = _setup()
    runners = {c: ClientRunner(cfg, part.clients[c], ds, CPU) for c in (0, 4, 1, 5)}
    assert _same(_weights(runners[0]), _weights(runners[4]))  # both cnn
    assert _same(_weights(runners[1]), _weights(runners[5]))  # both cnn_narrow
    # one initial model per architecture, drawn from the run's seed: another seed, other weights
    cfg2, _, _ = _setup("seed=7")
    assert not _same(_weights(runners[0]), _weights(ClientRunner(cfg2, part.clients[0], ds, CPU)))


def test_per_client_init_gives_each_client_its_own_weights_as_before() -> None:
    cfg, ds, part = _setup("model.init=per_client")
    a, b = ClientRunner(cfg, part.clients[0], ds, CPU), ClientRunner(cfg, part.clients[4], ds, CPU)
    assert not _same(_weights(a), _weights(b))
    # today's (pre-option) draw, unchanged: torch seeded with the client's id right before the build
    torch.manual_seed(cfg.seed * 100_003 + 4)
    old = build_client_model(cfg.model.group, 4, ds.channels, ds.image_size, ds.num_classes, 16, "pool")
    assert _same(_weights(b), old.state_dict())


def test_shared_init_keeps_each_clients_own_rng_stream() -> None:
    # Dropout and anything else drawing from torch's global RNG in a local update use the client's
    # own stream, seeded with its id: different clients of one architecture draw differently, and
    # the stream does not depend on which other models the process built before.
    cfg, ds, part = _setup()
    torch.manual_seed(123)
    a = ClientRunner(cfg, part.clients[0], ds, CPU)
    torch.manual_seed(456)
    ClientRunner(cfg, part.clients[1], ds, CPU)
    a_again = ClientRunner(cfg, part.clients[0], ds, CPU)
    b = ClientRunner(cfg, part.clients[4], ds, CPU)
    assert torch.equal(a.torch_rng, a_again.torch_rng)
    assert torch.equal(a.torch_rng, torch.random.manual_seed(cfg.seed * 100_003 + 0).get_state())
    assert not torch.equal(a.torch_rng, b.torch_rng)


def test_shared_build_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = build_client_model("small_hetero", 0, 1, 16, 10, 16, shared_seed=0)
    assert torch.equal(torch.rand(3), expected)
    second = build_client_model("small_hetero", 4, 1, 16, 10, 16, shared_seed=0)
    assert _same(first.state_dict(), second.state_dict())


def test_shared_clients_train_apart_from_equal_starts() -> None:
    # equal at version 0, then each client's own data moves its weights its own way
    cfg, ds, part = _setup()
    a, b = ClientRunner(cfg, part.clients[0], ds, CPU), ClientRunner(cfg, part.clients[4], ds, CPU)
    a.train(GlobalState(version=0))
    b.train(GlobalState(version=0))
    assert not _same(_weights(a), _weights(b))


# --- the pool projector --------------------------------------------------------------------------


def test_pool_projector_gives_the_fedavg_cnns_fc1_relu_output() -> None:
    # HtFLlib's BaseHeadSplit on FedAvgCNN: fc replaced by AdaptiveAvgPool1d(512), so the features
    # are fc1's output after its ReLU, unchanged at feature_dim 512.
    torch.manual_seed(0)
    model = build_model("cnn", 1, 28, 10, 512).eval()
    assert isinstance(model.backbone[-1], torch.nn.ReLU) and isinstance(model.backbone[-2], torch.nn.Linear)
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), model.backbone(x), rtol=0, atol=0)
        assert (model.features(x) >= 0).all()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in model.backbone.parameters()) + 512 * 10 + 10


def test_pool_projector_averages_wide_outputs_down_and_repeats_narrow_ones_up() -> None:
    pool = build_model("mlp", 1, 8, 3, 512).projection  # the mlp extractor's 128 widths up to 512
    z = torch.arange(8.0).reshape(2, 4)
    torch.testing.assert_close(build_model("mlp", 1, 8, 3, 2).projection(z), z.reshape(2, 2, 2).mean(-1))
    torch.testing.assert_close(pool(torch.arange(128.0).reshape(1, 128)),
                               torch.arange(128.0).repeat_interleave(4).reshape(1, 512))


def test_unknown_projector_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="projector must be one of 'pool', 'linear', 'mlp', got 'avg'"):
        build_model("mlp", 1, 8, 3, 4, projector="avg")


def test_fedlsa_still_gets_its_mlp_projector() -> None:
    cfg = build_config({}, ["algorithm.name=fedlsa", "model.group=HtFE1"])
    assert cfg.model.projector == "mlp" and cfg.model.normalize_features
