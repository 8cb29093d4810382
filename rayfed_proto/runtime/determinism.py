"""``resources.deterministic``: deterministic kernels in a process that trains or evaluates models.

Applied by every actor first thing in its constructor (before its first CUDA call: cuBLAS reads
``CUBLAS_WORKSPACE_CONFIG`` when it creates its handle) and by the in-process paths
(:class:`~rayfed_proto.runtime.client_core.ClientRunner` and the server core build their models after
it), so one setting covers the Ray layouts, the in-process loop and the driver.

What it sets (PyTorch's "Reproducibility" notes):

- ``torch.use_deterministic_algorithms(True, warn_only=True)``: deterministic kernels wherever
  torch has one. **Decision**: ``warn_only``, because a few CUDA backward passes have no
  deterministic kernel at all (``adaptive_avg_pool2d``'s, which every ResNet, GoogLeNet and
  MobileNetV2 and the ``pool`` projector use) and would otherwise raise. Its kernel adds each
  gradient term atomically: the global pooling of those extractors gives every input element
  one term, and the ``pool`` projector averaging down (backbone_dim >= feature_dim) at most two
  (its windows overlap by one element), and two floating-point additions onto zero commute, so
  those passes still give the same bits run to run. A ``pool`` projector repeating a narrower
  output up (the small CPU models at feature_dim 512) gets several terms per element: not
  covered.
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's deterministic workspace, CUDA >= 10.2), unless the
  environment already sets it.
- ``torch.backends.cudnn.benchmark = False`` (no run-time kernel autotuning) and
  ``torch.backends.cudnn.deterministic = True``.

With the setting off nothing is changed, except that a process this module made deterministic
before (an in-process run earlier in the same interpreter) is put back to torch's defaults.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"

_applied = False  # this process was made deterministic by apply_determinism


def apply_determinism(enabled: bool) -> None:
    """Make this process's kernels deterministic (``enabled``), or undo an earlier call of ours."""
    global _applied
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        _applied = True
    elif _applied:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        _applied = False
