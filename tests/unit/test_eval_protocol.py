"""The papers' evaluation protocols as options (issue 47, item 8a and 7): FedProto's own-class
prototype candidates, and the round's uploads in sync mode for methods with a ``latest`` scope."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfed_proto.algorithms.common import NO_CLASS, nearest_prototype_predict
from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.messages import PrototypeSet

# bank: class 0 at (0, 0), class 1 at (1, 0), class 2 at (0, 1)
BANK = PrototypeSet(np.array([0, 1, 2]), np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32), np.ones(3))
FEATURES = torch.tensor([[0.9, 0.1], [0.1, 0.8], [0.4, 0.0]])


def test_every_class_competes_by_default():
    # distances of (0.9, 0.1): 0.906, 0.141, 1.273 -> 1; (0.1, 0.8): 0.806, 1.131, 0.224 -> 2; (0.4, 0): 0.4, 0.6, 1.077 -> 0
    assert nearest_prototype_predict(FEATURES, BANK).tolist() == [1, 2, 0]


def test_own_classes_restrict_the_candidates_as_fedprotos_test():
    """Client holding classes {0, 2}: (0.9, 0.1) is nearest to class 1 (0.141) but class 1 is not its
    own, so the nearer of 0 (0.906) and 2 (1.273) wins: 0."""
    own = torch.tensor([0, 2])
    assert nearest_prototype_predict(FEATURES, BANK, own).tolist() == [0, 2, 0]
    # a client class the bank has no vector for is simply absent (class 5), the others still compete
    assert nearest_prototype_predict(FEATURES, BANK, torch.tensor([1, 5])).tolist() == [1, 1, 1]


def test_no_candidate_in_the_bank_predicts_no_class():
    pred = nearest_prototype_predict(FEATURES, BANK, torch.tensor([7, 8]))
    assert pred.tolist() == [NO_CLASS] * 3 and not (pred == torch.tensor([0, 1, 2])).any()
    assert nearest_prototype_predict(FEATURES, None, torch.tensor([0])) is None  # no bank: no prototype accuracy


def test_the_option_and_its_error():
    assert build_config({}).evaluation.proto_candidates == "all"
    assert build_config({}, ["evaluation.proto_candidates=own_classes"]).evaluation.proto_candidates == "own_classes"
    with pytest.raises(ConfigError, match="evaluation.proto_candidates.*'own'.*'all' or 'own_classes'"):
        build_config({}, ["evaluation.proto_candidates=own"])


# ----------------------------------------------------------------------------- sync + partial: the round's uploads


# FedSC's paper variant (its code variant's scope is buffer in every mode: the authors' round)
@pytest.mark.parametrize("name,extra", [("fedsc", {"model": {"group": "HtFE1"}}), ("fedprotokd", {})])
def test_sync_partial_participation_uses_the_rounds_uploads_and_refuses_latest(name, extra):
    algo = {"name": name, **({"variant": "paper"} if name == "fedsc" else {})}
    sync = {**extra, "federation": {"mode": "sync", "participation": 0.5}}
    assert build_config({**sync, "algorithm": algo}).algorithm_options().aggregation_scope == "buffer"
    with pytest.raises(ConfigError, match=r"algorithm.aggregation_scope = 'latest': buffer .* participation 0.5 < 1"):
        build_config({**sync, "algorithm": {**algo, "aggregation_scope": "latest"}})
    # async keeps the method's own default (every client's latest upload, staleness-weighted)
    assert build_config({**extra, "algorithm": algo}).algorithm_options().aggregation_scope == "latest"


def test_fedsc_code_variant_aggregates_the_rounds_uploads_in_every_mode():
    """hwang52/FedSC main_fedsc.py rebuilds the relational prototypes from the round's sampled clients."""
    for mode in ("sync", "async"):
        cfg = build_config({"model": {"group": "HtFE1"}, "federation": {"mode": mode}, "algorithm": {"name": "fedsc"}})
        assert cfg.algorithm_options().aggregation_scope == "buffer"


def test_fedscs_former_key_name_still_chooses_the_scope_in_sync_mode():
    with pytest.warns(FutureWarning):
        cfg = build_config({"algorithm": {"name": "fedsc", "prototype_scope": "latest"}, "model": {"group": "HtFE1"},
                            "federation": {"mode": "sync", "participation": 1.0}})
    assert cfg.algorithm_options().aggregation_scope == "latest"
