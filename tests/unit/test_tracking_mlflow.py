"""Metric naming, per-client series selection, model choice and trial names (no Ray, no MLflow run)."""

import warnings
from types import SimpleNamespace

import pytest

from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking.clients import EXTREMES, ClientHistory, ClientSeries, client_row
from rayfed_proto.tracking.metric_names import LEGACY, mlflow_key, resolve
from rayfed_proto.tracking.models import choose_models, pick_per_architecture
from rayfed_proto.tracking.round_metrics import version_metrics
from rayfed_proto.tuning.trainable import trial_run_name

SECTIONS = {"eval", "train", "server", "federation", "reliability", "system"}


def test_old_flat_names_translate_for_readers_only():
    assert mlflow_key("head_acc") == "eval/head_acc" and mlflow_key("proto_acc_std") == "eval/proto_acc_std"
    assert mlflow_key("train_loss") == "train/loss" and mlflow_key("train_pseudo_candidates") == "train/pseudo_candidates"
    assert mlflow_key("server_train_s") == "server/train_s" and mlflow_key("server_mixing_rate") == "server/mixing_rate"
    assert mlflow_key("staleness_mean") == "federation/staleness_mean"
    assert mlflow_key("global_acc") == "eval/global_acc" and mlflow_key("global_acc_mnist") == "eval/global_acc_mnist"
    assert mlflow_key("xi_mean") == "server/xi_mean"  # an algorithm's aggregate metric
    assert mlflow_key("client/3/head_acc") == "zz_client/head_acc/client_3"  # schema "2" name (issue 26)
    assert mlflow_key("eval/clients_nonfinite") == mlflow_key("clients_nonfinite") == "reliability/clients_nonfinite"
    assert mlflow_key("zz_client/head_acc/client_3") == "zz_client/head_acc/client_3"
    assert mlflow_key("version") == "version"
    assert mlflow_key("peak_rss_mib_server").startswith("system/")
    # the old table: every new name in a section and made by the table, none shared by two old names
    assert all(v.split("/", 1)[0] in SECTIONS and names.is_name(v) for v in LEGACY.values())
    assert len(set(LEGACY.values())) == len(LEGACY)


def test_the_table_makes_every_name_once():
    assert names.train_term("loss") == "train/loss"  # the clients' local-update loss
    assert names.server_metric("train_loss") == "server/train_loss"  # an aggregate's (server step's) own loss
    assert names.server_metric("server_loss") == "server/loss"  # FedTGP / FedProtoKD server-step loss, as before
    assert names.server_metric("xi_mean") == "server/xi_mean"
    assert names.server_metric("global_acc_d0") == "eval/global_acc_d0"  # the server model on the global test set
    # an aggregate key that would land on one of the runtime's own names gets a name of its own
    assert names.server_metric("train_s") == names.server_metric("server_train_s") == "server/aggregate/train_s"
    assert names.server_metric("proto_margin_min") != names.SERVER_PROTO_MARGIN_MIN
    assert names.client_series(3, "head_acc") == "zz_client/head_acc/client_3"
    assert names.actor_memory(2, "pss_mib") == "system/actors/client_actor_2_pss_mib"
    assert names.sweep_best(names.EVAL_HEAD_ACC) == "best/eval/head_acc"
    assert all(n.split("/", 1)[0] in SECTIONS | {"sweep"} for n in names.NAMES)
    assert not names.is_name("head_acc") and not names.is_name("train_loss") and not names.is_name("client/x/head_acc")
    assert not names.is_name("zz_client/samples/client_1")  # a constant: the param client.test_samples


def _fake_evaluation():
    """version_metrics' inputs: two clients, local-update terms loss/ce, an aggregate returning its
    own train_loss (the server step) next to a global-test accuracy, a virtual clock."""
    results = [{"client_id": 1, "n": 10, "head_correct": 6, "proto_correct": 5, "silhouette": 0.2, "train_loss": 0.9},
               {"client_id": 0, "n": 30, "head_correct": 24, "proto_correct": 21, "silhouette": 0.4, "nonfinite": True,
                "train_loss": 0.5}]
    server = {"margin": (1.0, 2.0), "staleness_mean": 0.5, "staleness_max": 2, "accepted": 7, "dropped_stale": 1,
              "late": 0, "rolled_back": 0, "refused": 2, "server_train_s": 3.0,
              "server_metrics": {"train_loss": 7.5, "server_loss": 6.5, "xi_mean": 0.25, "global_acc": 0.7,
                                 "train_s": 9.0}}
    stats = SimpleNamespace(last_terms={0: {"loss": 0.5, "ce": 0.4}, 1: {"loss": 0.9, "ce": float("nan")}},
                            bytes_up=100, bytes_down=400, dispatched=9, busy_s=12.0, updates_dropped_offline=0,
                            updates_dropped_deadline=0, updates_dropped_over_selection=0)
    return results, server, stats


def test_version_metrics_are_born_with_their_names_and_the_two_losses_kept_apart():
    results, server, stats = _fake_evaluation()
    m = version_metrics(results, server, stats, wall=10.0, sim_time=55.0, slots=2)
    per_client = m.pop(names.PER_CLIENT)
    assert [r["client_id"] for r in per_client] == [0, 1]
    unnamed = [k for k in m if not names.is_name(k)]
    assert unnamed == []  # every key made by the table
    # the clients' local-update loss (mean over clients) and the server step's loss: two names, two values
    assert m["train/loss"] == pytest.approx(0.7) and m["server/train_loss"] == 7.5
    assert m["train/ce"] == pytest.approx(0.4)  # a NaN term is left out of the mean
    assert m["server/loss"] == 6.5 and m["server/xi_mean"] == 0.25 and m["eval/global_acc"] == 0.7
    # a runtime counter is never overwritten by an aggregate key
    assert m[names.SERVER_TRAIN_S] == 3.0 and m["server/aggregate/train_s"] == 9.0
    assert m[names.EVAL_HEAD_ACC] == pytest.approx(30 / 40) and m[names.EVAL_PROTO_ACC] == pytest.approx(26 / 40)
    assert m[names.RELIABILITY_CLIENTS_NONFINITE] == 1 and m[names.EVAL_SILHOUETTE_MEAN] == pytest.approx(0.3)
    assert m[names.FEDERATION_SIM_TIME_S] == 55.0 and m[names.FEDERATION_SLOT_UTILISATION] == pytest.approx(0.6)
    assert m[names.FEDERATION_UPDATES_DROPPED] == 1 and m[names.SERVER_PROTO_MARGIN_MIN] == 1.0
    assert "version" not in m  # the driver adds the step
    without_clock = version_metrics(results, server, stats, wall=10.0, sim_time=float("nan"), slots=2)
    assert names.FEDERATION_SIM_TIME_S not in without_clock


def test_the_drivers_metric_helpers_use_the_table():
    from rayfed_proto.tracking.round_metrics import client_restart_counters, reliability_counters
    from rayfed_proto.tracking.run_end import bar_postfix
    from rayfed_proto.tracking.run_logging import RunLogging

    stats = SimpleNamespace(client_failures=1, updates_lost_client=2, server_restarts=0, updates_lost_server=0,
                            versions_redone=0, evals_incomplete=0, excluded={3}, checkpoints=4, versions_empty=0,
                            checkpoints_failed=0)
    made = {**reliability_counters(stats), **client_restart_counters(stats)}
    assert all(names.is_name(k) for k in made) and made[names.RELIABILITY_CLIENTS_EXCLUDED] == 1
    results, server, st = _fake_evaluation()
    m = version_metrics(results, server, st, wall=10.0, sim_time=55.0, slots=2)
    assert bar_postfix(m) == {"acc": "0.750", "proto": "0.650", "global": "0.700", "wall": "10s", "sim": "55s"}

    logged = []
    run_log = RunLogging.__new__(RunLogging)  # only what actor_memory and on_eval need
    tables = []
    run_log.tracker = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics),
                                      log_table=lambda frame, artifact_file: tables.append((artifact_file, frame)))
    run_log.series = ClientSeries(2, limit=5, sample=2, seed=0)
    run_log.client_history = ClientHistory()
    run_log.cfg = SimpleNamespace(tracking=SimpleNamespace(per_client_metrics=False))
    run_log.actor_memory([{"peak_rss_mib": 1.0, "pss_mib": 2.0}, {"peak_rss_mib": 3.0, "pss_mib": 4.0}], step=3)
    rest = run_log.on_eval(2, dict(m))  # default (issue 38): per-client series kept, not logged to MLflow
    assert len(logged) == 1 and run_log.client_history.frame()["client_id"].tolist() == [0, 1]
    run_log.cfg.tracking.per_client_metrics = True
    rest = run_log.on_eval(3, dict(m))
    assert names.PER_CLIENT not in rest and rest == {k: v for k, v in m.items() if k != names.PER_CLIENT}
    frame = run_log.client_history.frame()
    assert frame[["version", "client_id"]].values.tolist() == [[2, 0], [2, 1], [3, 0], [3, 1]]
    assert frame["head_acc"].tolist()[:2] == pytest.approx([0.8, frame["head_acc"].iloc[1]])
    # per actor: a table, not one single-point chart per actor and figure (issue 26, item 7)
    assert logged[0] == {names.SYSTEM_SERVER_PSS_MIB: 4.0, names.SYSTEM_SERVER_PEAK_RSS_MIB: 3.0,  # every memory figure here
                         names.SYSTEM_CLIENT_PEAK_RSS_MIB_MAX: 1.0, names.SYSTEM_CLIENT_PSS_MIB_MAX: 2.0,
                         names.SYSTEM_CLIENT_PSS_MIB_TOTAL: 2.0}
    (path, frame), = tables
    assert path == "tables/actor_memory.json"
    assert frame.to_dict("records") == [{"actor": "client_actor_0", "peak_rss_mib": 1.0, "pss_mib": 2.0},
                                        {"actor": "server", "peak_rss_mib": 3.0, "pss_mib": 4.0}]
    assert logged[1]["zz_client/head_acc/client_0"] == pytest.approx(0.8)
    assert logged[1]["zz_client/train_loss/client_1"] == 0.9
    assert all(names.is_name(k) for batch in logged for k in batch)


def test_the_drivers_end_of_run_metrics_use_the_table(tmp_path):
    from rayfed_proto.runtime.driver import _record_failure
    from rayfed_proto.tracking.run_end import time_to_target_metrics

    class Tracker:
        def __init__(self):
            self.logged, self.tags = [], {}

        def log_metrics(self, metrics, step):
            self.logged.append(dict(metrics))

        def set_tags(self, tags):
            self.tags.update(tags)

    history = [{"version": v, names.EVAL_HEAD_ACC: 0.2 * v, names.FEDERATION_WALL_S: 2.0 * v,
                names.FEDERATION_SIM_TIME_S: 10.0 * v} for v in range(4)]
    assert time_to_target_metrics(history, 0.4) == {names.FEDERATION_TIME_TO_TARGET_SIM_S: 20.0,
                                                    names.FEDERATION_TIME_TO_TARGET_WALL_S: 4.0}
    assert time_to_target_metrics(history, 0.9) == {} and time_to_target_metrics(history, None) == {}

    stats = SimpleNamespace(client_failures=0, updates_lost_client=0, server_restarts=0, updates_lost_server=0,
                            versions_redone=0, evals_incomplete=0, excluded=set(), checkpoints=1, versions_empty=0,
                            checkpoints_failed=0, dispatched=5, updates_dropped_offline=0, updates_dropped_deadline=0,
                            updates_dropped_over_selection=0)
    dead_server = SimpleNamespace(stats=SimpleNamespace(remote=lambda: None))  # its counters cannot be read
    tracker = Tracker()
    _record_failure(SimpleNamespace(stats=stats, server=dead_server, version=3), tracker, [], tmp_path, "no progress")
    (counters,) = tracker.logged
    assert counters[names.FEDERATION_UPDATES_DISPATCHED] == 5 and all(names.is_name(k) for k in counters)
    assert names.FEDERATION_UPDATES_REFUSED not in counters and tracker.tags == {"failure_reason": "no progress"}


def test_the_tracker_logs_names_as_given_and_warns_about_a_name_the_table_did_not_make(caplog):
    from rayfed_proto.tracking import mlflow_tracker

    with caplog.at_level("WARNING", logger="rayfed_proto"):
        mlflow_tracker._warn_unnamed({"eval/head_acc": 0.5, "zz_client/head_acc/client_2": 0.3, "some_flat_key": 1.0})
        mlflow_tracker._warn_unnamed({"some_flat_key": 2.0})  # once per key
    assert [r.getMessage().split("'")[1] for r in caplog.records] == ["some_flat_key"]


def test_an_old_flat_history_converts_once():
    old = [{"version": 0, "head_acc": 0.5, "train_loss": 1.5, "staleness_mean": 0.0, "server_loss": 2.0, "xi_mean": 0.1,
            "global_acc_d0": 0.3, "client_failures": 0, "peak_rss_mib_server": 100.0}]
    new = names.upgrade_history(old)
    assert new == [{"version": 0, "eval/head_acc": 0.5, "train/loss": 1.5, "federation/staleness_mean": 0.0,
                    "server/loss": 2.0, "server/xi_mean": 0.1, "eval/global_acc_d0": 0.3,
                    "reliability/client_failures": 0, "system/actors/server_peak_rss_mib": 100.0}]
    assert names.upgrade_history(new) == new  # today's names pass through: converting twice changes nothing
    assert old[0]["head_acc"] == 0.5  # the input is not modified
    # the summary and the plots read the converted history
    from rayfed_proto.tracking.report import summary_rows

    assert dict(summary_rows(new))["head accuracy (final)"] == "50.00% @ v0"


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
    assert m["zz_client/head_acc/client_3"] == 0.3 and "zz_client/proto_acc/client_3" not in m
    assert not any("samples" in k for k in m) and s.last[3]["samples"] == 10  # constant: a param, kept for the table
    assert s.backfill() == ([], "all 5 clients")


def test_large_federation_seeded_sample_plus_worst_and_best_with_whole_series():
    a, b, other = ClientSeries(50, 10, 4, seed=1), ClientSeries(50, 10, 4, seed=1), ClientSeries(50, 10, 4, seed=2)
    assert a.chosen == b.chosen and len(a.chosen) == 4 and a.chosen != other.chosen

    def results(shift):  # client c's accuracy is c/50 (+ shift): 0..2 worst, 47..49 best
        return [{"client_id": c, "n": 50, "head_correct": c + shift, "proto_correct": None, "train_loss": 0.5}
                for c in range(50)]

    live = {int(k.rsplit("_", 1)[1]) for step in (0, 5) for k in a.metrics(step, results(0 if step == 0 else 0))}
    assert live == set(a.chosen)  # only the sample is logged while the run goes on
    worst, best = a.extremes()
    assert worst == [0, 1, 2][:EXTREMES] and best == [49, 48, 47][:EXTREMES]
    points, described = a.backfill()
    filled = {int(k.rsplit("_", 1)[1]) for k, _, _ in points}
    assert filled == (set(worst) | set(best)) - set(a.chosen)
    for c in filled:  # every evaluation of each back-filled client
        assert sorted(s for k, _, s in points if k == f"zz_client/head_acc/client_{c}") == [0, 5]
    assert f"seeded sample of 4 of 50 clients {a.chosen}" in described


def test_client_row_without_test_samples_has_no_accuracy():
    assert client_row({"client_id": 0, "n": 0, "head_correct": 0, "proto_correct": None, "train_loss": float("nan")}) \
        == {"samples": 0.0}


def test_models_to_log():
    archs = ["cnn", "resnet", "cnn", "resnet", "vit"]
    assert choose_models("auto", True, archs) == (True, {})
    assert list(choose_models("auto", False, archs)[1]) == [0, 1, 4]  # no counts: the lowest id of each
    assert choose_models("server", False, archs) == (False, {})  # nothing: the method holds no model
    assert list(choose_models("all", True, archs)[1]) == [0, 1, 2, 3, 4]
    assert choose_models("none", True, archs) == (False, {})


def test_the_model_of_an_architecture_is_a_client_that_trained_and_says_why():
    """Issue 38: client 0 was never picked (0 updates, chance accuracy) and was the one logged."""
    archs = ["cnn", "resnet", "cnn", "resnet", "cnn"]
    chosen = pick_per_architecture(archs, updates={2: 5, 4: 5, 1: 3, 3: 1}, accuracy={0: 0.1, 2: 0.6, 4: 0.7, 1: 0.5})
    assert list(chosen) == [1, 4]  # cnn: 2 and 4 tie on updates, 4 is better on its test split; resnet: 1 trained most
    assert "most local updates, and of those the best accuracy" in chosen[4] and "5 local updates" in chosen[4]
    assert "70.0 %" in chosen[4] and "architecture cnn" in chosen[4]
    assert chosen[1].startswith("client 1, of the 2 clients of architecture resnet: the most local updates (3 ")
    alone = pick_per_architecture(["cnn", "mlp"], {1: 2}, {1: 0.5})[1]
    assert alone == "client 1, the only client of architecture mlp (2 local updates; final head accuracy on its own test split 50.0 %)"
    with_counts = choose_models("per_architecture", True, archs, {0: 0, 2: 1}, {})[1]
    assert list(with_counts) == [1, 2]  # resnet: no counts, lowest id


def test_trial_run_names_lead_with_the_swept_values_then_the_method():
    keys = ["algorithm.lam", "training.lr", "model.feature_dim"]
    name = trial_run_name("sw", "t_00001", {"algorithm.lam": 0.123456, "training.lr": 0.01, "model.feature_dim": 64}, keys,
                          "fedproto")
    assert name == "lam=0.1235 lr=0.01 feature_dim=64 fedproto sw-t_00001"  # a name cut short still tells trials apart
    # two keys ending alike keep their full names
    assert trial_run_name("sw", "t", {"a.x": 1, "b.x": 2}, ["a.x", "b.x"]) == "a.x=1 b.x=2 sw-t"
    assert trial_run_name("sw", "t", {}, []) == "sw-t"


def test_metric_sections_sort_global_first_and_the_per_client_sections_last():
    """The MLflow UI: one chart section per key prefix (before the last /), sorted as plain text
    (JavaScript's default sort: code units); the Model metrics tab opens on the first."""
    from rayfed_proto.tracking.clients import ClientSeries

    s = ClientSeries(20, limit=20, sample=5, seed=0)
    results = [{"client_id": c, "n": 10, "head_correct": 5, "proto_correct": 4, "train_loss": 0.5} for c in range(20)]
    keys = set(s.metrics(0, results)) | names.NAMES - {names.SWEEP_TRIALS, names.SWEEP_TRIALS_ERRORED}
    keys |= {names.train_term("loss"), names.server_metric("global_acc")}
    sections = sorted({k.rsplit("/", 1)[0] for k in keys})  # Python's str sort is code-point order, as JS's here
    assert sections[0] == "eval"
    client_sections = [x for x in sections if x.startswith(names.CLIENT_SECTION)]
    assert client_sections == sections[-len(client_sections):] == [f"zz_client/{k}" for k in names.CLIENT_SERIES]
    # a count of diverged models is not a score: not the first eval/ chart
    assert min(k for k in keys if k.startswith("eval/")) != "eval/clients_nonfinite"
    assert names.RELIABILITY_CLIENTS_NONFINITE.startswith("reliability/")


def test_schema2_names_are_read_back():
    assert names.schema2_name("zz_client/head_acc/client_3") == "client/3/head_acc"
    assert names.schema2_name(names.RELIABILITY_CLIENTS_NONFINITE) == "eval/clients_nonfinite"
    assert names.schema2_name("eval/head_acc") == "eval/head_acc"
    rows = names.upgrade_history([{"version": 1, "eval/clients_nonfinite": 0, "client/2/head_acc": 0.5}])
    assert rows == [{"version": 1, "reliability/clients_nonfinite": 0, "zz_client/head_acc/client_2": 0.5}]


def test_default_run_name_and_dataset_tag_say_what_ran():
    from rayfed_proto.config import build_config
    from rayfed_proto.tracking.run_logging import identity_tags, run_name

    cfg = build_config({}, ["algorithm.name=fedproto", "data.name=npz", "data.path=/x/cifar_subset.npz", "seed=3"])
    tags = identity_tags(cfg, "cifar_subset", "3f2a1b9c0d")
    assert tags["dataset"] == "cifar_subset" and tags["dataset.loader"] == "npz"
    assert tags["mlflow.runName"] == run_name("fedproto", "cifar_subset", 3, "3f2a1b9c0d") == "fedproto cifar_subset seed=3 3f2a1b"
    named = build_config({}, ["tracking.run_name=mine"])
    assert "mlflow.runName" not in identity_tags(named, "digits", "abc")  # a given name is kept


def test_params_that_read_like_missing_values_are_quoted_and_bookkeeping_is_not_a_param():
    from rayfed_proto.tracking.mlflow_tracker import BOOKKEEPING_PARAMS, param_text

    assert param_text("nan") == "nan" and param_text(None) == "None" and param_text(float("nan")) == "nan"
    assert param_text("sign_flip") == "sign_flip" and param_text(0.5) == "0.5"
    assert {"tracking.output_dir", "tracking.run_name"} <= set(BOOKKEEPING_PARAMS)


def test_sweep_plot_log_axis_and_parent_description_names_the_best_child():
    from rayfed_proto.tuning.report import log_axis, parent_description
    from rayfed_proto.tuning.spec import Distribution

    grid = Distribution(kind="grid", args=(0.1, 1.0, 10.0))
    assert log_axis(grid, [0.1, 1.0]) and not log_axis(Distribution(kind="grid", args=(1, 2, 3)), [1, 2])
    assert not log_axis(Distribution(kind="uniform", args=(-1.0, 1.0)), [-0.5, 0.5])
    ranked = [{"rank": 1, "trial": "t1", "algorithm.lam": 1.0, "eval/head_acc": 0.8, "mlflow_run_id": "abc123"},
              {"rank": 2, "trial": "t0", "algorithm.lam": 0.1, "eval/head_acc": 0.7, "mlflow_run_id": "def456"}]
    text = parent_description("sw", "eval/head_acc", "max", ranked, ["algorithm.lam"], "7")
    # issue 49: the links keep the model-training view (a link without workflowType opens the GenAI one)
    assert "Best child run: [abc123](#/experiments/7/runs/abc123?workflowType=machine_learning)" in text
    assert "`algorithm.lam` = 1.0" in text
    assert ("[Compare the trials](#/compare-runs?runs=%5B%22abc123%22%2C%22def456%22%5D&experiments=%5B%227%22%5D"
            "&workflowType=machine_learning)") in text
    # issue 38: the ranking is a padded text table (a markdown table ran its columns together in the UI)
    block = text.split("```")[1].strip().splitlines()
    assert block[0].split() == ["rank", "trial", "algorithm.lam", "eval/head_acc", "status", "mlflow_run_id"]
    assert block[1].split() == ["1", "t1", "1", "0.8", "-", "abc123"] and "plots/parallel_coordinates.png" in text
    assert "Compare the trials" not in parent_description("sw", "eval/head_acc", "max", ranked[:1], ["algorithm.lam"], "7")


def test_sweep_parallel_coordinates_plot(tmp_path):
    from rayfed_proto.tuning.report import plot_parallel_coordinates
    from rayfed_proto.tuning.spec import Distribution

    space = {"algorithm.lam": Distribution(kind="grid", args=(0.1, 1.0, 10.0)),
             "algorithm.name": Distribution(kind="choice", args=("fedproto", "fedsa"))}
    ranked = [{"trial": "t0", "algorithm.lam": 0.1, "algorithm.name": "fedsa", "eval/head_acc": 0.7},
              {"trial": "t1", "algorithm.lam": 10.0, "algorithm.name": "fedproto", "eval/head_acc": None}]
    out = plot_parallel_coordinates(ranked, space, "eval/head_acc", tmp_path / "p.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_series_is_charted_once_it_moves_with_its_held_points_back_filled():
    """Issue 49: a chart of one value says nothing. A counter is held while 0, any other series
    while it keeps its first value; the first change logs the held points at their steps."""
    from rayfed_proto.tracking.series_gate import SeriesGate

    gate = SeriesGate()
    failures, staleness, wall = names.RELIABILITY_CLIENT_FAILURES, names.FEDERATION_STALENESS_MAX, names.FEDERATION_WALL_S
    first = {names.EVAL_HEAD_ACC: 0.5, failures: 0.0, staleness: 0.0, wall: 3.0, names.FEDERATION_STARTUP_S: 12.25}
    assert gate.admit(first, 0) == ({names.EVAL_HEAD_ACC: 0.5}, [], {names.FEDERATION_STARTUP_S: "12.25"})
    assert gate.admit({names.EVAL_HEAD_ACC: 0.5, failures: 0.0, staleness: 0.0, wall: 3.0}, 1) == (
        {names.EVAL_HEAD_ACC: 0.5}, [], {})  # eval/ is charted even when flat; the others wait
    now, backfill, _ = gate.admit({names.EVAL_HEAD_ACC: 0.6, failures: 1.0, staleness: 0.0, wall: 7.0}, 2)
    assert now == {names.EVAL_HEAD_ACC: 0.6, failures: 1.0, wall: 7.0}
    assert sorted(backfill) == [(wall, 3.0, 0), (wall, 3.0, 1), (failures, 0.0, 0), (failures, 0.0, 1)]
    assert gate.admit({failures: 1.0, wall: 7.0}, 3)[0] == {failures: 1.0, wall: 7.0}  # moved once: charted
    assert gate.still_held() == {staleness: 0.0}  # a sync run's staleness: never a chart (history.csv has it)
    # a counter's baseline is 0: its first non-zero value is news, even as its first point
    assert SeriesGate().admit({names.RELIABILITY_CLIENT_ACTOR_RESTARTS: 1.0}, 4)[0] == {
        names.RELIABILITY_CLIENT_ACTOR_RESTARTS: 1.0}
    assert names.TRAIN_NONFINITE_STEPS in names.COUNTERS and names.train_term("nonfinite_steps") == names.TRAIN_NONFINITE_STEPS
    # a resumed run's charted series go on as before
    assert SeriesGate({wall: 1.0}).admit({wall: 7.0}, 5)[0] == {wall: 7.0}
    # the one-value figures kept as metrics: the run list sorts by them as numbers
    assert SeriesGate().admit({names.SYSTEM_SERVER_PSS_MIB: 80.0}, 2)[0] == {names.SYSTEM_SERVER_PSS_MIB: 80.0}


def test_system_metrics_sample_about_60_times_over_the_run_so_far_between_1_s_and_the_longest():
    from rayfed_proto.tracking.mlflow_tracker import system_metrics_interval

    assert system_metrics_interval(0.0, 10.0) == 1.0
    assert system_metrics_interval(30.0, 10.0) == 1.0
    assert system_metrics_interval(300.0, 10.0) == 5.0
    assert system_metrics_interval(3600.0, 10.0) == 10.0
    assert system_metrics_interval(3600.0, 0.5) == 0.5  # a shorter tracking.system_metrics_interval_s wins


def test_links_carry_the_model_training_view_and_mlflow_prints_none_of_its_own(monkeypatch):
    import os

    from rayfed_proto.tracking.links import compare_url, no_mlflow_run_links, relative, run_url

    assert relative(run_url("http://h:5000", "3", "r1")) == "#/experiments/3/runs/r1?workflowType=machine_learning"
    assert compare_url("http://h:5000/", "3", ["a", "b"]) == (
        "http://h:5000/#/compare-runs?runs=%5B%22a%22%2C%22b%22%5D&experiments=%5B%223%22%5D&workflowType=machine_learning")
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    with no_mlflow_run_links():
        from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT

        assert MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get() is True
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ


def test_system_metrics_sample_every_second_in_a_short_run_and_stretch_with_its_length(tmp_path, monkeypatch):
    """Issue 49: MLflow's 10 s interval gave a short run one point per system metric (CPU at 0.00)."""
    import time

    from mlflow.tracking import MlflowClient, fluent

    from rayfed_proto.config import TrackingConfig
    from rayfed_proto.tracking import mlflow_tracker
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("sys", artifact_location=str(tmp_path / "a"))
    tracker = MlflowTracker(TrackingConfig(tracking_uri=uri, experiment_name="sys", system_metrics=True))
    tracker.start({})
    tracker.log_metrics({names.EVAL_HEAD_ACC: 0.1}, step=0)
    monitor = fluent.run_id_to_system_metrics_monitor[tracker.run_id]
    assert monitor.sampling_interval == 1.0 and monitor.samples_before_logging == 1
    time.sleep(2.6)
    started = tracker._system_started
    monkeypatch.setattr(mlflow_tracker, "_clock", lambda: started + 300.0)  # five minutes into the run
    tracker.log_metrics({names.EVAL_HEAD_ACC: 0.2}, step=1)
    assert monitor.sampling_interval == pytest.approx(5.0)
    tracker.end()
    history = MlflowClient(uri).get_metric_history(tracker.run_id, "system/cpu_utilization_percentage")
    assert len({m.step for m in history}) >= 2
