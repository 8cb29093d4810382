"""Model zoo: shapes on every dataset geometry, the projection/head contract, groups, names, sizes, stems."""

from __future__ import annotations

import pytest
import torch

from rayfed_proto.models import (
    ARCHITECTURES,
    MODEL_GROUPS,
    ProtoModel,
    arch_for_client,
    build_client_model,
    build_model,
)
from rayfed_proto.registry import UnknownNameError

HTFE8 = ["cnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
SMALL = ["cnn", "cnn_narrow", "cnn_deep", "mlp"]
# lokinko/FedSA system/main.py, args.model_family (HtFE1 is their "FedAvg" family)
FEDSA_GROUPS = {
    "HtFE1": ["cnn"],
    "HtFE2": ["cnn", "resnet18"],
    "HtFE3": ["resnet10", "resnet18", "resnet34"],
    "HtFE4": ["cnn", "googlenet", "mobilenet_v2", "resnet18"],
    "HtFE5": ["cnn", "resnet10", "resnet18", "resnet34", "resnet50"],
    "HtFE8": HTFE8,
}
FEATURE_DIM, NUM_CLASSES, BATCH = 64, 7, 2


def _forward(arch: str, channels: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(arch, channels, size, NUM_CLASSES, FEATURE_DIM).eval()
    with torch.no_grad():
        return model.features(torch.randn(BATCH, channels, size, size)), model(torch.randn(BATCH, channels, size, size))


def _check(feats: torch.Tensor, logits: torch.Tensor) -> None:
    assert feats.shape == (BATCH, FEATURE_DIM)
    assert logits.shape == (BATCH, NUM_CLASSES)
    assert torch.isfinite(feats).all() and torch.isfinite(logits).all()
    # Random inputs must not collapse to a constant (e.g. a dead extractor returning zeros).
    assert feats.std() > 0


@pytest.mark.parametrize("arch", sorted(set(HTFE8 + SMALL + ["resnet10"])))
@pytest.mark.parametrize("channels", [3, 1], ids=["rgb32", "digits32"])
def test_every_architecture_at_32x32(arch: str, channels: int) -> None:
    _check(*_forward(arch, channels, 32))


# 16x16 digits: the small archs and cnn must work; the big extractors' stems shrink such maps to
# 1x1, where only the adaptive average pool keeps the features finite.
@pytest.mark.parametrize("arch", sorted(set(HTFE8 + SMALL)))
def test_every_architecture_on_16x16_digits(arch: str) -> None:
    _check(*_forward(arch, 1, 16))


@pytest.mark.parametrize("arch", ["cnn", "cnn_narrow", "mlp"])
def test_small_models_run_on_tiny_images(arch: str) -> None:
    _check(*_forward(arch, 1, 8))


def test_cnn_is_fedavg_cnn_at_paper_sizes() -> None:
    # HtFLlib's FedAvgCNN: unpadded conv5x5 -> flatten of 1600 at 32x32 and 1024 at 28x28.
    for size, flat in ((32, 1600), (28, 1024)):
        fc = build_model("cnn", 1, size, 10).backbone[-2]
        assert isinstance(fc, torch.nn.Linear) and (fc.in_features, fc.out_features) == (flat, 512)


def test_models_adapt_to_input_channels() -> None:
    for arch in ("cnn", "googlenet", "mobilenet_v2", "resnet18"):
        model = build_model(arch, 1, 32, 10, FEATURE_DIM)
        first_conv = next(m for m in model.backbone.modules() if isinstance(m, torch.nn.Conv2d))
        assert first_conv.in_channels == 1, arch


def test_model_attributes_and_default_feature_dim() -> None:
    model = build_model("cnn_narrow", 3, 32, 10)
    assert isinstance(model, ProtoModel)
    assert (model.arch, model.feature_dim, model.num_classes) == ("cnn_narrow", 512, 10)
    assert model.backbone_dim == 128  # pooled up to 512 by the default projector (no parameters)
    assert isinstance(model.projection, torch.nn.AdaptiveAvgPool1d) and model.projection.output_size == 512
    assert build_model("cnn_narrow", 3, 32, 10, projector="linear").projection.in_features == 128
    assert (model.head.in_features, model.head.out_features) == (512, 10)
    # The dry run switches to eval mode; every submodule must be back in training mode.
    assert all(m.training for m in model.modules())


def test_forward_features_matches_features_and_head() -> None:
    torch.manual_seed(0)
    model = build_model("cnn_deep", 1, 16, NUM_CLASSES, FEATURE_DIM).eval()
    x = torch.randn(4, 1, 16, 16)
    feats, logits = model.forward_features(x)
    torch.testing.assert_close(feats, model.features(x))
    torch.testing.assert_close(logits, model.head(model.features(x)))
    torch.testing.assert_close(logits, model(x))


def test_no_activation_after_projection() -> None:
    # Features are the raw projection output: a ReLU there would make them all >= 0. (The default
    # pool projector averages the extractor's last ReLU output, as the reference's, so >= 0 there.)
    torch.manual_seed(0)
    model = build_model("mlp", 1, 16, NUM_CLASSES, FEATURE_DIM, projector="linear").eval()
    with torch.no_grad():
        assert (model.features(torch.randn(8, 1, 16, 16)) < 0).any()


@pytest.mark.parametrize("projector", ["pool", "linear", "mlp"])
@pytest.mark.parametrize("arch", SMALL + ["mobilenet_v2"])
def test_backward_reaches_backbone_projection_and_head(arch: str, projector: str) -> None:
    torch.manual_seed(0)
    model = build_model(arch, 1, 16, NUM_CLASSES, FEATURE_DIM, projector=projector)
    assert (projector == "pool") == (not list(model.projection.parameters()))  # pool: nothing to train
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    # Each term of a prototype loss on its own: CE through the head must train the whole model,
    # a feature-space term the extractor and projection (and not the head).
    parts = {"backbone": model.backbone, "projection": model.projection, "head": model.head}
    for term, reached in (("ce", ("backbone", "projection", "head")), ("feature", ("backbone", "projection"))):
        model.zero_grad(set_to_none=True)
        feats, logits = model.forward_features(x)
        loss = torch.nn.functional.cross_entropy(logits, y) if term == "ce" else feats.pow(2).mean()
        loss.backward()
        for name, part in parts.items():
            grads = [p.grad for p in part.parameters()]
            if not grads:  # the pool projector: no parameters to reach
                continue
            if name in reached:
                assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads), (term, name)
            else:
                assert all(g is None for g in grads), (term, name)


def test_groups_are_the_documented_lists() -> None:
    for group, archs in FEDSA_GROUPS.items():
        assert MODEL_GROUPS.get(group) == archs, group
    assert MODEL_GROUPS.get("small_hetero") == SMALL
    assert (MODEL_GROUPS.get("ResNet10"), MODEL_GROUPS.get("ResNet18")) == (["resnet10"], ["resnet18"])
    for group in MODEL_GROUPS:
        assert all(arch in ARCHITECTURES for arch in MODEL_GROUPS.get(group)), group
        assert MODEL_GROUPS.describe(group) and "mutable sequence" not in MODEL_GROUPS.describe(group)


@pytest.mark.parametrize("group,archs", [("HtFE8", HTFE8), ("small_hetero", SMALL), ("HtFE5", FEDSA_GROUPS["HtFE5"])])
def test_arch_for_client_is_i_mod_len(group: str, archs: list[str]) -> None:
    for i in range(3 * len(archs) + 1):
        assert arch_for_client(group, i) == archs[i % len(archs)]


def test_build_client_model_uses_the_clients_architecture() -> None:
    model = build_client_model("small_hetero", 7, 1, 16, NUM_CLASSES, FEATURE_DIM)
    assert model.arch == "mlp"
    assert (model.feature_dim, model.num_classes) == (FEATURE_DIM, NUM_CLASSES)


def test_unknown_names_list_the_allowed_ones() -> None:
    with pytest.raises(UnknownNameError, match="unknown architecture 'vgg16'; allowed: .*resnet18"):
        build_model("vgg16", 3, 32, 10)
    with pytest.raises(UnknownNameError, match="unknown model group 'HtFE6'; allowed: .*HtFE8.*small_hetero"):
        arch_for_client("HtFE6", 0)
    with pytest.raises(UnknownNameError, match="allowed: .*small_hetero"):
        build_client_model("nope", 0, 3, 32, 10)


def test_bad_sizes_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="'googlenet' cannot take 8x8"):
        build_model("googlenet", 1, 8, 10)
    with pytest.raises(ValueError, match="at least 8x8"):
        build_model("cnn_deep", 1, 4, 10)
    with pytest.raises(ValueError, match="num_classes must be positive"):
        build_model("cnn", 1, 32, 0)
    with pytest.raises(ValueError, match="client_id"):
        arch_for_client("HtFE8", -1)


# Extractor sizes (fc removed, 3 channels): torchvision's published totals minus the ImageNet fc,
# e.g. resnet18 11,689,512 - 513,000. A wrong depth, width or removed layer changes them.
@pytest.mark.parametrize("arch,params", [
    ("cnn", 873_408),  # FedAvgCNN without its last layer, at 32x32
    ("googlenet", 5_599_904),
    ("mobilenet_v2", 2_223_872),
    ("resnet10", 4_905_792),  # resnet18 less one BasicBlock per stage: 73,984 + 295,424 + 1,180,672 + 4,720,640
    ("resnet18", 11_176_512),
    ("resnet34", 21_284_672),
    ("resnet50", 23_508_032),
    ("resnet101", 42_500_160),
    ("resnet152", 58_143_808),
])
def test_backbone_parameter_counts(arch: str, params: int) -> None:
    model = build_model(arch, 3, 32, 10)
    assert sum(p.numel() for p in model.backbone.parameters()) == params
    assert not list(model.projection.parameters())  # the default pool projector learns nothing
    assert build_model(arch, 3, 32, 10, projector="linear").projection.weight.shape == (512, model.backbone_dim)


def test_small_models_are_small() -> None:
    for arch in SMALL:
        assert sum(p.numel() for p in build_model(arch, 1, 32, 10).parameters()) < 5_000_000, arch


def test_a_model_on_meta_is_dry_run_on_an_uninitialised_cpu_copy_and_stays_on_meta():
    """build_model's dry run and architecture_macs run one image through a CPU copy of a meta
    model (to_empty), not on meta: the model returned is still all meta, its backbone_dim and MACs
    are those of a CPU build."""
    from torch import nn

    from rayfed_proto.models.zoo import _on_cpu_if_meta
    from rayfed_proto.system import count_macs

    with torch.device("meta"):
        meta = build_model("cnn", 1, 28, 10, 64, projector="linear")
    cpu = build_model("cnn", 1, 28, 10, 64, projector="linear")
    assert all(p.is_meta for p in meta.parameters()) and meta.backbone_dim == cpu.backbone_dim
    copy = _on_cpu_if_meta(meta)
    assert copy is not meta and not any(p.is_meta for p in copy.parameters())
    assert count_macs(copy, (1, 1, 28, 28)) == count_macs(cpu, (1, 1, 28, 28))
    plain = nn.Linear(2, 2)
    assert _on_cpu_if_meta(plain) is plain


def test_the_backbone_width_is_measured_once_per_input_shape(monkeypatch):
    """A worker builds a client's model at every materialisation (10,000 clients: 10,000 builds per
    evaluation of all of them); the dry run that measures the backbone's width runs once per shape."""
    from rayfed_proto.models import ARCHITECTURES, zoo

    calls = []
    real = zoo._output_dim
    monkeypatch.setattr(zoo, "_output_dim", lambda *a: calls.append(a[2:]) or real(*a))

    @zoo.register_backbone("_width_probe", help="a test backbone")
    def _probe(in_channels, image_size):
        return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 4, 3), torch.nn.Flatten())

    try:
        build = ARCHITECTURES.get("_width_probe")
        first, again, other = build(1, 8, 10, 16), build(1, 8, 10, 16), build(1, 10, 10, 16)
        assert calls == [(1, 8), (1, 10)]
        assert first.backbone_dim == again.backbone_dim == 4 * 6 * 6 and other.backbone_dim == 4 * 8 * 8
        assert first(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    finally:
        ARCHITECTURES._items.pop("_width_probe", None)  # the registry has no public removal: tests only
        ARCHITECTURES._help.pop("_width_probe", None)


def _after_stem(model: ProtoModel, x: torch.Tensor) -> torch.Tensor:
    b = model.backbone
    return b.maxpool(b.relu(b.bn1(b.conv1(x))))


@pytest.mark.parametrize("arch", ["resnet10", "resnet18", "resnet50"])
def test_the_cifar_stem_keeps_32x32_and_the_imagenet_stem_pools_to_8x8(arch: str) -> None:
    x = torch.randn(2, 3, 32, 32)
    cifar, imagenet = build_model(arch, 3, 32, 10, stem="cifar").eval(), build_model(arch, 3, 32, 10).eval()
    with torch.no_grad():
        assert _after_stem(cifar, x).shape == (2, 64, 32, 32)  # FedSC: conv3x3 stride 1, no max-pool
        assert _after_stem(imagenet, x).shape == (2, 64, 8, 8)  # torchvision: conv7x7 stride 2 + max-pool
        # the stages after the stem: 32 -> 32, 16, 8, 4 with the cifar stem (FedSC resnet_base.py's comments)
        assert cifar.backbone.layer4(cifar.backbone.layer3(cifar.backbone.layer2(cifar.backbone.layer1(
            _after_stem(cifar, x))))).shape[-2:] == (4, 4)
    conv = cifar.backbone.conv1
    assert (conv.kernel_size, conv.stride, conv.padding, conv.bias) == ((3, 3), (1, 1), (1, 1), None)
    assert isinstance(cifar.backbone.maxpool, torch.nn.Identity)
    assert cifar.backbone_dim == imagenet.backbone_dim
    # one conv smaller than the 7x7, nothing else: the stem is the only change
    assert sum(p.numel() for p in imagenet.parameters()) - sum(p.numel() for p in cifar.parameters()) == 64 * 3 * (49 - 9)


def test_the_cifar_stem_takes_the_datasets_channels_and_trains() -> None:
    torch.manual_seed(0)
    model = build_model("resnet10", 1, 16, NUM_CLASSES, FEATURE_DIM, stem="cifar")
    assert model.backbone.conv1.in_channels == 1
    feats, logits = model.forward_features(torch.randn(4, 1, 16, 16))
    _check(feats[:BATCH], logits[:BATCH])
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    assert model.backbone.conv1.weight.grad.abs().sum() > 0


def test_stem_applies_to_the_resnets_only_and_is_validated() -> None:
    from rayfed_proto.models import STEMS, takes_stem

    assert STEMS == ("imagenet", "cifar")
    assert [a for a in ARCHITECTURES.names() if takes_stem(a)] == [
        "resnet10", "resnet101", "resnet152", "resnet18", "resnet34", "resnet50"]
    torch.manual_seed(0)
    plain = build_model("cnn", 3, 32, 10)
    torch.manual_seed(0)
    ignored = build_model("cnn", 3, 32, 10, stem="cifar")  # no stem: the same network, the same init
    for a, b in zip(plain.state_dict().values(), ignored.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="model.stem must be one of 'imagenet', 'cifar', got 'tiny'"):
        build_model("resnet18", 3, 32, 10, stem="tiny")


def test_build_client_model_passes_the_stem() -> None:
    model = build_client_model("HtFE3", 0, 3, 32, 10, stem="cifar")
    assert model.arch == "resnet10" and model.backbone.conv1.kernel_size == (3, 3)
