"""Initial weights of a client's extractor (``model.weights``): none, ImageNet, or a local file.

- ``none`` (default): the architecture's own random init, as HtFLlib's heterogeneous-model
  experiments (``pretrained=False`` everywhere in FedSA's and HtFLlib's ``system/main.py``).
- ``imagenet``: torchvision's published ImageNet weights for the architecture (FedSAP Sec. 4.1:
  "a ResNet-18 initialised with ImageNet pre-trained weights"). The file is fetched with
  torchvision's own weight enum (``WeightsEnum.get_state_dict``) into torch hub's cache
  (``torch.hub.get_dir()/checkpoints``), once per machine; a cached file is used without any
  network. We take each architecture's ``IMAGENET1K_V1`` weights, what the papers'
  ``pretrained=True`` meant (torchvision's ``DEFAULT`` is V2 for some, e.g. ResNet-50).
  Where the download fails (no network, as on a cluster without egress) the error names the
  file to place in the cache and the other option, a path.
- a path: a ``torch.save``'d state dict of the extractor (``model.backbone.state_dict()``),
  or of a whole zoo model (keys ``backbone.*``, the rest ignored), or of the torchvision model
  itself (its classification head ``fc`` / ``classifier`` / ``aux1`` / ``aux2`` ignored: the zoo
  replaces it with its projector and head).

Only the extractor is loaded; the projector and head keep their init (``model.init``).

The first convolution is where the zoo's models depart from the published ones: it takes the
dataset's channels (``in_channels`` != 3) and, with ``model.stem: cifar``, is a 3x3 stride-1
conv instead of torchvision's 7x7 stride-2. **Decision**: a first-conv weight of another shape
is skipped (that conv keeps its fresh init) with one logged warning per architecture and
source, and every other tensor must match: the layers after the stem see the same channels
either way, so the rest of the pretrained extractor still applies (the usual practice when
fine-tuning ImageNet ResNets on CIFAR); any other missing, unexpected or mis-shaped tensor is an
error naming them, never a silent partial load.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

log = logging.getLogger(__name__)

WEIGHTS_KEYWORDS = ("none", "imagenet")
"""``model.weights`` values other than a path."""

_HEAD_PREFIXES = ("fc.", "classifier.", "aux1.", "aux2.")
"""torchvision's classification heads (the zoo swaps them for its projector and head)."""

_noted: set[tuple[str, str, str]] = set()  # (arch, source, key): each skipped first conv logged once per process


class WeightsUnavailableError(ValueError):
    """``model.weights`` could not be loaded (not downloadable, no such file, wrong tensors).

    A ``ValueError``, not ``config.InputError``: ``rayfed_proto.config`` imports this package
    (the model checks), so this package does not import it back (tests/unit/test_import_cycles.py)."""


def hub_file(published: str) -> Path:
    """Where torch hub keeps the file of torchvision weights ``published`` (e.g.
    ``ResNet18_Weights.IMAGENET1K_V1``): ``torch.hub.get_dir()/checkpoints/<file name of its URL>``."""
    from torchvision.models import get_weight

    url = get_weight(published).url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def imagenet_state(published: str) -> dict[str, torch.Tensor]:
    """torchvision's ``published`` weights, from torch hub's cache or downloaded into it."""
    from torchvision.models import get_weight

    weights = get_weight(published)
    try:
        return weights.get_state_dict(progress=False, check_hash=True)
    except Exception as err:  # URLError, HTTPError, OSError, a hash mismatch: all "could not get the file"
        raise WeightsUnavailableError(
            f"model.weights = 'imagenet': could not get torchvision's {published} ({weights.url}) into the torch hub "
            f"cache: {type(err).__name__}: {err}. This machine may have no network: either copy that file to "
            f"{hub_file(published)} (the cache torchvision reads first), or set model.weights to the path of a "
            f"state_dict file (.pt/.pth) of the extractor") from err


@functools.lru_cache(maxsize=4)  # a worker builds its clients' models often; load_state_dict copies the tensors
def _cached_imagenet_state(published: str) -> dict[str, torch.Tensor]:
    return imagenet_state(published)


def file_state(path: str) -> dict[str, torch.Tensor]:
    """The state dict saved at ``path`` (tensors only: ``weights_only``), keys as described above."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise WeightsUnavailableError(
            f"model.weights = {path!r}: no such file; allowed: none, imagenet (torchvision's published weights, "
            f"downloaded into the torch hub cache) or the path of a state_dict file (.pt/.pth) of the extractor")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # not a torch file, or objects other than tensors
        raise WeightsUnavailableError(f"model.weights = {path!r}: not a torch state_dict file ({err})") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsUnavailableError(
            f"model.weights = {path!r}: holds a {type(state).__name__}, not a state_dict (name -> tensor); save one "
            f"with torch.save(model.backbone.state_dict(), path)")
    return state


@functools.lru_cache(maxsize=4)
def _cached_file_state(path: str, mtime_ns: int) -> dict[str, torch.Tensor]:
    return file_state(path)


def _extractor_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A zoo model's ``backbone.*`` entries without the prefix; a torchvision model's without its head."""
    if any(k.startswith("backbone.") for k in state):
        state = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    return {k: v for k, v in state.items() if not k.startswith(_HEAD_PREFIXES)}


def _first_conv_key(backbone: nn.Module) -> str:
    name = next(n for n, m in backbone.named_modules() if isinstance(m, nn.Conv2d))
    return f"{name}.weight"


def load_extractor_weights(arch: str, backbone: nn.Module, source: str, published: Optional[str]) -> None:
    """Load ``source`` (``imagenet`` or a path) into ``backbone`` in place (see the module doc).

    ``published``: the architecture's torchvision weights name, None where it has none.
    """
    if source == "imagenet":
        if published is None:
            raise WeightsUnavailableError(
                f"model.weights = 'imagenet': architecture {arch!r} has no published ImageNet weights in torchvision; "
                f"use none, or the path of a state_dict file (.pt/.pth) of its extractor")
        state = _cached_imagenet_state(published)
    else:
        file = Path(source).expanduser()
        state = _cached_file_state(str(file), file.stat().st_mtime_ns if file.is_file() else -1)
    state = _extractor_keys(state)
    own = backbone.state_dict()
    first = _first_conv_key(backbone)
    if first in state and first in own and state[first].shape != own[first].shape:
        _note_skipped_first_conv(arch, source, first, tuple(state[first].shape), tuple(own[first].shape))
        state = {k: v for k, v in state.items() if k != first}
        own = {k: v for k, v in own.items() if k != first}
    _check_keys(arch, source, state, own)
    backbone.load_state_dict(state, strict=False)  # everything but a skipped first conv: checked above


def _note_skipped_first_conv(arch: str, source: str, key: str, theirs: tuple, ours: tuple) -> None:
    if (arch, source, key) in _noted:
        return
    _noted.add((arch, source, key))
    log.warning("model.weights = %r: %s's first convolution %s has shape %s there and %s here (the dataset's "
                "channels, or model.stem: cifar): it keeps its fresh init, every other tensor of the extractor "
                "is loaded", source, arch, key, theirs, ours)


def _check_keys(arch: str, source: str, state: dict, own: dict) -> None:
    """Raise naming the tensors that do not fit (BatchNorm's ``num_batches_tracked`` may be absent:
    torchvision's older files predate it and BatchNorm fills it in)."""
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state
              if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{label} ({len(keys)}): {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"
                 for label, keys in (("missing", missing), ("unexpected", unexpected), ("other shape", shapes)) if keys]
        raise WeightsUnavailableError(
            f"model.weights = {source!r} does not fit the extractor of {arch!r}: " + "; ".join(parts))
