"""Entry point of group ``rayfed_proto.models``: an architecture and a model group.

``register_backbone`` turns a factory ``(in_channels, image_size) -> module`` whose output is
flat (B, backbone_dim) into a ``ProtoModel`` builder (projection to ``feature_dim`` + head).
"""

from torch import nn

from rayfed_proto.models import MODEL_GROUPS, register_backbone


@register_backbone("plugin_tiny_mlp", help="example plug-in: flattened pixels, one hidden layer of 32")
def tiny_mlp(in_channels: int, image_size: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, 32), nn.ReLU(inplace=True))


# client i gets archs[i % len(archs)]: a group may mix plug-in and built-in architectures
MODEL_GROUPS.add("plugin_tiny", ["plugin_tiny_mlp", "mlp"], help="example plug-in: plugin_tiny_mlp, mlp")
