"""Train-time augmentation of a client's mini-batches (``data.augment``), on tensors.

The transforms are torchvision's, as the FedSC authors run them (hwang52/FedSC ``main_fedsc.py``,
``Local.local_train``: ``transforms.Compose([RandomCrop(32, padding=4), RandomHorizontalFlip()])``
applied to each training batch on the device), and as FPL's code (WenkeHuang/RethinkFL
``datasets/digits.py``, ``Nor_TRANSFORM``), which FedLSA follows, lists them:

* ``crop``: pad each side with ``padding`` = 4 zeros (``RandomCrop``'s default ``fill=0``), then
  take a random window of the input's own size: offsets (i, j) each uniform in [0, 2 x padding].
* ``flip``: mirror along the width axis with probability 0.5 (``RandomHorizontalFlip``).

The batches are the normalised tensors (``ArrayDataset.tensors``), so the padding is 0 after
normalisation, as in FedSC's code (its ``Normalize`` runs in the dataset, the crop on the batch).
``per``: ``sample`` draws an offset and a coin per image (torchvision's transforms inside a
``Dataset``, one image at a time: FPL's code); ``batch`` draws one of each for the whole batch,
which is what FedSC's code computes: torchvision's transforms given a 4-d batch tensor crop every
image at one offset and flip all or none.

Every random number comes from the ``torch.Generator`` passed in: the client's own batch
generator (``TrainBatchIterator.generator``, saved with the client's state), so two runs with the
same seed augment every batch identically, and a client batched with others
(``resources.batch_clients``) draws what it draws alone. Evaluation never sees these transforms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rayfed_proto.config import AUGMENTATIONS, DataConfig

CROP_PADDING = 4  # FedSC main_fedsc.py and FPL datasets/digits.py: RandomCrop(32, padding=4)
FLIP_PROBABILITY = 0.5  # RandomHorizontalFlip's default p


def random_crop(x: torch.Tensor, generator: torch.Generator, padding: int = CROP_PADDING,
                per: str = "sample") -> torch.Tensor:
    """(N, C, H, W) -> (N, C, H, W): zero-pad ``padding`` on every side, then the H x W window at
    row offset i and column offset j, each uniform in [0, 2 x padding] (i drawn before j, as in
    ``RandomCrop.get_params``); one (i, j) per image, or one for the batch with ``per='batch'``."""
    n, _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))  # fill 0
    draws = 1 if per == "batch" else n
    i = torch.randint(0, 2 * padding + 1, (draws,), generator=generator)
    j = torch.randint(0, 2 * padding + 1, (draws,), generator=generator)
    if per == "batch":
        top, left = int(i), int(j)
        return padded[:, :, top:top + h, left:left + w].contiguous()
    rows = (i[:, None] + torch.arange(h)).to(x.device)  # (N, H): each image's window rows
    cols = (j[:, None] + torch.arange(w)).to(x.device)  # (N, W)
    picked = padded[torch.arange(n, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return picked.permute(0, 3, 1, 2).contiguous()  # advanced indices first: (N, H, W, C) -> (N, C, H, W)


def random_flip(x: torch.Tensor, generator: torch.Generator, per: str = "sample") -> torch.Tensor:
    """(N, C, H, W): each image (or, ``per='batch'``, the whole batch) mirrored along the width
    axis where a uniform draw is below 0.5 (``RandomHorizontalFlip``: ``torch.rand(1) < p``)."""
    coins = torch.rand(1 if per == "batch" else len(x), generator=generator) < FLIP_PROBABILITY
    if per == "batch":
        return x.flip(-1) if bool(coins) else x
    return torch.where(coins.to(x.device)[:, None, None, None], x.flip(-1), x)


_TRANSFORMS = {"crop": random_crop, "flip": random_flip}
assert set(_TRANSFORMS) == set(AUGMENTATIONS)


@dataclass(frozen=True)
class BatchAugment:
    """The transforms ``names`` applied in order to a training batch, drawing from the generator
    given (a ``TrainBatchIterator``'s ``augment``)."""

    names: tuple[str, ...]
    per: str = "sample"

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        for name in self.names:
            x = _TRANSFORMS[name](x, generator, per=self.per)
        return x


def batch_augment(cfg: DataConfig) -> Optional[BatchAugment]:
    """The training batches' augmentation of ``data.augment`` (None: off)."""
    return BatchAugment(tuple(cfg.augment), cfg.augment_per) if cfg.augment else None
