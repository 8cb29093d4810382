"""FedSAP: proxy logits and loss, the scheduled composite loss and uniform aggregation, by hand."""

import math

import numpy as np
import pytest
import torch
from doubles import FixedModel, pset

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.base import ClientAlgorithm, PrototypeServer, TrainBatchIterator
from rayfed_proto.algorithms.common import bank_tensors, local_prototypes
from rayfed_proto.algorithms.fedsap import (
    SemiSupervisedOptions,
    accept_pseudo_labels,
    calibrate_thresholds,
    consistency_loss,
    mixed_prototypes,
    proxy_logits,
    proxy_loss,
    stratified_unlabelled_mask,
    strong_view,
    weak_view,
)
from rayfed_proto.messages import ClientUpdate, GlobalState

SPEC = FederationSpec(num_clients=2, num_classes=3, feature_dim=2, seed=0)
ALGO = ALGORITHMS.get("fedsap")


# ----------------------------------------------------------------------------- pure functions

def test_proxy_logits_are_scaled_cosines():
    bank = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    # f = (1, 0): cos to P0 = 1, to P1 = 0 -> (32, 0); the prototypes' norms (2, 3) do not matter
    z = proxy_logits(torch.tensor([[1.0, 0.0]]), bank, 32.0)
    assert z.tolist() == [[pytest.approx(32.0), pytest.approx(0.0)]]
    # f = (3, 4): |f| = 5, cosines 3/5 and 4/5 -> 32 * (0.6, 0.8) = (19.2, 25.6)
    z = proxy_logits(torch.tensor([[3.0, 4.0]]), bank, 32.0)
    assert z[0].tolist() == [pytest.approx(19.2, rel=1e-6), pytest.approx(25.6, rel=1e-6)]


def test_proxy_loss_on_tiny_vectors():
    bank, mask = torch.tensor([[2.0, 0.0], [0.0, 3.0]]), torch.tensor([True, True])
    f = torch.tensor([[1.0, 0.0]])
    # logits (32, 0): CE(y=0) = log(1 + e^-32) ~ 1.3e-14; CE(y=1) = 32 + log(1 + e^-32) ~ 32
    assert proxy_loss(f, torch.tensor([0]), bank, mask, 32.0).item() == pytest.approx(math.log1p(math.exp(-32)), abs=1e-6)
    assert proxy_loss(f, torch.tensor([1]), bank, mask, 32.0).item() == pytest.approx(32.0, rel=1e-6)
    # s = 2: logits (2, 0): CE(y=0) = log(1 + e^-2) = 0.1269 (the scale is applied)
    assert proxy_loss(f, torch.tensor([0]), bank, mask, 2.0).item() == pytest.approx(math.log1p(math.exp(-2)), rel=1e-6)


def test_proxy_loss_skips_absent_classes_and_their_samples():
    bank, mask = bank_tensors(pset([0, 2], [[2, 0], [0, 3]], [1, 1]), 3, "cpu")  # class 1 has no prototype
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    labels = torch.tensor([0, 1, 2])
    # softmax over classes {0, 2} only (s = 2):
    #   sample 0, f = (1, 0), y = 0: logits (2, 0)       -> log(1 + e^-2)
    #   sample 1, y = 1: class absent -> skipped
    #   sample 2, f = (1, 1), y = 2: logits (sqrt2, sqrt2) -> log 2
    # mean over the 2 kept samples (not over |B| = 3)
    expected = (math.log1p(math.exp(-2)) + math.log(2)) / 2
    assert proxy_loss(feats, labels, bank, mask, 2.0).item() == pytest.approx(expected, rel=1e-6)
    # had the absent class entered the softmax as a zero vector (logit 0), sample 0 would give
    # log(1 + 2e^-2) and sample 2 log(2 + e^-sqrt2): the value above rules that out
    wrong = (math.log1p(2 * math.exp(-2)) + math.log(2 + math.exp(-math.sqrt(2)))) / 2
    assert abs(expected - wrong) > 0.05


def test_proxy_loss_is_zero_without_prototypes_and_keeps_the_graph():
    feats = torch.tensor([[1.0, 2.0]], requires_grad=True)
    y = torch.tensor([1])
    bank, mask = bank_tensors(None, 3, "cpu")  # empty bank: (3, 0) and no class present
    loss = proxy_loss(feats, y, bank, mask, 32.0)
    assert loss.item() == 0.0
    loss.backward()  # still differentiable (zero gradient), so the composite loss can backprop
    assert torch.all(feats.grad == 0)
    bank, mask = bank_tensors(pset([0], [[1, 0]], [1]), 3, "cpu")  # a bank, but not the sample's class
    assert proxy_loss(feats, y, bank, mask, 32.0).item() == 0.0


def test_proxy_gradient_turns_the_feature_towards_its_prototype():
    bank, mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([True, True])
    f = torch.tensor([[1.0, 1.0]], requires_grad=True)
    proxy_loss(f, torch.tensor([0]), bank, mask, 4.0).backward()
    g = f - 0.1 * f.grad
    assert (g[0, 0] / g[0].norm()).item() > 1 / math.sqrt(2)  # cosine to P0 grew


# ----------------------------------------------------------------------------- client loss

X = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
Y = torch.tensor([0, 1])
BANK = pset([0, 2], [[2, 0], [0, 3]], [1, 1])  # class 1 (sample 1's) has no prototype
CE = math.log(3)  # zero head, 3 classes
PROTO_SUM = 5.0  # sample 0 only: (1 - 2)^2 + (2 - 0)^2 = 5 (squared norm, Eq. 5 as printed)
PROTO = PROTO_SUM / 2  # the default, nn.MSELoss: divided by D = 2
# sample 0 only: f = (1, 2)/sqrt5, cosines 1/sqrt5 (P0), 2/sqrt5 (P2); y = 0 -> log(1 + e^(32/sqrt5))
PROXY = math.log1p(math.exp(32 / math.sqrt(5)))


def client_at(version, **options):
    client = ALGO.Client(ALGO.Options(**options), SPEC, client_id=0)
    client.receive(GlobalState(version=version, prototypes=BANK), FixedModel())
    return client


# round = version + 1: 0 up to round 20 (version 19), M / 2 at round 60 (version 59), M = 0.7 from
# round 100 on, the last round of a 100-round run, which trains against version 99
@pytest.mark.parametrize("version,lam", [(0, 0.0), (10, 0.0), (19, 0.0), (20, 0.7 / 80), (59, 0.35), (98, 0.7 * 79 / 80),
                                         (99, 0.7), (500, 0.7)])
def test_loss_is_ce_plus_scheduled_proto_plus_proxy(version, lam):
    loss, terms = client_at(version).loss(FixedModel(), X, Y)
    assert set(terms) == {"ce", "proto", "proxy"}
    assert terms["ce"] == pytest.approx(CE)
    assert terms["proto"] == pytest.approx(PROTO)
    assert terms["proxy"] == pytest.approx(PROXY, rel=1e-5)
    assert loss.item() == pytest.approx(CE + lam * PROTO + PROXY, rel=1e-5)


def test_use_proxy_false_removes_the_term():
    loss, terms = client_at(100, use_proxy=False).loss(FixedModel(), X, Y)
    assert terms["proxy"] == 0.0
    assert loss.item() == pytest.approx(CE + 0.7 * PROTO, rel=1e-6)


def test_without_schedule_the_weight_is_constant_m():
    for version in (0, 10, 1000):
        loss, _ = client_at(version, alignment_schedule=None).loss(FixedModel(), X, Y)
        assert loss.item() == pytest.approx(CE + 0.7 * PROTO + PROXY, rel=1e-5)


def test_sum_reduction_is_the_squared_norm_as_printed():
    loss, terms = client_at(100, alignment_reduction="sum").loss(FixedModel(), X, Y)
    assert terms["proto"] == pytest.approx(PROTO_SUM)
    assert loss.item() == pytest.approx(CE + 0.7 * PROTO_SUM + PROXY, rel=1e-5)


def test_the_default_alignment_is_nn_mse_loss():
    """FedProto's code (HtFLlib clientproto.py): nn.MSELoss(proto_new, rep), the mean over the
    batch and the D dimensions; here over the samples whose class has a prototype (sample 0)."""
    feats = X[:1]
    target = torch.tensor([[2.0, 0.0]])
    _, terms = client_at(100).loss(FixedModel(), X, Y)
    assert terms["proto"] == pytest.approx(float(torch.nn.MSELoss()(feats, target)))


def test_before_any_prototype_only_ce_remains():
    client = ALGO.Client(ALGO.Options(alignment_schedule=None), SPEC, 0)
    model = FixedModel()
    client.receive(GlobalState(version=0, prototypes=None), model)
    loss, terms = client.loss(model, X, Y)
    assert terms == {"ce": pytest.approx(CE), "proto": 0.0, "proxy": 0.0}
    loss.backward()
    assert client.inference_bank() is None


def test_inference_bank_is_the_global_prototypes():
    bank = client_at(3).inference_bank()
    assert bank.class_ids.tolist() == [0, 2]
    np.testing.assert_allclose(bank.vectors, [[2, 0], [0, 3]])


# ----------------------------------------------------------------------------- server and options

def test_server_uniform_mean_ignores_sample_counts():
    server = ALGO.Server(ALGO.Options(), SPEC, torch.device("cpu"))
    assert isinstance(server, PrototypeServer)
    a = ClientUpdate(0, 0, 1, prototypes=pset([0], [[1, 0]], [1]))
    b = ClientUpdate(1, 0, 5, prototypes=pset([0, 1], [[3, 0], [0, 2]], [3, 2]))
    server.aggregate([a, b], [1.0, 1.0], version=1)
    state = server.broadcast(1)
    assert state.prototypes.class_ids.tolist() == [0, 1]
    # FedSAP Eq. 2: class 0 = ([1, 0] + [3, 0]) / 2 = [2, 0] (sample-weighted would be [2.5, 0])
    np.testing.assert_allclose(state.prototypes.vectors[0], [2.0, 0.0])
    np.testing.assert_allclose(state.prototypes.vectors[1], [0.0, 2.0])  # held by b only


def test_options_defaults_match_the_paper():
    opts = ALGO.Options()
    assert opts.proxy_scale == 32.0 and opts.lam == 0.7 and opts.use_proxy is True
    assert opts.aggregation == "uniform" and opts.alignment_reduction == "mean"
    s = opts.alignment_schedule
    assert (s.shape, s.start, s.length) == ("linear", 20, 80)
    assert ALGO.Options().alignment_schedule is not s  # each instance gets its own copy
    assert "fedsap" in ALGORITHMS.names() and ALGORITHMS.describe("fedsap")


# ----------------------------------------------------------------------------- semi-supervised (Sec. 3.6)

B01 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # dense bank: P0 = (1, 0), P1 = (0, 1), class 2 absent
M01 = torch.tensor([True, True, False])


def test_acceptance_rule_on_a_hand_computed_configuration():
    # f = (3, 4)/5 scaled by 10: cos to P0 = 0.6 -> d = 0.4; to P1 = 0.8 -> d = 0.2
    # -> pseudo-label 1 (Eq. 10), d1 = 0.2, d2 = 0.4, margin 0.2
    f = torch.tensor([[6.0, 8.0]])
    pseudo, ok = accept_pseudo_labels(f, B01, M01, margin=0.1, max_distance=0.3)
    assert pseudo.tolist() == [1] and ok.tolist() == [True]  # 0.2 > 0.1 and 0.2 < 0.3
    _, ok = accept_pseudo_labels(f, B01, M01, margin=0.25, max_distance=0.3)
    assert ok.tolist() == [False]  # rejected by the margin: 0.2 <= 0.25
    _, ok = accept_pseudo_labels(f, B01, M01, margin=0.1, max_distance=0.15)
    assert ok.tolist() == [False]  # rejected by the distance: 0.2 >= 0.15
    # f = (1, 1): equidistant (d = 1 - 1/sqrt2 to both) -> margin 0 -> rejected even with M = 0 (strict)
    _, ok = accept_pseudo_labels(torch.tensor([[1.0, 1.0]]), B01, M01, margin=0.0, max_distance=1.0)
    assert ok.tolist() == [False]


def test_absent_classes_are_no_candidates_and_one_candidate_passes_the_margin():
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    f = torch.tensor([[-1.0, 0.1]])  # nearest to P2 when it is a candidate
    pseudo, _ = accept_pseudo_labels(f, bank, torch.tensor([True, True, True]), 0.0, 2.0)
    assert pseudo.tolist() == [2]
    pseudo, _ = accept_pseudo_labels(f, bank, torch.tensor([True, True, False]), 0.0, 2.0)
    assert pseudo.tolist() == [1]  # P2 masked out
    # one candidate only: no second-nearest -> d2 = inf, the margin test passes; distance still applies
    # f = (1, 1) to P0: d = 1 - 1/sqrt2 = 0.293
    pseudo, ok = accept_pseudo_labels(torch.tensor([[1.0, 1.0]]), bank, torch.tensor([True, False, False]), 5.0, 0.3)
    assert pseudo.tolist() == [0] and ok.tolist() == [True]
    _, ok = accept_pseudo_labels(torch.tensor([[1.0, 1.0]]), bank, torch.tensor([True, False, False]), 5.0, 0.29)
    assert ok.tolist() == [False]


def test_consistency_loss_by_hand():
    bank = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # strong feature (1, 0), prototype (1, 1): 1 - 1/sqrt2
    assert consistency_loss(torch.tensor([[1.0, 0.0]]), bank, torch.tensor([0])).item() == pytest.approx(1 - 1 / math.sqrt(2))
    # norms do not matter; mean over the accepted: (1 - 1/sqrt2 + 1) / 2 for (5, 0) -> P0 and (0, 2) -> P1
    value = consistency_loss(torch.tensor([[5.0, 0.0], [0.0, 2.0]]), bank, torch.tensor([0, 1])).item()
    assert value == pytest.approx((1 - 1 / math.sqrt(2) + 1) / 2)
    f = torch.zeros(0, 2, requires_grad=True)
    empty = consistency_loss(f, bank, torch.zeros(0, dtype=torch.long))
    assert empty.item() == 0.0
    empty.backward()


def test_eq14_mixing_by_hand():
    lab_f = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    lab_y = torch.tensor([0, 0, 1])
    ps_f = torch.tensor([[0.0, 4.0], [9.0, 9.0]])
    ps_y = torch.tensor([0, 2])  # class 2: no labelled sample -> left out
    out = mixed_prototypes(lab_f, lab_y, ps_f, ps_y, alpha=0.5)
    assert out.class_ids.tolist() == [0, 1]
    # class 0: ((1, 0) + (3, 0) + 0.5 * (0, 4)) / (2 + 0.5 * 1) = (4, 2) / 2.5 = (1.6, 0.8)
    np.testing.assert_allclose(out.vectors[0], [1.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(out.vectors[1], [0.0, 2.0])  # labelled only
    assert out.counts.tolist() == [3, 1]  # |L_c| + |A_c|
    norm = mixed_prototypes(lab_f, lab_y, ps_f, ps_y, alpha=0.5, normalize=True)
    np.testing.assert_allclose(norm.vectors[0], np.array([2.0, 1.0]) / math.sqrt(5), rtol=1e-6)
    np.testing.assert_allclose(norm.vectors[1], [0.0, 1.0])
    # alpha = 0 or no pseudo-labels: the labelled means (FedSA Eq. 2)
    plain = mixed_prototypes(lab_f, lab_y, torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), alpha=0.5)
    np.testing.assert_allclose(plain.vectors, [[2.0, 0.0], [0.0, 2.0]])
    np.testing.assert_allclose(mixed_prototypes(lab_f, lab_y, ps_f, ps_y, alpha=0.0).vectors[0], [2.0, 0.0])


def test_calibration_picks_the_documented_quantiles():
    bank = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])  # opposite prototypes
    # f = 3 (c, sqrt(1 - c^2)), c = 0.5, 0.55, ..., 1.0 (11 samples of class 0):
    # d(P0) = 1 - c (nearest), d(P1) = 1 + c -> margin 2c in {1.0, 1.1, ..., 2.0}, d1 in {0, 0.05, ..., 0.5}
    c = torch.linspace(0.5, 1.0, 11)
    f = 3 * torch.stack([c, torch.sqrt(1 - c * c)], 1)
    y = torch.zeros(11, dtype=torch.long)
    # a misassigned labelled sample (label 1, nearest P0) must not count
    f = torch.cat([f, torch.tensor([[1.0, 0.0]])])
    y = torch.cat([y, torch.tensor([1])])
    m, d_max = calibrate_thresholds(f, y, bank, torch.tensor([True, True]), 0.10, 0.90)
    # 10th percentile of 11 sorted margins: position 0.1 * 10 = 1 -> 1.1; 90th of d1: position 9 -> 0.45
    assert m == pytest.approx(1.1, abs=1e-5)
    assert d_max == pytest.approx(0.45, abs=1e-5)
    m, d_max = calibrate_thresholds(f, y, bank, torch.tensor([True, True]), 0.0, 1.0)
    assert (m, d_max) == (pytest.approx(1.0, abs=1e-5), pytest.approx(0.5, abs=1e-5))
    # nobody correctly assigned -> None; a single candidate class -> no finite margin -> M = 0
    assert calibrate_thresholds(f[:3], torch.ones(3, dtype=torch.long), bank, torch.tensor([True, True]), 0.1, 0.9) is None
    m, _ = calibrate_thresholds(f[:11], y[:11], bank, torch.tensor([True, False]), 0.1, 0.9)
    assert m == 0.0


def test_split_is_deterministic_stratified_and_disjoint():
    y = torch.cat([torch.arange(4).repeat_interleave(10), torch.tensor([4])])  # 4 classes x 10, class 4 x 1
    a = stratified_unlabelled_mask(y, 0.5, seed=3, client_id=1)
    np.testing.assert_array_equal(a, stratified_unlabelled_mask(y, 0.5, seed=3, client_id=1))
    assert not np.array_equal(a, stratified_unlabelled_mask(y, 0.5, seed=3, client_id=2))
    assert not np.array_equal(a, stratified_unlabelled_mask(y, 0.5, seed=4, client_id=1))
    labelled, unlabelled = set(np.nonzero(~a)[0]), set(np.nonzero(a)[0])
    assert labelled.isdisjoint(unlabelled) and labelled | unlabelled == set(range(41))
    for c in range(4):
        assert a[(y == c).numpy()].sum() == 5  # floor(0.5 * 10) per class
    assert not a[40]  # a single-sample class stays labelled (closed set: only known classes are hidden)
    assert stratified_unlabelled_mask(y, 0.3, 3, 1)[:10].sum() == 3


class TinyModel(torch.nn.Module):
    """Trainable 2-D features and head, deterministic initialisation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(2, 2)
        self.head = torch.nn.Linear(2, 3)

    def features(self, x):
        return self.body(x)

    def forward_features(self, x):
        f = self.body(x)
        return f, self.head(f)


def semi_client(version, bank=BANK, client_id=0, **semi):
    opts = ALGO.Options(semi_supervised=SemiSupervisedOptions(**semi))
    client = ALGO.Client(opts, SPEC, client_id)
    client.receive(GlobalState(version=version, prototypes=bank), None)
    return client


def train(client, model, x, y, epochs=1, batch_size=4, seed=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = TrainBatchIterator(x, y, batch_size, torch.Generator().manual_seed(seed))
    return client.local_train(model, opt, batches, epochs, "cpu")


def data(n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, generator=g), torch.arange(3).repeat(n // 3)


def test_supervised_phase_never_reads_the_hidden_labels():
    x, y = data()
    a = semi_client(version=5, supervised_versions=10)
    a._ensure_split(y)
    hidden = torch.from_numpy(a.unlabelled)
    assert int(hidden.sum()) == 12
    flipped = y.clone()
    flipped[hidden] = (y[hidden] + 1) % 3
    b = semi_client(version=5, supervised_versions=10)
    b.load_state_dict(a.state_dict())  # same split (it is drawn once and kept)
    ma, mb = TinyModel(), TinyModel()
    ta, tb = train(a, ma, x, y), train(b, mb, x, flipped)
    assert ta["pseudo_candidates"] == 0 and ta["pseudo_accepted"] == 0 and math.isnan(ta["pseudo_accuracy"])
    for k in ("loss", "ce", "proto", "proxy", "cons"):
        assert ta[k] == tb[k]
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(pa, pb)
    ua, ub = a.make_update(ma, x, y), b.make_update(mb, x, flipped)
    np.testing.assert_array_equal(ua.prototypes.vectors, ub.prototypes.vectors)
    assert ua.prototypes.counts.tolist() == [4, 4, 4] and ua.num_samples == 12  # labelled part only
    # the test has teeth: training on every label (the option off) does see the flip
    off_a, off_b = ALGO.Client(ALGO.Options(), SPEC, 0), ALGO.Client(ALGO.Options(), SPEC, 0)
    for c in (off_a, off_b):
        c.receive(GlobalState(version=5, prototypes=BANK), None)
    assert train(off_a, TinyModel(), x, y)["loss"] != train(off_b, TinyModel(), x, flipped)["loss"]


def test_supervised_phase_batches_cover_the_labelled_part_once_per_epoch():
    x, y = data()
    seen = []

    class Spy(TinyModel):
        def forward_features(self, x):
            seen.append(x.clone())
            return super().forward_features(x)

    client = semi_client(version=0)
    train(client, Spy(), x, y, batch_size=4)
    rows = torch.cat(seen)
    labelled = x[torch.from_numpy(~client.unlabelled)]
    assert len(rows) == 12 and len(seen) == 3
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, labelled.tolist()))


# labelled: class 0 (1, 0), (2, 0); class 1 (0, 1), (0, 3). Unlabelled (hidden label):
# (2, 0.1) [0] -> P0, accepted, right; (0.1, 2) [1] -> P1, accepted, right;
# (3, 0) [1] -> P0, accepted, wrong; (1, 1) [0] -> margin 0, rejected.
XS = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [2.0, 0.1], [0.1, 2.0], [3.0, 0.0], [1.0, 1.0]])
YS = torch.tensor([0, 0, 1, 1, 0, 1, 1, 0])
HIDDEN = np.array([False] * 4 + [True] * 4)
BANK01 = pset([0, 1], [[1, 0], [0, 1]], [1, 1])


def semi_phase_client(**semi):
    client = semi_client(version=10, bank=BANK01, supervised_versions=10, strong_noise_std=0.0, **semi)
    client.unlabelled = HIDDEN.copy()
    client.thresholds = (0.1, 0.5)
    return client


def test_pseudo_labels_their_accuracy_and_the_consistency_term():
    client = semi_phase_client()
    terms = train(client, FixedModel(), XS, YS, batch_size=4)  # one step: 4 labelled + 4 unlabelled
    assert terms["pseudo_candidates"] == 4 and terms["pseudo_accepted"] == 3
    assert terms["pseudo_accuracy"] == pytest.approx(2 / 3)  # against the hidden labels
    assert client.accepted_idx.tolist() == [4, 5, 6] and client.accepted_label.tolist() == [0, 1, 0]
    # Eq. 12 (features = x, no noise, 2-D inputs: the views are x): (2, 0.1) and (0.1, 2) give
    # 1 - 2/sqrt(4.01) each, (3, 0) gives 0; mean over the 3 accepted
    cons = 2 * (1 - 2 / math.sqrt(4.01)) / 3
    assert terms["cons"] == pytest.approx(cons, abs=1e-7)  # float32 cancellation in 1 - cos
    # Eq. 13; lambda_t = 0 at version 10 (the curriculum starts at 20)
    assert terms["loss"] == pytest.approx(terms["ce"] + terms["proxy"] + cons, rel=1e-5)
    assert terms["pseudo_margin_threshold"] == 0.1 and terms["pseudo_distance_threshold"] == 0.5
    # lambda_Cons scales the term
    t2 = train(semi_phase_client(consistency_weight=2.0), FixedModel(), XS, YS, batch_size=4)
    assert t2["loss"] == pytest.approx(terms["loss"] + cons, rel=1e-5)
    # nothing accepted -> accuracy NaN, cons 0
    strict = semi_phase_client()
    strict.thresholds = (5.0, 0.5)
    t3 = train(strict, FixedModel(), XS, YS, batch_size=4)
    assert t3["pseudo_accepted"] == 0 and math.isnan(t3["pseudo_accuracy"]) and t3["cons"] == 0.0


def test_a_separate_unlabelled_pool_replaces_the_hidden_part_of_the_split():
    # the paper's regime (Table 3): k labelled shots and a separate pool U_q; here the split is
    # XS[:4] (all labelled) and the pool XS[4:] with its true labels (read for pseudo_accuracy only)
    client = semi_client(version=10, bank=BANK01, supervised_versions=10, strong_noise_std=0.0)
    client.thresholds = (0.1, 0.5)
    client.set_unlabelled_pool(XS[4:], YS[4:])
    model = FixedModel()
    terms = train(client, model, XS[:4], YS[:4], batch_size=4)  # one step: 4 labelled + 4 from the pool
    assert terms["pseudo_candidates"] == 4 and terms["pseudo_accepted"] == 3
    assert terms["pseudo_accuracy"] == pytest.approx(2 / 3)
    assert client.unlabelled is None  # nothing of the split is hidden
    assert client.accepted_idx.tolist() == [0, 1, 2] and client.accepted_label.tolist() == [0, 1, 0]  # pool positions
    assert terms["cons"] == pytest.approx(2 * (1 - 2 / math.sqrt(4.01)) / 3, abs=1e-7)
    up = client.make_update(model, XS[:4], YS[:4])
    # Eq. 14 as in the hidden-split case: the same labelled and accepted embeddings
    np.testing.assert_allclose(up.prototypes.vectors, [[5.5 / 3, 0.05 / 3], [0.02, 2.0]], rtol=1e-6)
    assert up.prototypes.counts.tolist() == [4, 3]
    # supervised phase: every sample of the split is labelled (no fraction hidden), the pool is unused
    early = semi_client(version=5, bank=BANK01, supervised_versions=10)
    early.set_unlabelled_pool(XS[4:], YS[4:])
    t = train(early, FixedModel(), XS[:4], YS[:4], batch_size=4)
    assert t["pseudo_candidates"] == 0
    assert early.make_update(FixedModel(), XS[:4], YS[:4]).prototypes.counts.tolist() == [2, 2]


def test_upload_mixes_accepted_embeddings_eq14():
    client = semi_phase_client(alpha=0.5)
    model = FixedModel()
    train(client, model, XS, YS, batch_size=4)
    up = client.make_update(model, XS, YS)
    assert up.prototypes.class_ids.tolist() == [0, 1]
    # class 0: ((1,0) + (2,0) + 0.5 * ((2,0.1) + (3,0))) / (2 + 0.5 * 2) = (5.5, 0.05) / 3
    np.testing.assert_allclose(up.prototypes.vectors[0], [5.5 / 3, 0.05 / 3], rtol=1e-6)
    # class 1: ((0,1) + (0,3) + 0.5 * (0.1,2)) / (2 + 0.5) = (0.05, 5) / 2.5
    np.testing.assert_allclose(up.prototypes.vectors[1], [0.02, 2.0], rtol=1e-6)
    assert up.prototypes.counts.tolist() == [4, 3] and up.num_samples == 7
    # the same state one version before T_sup: labelled means only
    client.version = 9
    up = client.make_update(model, XS, YS)
    np.testing.assert_allclose(up.prototypes.vectors, [[1.5, 0.0], [0.0, 2.0]])


def test_restrict_to_local_classes():
    bank = pset([0, 1, 2], [[1, 0], [0, 1], [1, 0.05]], [1, 1, 1])  # P2 is nearer than P0 to (3, 0.1)
    client = semi_client(version=10, bank=bank, supervised_versions=10, strong_noise_std=0.0,
                         restrict_to_local_classes=True)
    client.unlabelled, client.thresholds = HIDDEN.copy(), (0.0, 0.5)
    train(client, FixedModel(), XS, YS, batch_size=4)
    assert set(client.accepted_label.tolist()) <= {0, 1}  # class 2 has no labelled sample here


def test_calibration_happens_once_at_the_first_semi_supervised_update():
    client = semi_client(version=9, bank=BANK01, supervised_versions=10)
    client.unlabelled = HIDDEN.copy()
    train(client, FixedModel(), XS, YS, batch_size=4)
    assert client.thresholds is None  # still supervised
    client.receive(GlobalState(version=10, prototypes=BANK01), None)
    terms = train(client, FixedModel(), XS, YS, batch_size=4)
    # labelled features (1,0), (2,0), (0,1), (0,3): all at d1 = 0 from their prototype, margin 1
    expected = calibrate_thresholds(XS[:4], YS[:4], torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([True, True]),
                                    0.1, 0.9)
    assert expected == (pytest.approx(1.0), pytest.approx(0.0))
    assert client.thresholds == expected
    assert terms["pseudo_margin_threshold"] == pytest.approx(1.0)
    client.receive(GlobalState(version=11, prototypes=pset([0, 1], [[1, 1], [0, 1]], [1, 1])), None)
    train(client, FixedModel(), XS, YS, batch_size=4)
    assert client.thresholds == expected  # not recalibrated


def test_state_round_trip():
    x, y = data()
    client = semi_client(version=10, supervised_versions=10)
    client.unlabelled = stratified_unlabelled_mask(y, 0.5, 0, 0)
    client.thresholds = (0.05, 0.9)
    train(client, TinyModel(), x, y)
    state = client.state_dict()
    other = semi_client(version=0, supervised_versions=10)
    other.load_state_dict(state)
    assert other.version == 10 and other.thresholds == (0.05, 0.9)
    np.testing.assert_array_equal(other.unlabelled, client.unlabelled)
    np.testing.assert_array_equal(other.accepted_idx, client.accepted_idx)
    np.testing.assert_array_equal(other.accepted_label, client.accepted_label)
    other.unlabelled[0] = not other.unlabelled[0]
    assert other.unlabelled[0] != client.unlabelled[0]  # copies, not shared arrays
    fresh = semi_client(version=0)
    fresh.load_state_dict({"version": 3})  # an old state without the semi part
    assert fresh.unlabelled is None and fresh.thresholds is None


def test_option_off_is_the_plain_fedsap_client():
    x, y = data()
    client = ALGO.Client(ALGO.Options(), SPEC, 0)
    client.receive(GlobalState(version=5, prototypes=BANK), None)
    assert ALGO.Options().semi_supervised is None
    ref = ALGO.Client(ALGO.Options(), SPEC, 0)
    ref.receive(GlobalState(version=5, prototypes=BANK), None)
    m1, m2 = TinyModel(), TinyModel()
    t1 = train(client, m1, x, y)
    t2 = ClientAlgorithm.local_train(ref, m2, torch.optim.SGD(m2.parameters(), lr=0.1),
                                     TrainBatchIterator(x, y, 4, torch.Generator().manual_seed(0)), 1, "cpu")
    assert t1 == t2 and set(t1) == {"loss", "ce", "proto", "proxy", "nonfinite_steps"}
    up = client.make_update(m1, x, y)
    ref_protos = local_prototypes(m1, x, y)
    np.testing.assert_array_equal(up.prototypes.vectors, ref_protos.vectors)
    assert up.num_samples == 24 and client.state_dict() == {"version": 5}


def test_augmentations_are_seeded_and_shape_preserving():
    opts = SemiSupervisedOptions()
    x = torch.randn(5, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    w1 = weak_view(x, opts, torch.Generator().manual_seed(1))
    w2 = weak_view(x, opts, torch.Generator().manual_seed(1))
    assert w1.shape == x.shape and torch.equal(w1, w2)
    const = torch.full((2, 3, 8, 8), 0.7)
    assert torch.equal(weak_view(const, opts, torch.Generator().manual_seed(2)), const)  # replicate padding
    assert torch.equal(weak_view(x, SemiSupervisedOptions(weak_shift=0), torch.Generator()), x)
    s = strong_view(const, SemiSupervisedOptions(strong_noise_std=0.0), torch.Generator().manual_seed(3))
    holes = (s == 0).sum(dim=(1, 2, 3))
    assert torch.all(holes > 0) and torch.all(holes <= 3 * 2 * 2)  # a cutout of side round(0.25 * 8) = 2
    s1 = strong_view(x, opts, torch.Generator().manual_seed(4))
    assert torch.equal(s1, strong_view(x, opts, torch.Generator().manual_seed(4))) and not torch.equal(s1, x)


def test_semi_phase_runs_on_images_with_batchnorm():
    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2))
            self.head = torch.nn.Linear(2, 3)

        def features(self, x):
            return self.body(x)

        def forward_features(self, x):
            f = self.body(x)
            return f, self.head(f)

    x = torch.randn(30, 1, 10, 10, generator=torch.Generator().manual_seed(0))
    y = torch.arange(3).repeat(10)
    bank = pset([0, 1, 2], [[1, 0], [0, 1], [-1, -1]], [1, 1, 1])
    client = semi_client(version=100, bank=bank, margin_quantile=0.0, distance_quantile=1.0)
    model = Conv()
    terms = train(client, model, x, y, epochs=2, batch_size=4)
    assert client.thresholds is not None and terms["pseudo_candidates"] == 2 * 3 * 4  # 3 steps per epoch (the labelled half in batches of 4, the incomplete last one folded), 4 unlabelled views each
    assert all(math.isfinite(v) for k, v in terms.items() if k != "pseudo_accuracy")
    up = client.make_update(model, x, y)
    assert up.prototypes.class_ids.tolist() == [0, 1, 2]


def test_semi_supervised_options():
    o = SemiSupervisedOptions()
    assert (o.unlabelled_fraction, o.supervised_versions, o.alpha, o.consistency_weight) == (0.5, 100, 0.5, 1.0)
    assert (o.margin_quantile, o.distance_quantile) == (0.10, 0.90)
    with pytest.raises(ValueError):
        SemiSupervisedOptions(unlabelled_fraction=1.0)
    with pytest.raises(ValueError):
        SemiSupervisedOptions(bogus=1)
    assert ALGO.Options(semi_supervised={"alpha": 0.2}).semi_supervised.alpha == 0.2


def test_through_the_client_runner_with_a_real_model_and_a_state_round_trip():
    from rayfed_proto.config import build_config
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.messages import UpdateSchema, validate_update
    from rayfed_proto.runtime.client_core import ClientRunner

    cfg = build_config({"algorithm": {"name": "fedsap", "semi_supervised": {"supervised_versions": 1}}},
                       ["federation.num_clients=4", "model.feature_dim=16", "data.partition.beta=1.0",
                        "data.image_size=16"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 4, cfg.seed, cfg.data.test_fraction)
    schema = UpdateSchema(4, ds.num_classes, 16)
    a = ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    meta, first = a.train(GlobalState(version=0))  # supervised phase: labelled half only
    hidden = a.algorithm.unlabelled
    assert validate_update(first, schema, current_version=0) is None
    assert first.num_samples == int((~hidden).sum()) and meta["terms"]["pseudo_candidates"] == 0
    bank = GlobalState(version=1, prototypes=first.prototypes)
    meta, second = a.train(bank)  # semi-supervised phase: calibrated, pseudo-labels drawn
    assert validate_update(second, schema, current_version=1) is None
    assert a.algorithm.thresholds is not None and meta["terms"]["pseudo_candidates"] > 0
    b = ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    _, ua = a.train(GlobalState(version=2, prototypes=first.prototypes))
    _, ub = b.train(GlobalState(version=2, prototypes=first.prototypes))
    np.testing.assert_allclose(ua.prototypes.vectors, ub.prototypes.vectors, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(a.algorithm.accepted_idx, b.algorithm.accepted_idx)


def test_the_partitions_unlabelled_pool_reaches_the_client():
    from rayfed_proto.config import build_config
    from rayfed_proto.data import load_dataset, make_partition
    from rayfed_proto.runtime.client_core import ClientRunner

    cfg = build_config({"algorithm": {"name": "fedsap", "semi_supervised": {"supervised_versions": 1}}},
                       ["federation.num_clients=4", "model.feature_dim=16", "data.image_size=16",
                        "data.partition.name=nway_kshot", "data.partition.n_way=2", "data.partition.k_shot=8",
                        "data.partition.unlabelled_per_client=6"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 4, cfg.seed, cfg.data.test_fraction)
    split = part.clients[0]
    runner = ClientRunner(cfg, split, ds, torch.device("cpu"))
    x, y = ds.tensors(split.unlabelled_idx)
    assert len(y) == 6 and torch.equal(runner.algorithm.pool_x, x) and torch.equal(runner.algorithm.pool_y, y)
    _, first = runner.train(GlobalState(version=0))  # supervised phase: the whole split is labelled
    assert first.num_samples == len(split.train_idx) and runner.algorithm.unlabelled is None
    meta, _ = runner.train(GlobalState(version=1, prototypes=first.prototypes))
    assert meta["terms"]["pseudo_candidates"] > 0
