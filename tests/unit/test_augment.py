"""Train-time augmentation (``data.augment``, rayfed_proto/data/augment.py): exactly FedSC's
RandomCrop(32, padding=4) and RandomHorizontalFlip on tensors, drawn from the client's own batch
generator (reproducible, the same on the batched path), and never applied to evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.data.augment import BatchAugment, batch_augment, random_crop, random_flip
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime.client_core import ClientHost, ClientRunner
from rayfed_proto.training import batched

CPU = torch.device("cpu")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    """64 distinct random 3x8x8 images: every window of the padded image is told apart."""
    return torch.rand(64, 3, 8, 8, generator=gen(99)) + 0.5  # > 0: a window is never taken for padding


def window_offsets(x: torch.Tensor, out: torch.Tensor, padding: int = 4) -> list[tuple[int, int]]:
    """For each output image, the (row, column) offset of the zero-padded input's window it equals."""
    padded = F.pad(x, (padding,) * 4)
    h, w = x.shape[-2:]
    found = []
    for n in range(len(x)):
        hits = [(i, j) for i in range(2 * padding + 1) for j in range(2 * padding + 1)
                if torch.equal(out[n], padded[n, :, i:i + h, j:j + w])]
        assert len(hits) == 1, (n, hits)  # a shifted window of the zero-padded input, and only one
        found.append(hits[0])
    return found


def test_crop_is_a_window_of_the_zero_padded_input_offsets_0_to_8_per_image(x):
    out = random_crop(x, gen(1))
    assert out.shape == x.shape and out.is_contiguous()
    offsets = window_offsets(x, out)
    assert all(0 <= i <= 8 and 0 <= j <= 8 for i, j in offsets)
    # the offsets are RandomCrop.get_params's draws, i before j, one pair per image
    g = gen(1)
    i, j = torch.randint(0, 9, (64,), generator=g), torch.randint(0, 9, (64,), generator=g)
    assert offsets == list(zip(i.tolist(), j.tolist(), strict=True))
    assert len(set(offsets)) > 10  # not one offset for all (64 draws of 81)
    # the padding is zeros: an image cropped at row offset 0 starts with 4 rows of them
    top = [n for n, (i, _) in enumerate(offsets) if i == 0]
    assert top and all((out[n, :, :4] == 0).all() and (out[n, :, 4:] != 0).any() for n in top)


def test_crop_by_hand_on_a_2x2_image_with_padding_1():
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])  # padded 4x4: zeros around [[1, 2], [3, 4]]
    g = gen(5)
    i, j = int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(0, 3, (1,), generator=g))
    padded = torch.tensor([[0, 0, 0, 0], [0, 1, 2, 0], [0, 3, 4, 0], [0, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(random_crop(x, gen(5), padding=1)[0, 0], padded[i:i + 2, j:j + 2])


def test_crop_per_batch_uses_one_offset_for_every_image(x):
    offsets = window_offsets(x, random_crop(x, gen(2), per="batch"))
    assert len(set(offsets)) == 1 and all(0 <= v <= 8 for v in offsets[0])


def test_flip_mirrors_the_width_axis_with_probability_half_per_image(x):
    out = random_flip(x, gen(3))
    flipped = [torch.equal(o, xi.flip(-1)) for o, xi in zip(out, x, strict=True)]
    kept = [torch.equal(o, xi) for o, xi in zip(out, x, strict=True)]
    assert all(f != k for f, k in zip(flipped, kept, strict=True))  # each: the input or its mirror, never both
    coins = torch.rand(64, generator=gen(3)) < 0.5  # RandomHorizontalFlip: torch.rand(1) < p flips
    assert flipped == coins.tolist()
    assert 0 < sum(flipped) < 64
    assert torch.equal(x[0].flip(-1)[:, :, 0], x[0][:, :, -1])  # the mirror is along the width (last) axis


def test_flip_per_batch_flips_all_or_none(x):
    outs = [random_flip(x, gen(s), per="batch") for s in range(8)]
    states = ["all" if torch.equal(o, x.flip(-1)) else "none" if torch.equal(o, x) else "mixed" for o in outs]
    assert "mixed" not in states and {"all", "none"} == set(states)


def test_augment_applies_the_named_transforms_in_order_from_one_generator(x):
    g = gen(4)
    want = random_flip(random_crop(x, g), g)
    assert torch.equal(BatchAugment(("crop", "flip"))(x, gen(4)), want)
    assert torch.equal(BatchAugment(("flip",))(x, gen(4)), random_flip(x, gen(4)))


def iterator(seed: int, augment=None) -> TrainBatchIterator:
    xs = torch.arange(40 * 3 * 4 * 4, dtype=torch.float32).reshape(40, 3, 4, 4) + 1
    return TrainBatchIterator(xs, torch.arange(40), 16, gen(seed), augment)


def test_same_seed_same_augmented_batches_other_seed_differs():
    aug = BatchAugment(("crop", "flip"))
    a, b, c = iterator(7, aug), iterator(7, aug), iterator(8, aug)
    for _ in range(2):  # two epochs
        for (xa, ya), (xb, yb) in zip(a.epoch(), b.epoch(), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a.epoch(), c.epoch(), strict=True))


def test_augmentation_draws_after_the_epochs_order_and_off_leaves_batches_untouched():
    plain, aug = iterator(7), iterator(7, BatchAugment(("crop", "flip")))
    (xp, yp), (xa, ya) = next(plain.epoch()), next(aug.epoch())
    assert torch.equal(yp, ya)  # the first batch: the same samples, the permutation is drawn first
    assert not torch.equal(xp, xa)
    assert torch.equal(xp, plain.x[yp])  # off: the tensors as they are


def test_batched_path_draws_the_same_augmented_batches_as_the_client_alone():
    aug = BatchAugment(("crop", "flip"))
    alone, member = iterator(11, aug), iterator(11, aug)
    m = batched.Member(algorithm=None, model=None, optimizer=None, batches=member)
    got = list(batched._batches(m, epochs=2))
    want = [(xb, yb) for _ in range(2) for xb, yb in alone.epoch()]
    assert len(got) == len(want)
    for (xg, yg, _), (xw, yw) in zip(got, want, strict=True):
        assert torch.equal(xg, xw) and torch.equal(yg, yw)


# ----------------------------------------------------------------------------- config


def test_config_reads_names_and_off_values():
    assert build_config({}).data.augment == [] and batch_augment(build_config({}).data) is None
    cfg = build_config({"data": {"augment": ["crop", "flip"], "augment_per": "batch"}})
    assert batch_augment(cfg.data) == BatchAugment(("crop", "flip"), "batch")
    for off in (None, [], "none"):
        assert build_config({"data": {"augment": off}}).data.augment == []
    assert build_config({}, ["data.augment=flip"]).data.augment == ["flip"]


@pytest.mark.parametrize(("value", "message"), [
    (["crop", "rotate"], r"data\.augment = \['crop', 'rotate'\]: unknown augmentation 'rotate'; allowed: a list of crop, flip"),
    (["flip", "flip"], r"data\.augment = \['flip', 'flip'\]: a name is listed twice; allowed: a list of crop, flip"),
    (3, r"data\.augment = 3: expected a list of crop, flip"),
])
def test_bad_augment_names_key_value_and_allowed(value, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"data": {"augment": value}})


def test_bad_augment_per_names_the_key():
    with pytest.raises(ConfigError, match=r"data\.augment_per = 'image'.*'sample' or 'batch'"):
        build_config({"data": {"augment_per": "image"}})


# ----------------------------------------------------------------------------- on a client


def federation(*sets: str):
    cfg = build_config({}, ["algorithm.name=fedproto", "federation.num_clients=4", "model.group=HtFE1",
                            "model.feature_dim=16", "data.image_size=8", "data.partition.beta=1.0", "federation.mode=sync",
                            "training.batch_size=16", *sets])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 4, cfg.seed, cfg.data.test_fraction)
    return cfg, ds, part


def test_a_client_trains_on_augmented_batches_and_evaluates_on_the_tensors_as_they_are():
    cfg_off, ds, part = federation()
    cfg_on, *_ = federation("data.augment=[crop,flip]")
    off = ClientRunner(cfg_off, part.clients[0], ds, CPU)
    on = ClientRunner(cfg_on, part.clients[0], ds, CPU)
    assert on.batches.augment == BatchAugment(("crop", "flip")) and off.batches.augment is None
    state = GlobalState(version=0)
    ev_on, ev_off = on.evaluate(state), off.evaluate(state)
    assert ev_on.pop("train_loss") is not None and ev_off.pop("train_loss") is not None  # nan before training
    assert ev_on == ev_off and ev_on["n"] > 0  # evaluation: never augmented
    _, u_off = off.train(state)
    _, u_on = on.train(state)
    assert not all(torch.equal(a, b) for a, b in zip(off.model.parameters(), on.model.parameters(), strict=True))
    again = ClientRunner(cfg_on, part.clients[0], ds, CPU)
    _, u_again = again.train(state)  # reproducible: the same seed, the same augmented batches
    for a, b in zip(on.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)
    np.testing.assert_array_equal(u_on.prototypes.vectors, u_again.prototypes.vectors)


def test_batched_clients_with_augmentation_equal_one_after_another():
    cfg, ds, part = federation("data.augment=[crop,flip]")
    params = {}
    for mode in ("off", "on"):
        host = ClientHost(cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"batch_clients": mode})}),
                          ds, list(part.clients), CPU, None)
        host.train_group(host.client_ids, GlobalState(version=0))
        params[mode] = {c: [t.detach().clone() for t in r.model.state_dict().values()] for c, r in host.live.items()}
    for c in params["off"]:
        for a, b in zip(params["off"][c], params["on"][c], strict=True):
            if a.is_floating_point():
                assert float((a - b).norm()) <= 1e-5 * max(float(a.norm()), 1e-12)
            else:
                assert torch.equal(a, b)


def test_fedsc_paper_preset_augments_as_the_authors_code():
    from rayfed_proto.cli import resolve_config_arg
    from rayfed_proto.config import load_config

    cfg = load_config(resolve_config_arg("fedsc_cifar10"))
    assert (cfg.data.augment, cfg.data.augment_per) == (["crop", "flip"], "batch")
