"""training.trailing_batch: an epoch's incomplete last batch folded into the previous one or dropped."""

from __future__ import annotations

import pytest
import torch

from rayfed_proto.algorithms.base import TrainBatchIterator, steps_per_epoch
from rayfed_proto.config import ConfigError, build_config


def _sizes(n: int, batch_size: int, drop_last: bool) -> tuple[list[int], list[int]]:
    it = TrainBatchIterator(torch.arange(n).float().view(n, 1), torch.arange(n), batch_size,
                            torch.Generator().manual_seed(0), drop_last=drop_last)
    batches = list(it.epoch())
    return [len(y) for _, y in batches], sorted(int(v) for _, y in batches for v in y)


@pytest.mark.parametrize(("n", "fold", "drop"), [
    (25, [10, 15], [10, 10]),      # 2 full batches and 5 left: folded into the second, or dropped
    (30, [10, 10, 10], [10, 10, 10]),  # no incomplete batch: the same either way
    (11, [11], [10]),              # one sample left over
    (7, [7], [7]),                 # fewer than one batch: one batch of all the client has, both ways
    (10, [10], [10]),
])
def test_batches_per_epoch_and_their_sizes(n, fold, drop):
    sizes, seen = _sizes(n, 10, drop_last=False)
    assert sizes == fold and seen == list(range(n))  # fold: every sample once
    sizes, seen = _sizes(n, 10, drop_last=True)
    assert sizes == drop and len(set(seen)) == sum(drop)  # drop: distinct samples, the remainder unseen
    assert steps_per_epoch(n, 10) == len(fold) == len(drop)


def test_drop_draws_the_same_order_as_fold():
    # the permutation is drawn the same way: the kept batches are fold's first ones
    n = 25
    folded = TrainBatchIterator(torch.zeros(n, 1), torch.arange(n), 10, torch.Generator().manual_seed(3))
    dropped = TrainBatchIterator(torch.zeros(n, 1), torch.arange(n), 10, torch.Generator().manual_seed(3), drop_last=True)
    (_, a1), (_, a2) = folded.epoch()
    (_, b1), (_, b2) = dropped.epoch()
    assert torch.equal(a1, b1) and torch.equal(a2[:10], b2)


def test_trailing_batch_config_default_and_clear_error():
    assert build_config({}, []).training.trailing_batch == "fold"
    assert build_config({}, ["training.trailing_batch=drop"]).training.trailing_batch == "drop"
    with pytest.raises(ConfigError, match=r"training.trailing_batch.*'fold' or 'drop'"):
        build_config({}, ["training.trailing_batch=last"])


def test_the_client_runner_takes_the_setting():
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.runtime.client_core import ClientHost

    cfg = build_config({}, ["federation.num_clients=2", "model.group=HtFE1", "data.image_size=8",
                            "training.batch_size=16", "training.trailing_batch=drop", "data.global_test_fraction=0"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 2, cfg.seed, cfg.data.test_fraction)
    host = ClientHost(cfg, ds, list(part.clients), torch.device("cpu"))
    runner = host._runner(host.client_ids[0])
    assert runner.batches.drop_last
    assert {len(y) for _, y in runner.batches.epoch()} == ({16} if len(runner.batches.y) >= 16 else {len(runner.batches.y)})
