"""Global-test-set evaluation of a server-held model, per domain (no Ray)."""

import numpy as np
import torch

from rayfed_proto.config import build_config
from rayfed_proto.messages import ClientUpdate, UpdateSchema, validate_update
from rayfed_proto.runtime.core import EvalSet, ServerCore, evaluate_global_model


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
                      buffer_size=None, global_test=global_test)


def test_server_core_logs_global_accuracy_at_evaluated_versions_only():
    torch.manual_seed(0)
    data = EvalSet(torch.randn(10, 1, 8, 8), torch.randint(0, 3, (10,)), np.array([0] * 5 + [1] * 5), ["d0", "d1"])
    core = _fedavg_core(data)
    assert set(core.version_metrics[0]) == {"global_acc", "global_acc_d0", "global_acc_d1", "global_acc_domain_mean"}
    weights = {k: v.copy() for k, v in core.state.weights.items()}
    for _ in range(3):
        for c in (0, 1):
            core.submit(ClientUpdate(c, core.version, 5, weights=weights))
        core.step()
    # eval_every 2 and the last version (3): versions 2 and 3 evaluated, 1 not
    assert "global_acc" not in core.version_metrics[1]
    assert "global_acc" in core.version_metrics[2] and "global_acc" in core.version_metrics[3]
    # the global model is the untouched average of identical weights: same accuracy every time
    assert core.version_metrics[3]["global_acc"] == core.version_metrics[0]["global_acc"]


def test_no_global_test_set_no_global_metrics():
    assert _fedavg_core(None).version_metrics[0] == {}


def test_required_extras_are_checked_at_the_border():
    schema = UpdateSchema(num_clients=2, num_classes=3, feature_dim=2, extras_shapes={"public_logits": (4, 3)})
    ok = ClientUpdate(0, 0, 5, extras={"public_logits": np.zeros((4, 3), np.float32)})
    assert validate_update(ok, schema, 0) is None
    wrong_shape = ClientUpdate(0, 0, 5, extras={"public_logits": np.zeros((5, 3), np.float32)})
    assert "shape (5, 3), expected (4, 3)" in validate_update(wrong_shape, schema, 0)
    missing = ClientUpdate(0, 0, 5)
    assert "differ from the expected" in validate_update(missing, schema, 0)
