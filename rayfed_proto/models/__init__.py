"""Model zoo: every model is feature extractor -> projector to ``feature_dim`` -> linear head.

``ARCHITECTURES``: name -> builder ``(in_channels, image_size, num_classes, feature_dim, projector, normalize)
-> ProtoModel`` (keywords ``stem``, ``weights``); the projector is by default ``pool`` (HtFLlib's
``BaseHeadSplit``), see ``zoo``; ``model.weights`` loading: ``weights``.
``MODEL_GROUPS``: name -> list of architecture names; client i gets ``archs[i % len(archs)]``.

Importing this package registers the built-ins (``zoo``), then imports every entry point of
group ``rayfed_proto.models`` (``registry.load_plugins``): a plug-in module registers
architectures (``register_backbone``) and groups (``MODEL_GROUPS.add``) when imported.
"""

from rayfed_proto.registry import Registry, load_plugins

ARCHITECTURES: Registry = Registry("architecture")
MODEL_GROUPS: Registry = Registry("model group")

from rayfed_proto.models.weights import WEIGHTS_KEYWORDS, WeightsUnavailableError  # noqa: E402
from rayfed_proto.models.zoo import (  # noqa: E402
    PROJECTORS,
    STEMS,
    ProtoModel,
    arch_for_client,
    build_client_model,
    build_model,
    imagenet_weights,
    register_backbone,
    takes_stem,
)

# after the built-ins and the public names above, so plug-ins can import them from here
load_plugins("rayfed_proto.models", "model")

__all__ = ["ARCHITECTURES", "MODEL_GROUPS", "PROJECTORS", "STEMS", "WEIGHTS_KEYWORDS", "ProtoModel", "WeightsUnavailableError",
           "build_model", "build_client_model", "arch_for_client", "imagenet_weights", "register_backbone", "takes_stem"]
