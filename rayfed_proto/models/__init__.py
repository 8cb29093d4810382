"""Model zoo: every model is feature extractor -> projection to ``feature_dim`` -> linear head.

``ARCHITECTURES``: name -> builder ``(in_channels, image_size, num_classes, feature_dim) -> ProtoModel``.
``MODEL_GROUPS``: name -> list of architecture names; client i gets ``archs[i % len(archs)]``.
"""

from rayfed_proto.registry import Registry

ARCHITECTURES: Registry = Registry("architecture")
MODEL_GROUPS: Registry = Registry("model group")

from rayfed_proto.models.zoo import ProtoModel, arch_for_client, build_client_model, build_model  # noqa: E402

__all__ = ["ARCHITECTURES", "MODEL_GROUPS", "ProtoModel", "build_model", "build_client_model", "arch_for_client"]
