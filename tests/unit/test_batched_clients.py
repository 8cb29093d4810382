"""Batched clients (``resources.batch_clients``, training/batched.py): clients of one architecture
stepping as one vmapped model give what they give one after another, within float tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.data.base import ArrayDataset
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime import client_core as core
from rayfed_proto.runtime.client_core import ClientHost
from rayfed_proto.runtime.policies import ServerNeeds
from rayfed_proto.runtime.server_core import ServerCore
from rayfed_proto.runtime.stepping import OnRequest
from rayfed_proto.training import batched

CPU = torch.device("cpu")
BATCHED = ["fedavg", "fedproto", "fedtgp", "fedlsa", "fedsc"]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as a worker actor on a shared CPU has: these tiny models only wait for
    each other's threads with more (and the suite shares its cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _federation(method: str, *sets: str, clients: int = 4):
    cfg = build_config({}, [f"algorithm.name={method}", f"federation.num_clients={clients}", "model.group=HtFE1",
                            "model.feature_dim=16", "data.image_size=8", "data.partition.beta=0.5", "training.batch_size=16",
                            "federation.mode=sync", "data.global_test_fraction=0", *sets])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, clients, cfg.seed, cfg.data.test_fraction,
                          public_size=cfg.data.public_size)
    public_x = ds.tensors(part.public_idx)[0] if len(part.public_idx) else None
    return cfg, ds, part, public_x


def _host(cfg, ds, part, public_x, mode: str) -> ClientHost:
    cfg = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"batch_clients": mode})})
    return ClientHost(cfg, ds, list(part.clients), CPU, public_x)


def _params(host: ClientHost) -> dict[int, list[torch.Tensor]]:
    return {c: [t.detach().clone() for t in r.model.state_dict().values()] for c, r in host.live.items()}


def _accuracy(host: ClientHost, state: GlobalState) -> float:
    res = host.evaluate(host.client_ids, state)
    return 100.0 * sum(r["head_correct"] for r in res) / sum(r["n"] for r in res)


def _train_rounds(host: ClientHost, cfg, ds, public_x, rounds: int, server=None, after_round=None):
    """``rounds`` sync rounds of every client of ``host`` against one server (``after_round(r)``
    after each): the server and each round's metadata."""
    server = server or ServerCore(cfg, ds.num_classes, ds.channels, ds.image_size, CPU, ServerNeeds(OnRequest(), 10),
                                  public_x=public_x)
    metas = []
    for r in range(rounds):
        results = host.train_group(host.client_ids, server.state)
        metas.append([m for m, _ in results])
        for _, u in results:
            assert server.submit(u)["accepted"]
        server.step()
        if after_round is not None:
            after_round(r)
    return server, metas


def _rounds(cfg, ds, part, public_x, mode: str, rounds: int):
    """``rounds`` sync rounds of every client on one host; the parameters after round 1, the
    metadata of each round and the final accuracy."""
    host = _host(cfg, ds, part, public_x, mode)
    first = []
    server, metas = _train_rounds(host, cfg, ds, public_x, rounds,
                                  after_round=lambda r: first.append(_params(host)) if r == 0 else None)
    return first[0], metas, _accuracy(host, server.state), host


def _assert_close(a: dict, b: dict, rtol: float) -> None:
    """Every tensor of every client equal within ``rtol`` relative to its norm (integers exactly)."""
    for c in a:
        for x, y in zip(a[c], b[c], strict=True):
            if x.is_floating_point():
                assert float((x - y).norm()) <= rtol * max(float(x.norm()), 1e-12), (c, x.shape)
            else:
                assert torch.equal(x, y)


@pytest.mark.parametrize("method", BATCHED)
def test_one_batched_step_equals_one_step_of_each_client(method):
    # a batch larger than every client's split: each local update is one step
    cfg, ds, part, public_x = _federation(method, "training.batch_size=512")
    first_off, *_ = _rounds(cfg, ds, part, public_x, "off", 1)
    first_on, *_ = _rounds(cfg, ds, part, public_x, "on", 1)
    _assert_close(first_off, first_on, rtol=1e-5)


@pytest.fixture
def float64(monkeypatch):
    """Clients' models and data in float64 (the runtime trains in the model's dtype).

    Over several rounds these methods are chaotic at this size: FedSC's relational prototypes,
    FedLSA's anchors and BatchNorm on batches of a few samples turn a float32 rounding
    difference of 1e-8 (a vmapped convolution sums in another order than a per-client one) into
    1e-4..1e-2 of the parameters by round 3, and into a different accuracy on some CPUs and not
    others (0.44 points on a 2-core AMD EPYC, 0 here). In float64 the same arithmetic rounds at
    1e-16; measured here the parameters agree to 1e-16 (FedAvg, FedProto, FedTGP, FedLSA) and
    9e-12 (FedSC, which amplifies about 1e3 a round) after 3 rounds, so the bound below (1e-9)
    keeps a margin of 100 over the worst amplification seen, and a test prediction flips only on
    a logit tie within 1e-9: the accuracy must be equal."""
    to_double = ArrayDataset.tensors

    def tensors(self, indices):
        x, y = to_double(self, indices)
        return x.double(), y

    build = core.build_client_model
    monkeypatch.setattr(ArrayDataset, "tensors", tensors)
    monkeypatch.setattr(core, "build_client_model", lambda *a, **k: build(*a, **k).double())


def _relative_gap(a: dict, b: dict) -> float:
    """||a - b|| / ||a|| over every float tensor of every client."""
    num = sum(float((x - y).norm()) ** 2 for c in a for x, y in zip(a[c], b[c], strict=True) if x.is_floating_point())
    den = sum(float(x.norm()) ** 2 for c in a for x in a[c] if x.is_floating_point())
    return (num / max(den, 1e-300)) ** 0.5


@pytest.mark.parametrize("method", BATCHED)
def test_batched_clients_equal_one_after_another_over_three_rounds(method, float64):
    """Three rounds carry optimizer state, BatchNorm buffers, the clients' RNG streams and the
    server's guidance from round to round: the batched path keeps all of it as the per-client
    path does (exact in float64, see the fixture; one float32 step is checked above)."""
    cfg, ds, part, public_x = _federation(method, "training.lr=0.05")
    runs = {mode: _rounds(cfg, ds, part, public_x, mode, 3) for mode in ("off", "on")}
    (first_off, metas_off, acc_off, host_off), (first_on, metas_on, acc_on, host_on) = runs["off"], runs["on"]
    assert {t.dtype for ps in _params(host_on).values() for t in ps if t.is_floating_point()} == {torch.float64}
    assert _relative_gap(first_off, first_on) <= 1e-9
    assert _relative_gap(_params(host_off), _params(host_on)) <= 1e-9
    assert acc_on == acc_off
    for off, on in zip(metas_off, metas_on, strict=True):
        assert [m["client_id"] for m in off] == [m["client_id"] for m in on]
        assert [m["update"] for m in off] == [m["update"] for m in on]
        for a, b in zip(off, on, strict=True):
            assert a["terms"].keys() == b["terms"].keys()
            # the loss terms are tallied in float32 (metrics): equal to float32 rounding
            assert a["terms"]["loss"] == pytest.approx(b["terms"]["loss"], rel=1e-6, abs=1e-7)


# ----------------------------------------------------------------------------- the batched step itself


def _bn_members(method: str, optimizer: str, sizes: list[int], nan_client: int | None = None, seed: int = 0,
                **hyper):
    """Clients of a small BatchNorm model (ProtoModel) with splits of ``sizes`` samples, batch 8:
    different numbers of batches, trailing partial batches and a folded single sample."""
    from rayfed_proto import optim
    from rayfed_proto.algorithms.base import FederationSpec, TrainBatchIterator
    from rayfed_proto.messages import PrototypeSet
    from rayfed_proto.models.zoo import ProtoModel

    algo = ALGORITHMS.get(method)
    spec = FederationSpec(num_clients=len(sizes), num_classes=3, feature_dim=4)
    bank = PrototypeSet(np.array([0, 2]), np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32),
                        np.array([5, 5]))
    members = []
    for i, n in enumerate(sizes):
        torch.manual_seed(seed + i)
        # no bias before a BatchNorm: its gradient is rounding noise, which Adam would scale up to steps
        backbone = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3, bias=False), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                                       torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 6, bias=False),
                                       torch.nn.BatchNorm1d(6))
        model = ProtoModel("bn", backbone, 6, 4, 3)
        make = optim.adam if optimizer == "adam" else optim.sgd
        opt = make(model.parameters(), lr=0.05, **hyper)
        opt.max_grad_norm = None
        x = torch.randn(n, 1, 6, 6, generator=torch.Generator().manual_seed(100 + i))
        if i == nan_client:
            x[0, 0, 0, 0] = float("nan")  # every batch holding it gives a non-finite loss: that step is skipped
        y = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(200 + i))
        client = algo.Client(algo.Options(), spec, i)
        client.receive(GlobalState(version=1, prototypes=bank), model)
        batches = TrainBatchIterator(x, y, 8, torch.Generator().manual_seed(300 + i))
        members.append(batched.Member(client, model, opt, batches))
    return members


def _one_after_another(members, epochs: int = 2) -> list[dict]:
    return [m.algorithm.local_train(m.model, m.optimizer, m.batches, epochs, CPU) for m in members]


@pytest.mark.parametrize(("optimizer", "hyper"), [
    ("sgd", {}), ("sgd", {"momentum": 0.9, "weight_decay": 1e-3}), ("sgd", {"momentum": 0.5, "nesterov": True}),
    ("adam", {}), ("adam", {"weight_decay": 1e-3})])
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_batched_update_keeps_each_clients_batchnorm_optimizer_clipping_and_prototypes(optimizer, hyper, max_grad_norm):
    sizes = [17, 33, 8, 25]  # 2, 4, 1 and 3 batches an epoch (incomplete last ones folded): clients drop out, sizes differ
    alone, together = _bn_members("fedproto", optimizer, sizes, **hyper), _bn_members("fedproto", optimizer, sizes, **hyper)
    for m in alone + together:
        m.optimizer.max_grad_norm = max_grad_norm
    terms_alone = _one_after_another(alone)
    terms_together = batched.train_together(together, 2, CPU)
    for a, b, ta, tb in zip(alone, together, terms_alone, terms_together, strict=True):
        for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
            if x.is_floating_point():  # parameters and BatchNorm running statistics, per client
                # Adam with clipping divides rounding noise by sqrt(v): over 2 epochs of 9-sample folded
                # batches it reaches 1.4e-5 on weights of 0.4 (a client with another's state differs by 1e-2)
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 if optimizer == "sgd" else 5e-5, msg=k)
            else:
                assert torch.equal(x, y), k  # num_batches_tracked: the client's own count of steps
        assert ta.keys() == tb.keys()
        for k in ta:
            assert ta[k] == pytest.approx(tb[k], rel=1e-4, abs=1e-5), k
        pa, pb = a.algorithm._train_protos, b.algorithm._train_protos
        np.testing.assert_array_equal(pa.class_ids, pb.class_ids)
        np.testing.assert_allclose(pa.vectors, pb.vectors, rtol=1e-4, atol=1e-5)
        sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            for k in sa[i]:
                torch.testing.assert_close(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]), rtol=1e-4, atol=1e-5)


def test_a_non_finite_step_is_skipped_for_its_client_only():
    sizes = [16, 16, 16]
    alone, together = _bn_members("fedproto", "sgd", sizes, nan_client=1), _bn_members("fedproto", "sgd", sizes, nan_client=1)
    before = [t.clone() for t in together[1].model.parameters()]
    terms_alone = _one_after_another(alone)
    terms_together = batched.train_together(together, 2, CPU)
    assert [t["nonfinite_steps"] for t in terms_together] == [t["nonfinite_steps"] for t in terms_alone] == [0, 2, 0]
    for a, b in zip(alone, together, strict=True):
        for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    # client 1's batch with the NaN was skipped (its other batch stepped); nothing non-finite anywhere
    assert all(bool(torch.isfinite(p).all()) for m in together for p in m.model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(before, together[1].model.parameters(), strict=True))


def test_methods_declare_whether_their_local_update_batches():
    from rayfed_proto.algorithms.base import FederationSpec

    spec = FederationSpec(num_clients=2, num_classes=3, feature_dim=4)
    for name in ALGORITHMS.names():
        refusal = batched.method_refusal(ALGORITHMS.get(name).Client)
        assert (refusal is None) == (name in BATCHED), (name, refusal)
    dropout = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    fedavg = ALGORITHMS.get("fedavg")
    assert "dropout" in batched.batch_refusal(fedavg.Client(fedavg.Options(), spec, 0), dropout,
                                              torch.optim.SGD(dropout.parameters(), lr=0.1))


def test_batch_clients_off_is_the_one_after_another_path_bit_for_bit():
    cfg, ds, part, public_x = _federation("fedproto")
    group = _host(cfg, ds, part, public_x, "off")
    single = _host(cfg, ds, part, public_x, "off")
    state = GlobalState(version=0)
    got = group.train_group(group.client_ids, state)
    want = [single.train(c, state) for c in single.client_ids]
    for (ma, ua), (mb, ub) in zip(got, want, strict=True):
        assert ma["terms"] == mb["terms"]
        np.testing.assert_array_equal(ua.prototypes.vectors, ub.prototypes.vectors)
    _assert_close(_params(group), _params(single), rtol=0.0)


def test_list_says_which_methods_batch(capsys):
    from rayfed_proto.cli import main

    main(["list"])
    out = capsys.readouterr().out
    section = out.split("local update with resources.batch_clients auto:")[1].split("\n\n")[0]
    lines = {line.split()[0]: line for line in section.strip().splitlines()}
    assert all("batched" in lines[m] for m in BATCHED)
    assert all("one client at a time" in lines[m] for m in ("fedsa", "fedsap", "fedprotokd"))
    # each says why (ClientAlgorithm.unbatchable_reason)
    assert "d_local" in lines["fedsa"] and "pseudo-labels" in lines["fedsap"] and "public set" in lines["fedprotokd"]


def test_batch_clients_reads_off_and_on_from_yaml_and_names_the_allowed_values():
    from rayfed_proto.config import ConfigError

    assert build_config({}, ["resources.batch_clients=off"]).resources.batch_clients == "off"  # YAML's false
    assert build_config({}, ["resources.batch_clients=on"]).resources.batch_clients == "on"  # YAML's true
    assert build_config({"resources": {"batch_clients": "auto"}}, []).resources.batch_clients == "auto"
    with pytest.raises(ConfigError, match=r"resources.batch_clients.*'auto', 'on', 'lanes' or 'off'"):
        build_config({}, ["resources.batch_clients=yes please"])


def test_auto_batches_on_accelerators_only():
    from rayfed_proto.runtime.client_core import batches_on

    assert batches_on("on", CPU) and not batches_on("auto", CPU) and not batches_on("off", CPU)
    assert batches_on("auto", torch.device("cuda")) and not batches_on("off", torch.device("cuda"))
