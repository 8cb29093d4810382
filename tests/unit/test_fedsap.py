"""FedSAP: proxy logits and loss, the scheduled composite loss and uniform aggregation, by hand."""

import math

import numpy as np
import pytest
import torch

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.base import PrototypeServer
from rayfed_proto.algorithms.common import bank_tensors
from rayfed_proto.algorithms.fedsap import proxy_logits, proxy_loss
from rayfed_proto.messages import ClientUpdate, GlobalState, PrototypeSet


class FixedModel(torch.nn.Module):
    """features(x) = x, logits = x @ W with W = 0: CE is ln(num_classes) whatever x is."""

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
PROTO = 5.0  # sample 0 only: (1 - 2)^2 + (2 - 0)^2 = 5 (squared norm, Eq. 5 as printed)
# sample 0 only: f = (1, 2)/sqrt5, cosines 1/sqrt5 (P0), 2/sqrt5 (P2); y = 0 -> log(1 + e^(32/sqrt5))
PROXY = math.log1p(math.exp(32 / math.sqrt(5)))


def client_at(version, **options):
    client = ALGO.Client(ALGO.Options(**options), SPEC, client_id=0)
    client.receive(GlobalState(version=version, prototypes=BANK), FixedModel())
    return client


@pytest.mark.parametrize("version,lam", [(0, 0.0), (10, 0.0), (20, 0.0), (60, 0.35), (100, 0.7), (500, 0.7)])
def test_loss_is_ce_plus_scheduled_proto_plus_proxy(version, lam):
    loss, terms = client_at(version).loss(FixedModel(), X, Y)
    assert set(terms) == {"ce", "proto", "proxy"}
    assert terms["ce"] == pytest.approx(CE)
    assert terms["proto"] == pytest.approx(PROTO)
    assert terms["proxy"] == pytest.approx(PROXY, rel=1e-5)
    # before r_start = 20: 0; mid-ramp (60): M / 2; from 100 on: M = 0.7
    assert loss.item() == pytest.approx(CE + lam * PROTO + PROXY, rel=1e-5)


def test_use_proxy_false_removes_the_term():
    loss, terms = client_at(100, use_proxy=False).loss(FixedModel(), X, Y)
    assert terms["proxy"] == 0.0
    assert loss.item() == pytest.approx(CE + 0.7 * PROTO, rel=1e-6)


def test_without_schedule_the_weight_is_constant_m():
    for version in (0, 10, 1000):
        loss, _ = client_at(version, alignment_schedule=None).loss(FixedModel(), X, Y)
        assert loss.item() == pytest.approx(CE + 0.7 * PROTO + PROXY, rel=1e-5)


def test_mean_reduction_divides_the_squared_distance_by_d():
    _, terms = client_at(100, alignment_reduction="mean").loss(FixedModel(), X, Y)
    assert terms["proto"] == pytest.approx(PROTO / 2)


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
    assert opts.aggregation == "uniform" and opts.alignment_reduction == "sum"
    s = opts.alignment_schedule
    assert (s.shape, s.start, s.length) == ("linear", 20, 80)
    assert ALGO.Options().alignment_schedule is not s  # each instance gets its own copy
    assert "fedsap" in ALGORITHMS.names() and ALGORITHMS.describe("fedsap")
