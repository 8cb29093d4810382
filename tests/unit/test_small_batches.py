"""No training step on a handful of samples: an incomplete last batch joins the previous one.

The cause of the non-finite evaluation features in bench/gpu_share.py's workload on the CPU
(docs/benchmarks.md, "On a GPU"): a client of 142 samples at batch 10 ended its epoch with a
batch of 2, whose one step through BatchNorm (1x1 maps in the ResNets at 32x32) moved a
BatchNorm weight from 1.2 to 330, and the eval-mode features overflowed.
"""

from __future__ import annotations

import pytest
import torch

from rayfed_proto.algorithms.base import TrainBatchIterator


@pytest.mark.parametrize("n", [142, 21, 29, 30, 9, 10, 11, 2])
def test_no_batch_is_smaller_than_batch_size_and_every_sample_trains_once(n: int) -> None:
    it = TrainBatchIterator(torch.arange(n).float().unsqueeze(1), torch.arange(n), 10, torch.Generator().manual_seed(0))
    sizes = [len(yb) for _, yb in it.epoch()]
    assert sorted(torch.cat([yb for _, yb in TrainBatchIterator(
        torch.arange(n).float().unsqueeze(1), torch.arange(n), 10, torch.Generator().manual_seed(0)).epoch()]).tolist()) \
        == list(range(n))
    if n >= 10:
        assert min(sizes) >= 10 and max(sizes) <= 19, sizes  # 142 = 13 x 10 + 12, never ... + 2
    else:
        assert sizes == [n]  # fewer samples than a batch: one batch of all of them


def test_the_142_sample_client_of_the_divergence_gets_no_batch_of_two() -> None:
    it = TrainBatchIterator(torch.zeros(142, 1), torch.zeros(142, dtype=torch.long), 10, torch.Generator().manual_seed(0))
    assert [len(yb) for _, yb in it.epoch()] == [10] * 13 + [12]
