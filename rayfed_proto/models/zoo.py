"""Architectures and model groups: every client model is extractor -> projector -> linear head.

Prototype methods (FedProto, FedTGP, FedSA, ...) compare features across clients whose
extractors differ, so every model here ends its extractor in a projector to one shared
``feature_dim`` before a linear head; the head is what the methods' classifier losses train and
the projector's output is what they average into prototypes.

The projector (``model.projector``) is by default the reference implementations' one:
``pool``, HtFLlib's ``BaseHeadSplit`` (system/flcore/trainmodel/models.py), which replaces the
extractor's last layer with ``nn.AdaptiveAvgPool1d(feature_dim)``, no learnable layer: the
features are the extractor's flat output (the FedAvg CNN's fc1 after ReLU, a ResNet's pooled
and flattened map) averaged down (or repeated up) to ``feature_dim`` widths. ``linear`` (one
learnable ``nn.Linear(backbone_dim, feature_dim)``) and ``mlp`` (Linear-ReLU-Linear, FedLSA's
phi) are the learnable options.

Architectures (``ARCHITECTURES``) adapt to the dataset: the first convolution takes the
dataset's channels, and the width of the extractor's flat output (``backbone_dim``) is measured
with a dry run at the dataset's image size, so no per-dataset constants are hard-coded.
Models start untrained by default (``model.weights: none``), as the papers' heterogeneous-model
experiments; ``model.weights: imagenet | <path>`` loads torchvision's published ImageNet weights or
a local file into the extractor (:mod:`rayfed_proto.models.weights`). The ResNets take
``model.stem``: ``imagenet`` (torchvision's 7x7 stride-2 conv + 3x3 stride-2 max-pool, as
HtFLlib's) or ``cifar`` (a 3x3 stride-1 conv, no pool, as FedSC's ``model/resnet_base.py``).

Groups (``MODEL_GROUPS``) list architecture names; client ``i`` gets ``archs[i % len(archs)]``,
the assignment rule of HtFLlib that the FedSA and FedTGP experiments use.

Other packages add architectures (with :func:`register_backbone`) and groups through entry
points in group ``rayfed_proto.models`` (loaded by ``rayfed_proto.models`` after this module).
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from rayfed_proto.models import ARCHITECTURES, MODEL_GROUPS
from rayfed_proto.models.weights import load_extractor_weights

BackboneFactory = Callable[..., nn.Module]
"""``(in_channels, image_size) -> module`` mapping (B, C, H, W) images to flat (B, backbone_dim);
registered with ``stem=True``, ``(in_channels, image_size, stem) -> module``."""

STEMS = ("imagenet", "cifar")
"""``model.stem`` choices for the architectures that take one (the ResNets)."""


PROJECTORS = ("pool", "linear", "mlp")
"""``model.projector`` choices; ``pool`` (the reference models' pooling) is the default."""


class ProtoModel(nn.Module):
    """Feature extractor -> projector to ``feature_dim`` -> linear head.

    Projectors (``projector``):

    - ``pool`` (default): ``nn.AdaptiveAvgPool1d(feature_dim)`` over the extractor's flat
      (B, backbone_dim) output, no parameters. This is HtFLlib's ``BaseHeadSplit``
      (system/flcore/trainmodel/models.py), on which FedProto's, FedTGP's and FedSA's
      heterogeneous-model results run: it replaces the extractor's last layer (``fc`` or
      ``classifier``) by this pooling. For the FedAvg CNN (backbone_dim 512) at
      ``feature_dim`` 512 the features are its fc1 output after ReLU, unchanged; a ResNet-50's
      2048 pooled channels are averaged in groups of 4; a width below ``feature_dim`` (the
      small CPU models' 128) is repeated up to it, as the reference's pooling does.
    - ``linear``: a learnable ``nn.Linear(backbone_dim, feature_dim)``: any ``backbone_dim``
      mapped to any ``feature_dim`` by a trained map instead of channel averages.
    - ``mlp``: Linear-ReLU-Linear, FedLSA's 2-layer projector phi.

    There is no ReLU after the projector: prototype methods compare raw features, and HtFLlib
    likewise feeds the pooled features straight to the head.

    Caveat for trainers: extractors with BatchNorm (googlenet, mobilenet_v2, the resnets) end in
    1x1 maps at 32x32 and below, and BatchNorm cannot train on one value per channel, so a
    training batch of a single sample raises, and one of two samples can take a step
    that makes the eval-mode features overflow (docs/benchmarks.md, "On a GPU"):
    ``algorithms.base.TrainBatchIterator`` folds any incomplete last batch into the previous one.
    """

    def __init__(self, arch: str, backbone: nn.Module, backbone_dim: int, feature_dim: int, num_classes: int,
                 projector: str = "pool", normalize: bool = False):
        super().__init__()
        self.arch = arch
        self.backbone_dim = backbone_dim
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.normalize = normalize
        self.backbone = backbone
        self.projection = _projector(projector, backbone_dim, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, feature_dim) projected features: what prototypes are made of (unit length when
        ``normalize``: the hypersphere embedding h = phi(z) / |phi(z)| of FedLSA)."""
        f = self.projection(self.backbone(x))
        return torch.nn.functional.normalize(f, dim=1) if self.normalize else f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def forward_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) from one pass, for losses that need both."""
        f = self.features(x)
        return f, self.head(f)

    def extra_repr(self) -> str:
        return (f"arch={self.arch!r}, backbone_dim={self.backbone_dim}, feature_dim={self.feature_dim}"
                + (", normalize=True" if self.normalize else ""))


def _projector(kind: str, backbone_dim: int, feature_dim: int) -> nn.Module:
    """The module from the extractor's flat output to the features (see :class:`ProtoModel`)."""
    if kind == "pool":  # HtFLlib BaseHeadSplit: the last layer replaced by nn.AdaptiveAvgPool1d(feature_dim)
        return nn.AdaptiveAvgPool1d(feature_dim)  # on (B, D) it pools along D, per sample
    if kind == "linear":
        return nn.Linear(backbone_dim, feature_dim)
    if kind == "mlp":  # FedLSA's 2-layer projector phi
        return nn.Sequential(nn.Linear(backbone_dim, feature_dim), nn.ReLU(inplace=True),
                             nn.Linear(feature_dim, feature_dim))
    raise ValueError(f"projector must be one of {', '.join(map(repr, PROJECTORS))}, got {kind!r}")


def _output_dim(arch: str, backbone: nn.Module, in_channels: int, image_size: int) -> int:
    """Width of the backbone's flat output, from a dry run on one blank image.

    Eval mode so BatchNorm neither needs two samples nor updates its running statistics;
    the backbone is put back in training mode, the state a fresh ``nn.Module`` is in.
    """
    probe = _on_cpu_if_meta(backbone)
    probe.eval()
    try:
        with torch.no_grad():
            out = probe(torch.zeros(1, in_channels, image_size, image_size, device=next(
                (p.device for p in probe.parameters()), None)))
    except RuntimeError as err:  # a map shrunk to nothing: say which model and size, not just the op
        raise ValueError(
            f"architecture {arch!r} cannot take {image_size}x{image_size} images with {in_channels} channel(s): {err}"
        ) from err
    finally:
        probe.train()
    if out.dim() != 2:
        raise AssertionError(f"backbone of {arch!r} must return (B, D), got shape {tuple(out.shape)}")
    return int(out.shape[1])


def _on_cpu_if_meta(module: nn.Module) -> nn.Module:
    """``module`` itself, or, when its parameters are on torch's ``meta`` device (shapes only), an
    uninitialised CPU copy of it (``to_empty``: memory allocated, nothing initialised) for a dry run
    of shapes. A forward pass on ``meta`` runs torch's Python meta kernels, whose first use imports
    them with sympy: about 2 s of a run's start-up, where one image through the zoo's small CNNs
    takes milliseconds on the CPU (``system.architecture_macs`` builds on ``meta``)."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return module
    with torch.device("cpu"):
        return copy.deepcopy(module).to_empty(device="cpu")


def register_backbone(name: str, help: str, *, stem: bool = False,
                      imagenet_weights: Optional[str] = None) -> Callable[[BackboneFactory], BackboneFactory]:
    """Decorator: register a backbone factory under ``name`` in ``ARCHITECTURES`` as a ``ProtoModel`` builder.

    The factory is ``(in_channels, image_size) -> nn.Module`` mapping (B, C, H, W) images to flat
    (B, backbone_dim); the projector to ``feature_dim`` (``model.projector``) and the head are added here, and
    ``backbone_dim`` is measured with a dry run. Plug-in packages (entry point group
    ``rayfed_proto.models``) use it as the built-ins do.

    ``stem=True``: the factory also takes ``stem`` (one of :data:`STEMS`, ``model.stem``); other
    architectures ignore ``model.stem``. ``imagenet_weights``: the name of its torchvision weights
    (``"ResNet18_Weights.IMAGENET1K_V1"``), which ``model.weights: imagenet`` loads; None: it has none.
    The builder carries both as attributes ``takes_stem`` and ``imagenet_weights``.
    """

    def decorator(make_backbone: BackboneFactory) -> BackboneFactory:
        dims: dict[tuple[int, int, str], int] = {}  # the dry run once per input shape: a worker builds its clients' models often

        def builder(in_channels: int, image_size: int, num_classes: int, feature_dim: int = 512,
                    projector: str = "pool", normalize: bool = False, *, stem: str = "imagenet",
                    weights: str = "none") -> ProtoModel:
            if stem not in STEMS:
                raise ValueError(f"model.stem must be one of {', '.join(map(repr, STEMS))}, got {stem!r}")
            stem = stem if builder.takes_stem else "imagenet"  # model.stem: only the architectures with a stem
            backbone = make_backbone(in_channels, image_size, stem=stem) if builder.takes_stem else \
                make_backbone(in_channels, image_size)
            shape = (in_channels, image_size, stem)
            if shape not in dims or any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in backbone.modules()):
                dims[shape] = _output_dim(name, backbone, in_channels, image_size)
            if weights != "none":
                load_extractor_weights(name, backbone, weights, builder.imagenet_weights)
            return ProtoModel(name, backbone, dims[shape], feature_dim, num_classes, projector, normalize)

        builder.__name__ = builder.__qualname__ = f"build_{name}"
        builder.__doc__ = help
        builder.takes_stem = stem
        builder.imagenet_weights = imagenet_weights
        ARCHITECTURES.add(name, builder, help=help)
        return make_backbone

    return decorator


def takes_stem(arch: str) -> bool:
    """Whether ``arch`` has a ``model.stem`` choice (the ResNets)."""
    return getattr(ARCHITECTURES.get(arch), "takes_stem", False)


def imagenet_weights(arch: str) -> Optional[str]:
    """The torchvision weights ``model.weights: imagenet`` loads into ``arch``; None where it has none."""
    return getattr(ARCHITECTURES.get(arch), "imagenet_weights", None)


def _first_conv(conv: nn.Conv2d, in_channels: int, init: Callable[[torch.Tensor], object]) -> nn.Conv2d:
    """``conv`` rebuilt for ``in_channels`` inputs, initialised the way its model initialises convs.

    torchvision's ImageNet models hard-code 3 input channels; the replacement keeps every other
    hyper-parameter (kernel, stride, padding) so the stem is otherwise torchvision's.
    """
    new = nn.Conv2d(
        in_channels, conv.out_channels, kernel_size=conv.kernel_size, stride=conv.stride,
        padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    )
    init(new.weight)
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    return new


def _kaiming_fan_out(w: torch.Tensor) -> object:
    # ResNet's and MobileNetV2's own conv init in torchvision.
    return nn.init.kaiming_normal_(w, mode="fan_out", nonlinearity="relu")


def _googlenet_init(w: torch.Tensor) -> object:
    # GoogLeNet's own conv init in torchvision (init_weights=True).
    return nn.init.trunc_normal_(w, mean=0.0, std=0.01, a=-2, b=2)


# --- the FedSA paper's heterogeneous extractors (HtFE8) ---------------------------------------


@register_backbone("cnn", help="FedAvg 4-layer CNN (McMahan et al.; HtFLlib FedAvgCNN): 2 conv5x5 + fc 512")
def _cnn(in_channels: int, image_size: int) -> nn.Module:
    """HtFLlib's FedAvgCNN without its last layer (``fc``), which is our head.

    conv5x5(32) ReLU maxpool2, conv5x5(64) ReLU maxpool2, flatten, fc 512 ReLU. The reference
    convs are unpadded, which needs images of at least 16x16 (16 -> 12 -> 6 -> 2 -> 1); at 32x32
    that gives its 1600-d flatten. **Decision**: below 16x16 the convs get padding=2 ("same"), so
    that tiny images (4x4 up) still run; at the paper's sizes (28, 32) the network is the
    reference one, parameter for parameter.
    """
    pad = 0 if image_size >= 16 else 2
    side = image_size - 4 + 2 * pad
    side = (side // 2 - 4 + 2 * pad) // 2
    if side < 1:
        raise ValueError(f"architecture 'cnn' needs images of at least 4x4, got {image_size}x{image_size}")
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, kernel_size=5, padding=pad),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=5, padding=pad),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * side * side, 512),
        nn.ReLU(inplace=True),
    )


@register_backbone("googlenet", help="torchvision GoogLeNet (Inception v1), no aux heads; ImageNet weights; 1024-d",
                   imagenet_weights="GoogLeNet_Weights.IMAGENET1K_V1")
def _googlenet(in_channels: int, image_size: int) -> nn.Module:
    # Needs images of at least 15x15: below that a max pool receives an empty map.
    # transform_input re-normalises 3 ImageNet channels, wrong for other data and impossible with 1
    # channel (also with model.weights: imagenet, whose file torchvision pairs with transform_input=True). torchvision's dropout before the removed fc stays: it regularises the features in
    # training and is off in eval mode, where prototypes are computed.
    import torchvision  # imported lazily: 1.5 s per process, and the small CNNs never need it

    model = torchvision.models.googlenet(weights=None, aux_logits=False, transform_input=False, init_weights=True)
    model.conv1.conv = _first_conv(model.conv1.conv, in_channels, _googlenet_init)
    model.fc = nn.Identity()
    return model


@register_backbone("mobilenet_v2", help="torchvision MobileNetV2; ImageNet weights; 1280-d",
                   imagenet_weights="MobileNet_V2_Weights.IMAGENET1K_V1")
def _mobilenet_v2(in_channels: int, image_size: int) -> nn.Module:
    import torchvision

    model = torchvision.models.mobilenet_v2(weights=None)
    model.features[0][0] = _first_conv(model.features[0][0], in_channels, _kaiming_fan_out)
    model.classifier = nn.Identity()  # its dropout + fc; the forward already pools and flattens
    return model


def _resnet_stem(model: nn.Module, in_channels: int, stem: str) -> None:
    """Replace ``model``'s stem for ``in_channels`` inputs: ``imagenet`` keeps torchvision's (conv7x7
    stride 2, padding 3, then maxpool3x3 stride 2: a 32x32 image is 8x8 at the first block), as
    HtFLlib's ResNets; ``cifar`` is FedSC's (hwang52/FedSC model/resnet_base.py, ``ResNet.__init__``
    ``self.conv1 = conv3x3(3, nf * 1)`` and ``forward`` without a max-pool): conv3x3 stride 1,
    padding 1, no bias, no pool, so a 32x32 image is 32x32 at the first block. BatchNorm and ReLU
    after the conv are torchvision's ``bn1``/``relu`` either way."""
    if stem == "cifar":
        model.conv1 = nn.Conv2d(in_channels, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        _kaiming_fan_out(model.conv1.weight)
        model.maxpool = nn.Identity()
    else:
        model.conv1 = _first_conv(model.conv1, in_channels, _kaiming_fan_out)


def _register_resnet(depth: int, width: int, weights: Optional[str]) -> None:
    # With the imagenet stem, small images reach 1x1 maps early, and the adaptive average pool
    # still yields finite features.
    def make(in_channels: int, image_size: int, stem: str) -> nn.Module:
        import torchvision

        if depth == 10:  # not in torchvision: its ResNet class with one BasicBlock per stage (see below)
            from torchvision.models.resnet import BasicBlock, ResNet

            model = ResNet(BasicBlock, [1, 1, 1, 1])
        else:
            model = getattr(torchvision.models, f"resnet{depth}")(weights=None)
        _resnet_stem(model, in_channels, stem)
        model.fc = nn.Identity()
        return model

    published = f"ImageNet weights; {width}-d" if weights else f"no published weights; {width}-d"
    what = "HtFLlib's ResNet-10 (torchvision's ResNet, BasicBlocks [1, 1, 1, 1])" if depth == 10 else \
        f"torchvision ResNet-{depth}"
    register_backbone(f"resnet{depth}", help=f"{what} (model.stem imagenet|cifar); {published}",
                      stem=True, imagenet_weights=weights)(make)


# ResNet-10 as the FedSA/HtFLlib authors define it: ``resnet10 = ResNet(BasicBlock, [1, 1, 1, 1])``,
# "10 = 2 + 2 * (1 + 1 + 1 + 1)", in flcore/trainmodel/resnet.py (HtFLlib's file is not stored
# here; read in TsingZ0/PFLlib and TsingZ0/FedL2G, the same author's, at system/flcore/trainmodel/
# resnet.py): torchvision's ImageNet stem and stage widths 64-128-256-512, so torchvision's ResNet
# class with one BasicBlock per stage. Deviation: PFLlib's copy builds its BatchNorms with
# track_running_stats=False (batch statistics in eval mode too); FedL2G's, and ours, are standard.
# FedSC's resnet10 (model/resnet_base.py) is the same blocks with the cifar stem.
for _depth, _width, _weights in ((10, 512, None), (18, 512, "ResNet18_Weights.IMAGENET1K_V1"),
                                 (34, 512, "ResNet34_Weights.IMAGENET1K_V1"),
                                 (50, 2048, "ResNet50_Weights.IMAGENET1K_V1"),
                                 (101, 2048, "ResNet101_Weights.IMAGENET1K_V1"),
                                 (152, 2048, "ResNet152_Weights.IMAGENET1K_V1")):
    _register_resnet(_depth, _width, _weights)


# --- small models, so that 20 heterogeneous clients train quickly on a 2-core CPU ----------------


def _conv3x3_stack(in_channels: int, image_size: int, widths: tuple[int, ...]) -> nn.Sequential:
    """conv3x3 ReLU maxpool2 per width, then flatten and fc 128 ReLU."""
    layers: list[nn.Module] = []
    side = image_size
    for width in widths:
        layers += [nn.Conv2d(in_channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        in_channels, side = width, side // 2
    if side < 1:
        raise ValueError(
            f"{len(widths)} poolings need images of at least {2 ** len(widths)}x{2 ** len(widths)}, "
            f"got {image_size}x{image_size}"
        )
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(in_channels * side * side, 128), nn.ReLU(inplace=True))


@register_backbone("cnn_narrow", help="small CNN: conv3x3 16, 32 (+ maxpools), fc 128")
def _cnn_narrow(in_channels: int, image_size: int) -> nn.Module:
    return _conv3x3_stack(in_channels, image_size, (16, 32))


@register_backbone("cnn_deep", help="small CNN: conv3x3 16, 32, 64 (+ maxpools), fc 128")
def _cnn_deep(in_channels: int, image_size: int) -> nn.Module:
    return _conv3x3_stack(in_channels, image_size, (16, 32, 64))


@register_backbone("mlp", help="MLP on flattened pixels: 256, 128 with ReLU")
def _mlp(in_channels: int, image_size: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size * image_size, 256),
        nn.ReLU(inplace=True),
        nn.Linear(256, 128),
        nn.ReLU(inplace=True),
    )


# --- groups -------------------------------------------------------------------------------------

# The FedSA authors' model families (lokinko/FedSA system/main.py, ``args.model_family``, lines
# 47-98 at commit 75bf106), client i getting models[i % len] (HtFLlib's BaseHeadSplit). FedSA
# Table 2's columns are HtFE2, HtFE3, HtFE5 and HtFE8. The family "FedAvg" there (the CNN alone)
# is HtFE1 here. mobilenet_v2 there is HtFLlib's own copy of torchvision's MobileNetV2.
_HTFE = {
    "HtFE1": ["cnn"],  # their "FedAvg" family (lines 47-50)
    "HtFE2": ["cnn", "resnet18"],  # lines 66-70
    "HtFE3": ["resnet10", "resnet18", "resnet34"],  # lines 72-77
    "HtFE4": ["cnn", "googlenet", "mobilenet_v2", "resnet18"],  # lines 79-85
    "HtFE5": ["cnn", "resnet10", "resnet18", "resnet34", "resnet50"],  # lines 57-64
    # lines 87-98; the FedSA paper's "Model heterogeneity" paragraph, in its order
    "HtFE8": ["cnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"],
}
# Registry.add falls back to the object's docstring, which for a list is list's own: always give help.
for _name, _archs in _HTFE.items():
    MODEL_GROUPS.add(_name, _archs, help="homogeneous: the FedAvg CNN for every client" if _name == "HtFE1" else
                     f"FedSA's {_name} (lokinko/FedSA system/main.py): " + ", ".join(_archs))
MODEL_GROUPS.add("ResNet18", ["resnet18"], help="homogeneous: ResNet-18 for every client (FedSAP's CIFAR setting)")
MODEL_GROUPS.add("ResNet10", ["resnet10"], help="homogeneous: ResNet-10 for every client (FedSC's CIFAR setting)")
MODEL_GROUPS.add(
    "small_hetero", ["cnn", "cnn_narrow", "cnn_deep", "mlp"],
    help="4 heterogeneous small models for CPU demos: cnn, cnn_narrow, cnn_deep, mlp",
)


# --- public entry points -------------------------------------------------------------------------


def build_model(arch: str, in_channels: int, image_size: int, num_classes: int, feature_dim: int = 512,
                projector: str = "pool", normalize: bool = False, *, stem: str = "imagenet",
                weights: str = "none") -> ProtoModel:
    """``arch`` for ``in_channels`` x ``image_size`` x ``image_size`` images.

    ``stem`` (``model.stem``) applies to the architectures that have one (:func:`takes_stem`, the
    ResNets) and is ignored by the others; ``weights`` (``model.weights``: none, imagenet or a path)
    initialises the extractor (:mod:`rayfed_proto.models.weights`). Raises ``UnknownNameError``
    (listing the allowed names) for an unregistered ``arch``, ``ValueError`` for sizes the
    architecture cannot take, and ``WeightsUnavailableError`` (a ``ValueError``) for weights that
    cannot be had.
    """
    builder = ARCHITECTURES.get(arch)
    for key, value in (("in_channels", in_channels), ("image_size", image_size),
                       ("num_classes", num_classes), ("feature_dim", feature_dim)):
        if value < 1:
            raise ValueError(f"{key} must be positive, got {value}")
    if stem == "imagenet" and weights == "none":  # the call a plug-in builder without these keywords takes too
        return builder(in_channels, image_size, num_classes, feature_dim, projector, normalize)
    return builder(in_channels, image_size, num_classes, feature_dim, projector, normalize, stem=stem, weights=weights)


def arch_for_client(group: str, client_id: int) -> str:
    """Architecture of client ``client_id`` (0-based) in ``group``: ``archs[client_id % len(archs)]``."""
    archs = MODEL_GROUPS.get(group)
    if client_id < 0:
        raise ValueError(f"client_id must be >= 0, got {client_id}")
    return archs[client_id % len(archs)]


def build_client_model(
    group: str, client_id: int, in_channels: int, image_size: int, num_classes: int, feature_dim: int = 512,
    projector: str = "pool", normalize: bool = False, shared_seed: Optional[int] = None, *, stem: str = "imagenet",
    weights: str = "none",
) -> ProtoModel:
    """The model of client ``client_id`` in ``group`` (``stem``, ``weights``: as :func:`build_model`).

    Initial weights: with ``shared_seed`` (``model.init: shared``) every client of one
    architecture gets the same ones, drawn from ``torch.manual_seed(shared_seed)`` inside
    ``torch.random.fork_rng`` (the caller's torch RNG is left as it was), as HtFLlib seeds torch
    with 0 right before it builds each client's model (system/flcore/clients/clientbase.py,
    ``Client.__init__``); without it (``per_client``) they are drawn from torch's global RNG
    as it stands, which the caller seeds per client. ``weights`` then overwrites the extractor's.
    """
    arch = arch_for_client(group, client_id)
    build = functools.partial(build_model, arch, in_channels, image_size, num_classes, feature_dim, projector,
                              normalize, stem=stem, weights=weights)
    if shared_seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shared_seed)
        return build()
