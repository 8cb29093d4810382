"""rayfed_proto.optim: torch.optim's CPU arithmetic without the torch._dynamo import, checked by
hand on one parameter, bit for bit against torch.optim over several steps, and state dicts moving
both ways."""

import copy
import subprocess
import sys

import pytest
import torch

from rayfed_proto.optim import LeanAdam, LeanSGD, adam, sgd


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * 6 * 6, 4))


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(5, 1, 8, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _assert_same(model_a, model_b, opt_a, opt_b):
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)


def test_sgd_with_momentum_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LeanSGD([p], lr=0.1, momentum=0.9, weight_decay=0.5)
    p.grad = torch.tensor([2.0])
    opt.step()  # g = 2 + 0.5 * 1 = 2.5; buf = 2.5; p = 1 - 0.1 * 2.5 = 0.75
    assert p.item() == pytest.approx(0.75)
    p.grad = torch.tensor([2.0])
    opt.step()  # g = 2 + 0.5 * 0.75 = 2.375; buf = 0.9 * 2.5 + 2.375 = 4.625; p = 0.75 - 0.4625 = 0.2875
    assert p.item() == pytest.approx(0.2875)
    assert opt.state[p]["momentum_buffer"].item() == pytest.approx(4.625)


def test_adam_first_two_steps_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LeanAdam([p], lr=0.1, eps=0.0)
    p.grad = torch.tensor([2.0])
    opt.step()  # m = 0.2, v = 0.004; m^ = 2, v^ = 4: p = 1 - 0.1 * 2 / 2 = 0.9
    assert p.item() == pytest.approx(0.9)
    p.grad = torch.tensor([-1.0])
    opt.step()
    m = 0.9 * 0.2 + 0.1 * -1.0  # 0.08
    v = 0.999 * 0.004 + 0.001 * 1.0  # 0.004996
    m_hat, v_hat = m / (1 - 0.9**2), v / (1 - 0.999**2)
    assert p.item() == pytest.approx(0.9 - 0.1 * m_hat / v_hat**0.5, rel=1e-6)
    assert opt.state[p]["step"].item() == 2.0


@pytest.mark.parametrize("lean, torch_cls, hyper", [
    (LeanSGD, torch.optim.SGD, {"lr": 0.05}),
    (LeanSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (LeanSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    (LeanSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.5, "dampening": 0.1}),
    (LeanSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (LeanAdam, torch.optim.Adam, {"lr": 0.01}),
    (LeanAdam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 1e-3}),
    (LeanAdam, torch.optim.Adam, {"lr": 0.003, "betas": (0.8, 0.99), "eps": 1e-6}),
])
def test_lean_optimizers_equal_torch_optim_bit_for_bit(lean, torch_cls, hyper):
    a, b = _model(), _model()
    opt_a, opt_b = lean(a.parameters(), **hyper), torch_cls(b.parameters(), **hyper)
    _train(a, opt_a, 6)
    _train(b, opt_b, 6)
    _assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("lean, torch_cls, hyper", [(LeanSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
                                                    (LeanAdam, torch.optim.Adam, {"lr": 0.01})])
def test_state_dicts_move_both_ways_and_continue_identically(lean, torch_cls, hyper):
    """A checkpoint written by torch.optim (every checkpoint before this module) resumes in the
    lean class, and the other way round, with the same numbers as an uninterrupted run."""
    ref = _model()
    ref_opt = torch_cls(ref.parameters(), **hyper)
    _train(ref, ref_opt, 3)
    lean_model, lean_opt = _resumed_alongside(ref, ref_opt, lean, hyper, seed=2)
    _resumed_alongside(lean_model, lean_opt, torch_cls, hyper, seed=3)


def _resumed_alongside(model, opt, cls, hyper, seed):
    """A copy of ``model`` with a ``cls`` optimizer loaded from ``opt``'s state dict; both train 3
    more steps on the same batches and must stay identical. Returns the copy and its optimizer."""
    twin = copy.deepcopy(model)
    twin_opt = cls(twin.parameters(), **hyper)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(model, opt, 3, seed=seed)
    _train(twin, twin_opt, 3, seed=seed)
    _assert_same(twin, model, twin_opt, opt)
    return twin, twin_opt


def test_cleared_state_is_a_fresh_optimizer_and_zero_grad_frees_gradients():
    a, b = _model(), _model()
    opt_a, opt_b = LeanSGD(a.parameters(), lr=0.05, momentum=0.9), LeanSGD(b.parameters(), lr=0.05, momentum=0.9)
    _train(a, opt_a, 2)
    opt_a.state.clear()  # what the runtime does when a broadcast replaced the weights
    b.load_state_dict(a.state_dict())
    _train(a, opt_a, 2, seed=5)
    _train(b, opt_b, 2, seed=5)
    _assert_same(a, b, opt_a, opt_b)
    opt_a.zero_grad()
    assert all(p.grad is None for p in a.parameters())


def test_bad_options_are_refused_with_their_names():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match="unknown option.*betas.*allowed: dampening"):
        LeanSGD(p, lr=0.1, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        LeanAdam(p, lr=0.1, amsgrad=True)
    with pytest.raises(ValueError, match="empty parameter list"):
        LeanSGD([], lr=0.1)
    opt = LeanSGD(p, lr=0.1)
    with pytest.raises(ValueError, match="different number of parameter groups or parameters"):
        opt.load_state_dict(LeanSGD([torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))], lr=0.1).state_dict())


def test_the_factories_keep_torch_optim_off_the_cpu():
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    meta = [torch.nn.Parameter(torch.zeros(2, device="meta"))]  # any non-CPU device: torch.optim's kernels
    assert type(sgd(cpu, lr=0.1)) is LeanSGD and type(adam(cpu, lr=0.1)) is LeanAdam
    assert type(sgd(meta, lr=0.1)) is torch.optim.SGD and type(adam(meta, lr=0.1)) is torch.optim.Adam


def test_training_with_the_lean_optimizers_never_imports_dynamo():
    """In a fresh interpreter (this one has imported torch._dynamo long ago)."""
    probe = ("import sys, torch\n"
             "from rayfed_proto.optim import adam, sgd\n"
             "m = torch.nn.Linear(3, 2)\n"
             "for opt in (sgd(m.parameters(), lr=0.1, momentum=0.9), adam(m.parameters(), lr=0.1)):\n"
             "    opt.zero_grad(); m(torch.ones(4, 3)).sum().backward(); opt.step(); opt.load_state_dict(opt.state_dict())\n"
             "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
             "torch.optim.SGD(m.parameters(), lr=0.1).step()\n"
             "assert 'torch._dynamo' in sys.modules  # the probe can tell\n"
             "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
