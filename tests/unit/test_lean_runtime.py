"""The lean runtime's pieces without Ray: the one-sync guarded step, train-pass prototypes, the
bank cache, per-client RNG streams and parked clients (ClientHost)."""

import copy

import numpy as np
import pytest
import torch

from rayfed_proto.algorithms.base import StepTally, TrainPrototypes, guarded_step
from rayfed_proto.algorithms.common import bank_tensors
from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState, PrototypeSet
from rayfed_proto.runtime.client_core import ClientHost, ClientRunner


class Tiny(torch.nn.Module):
    """A ProtoModel-shaped toy: projection (features) then head."""

    def __init__(self, normalize=False):
        super().__init__()
        self.projection = torch.nn.Linear(2, 2, bias=False)
        self.head = torch.nn.Linear(2, 2, bias=False)
        self.normalize = normalize
        with torch.no_grad():
            self.projection.weight.copy_(torch.eye(2))
            self.head.weight.copy_(torch.eye(2))

    def features(self, x):
        f = self.projection(x)
        return torch.nn.functional.normalize(f, dim=1) if self.normalize else f

    def forward_features(self, x):
        f = self.features(x)
        return f, self.head(f)


def test_guarded_step_applies_a_finite_step():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.tensor([[1.0, 0.0]])
    loss = (model.head(model.features(x)) ** 2).sum()  # = 1 at identity weights
    assert guarded_step(model, opt, loss)
    # d/dW (W2 W1 x)^2 at W=I: head grad = 2 * y x^T = [[2, 0], [0, 0]]; one step of lr 0.5 -> W[0,0] = 0
    assert model.head.weight[0, 0].item() == pytest.approx(0.0)


@pytest.mark.parametrize("bad", ["loss", "grad"])
def test_guarded_step_skips_nonfinite_loss_or_gradient(bad):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.tensor([[1.0, 0.0]])
    out = model.head(model.features(x)).sum()
    loss = out * float("nan") if bad == "loss" else out * torch.tensor(float("inf"))
    if bad == "grad":  # a finite loss whose gradient overflows: inf * 0 -> nan in the graph, finite value
        loss = out + (model.projection.weight.sum() * torch.tensor(1e38)) ** 2 * 0.0
        loss = loss.nan_to_num()
    assert not guarded_step(model, opt, loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_guarded_step_clips_with_the_same_norm():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.max_grad_norm = 1.0
    x = torch.tensor([[3.0, 4.0]])
    loss = model.head(model.features(x)).sum()  # grads: head = [[3, 4], [3, 4]], projection = [[3, 4], [3, 4]]
    assert guarded_step(model, opt, loss)
    total = (4 * 9 + 4 * 16) ** 0.5  # = 10: every gradient scaled by 1 / 10
    np.testing.assert_allclose(model.head.weight.detach().numpy(), np.eye(2) - np.array([[3, 4], [3, 4]]) / total, atol=1e-6)


def test_tally_sums_the_loss_without_per_step_reads():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tally = StepTally()
    for v in (1.0, 3.0):
        loss = model.head(model.features(torch.tensor([[v, 0.0]]))).sum()  # = v at identity
        tally.step(model, opt, loss, {"ce": 2 * v})
    tally.step(model, opt, torch.tensor(float("nan"), requires_grad=True), {"ce": 99.0})  # skipped: not counted
    assert tally.result() == {"loss": 2.0, "ce": 4.0, "nonfinite_steps": 1.0}


@pytest.mark.parametrize("normalize", [False, True])
def test_train_prototypes_are_class_means_of_the_training_passes(normalize):
    model = Tiny(normalize=normalize)
    batches = [(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 2])),
               (torch.tensor([[3.0, 0.0]]), torch.tensor([0]))]
    with TrainPrototypes(model, num_classes=3) as protos:
        for x, y in batches:
            model.forward_features(x)
            protos.add(y)
    split_y = torch.tensor([0, 0, 2, 2, 2])  # the split's class counts are what the server weighs by
    ps = protos.result(split_y)
    assert ps.class_ids.tolist() == [0, 2] and ps.counts.tolist() == [2, 3]
    if normalize:  # unit features: (1, 0) and (1, 0) for class 0; (0, 1) for class 2
        expected = [[1.0, 0.0], [0.0, 1.0]]
    else:
        expected = [[2.0, 0.0], [0.0, 2.0]]  # class 0: mean of (1, 0), (3, 0); class 2: (0, 2)
    np.testing.assert_allclose(ps.vectors, expected)


def test_train_prototypes_refuse_a_loss_without_one_forward_pass():
    model = Tiny()
    with TrainPrototypes(model, num_classes=2) as protos, pytest.raises(RuntimeError, match="prototype_source 'eval'"):
        protos.add(torch.tensor([0]))  # no forward pass recorded


def test_bank_tensors_are_built_once_per_received_bank():
    bank = PrototypeSet(np.array([1]), np.array([[1.0, 2.0]], np.float32), np.array([3]))
    dense, mask = bank_tensors(bank, 3, "cpu")
    assert dense.tolist() == [[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]] and mask.tolist() == [False, True, False]
    again = bank_tensors(bank, 3, "cpu")
    assert again[0] is dense and again[1] is mask  # cached: the same tensors
    other = PrototypeSet(np.array([0]), np.array([[5.0, 5.0]], np.float32), np.array([1]))
    assert bank_tensors(other, 3, "cpu")[0][0].tolist() == [5.0, 5.0]  # a new bank is densified anew


@pytest.fixture(scope="module")
def fed():
    cfg = build_config({}, ["algorithm.name=fedproto", "federation.num_clients=4", "model.feature_dim=16",
                            "data.partition.beta=1.0", "data.image_size=16", "model.group=HtFE1"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 4, cfg.seed, cfg.data.test_fraction)
    return cfg, ds, part


def test_train_source_upload_differs_from_an_eval_pass_and_follows_the_option(fed):
    cfg, ds, part = fed
    eval_cfg = build_config(cfg.to_dict(), ["algorithm.prototype_source=eval"])
    assert cfg.algorithm_options().prototype_source == "train"  # FedProto's reference collects in training
    _, train_up = ClientRunner(cfg, part.clients[0], ds, torch.device("cpu")).train(GlobalState(version=0))
    _, eval_up = ClientRunner(eval_cfg, part.clients[0], ds, torch.device("cpu")).train(GlobalState(version=0))
    assert train_up.prototypes.class_ids.tolist() == eval_up.prototypes.class_ids.tolist()
    assert train_up.prototypes.counts.tolist() == eval_up.prototypes.counts.tolist()
    assert not np.allclose(train_up.prototypes.vectors, eval_up.prototypes.vectors)  # features before each step


def test_a_client_result_does_not_depend_on_the_order_clients_run(fed):
    cfg, ds, part = fed
    cpu = torch.device("cpu")

    def run(order):
        runners = {c: ClientRunner(cfg, part.clients[c], ds, cpu) for c in (0, 1)}
        torch.manual_seed(123)  # whatever the process's own stream holds
        outer = torch.get_rng_state()
        ups = {c: runners[c].train(GlobalState(version=0))[1] for c in order}
        assert torch.equal(torch.get_rng_state(), outer)  # a client's update leaves the process stream alone
        return ups

    a, b = run([0, 1]), run([1, 0])
    for c in (0, 1):
        assert np.array_equal(a[c].prototypes.vectors, b[c].prototypes.vectors)


def test_parked_clients_hold_no_model_and_train_exactly_as_live_ones(fed):
    cfg, ds, part = fed
    cpu = torch.device("cpu")
    live = ClientHost(cfg, ds, part.clients, cpu, park=False)
    parked = ClientHost(cfg, ds, part.clients, cpu, park=True)
    assert live.live_count() == 4 and parked.live_count() == 0 and parked.state_dicts() == {}
    state = GlobalState(version=0)
    for rnd in range(2):
        for c in (2, 0):
            _, ul = live.train(c, state)
            _, up = parked.train(c, state)
            assert np.array_equal(ul.prototypes.vectors, up.prototypes.vectors)
            assert parked.live_count() == 0  # released right after its update
        state = GlobalState(version=rnd + 1, prototypes=ul.prototypes)
        ev_live, ev_parked = live.evaluate([0, 1, 2, 3], state), parked.evaluate([0, 1, 2, 3], state)
        assert [e["head_correct"] for e in ev_live] == [e["head_correct"] for e in ev_parked]
        assert parked.live_count() == 0
    assert sorted(parked.state_dicts()) == [0, 2]  # clients 1 and 3 never trained: nothing kept for them
    # a parked host restores checkpointed states and continues identically
    restored = ClientHost(cfg, ds, part.clients, cpu, park=True)
    restored.load_state_dicts(copy.deepcopy(live.state_dicts()))  # copies, as a checkpoint or Ray's transfer gives
    _, ul = live.train(0, state)
    _, ur = restored.train(0, state)
    assert np.array_equal(ul.prototypes.vectors, ur.prototypes.vectors)


def test_tally_sums_tensor_terms_on_the_device_and_reads_them_once():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tally = StepTally()
    for v in (1.0, 3.0):
        loss = model.head(model.features(torch.tensor([[v, 0.0]]))).sum()
        tally.step(model, opt, loss, {"ce": torch.tensor(2 * v, requires_grad=True), "n": v})
    assert isinstance(tally.totals["ce"], torch.Tensor) and not tally.totals["ce"].requires_grad  # not read yet
    assert tally.result() == {"loss": 2.0, "ce": 4.0, "n": 2.0, "nonfinite_steps": 0.0}


class _SyncCounter:
    """Counts the ways a tensor's value reaches Python (each one a host/device sync on a GPU)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
            original = getattr(torch.Tensor, name)

            def counted(self_tensor, *a, _original=original, **k):
                self.count += 1
                return _original(self_tensor, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("method", ["fedavg", "fedproto", "fedtgp", "fedsa", "fedsap", "fedlsa", "fedsc", "fedprotokd"])
def test_a_local_update_reads_at_most_one_value_per_step(method, monkeypatch):
    """Issue 11: at most one host/device synchronisation per step. The loss terms are summed on
    the device (StepTally) and only the guarded step's finiteness check reads a value each step;
    an update may read a few more once (the averaged terms, the prototype counts)."""
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.runtime.core import federation_spec

    cfg = build_config({}, [f"algorithm.name={method}", "federation.num_clients=4", "model.feature_dim=16",
                            "data.partition.beta=1.0", "data.image_size=16", "model.group=HtFE1",
                            "training.local_epochs=3", "data.public_size=200"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 4, cfg.seed, cfg.data.test_fraction, public_size=cfg.data.public_size)
    cpu = torch.device("cpu")
    spec = federation_spec(cfg, ds.num_classes, ds.channels, ds.image_size,
                           ds.tensors(part.public_idx)[0] if len(part.public_idx) else None)
    server = ALGORITHMS.get(method).Server(cfg.algorithm_options(), spec, cpu)
    runner = ClientRunner(cfg, part.clients[0], ds, cpu, spec.public_x)
    _, first = runner.train(server.broadcast(0))
    server.aggregate([first], [1.0], 1)
    state = server.broadcast(1)  # with a bank / weights / anchors: the method's full local loss
    steps = cfg.training.local_epochs * -(-len(part.clients[0].train_idx) // cfg.training.batch_size)
    counter = _SyncCounter(monkeypatch)
    runner.train(state)
    assert counter.count <= steps + 30, f"{method}: {counter.count} value reads in {steps} steps"


def test_masked_losses_equal_the_selected_rows_and_keep_gradients_finite():
    """The masked forms that replaced ``x[keep]`` selection give the same value as the selection,
    and the rows left out (neutral logits, weight 0) get zero, finite gradients even where their
    class's logit is -inf."""
    from rayfed_proto.algorithms.common import masked_cross_entropy, masked_mean

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=gen, requires_grad=True)
    labels = torch.tensor([0, 1, 3, 3, 2, 0])
    present = torch.tensor([True, True, False, True])  # class 2 has no prototype
    keep = present[labels]
    masked = logits.masked_fill(~present.unsqueeze(0), float("-inf"))
    got = masked_cross_entropy(masked, labels, keep)
    want = torch.nn.functional.cross_entropy(masked[keep], labels[keep])
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    got.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[4].abs().sum() == 0  # sample 4 (class 2) left out
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert masked_mean(values, torch.tensor([True, False, True, False])).item() == pytest.approx(2.0)
    assert masked_mean(values, torch.zeros(4, dtype=torch.bool)).item() == 0.0  # none kept: 0, not NaN


_TRITON_PROBE = """
import sys, torch
from rayfed_proto.runtime.actors import leave_out_triton_on_cpu
assert not leave_out_triton_on_cpu(torch.device("cuda")) and "triton" not in sys.modules  # a GPU process: untouched
assert leave_out_triton_on_cpu(torch.device("cpu"))
model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(2 * 6 * 6, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(4, 1, 8, 8)).sum().backward()
opt.step()  # imports torch._dynamo, which asks whether triton is installed
assert "torch._dynamo" in sys.modules and sys.modules["triton"] is None
{compile}
print("ok")
"""


@pytest.mark.parametrize("with_compile", [False, True])
def test_a_cpu_process_never_imports_triton_and_still_trains_and_compiles(with_compile):
    """Run in a fresh interpreter: the guard edits sys.modules, which must not leak into this one."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed with this torch: nothing to leave out")
    check = ("compiled = torch.compile(model)\n"
             "assert torch.allclose(compiled(torch.ones(2, 1, 8, 8)), model(torch.ones(2, 1, 8, 8)), atol=1e-5)") if with_compile else ""
    out = subprocess.run([sys.executable, "-c", _TRITON_PROBE.format(compile=check)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_triton_guard_leaves_an_imported_triton_alone(monkeypatch):
    import sys
    import types

    from rayfed_proto.runtime.actors import leave_out_triton_on_cpu

    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert not leave_out_triton_on_cpu(torch.device("cpu"))
    assert sys.modules["triton"] is not None


def test_a_local_update_keeps_no_gradients_and_steps_with_the_lean_optimizer(fed):
    """Gradients are not client state: none is held between local updates (memory of every
    hosted client), and the CPU runner steps with rayfed_proto.optim, not torch.optim."""
    from rayfed_proto.optim import LeanSGD

    cfg, ds, part = fed
    runner = ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    assert type(runner.optimizer) is LeanSGD
    runner.train(GlobalState(version=0))
    assert all(p.grad is None for p in runner.model.parameters())
