"""FedSC (papers/fedsc.md Eq. 5-15) against values computed by hand."""

import math

import numpy as np
import pytest
import torch
from doubles import FixedModel, pset

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.algorithms.fedsc import (
    consistent_prototypes,
    consistent_weights,
    cpdr_loss,
    dense_uploads,
    discrepancy,
    global_prototypes,
    neighbor_sets,
    relational_prototypes,
    rpcl_loss,
    rpcl_loss_code,
)
from rayfed_proto.config import build_config
from rayfed_proto.messages import ClientUpdate, GlobalState
from rayfed_proto.models.zoo import ProtoModel

ALGO = ALGORITHMS.get("fedsc")
CPU = torch.device("cpu")


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def tiny_model():
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 6), torch.nn.ReLU())
    return ProtoModel("tiny", backbone, 6, 2, 4)


def tiny_spec(seed=0):
    return FederationSpec(num_clients=3, num_classes=4, feature_dim=2, seed=seed, build_model=tiny_model)


def fixed_spec(num_clients=3, num_classes=3):
    return FederationSpec(num_clients=num_clients, num_classes=num_classes, feature_dim=2, seed=0,
                          build_model=lambda: FixedModel(2, num_classes))


# ----------------------------------------------------------------------------- options


def test_defaults_are_the_authors_code_and_the_paper_is_a_variant():
    o = ALGO.Options()
    assert (o.num_neighbors, o.tau, o.rpcl_weight, o.cpdr_weight) == (0, 0.05, 1.0, 1.0)
    assert (o.variant, o.cpdr_reduction, o.prototype_source) == ("code", "mse", "train_last_epoch")
    assert (o.aggregation_scope, o.server_lr) == ("buffer", 1.0)
    paper = ALGO.Options(variant="paper")
    assert (paper.cpdr_reduction, paper.prototype_source, paper.num_neighbors, paper.aggregation_scope) == (
        "sum", "eval", 2, "latest")
    assert ALGO.Options(variant="paper", cpdr_reduction="mean").cpdr_reduction == "mean"  # a set key wins
    assert ALGO.Options(num_neighbors=2, aggregation_scope="latest").num_neighbors == 2
    with pytest.warns(FutureWarning, match="prototype_scope"):  # the old name still wins over the variant's default
        assert ALGO.Options(prototype_scope="latest").aggregation_scope == "latest"
    cfg = build_config({"algorithm": {"name": "fedsc"}, "model": {"group": "HtFE1"}})
    assert cfg.data.global_test_fraction == 0.2 and ALGO.requires_homogeneous_models


def run_settings(cfg):
    t = cfg.training
    return t.lr, t.momentum, t.weight_decay, cfg.federation.participation


def test_variant_code_sets_the_authors_optimizer_and_participation():
    """hwang52/FedSC: SGD(params, lr=args.lr_local_training) with --lr_local_training 0.1 (no
    momentum, no weight decay); --num_online_clients 5 of --num_clients 10 per round."""
    base = {"model": {"group": "HtFE1"}, "federation": {"mode": "sync", "num_clients": 10}}
    code = build_config({**base, "algorithm": {"name": "fedsc"}})
    assert run_settings(code) == (0.1, 0.0, 0.0, 0.5)
    assert code.algorithm.model_extra["cpdr_reduction"] == "mse"
    paper = build_config({**base, "algorithm": {"name": "fedsc", "variant": "paper"}})
    assert run_settings(paper) == (0.01, 0.9, 1e-5, 1.0)  # Sec. 5.1, every client
    assert paper.algorithm.model_extra["prototype_source"] == "eval"
    mine = build_config({**base, "algorithm": {"name": "fedsc"}}, ["training.lr=0.05", "federation.participation=1.0"])
    assert run_settings(mine) == (0.05, 0.0, 0.0, 1.0)  # what the user sets wins
    assert run_settings(build_config({**base, "algorithm": {"name": "fedavg"}})) == (0.01, 0.0, 0.0, 1.0)


@pytest.mark.parametrize("bad", ["papers", ["code"], 3])
def test_a_bad_variant_is_reported_with_the_key_and_the_values_allowed(bad):
    from rayfed_proto.config import ConfigError

    with pytest.raises(ConfigError) as err:
        build_config({"algorithm": {"name": "fedsc", "variant": bad}, "model": {"group": "HtFE1"}})
    assert "algorithm.variant" in str(err.value) and "'code'" in str(err.value) and "'paper'" in str(err.value)


def test_presets_keep_the_paper_variant():
    from rayfed_proto.config import load_config
    from rayfed_proto.preset_files import resolve_config_arg

    for name in ("fedsc_cifar10", "fedsc_domains"):
        opts = load_config(resolve_config_arg(name)).algorithm_options()
        assert (opts.variant, opts.prototype_source) == ("paper", "eval"), name


# ----------------------------------------------------------------------------- Eq. 5, 7-9


def test_neighbor_selection_top_m_by_angular_difference():
    phi = np.array([1.0, 0.5, 0.75, 0.0])  # exactly representable: ties are exact
    sets = neighbor_sets(phi, np.array([0, 1, 2, 3]), 2)
    # k=0: |1 - phi_q| = 0.5 (1), 0.25 (2), 1.0 (3) -> 2 then 1
    assert sets[0] == [0, 2, 1]
    # k=1: 0.5 (0), 0.25 (2), 0.5 (3): tie between 0 and 3 goes to the lower id
    assert sets[1] == [1, 2, 0]
    # k=2: 0.25 (0), 0.25 (1), 0.75 (3)
    assert sets[2] == [2, 0, 1]
    # k=3: 1.0 (0), 0.5 (1), 0.75 (2)
    assert sets[3] == [3, 1, 2]
    # only the holders of the class are candidates; fewer than M others: all of them
    assert neighbor_sets(phi, np.array([0, 3]), 2) == {0: [0, 3], 3: [3, 0]}
    assert neighbor_sets(phi, np.array([1]), 2) == {1: [1]}
    assert neighbor_sets(phi, np.array([0, 1, 2]), 0) == {0: [0], 1: [1], 2: [2]}


# Three clients, two classes and a third nobody holds:
#   class 0: c_0 = (1, 0), c_1 = (0, 1), c_2 = (1, 1)    class 1: only client 0, c_0^1 = (0, 3)
UPLOADS = {0: pset([0, 1], [[1, 0], [0, 3]], [3, 1]), 1: pset([0], [[0, 1]], [2]), 2: pset([0], [[1, 1]], [4])}


def test_global_and_relational_prototypes_by_hand():
    protos, held, counts = dense_uploads(UPLOADS, 3, 3, 2)
    g, g_mask = global_prototypes(protos, held, np.ones(3))
    # Eq. 5: g^0 = ((1,0) + (0,1) + (1,1)) / 3 = (2/3, 2/3); g^1 = (0, 3); class 2: none
    np.testing.assert_allclose(g[:2], [[2 / 3, 2 / 3], [0, 3]])
    assert g_mask.tolist() == [True, True, False]
    # Eq. 7: phi^0 = cos to (1, 1): [1/sqrt2, 1/sqrt2, 1]. M = 1:
    #   k=0: |phi_0 - phi_1| = 0 < |phi_0 - phi_2| -> {0, 1}: r = ((1,0) + (0,1)) / 2 = (0.5, 0.5)
    #   k=1: {1, 0}: (0.5, 0.5);  k=2: tie between 0 and 1 -> 0: ((1,1) + (1,0)) / 2 = (1, 0.5)
    # class 1 held by client 0 alone: r = c itself (divided by 1, not M + 1)
    rel, mask = relational_prototypes(protos, held, g, 1)
    np.testing.assert_allclose(rel[:, 0], [[0.5, 0.5], [0.5, 0.5], [1, 0.5]])
    np.testing.assert_allclose(rel[0, 1], [0, 3])
    assert mask.tolist() == [[True, True, False], [True, False, False], [True, False, False]]
    np.testing.assert_array_equal(rel[~mask], 0.0)
    # M = 2: every holder of class 0 merges all three: (2/3, 2/3)
    rel2, _ = relational_prototypes(protos, held, g, 2)
    np.testing.assert_allclose(rel2[:, 0], [[2 / 3, 2 / 3]] * 3)


def test_global_prototypes_are_staleness_weighted():
    protos, held, _ = dense_uploads(UPLOADS, 3, 3, 2)
    g, _ = global_prototypes(protos, held, np.array([1.0, 0.5, 0.5]))
    # (1 * (1,0) + 0.5 * (0,1) + 0.5 * (1,1)) / 2 = (0.75, 0.5)
    np.testing.assert_allclose(g[0], [0.75, 0.5])


# ----------------------------------------------------------------------------- Eq. 10-12


def test_discrepancy_by_hand():
    counts = np.array([[3, 1], [2, 2], [4, 0], [0, 0]], float)
    # B = (3/4, 1/4), H = (1/2, 1/2): sqrt(1/2 (1/16 + 1/16)) = 1/4; uniform: 0;
    # (1, 0): sqrt(1/2 (1/4 + 1/4)) = 1/2; a client without samples: 0
    np.testing.assert_allclose(discrepancy(counts), [0.25, 0.0, 0.5, 0.0])


def test_consistent_weights_by_hand():
    counts = np.array([[3, 1], [2, 2], [4, 0]], float)
    held = counts > 0
    # n_k = 4 each, N = 12 -> a n_k = 1/3; d = (1/4, 0, 1/2), sum d = 3/4 -> b d_k = (1/3, 0, 2/3)
    # sigmoid arguments: 0, 1/3, -1/3
    s0, s1, s2 = sig(0), sig(1 / 3), sig(-1 / 3)
    e = consistent_weights(counts, held, np.ones(3))
    # class 0 is held by all three, class 1 by clients 0 and 1 only (normalised over them)
    np.testing.assert_allclose(e[:, 0], np.array([s0, s1, s2]) / (s0 + s1 + s2))
    np.testing.assert_allclose(e[:, 1], np.array([s0, s1, 0]) / (s0 + s1))
    np.testing.assert_allclose(e.sum(0), 1.0)
    # staleness weights multiply before the normalisation
    e = consistent_weights(counts, held, np.array([1.0, 0.5, 1.0]))
    np.testing.assert_allclose(e[:, 1], np.array([s0, 0.5 * s1, 0]) / (s0 + 0.5 * s1))
    # every client uniform: sum d = 0, the d term vanishes; equal n: equal weights
    flat = np.array([[2, 2], [2, 2]], float)
    np.testing.assert_allclose(consistent_weights(flat, flat > 0, np.ones(2)), 0.5)


def test_consistent_prototypes_by_hand():
    rel = np.zeros((2, 3, 2))
    rel[0, 0], rel[1, 0], rel[0, 1] = [1, 0], [0, 2], [4, 4]
    held = np.array([[True, True, False], [True, False, False]])
    e = np.array([[0.25, 1.0, 0.0], [0.75, 0.0, 0.0]])
    o, mask = consistent_prototypes(rel, held, e)
    # o^0 = 0.25 (1, 0) + 0.75 (0, 2) = (0.25, 1.5); o^1 = (4, 4); class 2 held by nobody: absent
    np.testing.assert_allclose(o[:2], [[0.25, 1.5], [4, 4]])
    assert mask.tolist() == [True, True, False]


# ----------------------------------------------------------------------------- Eq. 13-15


def test_rpcl_with_the_normaliser_u_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1])
    rel = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    rel_y = torch.tensor([0, 1])
    # U over the batch: U_a = (||(1,0)-(2,0)|| + ||(0,1)-(2,0)||) / 2 = (1 + sqrt5) / 2
    #                   U_b = (||(1,0)-(0,3)|| + ||(0,1)-(0,3)||) / 2 = (sqrt10 + 2) / 2
    # sample 0: cos = [1, 0] -> s = [1/U_a, 0]; sample 1: cos = [0, 1] -> s = [0, 1/U_b]
    # tau 0.5: loss_i = -log(e^{s_pos/tau} / (e^{s_pos/tau} + e^0)) = log(1 + e^{-s_pos/tau})
    ua, ub = (1 + math.sqrt(5)) / 2, (math.sqrt(10) + 2) / 2
    expected = (math.log(1 + math.exp(-2 / ua)) + math.log(1 + math.exp(-2 / ub))) / 2
    assert rpcl_loss(z, y, rel, rel_y, 0.5).item() == pytest.approx(expected, rel=1e-6)


def test_rpcl_every_relational_prototype_of_the_class_is_a_positive():
    z = torch.tensor([[1.0, 0.0]])
    rel = torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, 3.0]])  # two of class 0 (two clients), one of class 1
    rel_y = torch.tensor([0, 0, 1])
    # U = ||z - r|| (one sample): 1, 1, sqrt10; cos: 1, 1/sqrt2, 0 -> s = 1, 1/sqrt2, 0
    # tau 1: -log((e + e^{1/sqrt2}) / (e + e^{1/sqrt2} + 1)) = log(1 + 1 / (e + e^{1/sqrt2}))
    expected = math.log(1 + 1 / (math.e + math.exp(1 / math.sqrt(2))))
    assert rpcl_loss(z, torch.tensor([0]), rel, rel_y, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # a sample whose class has no relational prototype is skipped (it still counts in U, the mean over
    # the client's samples: here it sits on z, so U is unchanged); one class only: no negatives, loss 0
    two = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert rpcl_loss(two, torch.tensor([0, 2]), rel, rel_y, 1.0).item() == pytest.approx(expected, rel=1e-6)
    assert rpcl_loss(z, torch.tensor([0]), rel[:2], rel_y[:2], 1.0).item() == pytest.approx(0.0, abs=1e-7)
    assert rpcl_loss(z, torch.tensor([0]), rel[:0], rel_y[:0], 1.0).item() == 0.0


def test_rpcl_treats_u_as_a_constant():
    z = torch.tensor([[1.0, 0.5], [0.2, 1.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    rel, rel_y = torch.tensor([[2.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1])
    rpcl_loss(z, y, rel, rel_y, 0.5).backward()
    z2 = z.detach().clone().requires_grad_(True)
    u = torch.cdist(z2.detach(), rel).mean(0)  # constants
    logits = torch.nn.functional.normalize(z2, dim=1) @ torch.nn.functional.normalize(rel, dim=1).T / u / 0.5
    torch.nn.functional.cross_entropy(logits, y).backward()  # one positive per class: Eq. 14 is this CE
    torch.testing.assert_close(z.grad, z2.grad)


def test_cpdr_by_hand():
    z = torch.tensor([[1.0, 2.0], [7.0, 7.0]])
    o = torch.tensor([[0.0, 4.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([True, False, False])
    # sample 0: |1 - 0| + |2 - 4| = 3; sample 1 (class 1 has no o): skipped
    assert cpdr_loss(z, torch.tensor([0, 1]), o, mask).item() == pytest.approx(3.0)
    assert cpdr_loss(z, torch.tensor([0, 1]), o, mask, "mean").item() == pytest.approx(1.5)  # / D = 2
    assert cpdr_loss(z, torch.tensor([1, 1]), o, mask).item() == 0.0


def test_cpdr_mse_is_the_authors_f_mse_loss():
    """main_fedsc.py: reg_vector = co_p[y] where the class has one, else feas[i].detach();
    cpdr_loss = F.mse_loss(feas, stack(reg_vector)): mean over the batch and D."""
    z = torch.tensor([[1.0, 2.0], [7.0, 7.0]], requires_grad=True)
    o = torch.tensor([[0.0, 4.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([True, False, False])
    got = cpdr_loss(z, torch.tensor([0, 1]), o, mask, "mse")
    assert got.item() == pytest.approx((1 + 4) / 4)  # (1^2 + 2^2) / (B = 2 x D = 2)
    reference = torch.nn.functional.mse_loss(z, torch.stack([o[0], z[1].detach()]))
    assert got.item() == pytest.approx(reference.item())
    got.backward()
    z2 = z.detach().clone().requires_grad_(True)
    torch.nn.functional.mse_loss(z2, torch.stack([o[0], z2[1].detach()])).backward()
    torch.testing.assert_close(z.grad, z2.grad)


# ----------------------------------------------------------------------------- variant code: the authors' runnable loss


def pooled_reference(z, labels, protos, proto_labels, tau):
    """main_fedsc.py round_id > 1 with its except branch, written out with lists: every sample's
    positive is its own detached feature; sample j appends the prototypes of every class but
    y_j to one pooled list, and every sample is scored against the whole pool (infonce_lcl.py)."""
    pos_key = [z[i].detach() for i in range(len(z))]
    pool = [protos[m] for j in range(len(z)) for m in range(len(protos)) if proto_labels[m] != labels[j]]
    zn = torch.nn.functional.normalize(z, dim=1)
    pos = (zn * torch.nn.functional.normalize(torch.stack(pos_key), dim=1)).sum(1, keepdim=True)
    neg = zn @ torch.nn.functional.normalize(torch.stack(pool), dim=1).T
    logits = torch.cat([pos, neg], 1) / tau
    return torch.nn.functional.cross_entropy(logits, torch.zeros(len(z), dtype=torch.int64))


CODE_PROTOS = torch.tensor([[2.0, 0.0], [0.0, 3.0]])  # an upload of class 0 and one of class 1
CODE_LABELS = torch.tensor([0, 1])


def test_code_rpcl_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    y = torch.tensor([0, 1, 0])
    # pooled negatives: sample 0 adds (0,3), sample 1 adds (2,0), sample 2 adds (0,3): (2,0) once, (0,3) twice.
    # tau 0.5, positive logit cos(z, z) / tau = 2 for every sample:
    #   z0 = (1,0): cos (1, 0)     -> log((e^2 + e^2 + 2 e^0) / e^2)        = log(2 + 2 e^-2)
    #   z1 = (0,2): cos (0, 1)     -> log((e^2 + e^0 + 2 e^2) / e^2)        = log(3 + e^-2)
    #   z2 = (3,4): cos (0.6, 0.8) -> log((e^2 + e^1.2 + 2 e^1.6) / e^2)    = log(1 + e^-0.8 + 2 e^-0.4)
    # sample 1's own class prototype (0,3) is among its negatives (added by samples 0 and 2)
    expected = (math.log(2 + 2 * math.exp(-2)) + math.log(3 + math.exp(-2))
                + math.log(1 + math.exp(-0.8) + 2 * math.exp(-0.4))) / 3
    got = rpcl_loss_code(z, y, CODE_PROTOS, CODE_LABELS, 0.5)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert got.item() == pytest.approx(pooled_reference(z, y, CODE_PROTOS, CODE_LABELS, 0.5).item(), rel=1e-6)
    # a batch of one class: (2,0) never enters the pool; z0 = (1,0) against (0,3) once: log(1 + e^-2)
    one = rpcl_loss_code(z[:1], y[:1], CODE_PROTOS, CODE_LABELS, 0.5)
    assert one.item() == pytest.approx(math.log(1 + math.exp(-2)), rel=1e-6)
    # an empty pool (only the sample's own class uploaded; the code's torch.stack([]) would raise): 0
    assert rpcl_loss_code(z[:1], y[:1], CODE_PROTOS[:1], CODE_LABELS[:1], 0.5).item() == 0.0
    assert rpcl_loss_code(z, y, CODE_PROTOS[:0], CODE_LABELS[:0], 0.5).item() == 0.0


def test_code_rpcl_gradient_is_the_pooled_lists_and_the_positive_pulls_nothing():
    z = torch.tensor([[1.0, 0.5], [0.2, 1.0], [0.7, -0.3]], requires_grad=True)
    y = torch.tensor([0, 1, 0])
    rpcl_loss_code(z, y, CODE_PROTOS, CODE_LABELS, 0.05).backward()
    z2 = z.detach().clone().requires_grad_(True)
    pooled_reference(z2, y, CODE_PROTOS, CODE_LABELS, 0.05).backward()
    torch.testing.assert_close(z.grad, z2.grad)
    # the positive logit is the constant 1 / tau: the same loss with it as a number has the same gradient
    z3 = z.detach().clone().requires_grad_(True)
    neg = torch.nn.functional.normalize(z3, dim=1) @ torch.nn.functional.normalize(CODE_PROTOS, dim=1).T / 0.05
    mult = torch.tensor([1.0, 2.0])  # (2,0): one sample of another class; (0,3): two
    loss = (torch.logsumexp(torch.cat([torch.full((3, 1), 1 / 0.05), neg + mult.log()], 1), 1) - 1 / 0.05).mean()
    loss.backward()
    torch.testing.assert_close(z.grad, z3.grad)
    # no negatives: the positive alone, loss 0 and no gradient
    z4 = z.detach().clone().requires_grad_(True)
    rpcl_loss_code(z4, y, CODE_PROTOS[:0], CODE_LABELS[:0], 0.05).backward()
    assert torch.count_nonzero(z4.grad) == 0


def code_state():
    """The previous version's uploads as broadcast under variant code (M = 0: r_k^j = c_k^j)."""
    rel = np.zeros((3, 3, 2), np.float32)
    mask = np.zeros((3, 3), bool)
    rel[0, 0], rel[1, 1] = [2, 0], [0, 3]
    mask[0, 0] = mask[1, 1] = True
    return GlobalState(version=1, prototypes=pset([0, 1], [[0, 4], [9, 9]], [1, 1]),
                       extras={"relational": rel, "relational_mask": mask})


def test_code_client_loss_is_ce_plus_rpcl_and_cpdr_is_zero_without_gradient():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]], requires_grad=True)
    y = torch.tensor([0, 1, 0])
    client, model = client_with(code_state(), tau=0.5)  # variant code by default; consistent o^y far from z
    loss, terms = client.loss(model, z, y)
    rpcl = (math.log(2 + 2 * math.exp(-2)) + math.log(3 + math.exp(-2))
            + math.log(1 + math.exp(-0.8) + 2 * math.exp(-0.4))) / 3  # test_code_rpcl_by_hand
    assert terms["cpdr"] == 0.0  # F.mse_loss(feas, feas.detach())
    assert terms["rpcl"] == pytest.approx(rpcl, rel=1e-6)
    assert loss.item() == pytest.approx(math.log(3) + rpcl, rel=1e-6)
    loss.backward()
    # FixedModel's head is zero, so CE gives z no gradient (W^T (p - y) = 0): z's gradient is RPCL's alone
    z2 = z.detach().clone().requires_grad_(True)
    rpcl_loss_code(z2, y, CODE_PROTOS, CODE_LABELS, 0.5).backward()
    torch.testing.assert_close(z.grad, z2.grad)
    # the CPDR term alone: 0 with a zero gradient, whatever the weight
    z3 = z.detach().clone().requires_grad_(True)
    heavy, model = client_with(code_state(), tau=0.5, rpcl_weight=0.0, cpdr_weight=100.0)
    loss, terms = heavy.loss(model, z3, y)
    loss.backward()
    assert terms["cpdr"] == 0.0 and torch.count_nonzero(z3.grad) == 0


# ----------------------------------------------------------------------------- client


def client_with(state, **opts):
    client = ALGO.Client(ALGO.Options(**opts), fixed_spec(), client_id=0)
    model = FixedModel()
    client.receive(state, model)
    return client, model


def sc_state(version=1):
    rel = np.zeros((3, 3, 2), np.float32)
    mask = np.zeros((3, 3), bool)
    rel[0, 0], rel[1, 1] = [2, 0], [0, 3]
    mask[0, 0] = mask[1, 1] = True
    return GlobalState(version=version, prototypes=pset([0], [[0, 4]], [1]),
                       extras={"relational": rel, "relational_mask": mask})


def test_client_loss_is_ce_plus_weighted_terms():
    z, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    client, model = client_with(sc_state(), variant="paper", tau=0.5, rpcl_weight=0.5, cpdr_weight=2.0,
                                cpdr_reduction="sum")
    loss, terms = client.loss(model, z, y)
    assert set(terms) == {"ce", "rpcl", "cpdr"}
    assert terms["ce"] == pytest.approx(math.log(3))  # zero head
    ua, ub = (1 + math.sqrt(5)) / 2, (math.sqrt(10) + 2) / 2  # as in the RPCL test above
    rpcl = (math.log(1 + math.exp(-2 / ua)) + math.log(1 + math.exp(-2 / ub))) / 2
    assert terms["rpcl"] == pytest.approx(rpcl, rel=1e-6)
    assert terms["cpdr"] == pytest.approx(5.0)  # only sample 0 has o^0 = (0, 4): |1| + |0 - 4| = 5
    assert loss.item() == pytest.approx(math.log(3) + 0.5 * rpcl + 2.0 * 5.0, rel=1e-6)
    np.testing.assert_array_equal(client.inference_bank().vectors, [[0, 4]])  # nearest consistent prototype
    off, model = client_with(sc_state(), variant="paper", tau=0.5, rpcl_weight=0.0, cpdr_weight=0.0,
                             cpdr_reduction="sum")
    loss, terms = off.loss(model, z, y)
    assert loss.item() == pytest.approx(math.log(3)) and terms["cpdr"] == pytest.approx(5.0)  # logged, not optimised


@pytest.mark.parametrize("variant", ["code", "paper"])
def test_client_before_any_prototype_trains_on_ce_only(variant):
    client, model = client_with(GlobalState(version=0), variant=variant)
    loss, terms = client.loss(model, torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    assert loss.item() == pytest.approx(math.log(3)) and terms["rpcl"] == terms["cpdr"] == 0.0
    # an all-False mask is the same as none
    empty = GlobalState(version=0, extras={"relational": np.zeros((3, 3, 2), np.float32),
                                           "relational_mask": np.zeros((3, 3), bool)})
    client, model = client_with(empty)
    assert client.relational is None


def test_client_uploads_weights_and_prototypes_with_counts():
    client, model = client_with(sc_state())
    update = client.make_update(model, torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0, 2]))
    assert set(update.weights) == {"head.weight"}
    assert update.prototypes.class_ids.tolist() == [0, 2] and update.prototypes.counts.tolist() == [2, 1]
    np.testing.assert_allclose(update.prototypes.vectors, [[2, 0], [0, 2]])


def test_code_variant_uploads_the_last_local_epochs_training_features():
    """main_fedsc.py Local.local_train: local_p collects feas[i] only when tr_idx ==
    num_epochs_local_training - 1, then average_kns: per-class means of the last epoch's training
    features (train mode, before each step)."""
    torch.manual_seed(0)
    spec = tiny_spec()
    client = ALGO.Client(ALGO.Options(), spec, 0)
    model = tiny_model()
    client.receive(GlobalState(version=0), model)
    x, y = torch.randn(9, 4), torch.tensor([0, 1, 2] * 3)
    seen_feats, seen_y = [], []
    hook = model.projection.register_forward_hook(lambda _m, _i, out: seen_feats.append(out.detach().clone()))
    loss = client.loss
    client.loss = lambda m, xb, yb: (seen_y.append(yb.clone()), loss(m, xb, yb))[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    client.local_train(model, opt, TrainBatchIterator(x, y, 4, torch.Generator().manual_seed(0)), 3, CPU)
    hook.remove()
    steps = 2  # 9 samples in batches of 4: 4 + 5 (the last one-sample batch folded in)
    last_f, last_y = torch.cat(seen_feats[-steps:]), torch.cat(seen_y[-steps:])
    update = client.make_update(model, x, y)
    assert update.prototypes.class_ids.tolist() == [0, 1, 2] and update.prototypes.counts.tolist() == [3, 3, 3]
    expected = torch.stack([last_f[last_y == c].mean(0) for c in range(3)])
    np.testing.assert_allclose(update.prototypes.vectors, expected.numpy(), rtol=1e-5, atol=1e-6)
    every_epoch = torch.cat(seen_feats)
    assert not np.allclose(update.prototypes.vectors, every_epoch[torch.cat(seen_y) == 0].mean(0).numpy())


def test_update_work_has_the_eval_pass_only_in_the_paper_variant():
    from rayfed_proto.algorithms.base import UpdateSizes

    sizes = UpdateSizes(train=100, local_epochs=10, batch_size=64)
    assert [p.backward for p in ALGO.Client.update_work(ALGO.Options(), sizes)] == [True]
    assert [p.backward for p in ALGO.Client.update_work(ALGO.Options(variant="paper"), sizes)] == [True, False]


# ----------------------------------------------------------------------------- server


def updates_for(sets, base_version=0):
    return [ClientUpdate(k, base_version, int(ps.counts.sum()), prototypes=ps) for k, ps in sets.items()]


def test_server_computes_relational_and_consistent_prototypes_by_hand():
    server = ALGO.Server(ALGO.Options(variant="paper", num_neighbors=1), fixed_spec(), CPU)
    state0 = server.broadcast(0)
    assert state0.prototypes is not None and len(state0.prototypes) == 0
    assert state0.extras["relational"].shape == (3, 3, 2) and not state0.extras["relational_mask"].any()
    metrics = server.aggregate(updates_for(UPLOADS), [1.0] * 3, 1)
    state = server.broadcast(1)
    mask = state.extras["relational_mask"]
    np.testing.assert_allclose(state.extras["relational"][:, 0], [[0.5, 0.5], [0.5, 0.5], [1, 0.5]])  # as above
    assert mask.tolist() == [[True, True, False], [True, False, False], [True, False, False]]
    # counts (C = 3): client 0 [3, 1, 0] (n 4), client 1 [2, 0, 0] (n 2), client 2 [4, 0, 0] (n 4); N = 10
    # d_0 = sqrt(1/2 ((3/4 - 1/3)^2 + (1/4 - 1/3)^2 + (1/3)^2)), d_1 = d_2 = sqrt(1/2 ((2/3)^2 + 2 (1/3)^2)) = sqrt(1/3)
    d0 = math.sqrt(0.5 * ((3 / 4 - 1 / 3) ** 2 + (1 / 4 - 1 / 3) ** 2 + (1 / 3) ** 2))
    d1 = math.sqrt(1 / 3)
    dsum = d0 + 2 * d1
    w = [sig(4 / 10 - d0 / dsum), sig(2 / 10 - d1 / dsum), sig(4 / 10 - d1 / dsum)]
    e = np.array(w) / sum(w)
    o0 = e[0] * np.array([0.5, 0.5]) + e[1] * np.array([0.5, 0.5]) + e[2] * np.array([1, 0.5])
    assert state.prototypes.class_ids.tolist() == [0, 1]  # class 2: held by nobody, absent
    np.testing.assert_allclose(state.prototypes.vectors, [o0, [0, 3]], rtol=1e-6)  # class 1: one holder, e = 1
    assert metrics["consistent_classes"] == 2.0 and metrics["prototype_clients"] == 3.0
    assert metrics["discrepancy_mean"] == pytest.approx((d0 + 2 * d1) / 3)
    np.testing.assert_array_equal(server.guidance_bank().vectors, state.prototypes.vectors)


def test_code_server_sends_only_this_versions_uploads_unmerged_and_weighs_over_every_client():
    """main_fedsc.py FedSC_main: re_p = get_re_p(list_local_p) of the round's online_clients, the
    raw uploads (the merge writes into a copy); get_co_p: e normalised over all of them."""
    server = ALGO.Server(ALGO.Options(), fixed_spec(), CPU)  # variant code: M = 0, scope buffer
    server.aggregate(updates_for(UPLOADS), [1.0] * 3, 1)
    state = server.broadcast(1)
    np.testing.assert_allclose(state.extras["relational"][:, 0], [[1, 0], [0, 1], [1, 1]])  # c_k^0 themselves
    np.testing.assert_allclose(state.extras["relational"][0, 1], [0, 3])
    # counts and d as in test_server_computes_relational_and_consistent_prototypes_by_hand
    d0 = math.sqrt(0.5 * ((3 / 4 - 1 / 3) ** 2 + (1 / 4 - 1 / 3) ** 2 + (1 / 3) ** 2))
    d1 = math.sqrt(1 / 3)
    dsum = d0 + 2 * d1
    w = np.array([sig(4 / 10 - d0 / dsum), sig(2 / 10 - d1 / dsum), sig(4 / 10 - d1 / dsum)])
    e = w / w.sum()  # over the three clients, for every class
    o0 = e[0] * np.array([1, 0]) + e[1] * np.array([0, 1]) + e[2] * np.array([1, 1])
    np.testing.assert_allclose(state.prototypes.vectors, [o0, e[0] * np.array([0, 3])], rtol=1e-6)  # o^1: e_0 < 1
    # the next version aggregates client 1 alone: its class-0 upload is the only prototype sent
    server.aggregate([ClientUpdate(1, 1, 2, prototypes=pset([0], [[0, 5]], [2]))], [1.0], 2)
    mask = server.broadcast(2).extras["relational_mask"]
    assert mask.tolist() == [[False, False, False], [True, False, False], [False, False, False]]
    client, _ = client_with(server.broadcast(2))
    assert client.relational.tolist() == [[0.0, 5.0]] and client.relational_labels.tolist() == [0]


def test_latest_scope_keeps_every_client_with_its_staleness():
    # M = 0: r_k = c_k. Both clients uniform over 2 classes with 4 samples: equal sigmoid terms,
    # so e_k is proportional to the staleness weight alone
    spec = fixed_spec(num_clients=2, num_classes=2)
    a = pset([0, 1], [[1, 0], [0, 1]], [2, 2])
    b = pset([0, 1], [[3, 0], [0, 3]], [2, 2])
    latest = ALGO.Server(ALGO.Options(variant="paper", num_neighbors=0), spec, CPU)
    buffer = ALGO.Server(ALGO.Options(variant="paper", num_neighbors=0, aggregation_scope="buffer"), spec, CPU)
    for server in (latest, buffer):
        server.aggregate([ClientUpdate(0, 0, 4, prototypes=a)], [1.0], 1)
        server.aggregate([ClientUpdate(1, 1, 4, prototypes=b)], [1.0], 2)
    # at version 2: client 0 trained on 0 -> staleness 1, weight 2^-0.5; client 1 trained on 1 -> 1
    s0 = 2 ** -0.5
    e0 = s0 / (s0 + 1)
    np.testing.assert_allclose(latest.broadcast(2).prototypes.vectors[0], [e0 * 1 + (1 - e0) * 3, 0], rtol=1e-6)
    assert latest.broadcast(2).extras["relational_mask"].tolist() == [[True, True], [True, True]]
    # buffer: only this version's upload
    np.testing.assert_allclose(buffer.broadcast(2).prototypes.vectors, [[3, 0], [0, 3]])
    assert buffer.broadcast(2).extras["relational_mask"].tolist() == [[False, False], [True, True]]
    # an older upload of a client never replaces a newer one in the store
    latest.aggregate([ClientUpdate(1, 0, 4, prototypes=a)], [1.0], 3)
    assert latest.latest[1][1] == 1


def test_buffer_scope_keeps_the_last_consistent_prototype_of_classes_not_in_the_buffer():
    spec = fixed_spec(num_clients=2, num_classes=2)
    server = ALGO.Server(ALGO.Options(aggregation_scope="buffer"), spec, CPU)
    server.aggregate([ClientUpdate(0, 0, 2, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 1]))], [1.0], 1)
    server.aggregate([ClientUpdate(1, 1, 2, prototypes=pset([0], [[5, 0]], [2]))], [1.0], 2)
    np.testing.assert_allclose(server.broadcast(2).prototypes.vectors, [[5, 0], [0, 1]])
    assert server.bank.updated_at.tolist() == [2, 1]


@pytest.mark.parametrize("variant", ["code", "paper"])
def test_round_trip_and_state_dict_restores_identical_broadcasts(variant):
    torch.manual_seed(0)
    opts = ALGO.Options(variant=variant)
    spec = tiny_spec()
    server = ALGO.Server(opts, spec, CPU)
    clients = [ALGO.Client(opts, spec, k) for k in range(3)]
    models = [tiny_model() for _ in range(3)]
    # class 2 held by client 2 alone; class 3 by nobody
    data = [(torch.randn(8, 4), torch.tensor([0, 1] * 4)), (torch.randn(8, 4), torch.tensor([0, 1] * 4)),
            (torch.randn(9, 4), torch.tensor([0, 1, 2] * 3))]

    def round_(version, ws):
        state = server.broadcast(version - 1)
        updates = []
        for client, model, (x, y) in zip(clients, models, data, strict=True):
            client.receive(state, model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            terms = client.local_train(model, opt, TrainBatchIterator(x, y, 4, torch.Generator().manual_seed(0)), 1, CPU)
            assert set(terms) == {"loss", "ce", "rpcl", "cpdr", "nonfinite_steps"} and terms["nonfinite_steps"] == 0
            updates.append(client.make_update(model, x, y))
        return updates

    server.aggregate(round_(1, None), [1.0] * 3, 1)
    state1 = server.broadcast(1)
    assert state1.prototypes.class_ids.tolist() == [0, 1, 2]
    assert state1.extras["relational_mask"][:, 2].tolist() == [False, False, True]
    assert not state1.extras["relational_mask"][:, 3].any()
    if variant == "paper":  # one holder: e = 1 (variant code divides by every client's weight)
        np.testing.assert_allclose(state1.prototypes.vectors[2], server.latest[2][0].vectors[2], rtol=1e-6)
    saved = server.state_dict()
    fresh = ALGO.Server(opts, tiny_spec(seed=7), CPU)
    fresh.load_state_dict(saved)
    a, b = server.broadcast(1), fresh.broadcast(1)
    np.testing.assert_array_equal(a.prototypes.vectors, b.prototypes.vectors)
    for k in a.extras:
        np.testing.assert_array_equal(a.extras[k], b.extras[k])
    for k in a.weights:
        np.testing.assert_array_equal(a.weights[k], b.weights[k])
    # the next version is identical too (the store of latest uploads was restored), with a partial buffer
    updates = round_(2, None)[:1]
    server.aggregate(updates, [1.0], 2)
    fresh.aggregate(updates, [1.0], 2)
    np.testing.assert_array_equal(server.broadcast(2).prototypes.vectors, fresh.broadcast(2).prototypes.vectors)
    np.testing.assert_array_equal(server.broadcast(2).extras["relational"], fresh.broadcast(2).extras["relational"])
    # the saved state is a copy: aggregating on does not change it
    assert not np.array_equal(np.asarray(saved["relational"]), server.broadcast(2).extras["relational"])
