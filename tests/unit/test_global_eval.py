"""Global-test-set evaluation of a server-held model, per domain (no Ray)."""

import math

import numpy as np
import torch

from rayfed_proto.config import build_config
from rayfed_proto.messages import ClientUpdate, UpdateSchema, validate_update
from rayfed_proto.runtime.core import EvalSet, evaluate_global_model
from rayfed_proto.runtime.policies import ServerNeeds
from rayfed_proto.runtime.server_core import ServerCore
from rayfed_proto.runtime.stepping import OnRequest


class ArgmaxOfInput(torch.nn.Module):
    """Predicts argmax of the input's first 3 values: a test chooses every prediction."""

    def forward(self, x):
        return x.flatten(1)[:, :3]


def _onehot(classes):
    x = torch.zeros(len(classes), 1, 2, 2)
    for i, c in enumerate(classes):
        x.view(len(classes), -1)[i, c] = 1.0
    return x


def test_accuracy_overall_and_per_domain_by_hand():
    # 6 samples, predictions [0,1,2,0,1,2], labels [0,1,0,0,2,2] -> correct T,T,F,T,F,T
    # domain a = samples 0-1 (2/2 = 1.0), domain b = samples 2-5 (2/4 = 0.5)
    x = _onehot([0, 1, 2, 0, 1, 2])
    y = torch.tensor([0, 1, 0, 0, 2, 2])
    data = EvalSet(x, y, np.array([0, 0, 1, 1, 1, 1]), ["a", "b"])
    m = evaluate_global_model(ArgmaxOfInput(), data, torch.device("cpu"), batch_size=4)  # two batches
    assert m["global_acc"] == 4 / 6
    assert m["global_acc_a"] == 1.0 and m["global_acc_b"] == 0.5
    assert m["global_acc_domain_mean"] == 0.75  # unweighted mean of domains, not 4/6


def test_without_domains_only_overall_accuracy():
    m = evaluate_global_model(ArgmaxOfInput(), EvalSet(_onehot([0, 1]), torch.tensor([0, 0])), torch.device("cpu"))
    assert m == {"global_acc": 0.5}


def _fedavg_core(global_test):
    cfg = build_config({}, ["algorithm.name=fedavg", "model.group=HtFE1", "model.feature_dim=8",
                            "federation.num_clients=2", "federation.mode=sync", "federation.rounds=3",
                            "federation.eval_every=2"])
    return ServerCore(cfg, num_classes=3, in_channels=1, image_size=8, device=torch.device("cpu"),
                      needs=ServerNeeds(OnRequest(), max_staleness=math.inf), global_test=global_test)


def test_server_core_logs_global_accuracy_at_evaluated_versions_only():
    torch.manual_seed(0)
    data = EvalSet(torch.randn(10, 1, 8, 8), torch.randint(0, 3, (10,)), np.array([0] * 5 + [1] * 5), ["d0", "d1"])
    core = _fedavg_core(data)
    metrics = lambda v: core.read_stats(v)["server_metrics"]  # noqa: E731 (waits for that version's evaluation)
    assert set(metrics(0)) == {"global_acc", "global_acc_d0", "global_acc_d1", "global_acc_domain_mean"}
    weights = {k: v.copy() for k, v in core.state.weights.items()}
    for _ in range(3):
        for c in (0, 1):
            core.submit(ClientUpdate(c, core.version, 5, weights=weights))
        core.step()
    # eval_every 2 and the last version (3): versions 2 and 3 evaluated, 1 not
    assert "global_acc" not in metrics(1)
    assert "global_acc" in metrics(2) and "global_acc" in metrics(3)
    # the global model is the untouched average of identical weights: same accuracy every time
    assert metrics(3)["global_acc"] == metrics(0)["global_acc"]


def test_global_evaluation_runs_beside_the_next_round_on_its_versions_model(monkeypatch):
    """A step hands out its version without waiting for the global-test evaluation (which used
    to hold a sync round's workers idle), and the evaluation scores a copy of that version's
    model even when it runs after the server has moved on."""
    import threading

    import rayfed_proto.runtime.server_core as core_module

    release, seen = threading.Event(), {}

    def slow_eval(model, data, device):
        release.wait(timeout=30)
        return {"global_acc": float(model.head.bias[0].detach())}  # which weights it was given

    monkeypatch.setattr(core_module, "evaluate_global_model", slow_eval)
    data = EvalSet(torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)))
    core = _fedavg_core(data)
    for version in (1, 2, 3):
        weights = {k: v.copy() for k, v in core.state.weights.items()}
        weights["head.bias"][:] = version  # each version's model is told apart by its head bias
        for c in (0, 1):
            core.submit(ClientUpdate(c, core.version, 5, weights=weights))
        seen[version] = core.step()["new_version"]  # returns while version 0's evaluation still waits
    assert not release.is_set() and core.version == 3 and seen == {1: 1, 2: 2, 3: 3}
    assert set(core.pending_evals) == {0, 2, 3}
    release.set()
    assert core.read_stats(2)["server_metrics"]["global_acc"] == 2.0
    checkpoint = core.state_dict()  # waits for the evaluations still running (version 3's)
    assert core.pending_evals == {} and checkpoint["version_metrics"][3]["global_acc"] == 3.0
    assert core.read_stats(3)["server_metrics"]["global_acc"] == 3.0


def test_no_global_test_set_no_global_metrics():
    core = _fedavg_core(None)
    assert core.read_stats(0)["server_metrics"] == {} and core.pending_evals == {}


def test_required_extras_are_checked_at_the_border():
    schema = UpdateSchema(num_clients=2, num_classes=3, feature_dim=2, extras_shapes={"public_logits": (4, 3)})
    ok = ClientUpdate(0, 0, 5, extras={"public_logits": np.zeros((4, 3), np.float32)})
    assert validate_update(ok, schema, 0) is None
    wrong_shape = ClientUpdate(0, 0, 5, extras={"public_logits": np.zeros((5, 3), np.float32)})
    assert "shape (5, 3), expected (4, 3)" in validate_update(wrong_shape, schema, 0)
    missing = ClientUpdate(0, 0, 5)
    assert "differ from the expected" in validate_update(missing, schema, 0)
