"""Each method's declared work of one local update (ClientAlgorithm.update_work) and what the
virtual clock charges for it (rayfed_proto.system): forward-backward samples at the architecture's
cost per training sample, forward-only samples at a third of it. Costs of 3.0 s per training
sample make every figure below exact (a forward sample costs 1.0 s)."""

import numpy as np
import pytest
import torch

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import Pass, TrainBatchIterator, UpdateSizes, steps_per_epoch
from rayfed_proto.algorithms.fedsap import stratified_unlabelled_mask
from rayfed_proto.config import build_config
from rayfed_proto.runtime.simclock import VirtualClock
from rayfed_proto.system import SystemModel, update_work_s

COST = 3.0  # seconds per training sample (forward-backward) at speed 1; a forward sample: 1.0 s
SIZES = UpdateSizes(train=40, local_epochs=2, batch_size=10, public=25)


def work(name, sizes=SIZES, **options):
    algo = ALGORITHMS.get(name)
    return algo.Client.update_work(algo.Options(**options), sizes)


def model(passes, speeds=(1.0, 2.0)):
    n = len(speeds)
    return SystemModel(list(speeds), ["cnn"] * n, {"cnn": COST}, [SIZES.train] * n, SIZES.local_epochs,
                       work=[passes] * n)


def test_fedprotokd_costs_more_than_fedproto_by_exactly_its_public_set_share():
    proto = model(work("fedproto", prototype_source="eval"))  # both upload eval-mode prototypes
    kd = model(work("fedprotokd", client_distill_epochs=2))
    speeds = np.array([1.0, 2.0])
    # FedProto: 2 epochs x 40 samples forward-backward + 40 forward (the prototype pass)
    assert np.array_equal(proto.compute_s, (80 * 3.0 + 40 * 1.0) / speeds)
    # version 0 (no server logits yet, no distillation): + 25 public samples forward (the uploaded logits)
    assert [kd.compute_at(c, 0) - proto.compute_at(c, 0) for c in (0, 1)] == [25.0, 12.5]
    # from version 1: + 2 distillation epochs x 25 public samples forward-backward
    share = (2 * 25 * 3.0 + 25 * 1.0) / speeds
    assert [kd.compute_at(c, v) - proto.compute_at(c, v) for v in (1, 7) for c in (0, 1)] == [*share, *share]
    # FedProto's default takes its prototypes from the training passes: KD also pays its eval pass
    plain = model(work("fedproto"))
    assert kd.compute_at(0, 1) - plain.compute_at(0, 1) == 2 * 25 * 3.0 + 25 * 1.0 + 40 * 1.0


def test_the_default_cost_is_unchanged_for_fedavg_exactly():
    speeds = np.exp(np.random.default_rng(0).normal(0, 1, 5))
    sizes = [37, 101, 8, 64, 250]
    before = SystemModel(speeds, ["cnn"] * 5, {"cnn": 0.0123}, sizes, 3)  # no declared work: today's formula
    passes = [ALGORITHMS.get("fedavg").Client.update_work(ALGORITHMS.get("fedavg").Options(),
                                                         UpdateSizes(train=n, local_epochs=3, batch_size=10))
              for n in sizes]
    after = SystemModel(speeds, ["cnn"] * 5, {"cnn": 0.0123}, sizes, 3, work=passes)
    assert np.array_equal(after.compute_s, before.compute_s) and not after.phases
    assert np.array_equal(before.compute_s, np.array(sizes) * 3 * 0.0123 / speeds)
    # the same for every method whose update is the default training passes only
    for name in ("fedlsa", "fedproto", "fedsa"):
        assert work(name) == [Pass("train", 80, backward=True)], name


def test_declared_extra_passes_of_the_other_methods():
    # FedSC's default (variant code) averages the last epoch's training features: no extra pass;
    # variant paper adds the local prototypes' eval-mode pass
    assert work("fedsc") == [Pass("train", 80, True)]
    assert work("fedsc", variant="paper") == [Pass("train", 80, True), Pass("train", 40, False)]
    # FedTGP and FedSAP upload the prototypes of an eval-mode pass after training by default
    assert work("fedtgp") == work("fedsap") == [Pass("train", 80, True), Pass("train", 40, False)]
    assert work("fedtgp", prototype_source="train") == [Pass("train", 80, True)]
    assert work("fedtgp", prototype_source="eval", prototype_model="before_training") == [
        Pass("train", 80, True), Pass("train", 40, False)]  # the pass before training instead of after it
    assert work("fedsa", prototype_source="eval")[-1] == Pass("train", 40, False)
    assert work("fedprotokd", client_distill_epochs=0) == [Pass("train", 80, True), Pass("public", 25, False),
                                                            Pass("train", 40, False)]


def test_fedsap_semi_supervised_views_of_a_separate_pool_are_charged_from_t_sup():
    sizes = UpdateSizes(train=40, local_epochs=2, batch_size=10, unlabelled=30)
    passes = work("fedsap", sizes, semi_supervised={"supervised_versions": 5, "unlabelled_batch_ratio": 1})
    m = model(passes, speeds=(1.0,))
    # supervised phase: 2 x 40 forward-backward + the upload's eval pass over the 40 labelled samples
    assert [m.compute_at(0, v) for v in (0, 4)] == [80 * 3.0 + 40 * 1.0] * 2
    # from version 5: 2 epochs x 4 steps x 10 pool samples, weak view forward + strong view forward-backward
    assert [m.compute_at(0, v) for v in (5, 50)] == [80 * 3.0 + 40 * 1.0 + 80 * 1.0 + 80 * 3.0] * 2
    assert m.compute_s[0] == 80 * 3.0 + 40 * 1.0  # what max_update_starts bounds with: the least work
    big = work("fedsap", sizes, semi_supervised={"supervised_versions": 5, "unlabelled_batch_ratio": 4})
    assert big[-1] == Pass("unlabelled", 2 * 4 * 30, True, from_version=5)  # min(4 x 10, 30) per step


def test_fedsap_semi_supervised_split_counts_what_the_client_hides_and_its_batches():
    y = torch.tensor([0] * 10 + [1] * 21 + [2] * 9)
    counts = tuple(int(n) for n in torch.bincount(y))
    sizes = UpdateSizes(train=40, local_epochs=1, batch_size=10, train_class_counts=counts)
    passes = work("fedsap", sizes, semi_supervised={"supervised_versions": 0, "unlabelled_fraction": 0.5})
    hidden = int(stratified_unlabelled_mask(y, 0.5, 0, 0).sum())
    assert hidden == 5 + 10 + 4
    labelled = 40 - hidden
    steps = len(list(TrainBatchIterator(torch.zeros(labelled), torch.zeros(labelled), 10, torch.Generator()).epoch()))
    assert steps == steps_per_epoch(labelled, 10) == 2  # 21 samples: 10 + 11 (a last batch of one is folded)
    assert passes == [Pass("train", labelled, True), Pass("train", labelled, False),
                      Pass("train", steps * 10, False), Pass("train", steps * 10, True)]


@pytest.mark.parametrize("n,batch", [(1, 4), (4, 4), (5, 4), (9, 4), (10, 4), (3, 1), (7, 10)])
def test_steps_per_epoch_counts_the_batches_of_train_batch_iterator(n, batch):
    it = TrainBatchIterator(torch.zeros(n), torch.zeros(n), batch, torch.Generator().manual_seed(0))
    assert steps_per_epoch(n, batch) == len(list(it.epoch()))


def test_the_clock_charges_the_work_of_the_version_an_update_trains_against():
    m = model(work("fedprotokd", client_distill_epochs=1), speeds=(1.0,))
    clock = VirtualClock(m, seed=0)
    first = clock.start(0, "a", version=0)
    later = clock.start(0, "b", version=3)
    assert first.finish == 80 * 3.0 + 25 + 40 and later.finish == 80 * 3.0 + 25 * 3.0 + 25 + 40
    clock.finish(later, {"download_bytes": 0, "upload_bytes": 0}, None)
    assert later.finish == 80 * 3.0 + 25 * 3.0 + 25 + 40  # exact: the same version's work
    assert update_work_s(work("fedprotokd"), COST, 0) == m.compute_at(0, 0)


def test_the_driver_charges_the_configured_methods_work_from_the_partition():
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.runtime.preparation import system_model as _system_model

    over = ["data.name=digits", "federation.num_clients=3", "model.group=HtFE1", "system.cost_per_sample.cnn=3.0",
            "training.local_epochs=2", "data.public_size=50"]
    cfg_kd = build_config({}, over + ["algorithm.name=fedprotokd", "algorithm.client_distill_epochs=1"])
    ds = load_dataset(cfg_kd.data, cfg_kd.seed)
    d = cfg_kd.data
    part = make_partition(ds, d.partition, 3, cfg_kd.seed, d.test_fraction, public_size=d.public_size)
    shape = (ds.num_classes, ds.channels, ds.image_size)
    train = np.array([len(s.train_idx) for s in part.clients])
    kd = _system_model(cfg_kd, part, *shape)
    avg = _system_model(build_config({}, over + ["algorithm.name=fedavg"]), part, *shape)
    assert np.array_equal(avg.compute_s, train * 2 * 3.0)  # speed 1: today's formula, exactly
    assert np.array_equal(kd.compute_s, train * 2 * 3.0 + (50 + train) * 1.0)  # + public logits + prototype pass
    assert np.array_equal(kd.phases[0][1] - kd.compute_s, np.full(3, 50 * 3.0))  # + distillation from version 1
