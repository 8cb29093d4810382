"""Metric naming, per-client series selection, model choice and trial names (no Ray, no MLflow run)."""

import warnings

import pytest

from rayfed_proto.tracking.clients import EXTREMES, ClientSeries, client_row
from rayfed_proto.tracking.metric_names import EXACT, mlflow_key, namespaced, resolve
from rayfed_proto.tracking.models import choose_models
from rayfed_proto.tuning.trainable import trial_run_name

SECTIONS = {"eval", "train", "server", "federation", "reliability", "system"}


def test_metric_keys_are_namespaced_by_rule_and_by_table():
    assert mlflow_key("head_acc") == "eval/head_acc" and mlflow_key("proto_acc_std") == "eval/proto_acc_std"
    assert mlflow_key("train_loss") == "train/loss" and mlflow_key("train_pseudo_candidates") == "train/pseudo_candidates"
    assert mlflow_key("server_train_s") == "server/train_s" and mlflow_key("server_mixing_rate") == "server/mixing_rate"
    assert mlflow_key("staleness_mean") == "federation/staleness_mean"
    assert mlflow_key("global_acc") == "eval/global_acc" and mlflow_key("global_acc_mnist") == "eval/global_acc_mnist"
    assert mlflow_key("xi_mean") == "server/xi_mean"  # an algorithm's aggregate metric
    assert mlflow_key("client/3/head_acc") == "client/3/head_acc"  # already namespaced
    assert mlflow_key("peak_rss_mib_server").startswith("system/")
    # the table: every new name in a section, none shared by two old names
    assert all(v.split("/", 1)[0] in SECTIONS for k, v in EXACT.items() if k != "version")
    assert len(set(EXACT.values())) == len(EXACT)
    assert namespaced({"head_acc": 0.5, "version": 3}) == {"eval/head_acc": 0.5, "version": 3}


def test_old_names_resolve_with_a_deprecation_warning_new_names_silently():
    with pytest.warns(DeprecationWarning, match="head_acc"):
        assert resolve("head_acc") == "eval/head_acc"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("eval/head_acc") == "eval/head_acc"


def test_sweep_metric_accepts_new_names_and_reads_old_ones():
    from rayfed_proto.config import ConfigError
    from rayfed_proto.tuning.spec import parse_sweep

    def spec(metric):
        return parse_sweep({"metric": metric,
                            "search_space": {"algorithm.lam": {"choice": [0.1, 1.0]}}}, "s.yaml", None)

    assert spec("eval/proto_acc").file.metric == "eval/proto_acc"
    with pytest.warns(DeprecationWarning):
        assert spec("head_acc").file.metric == "eval/head_acc"
    with pytest.raises(ConfigError):
        spec("acc")


def test_every_client_up_to_the_limit():
    s = ClientSeries(5, limit=5, sample=2, seed=0)
    assert s.chosen == [0, 1, 2, 3, 4]
    m = s.metrics(0, [{"client_id": c, "n": 10, "head_correct": c, "proto_correct": None, "train_loss": 1.0} for c in range(5)])
    assert m["client/3/head_acc"] == 0.3 and m["client/3/samples"] == 10 and "client/3/proto_acc" not in m
    assert s.backfill() == ([], "all 5 clients")


def test_large_federation_seeded_sample_plus_worst_and_best_with_whole_series():
    a, b, other = ClientSeries(50, 10, 4, seed=1), ClientSeries(50, 10, 4, seed=1), ClientSeries(50, 10, 4, seed=2)
    assert a.chosen == b.chosen and len(a.chosen) == 4 and a.chosen != other.chosen

    def results(shift):  # client c's accuracy is c/50 (+ shift): 0..2 worst, 47..49 best
        return [{"client_id": c, "n": 50, "head_correct": c + shift, "proto_correct": None, "train_loss": 0.5}
                for c in range(50)]

    live = {int(k.split("/")[1]) for step in (0, 5) for k in a.metrics(step, results(0 if step == 0 else 0))}
    assert live == set(a.chosen)  # only the sample is logged while the run goes on
    worst, best = a.extremes()
    assert worst == [0, 1, 2][:EXTREMES] and best == [49, 48, 47][:EXTREMES]
    points, described = a.backfill()
    filled = {int(k.split("/")[1]) for k, _, _ in points}
    assert filled == (set(worst) | set(best)) - set(a.chosen)
    for c in filled:  # every evaluation of each back-filled client
        assert sorted(s for k, _, s in points if k == f"client/{c}/head_acc") == [0, 5]
    assert f"seeded sample of 4 of 50 clients {a.chosen}" in described


def test_client_row_without_test_samples_has_no_accuracy():
    assert client_row({"client_id": 0, "n": 0, "head_correct": 0, "proto_correct": None, "train_loss": float("nan")}) \
        == {"samples": 0.0}


def test_models_to_log():
    archs = ["cnn", "resnet", "cnn", "resnet", "vit"]
    assert choose_models("auto", True, archs) == (True, [])
    assert choose_models("auto", False, archs) == (False, [0, 1, 4])
    assert choose_models("server", False, archs) == (False, [])  # nothing: the method holds no model
    assert choose_models("all", True, archs) == (False, [0, 1, 2, 3, 4])
    assert choose_models("none", True, archs) == (False, [])


def test_trial_run_names_show_the_swept_values():
    keys = ["algorithm.lam", "training.lr", "model.feature_dim"]
    name = trial_run_name("sw", "t_00001", {"algorithm.lam": 0.123456, "training.lr": 0.01, "model.feature_dim": 64}, keys)
    assert name == "sw-t_00001 [lam=0.1235 lr=0.01 feature_dim=64]"
    # two keys ending alike keep their full names
    assert trial_run_name("sw", "t", {"a.x": 1, "b.x": 2}, ["a.x", "b.x"]) == "sw-t [a.x=1 b.x=2]"
    assert trial_run_name("sw", "t", {}, []) == "sw-t"
