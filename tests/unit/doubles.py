"""Test doubles shared by the algorithm tests."""

import numpy as np
import torch

from rayfed_proto.messages import PrototypeSet


class FixedModel(torch.nn.Module):
    """features(x) = x, logits = x @ W with W = 0: a test chooses the features exactly, and CE is
    ln(num_classes) whatever x is."""

    def __init__(self, dim=2, num_classes=3):
        super().__init__()
        self.head = torch.nn.Linear(dim, num_classes, bias=False)
        torch.nn.init.zeros_(self.head.weight)

    def features(self, x):
        return x

    def forward_features(self, x):
        return x, self.head(x)


def pset(ids, vecs, counts):
    return PrototypeSet(np.array(ids, np.int64), np.array(vecs, np.float32), np.array(counts, np.int64))
