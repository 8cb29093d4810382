"""What a finished run holds in MLflow, read back through MlflowClient (issue 14): namespaced
metrics, per-client series (capped for large federations), tables, datasets, loadable models."""

import json

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from rayfed_proto.config import build_config
from rayfed_proto.data import Partition, load_dataset
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.tracking.clients import EXTREMES, ClientSeries
from rayfed_proto.tracking.metric_names import COUNTERS, SCHEMA_TAG, get_metric_history

pytestmark = pytest.mark.integration

SMALL = ["data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20", "model.group=small_hetero",
         "model.feature_dim=32", "federation.mode=sync", "federation.eval_every=1", "tracking.system_metrics=false"]
SECTIONS = {"eval", "train", "server", "federation", "reliability", "system", "zz_client", "model"}


def client_key(c, series):
    return f"zz_client/{series}/client_{c}"


def steps(client, run_id, key):
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


# Series that may legitimately be flat in a small run, each with its reason (issue 49: every other chart must move)
FLAT_ALLOWED = {
    # a client's accuracy on its own small test split can repeat across 3 evaluations; per-client series
    # are opt-in (tracking.per_client_metrics) and compared across clients, not read one by one
    "zz_client/": "per-client series: a client's accuracy may repeat on a small test split",
    # the evaluation is what runs are compared by: charted as it comes, even when flat (a stuck run is a result)
    "eval/": "evaluation figures are charted even when flat",
}
# one value each, kept metrics on purpose (tracking/series_gate.py FINAL_FIGURES): the run list sorts by them as numbers
ONE_POINT_ALLOWED = {"system/actors/client_peak_rss_mib_max", "system/actors/client_pss_mib_max",
                     "system/actors/client_pss_mib_total", "system/actors/server_peak_rss_mib",
                     "system/actors/server_pss_mib"}


def assert_every_chart_says_something(client, run_id):
    """Issue 49: each metric series has two steps or more and two values or more; one-value figures
    are tags (``federation/startup_s``) or the logged model's params. Returns the charts, by key."""
    run = client.get_run(run_id)
    charts = {}
    for key in run.data.metrics:
        history = client.get_metric_history(run_id, key)
        charts[key] = (len({m.step for m in history}), len({m.value for m in history}))
    one_point = {k for k, (n_steps, _) in charts.items() if n_steps < 2} - ONE_POINT_ALLOWED
    flat = {k for k, (n_steps, n_values) in charts.items() if n_steps >= 2 and n_values < 2
            and not k.startswith(tuple(FLAT_ALLOWED))}
    assert not one_point and not flat, (sorted(one_point), sorted(flat))
    assert not any(k.startswith(("model/", "federation/startup_s")) for k in charts)
    assert float(run.data.tags["federation/startup_s"]) > 0  # a tag: beside the summary, not a one-dot chart
    for model in client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                             filter_string=f"source_run_id = '{run_id}'"):
        assert not model.metrics and model.params.get("eval_split")  # its accuracy: its params
    # issue 49 item 3: models are outputs of the run, at its final version, never inputs
    assert not (run.inputs.model_inputs or [])
    final = max(m.step for m in client.get_metric_history(run_id, "eval/head_acc"))
    assert all(o.step == final for o in run.outputs.model_outputs or [])
    return charts


def predict_accuracy(model, x, y):
    with torch.no_grad():
        return int((model(x).argmax(1) == y).sum()) / len(y)


def test_sync_run_namespaced_metrics_client_series_tables_datasets_and_loadable_client_models(ray_session, tracking,
                                                                                              monkeypatch):
    import ray

    from rayfed_proto.tracking.run_logging import RunLogging

    uri, track = tracking
    cfg = build_config({}, SMALL + track + ["algorithm.name=fedproto", "federation.num_clients=4", "federation.rounds=2",
                                            "tracking.log_models=all", "tracking.per_client_metrics=true"])
    alive_at_finish = []
    finish = RunLogging.finish

    def spy(self, *args, **kwargs):  # the models are logged after the run's actors are gone (peak memory)
        alive_at_finish.extend(a for a in ray.util.list_named_actors(all_namespaces=True) if "rayfed" in str(a))
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(RunLogging, "finish", spy)
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    assert alive_at_finish == []
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    keys = set(run.data.metrics)

    # 1. every key in a section the UI groups by; resource settings are params, not metrics
    assert keys and all("/" in k and k.split("/", 1)[0] in SECTIONS for k in keys), sorted(keys)
    assert not any(k.startswith("resources") for k in keys)
    assert {"eval/head_acc", "eval/proto_acc", "train/loss", "train/align", "server/train_s"} <= keys
    # the in-process history holds the very names MLflow holds (born once, never renamed); a counter that
    # stayed 0 is in the history only (issue 38: no flat-zero charts)
    last = {k for k, v in result.history[-1].items() if k != "version" and np.isfinite(v)}
    assert "reliability/client_failures" in last - keys
    for k in last - keys:  # issue 49: what the history holds and MLflow does not kept one value all run
        assert len({h[k] for h in result.history if k in h}) == 1, k
    assert not any(k in COUNTERS and run.data.metrics[k] == 0 for k in keys)
    # issue 49: a sync run's staleness is 0 by construction, no chart; nor the counters that stayed 0
    assert not {"federation/staleness_mean", "federation/staleness_max", "train/nonfinite_steps"} & keys
    charts = assert_every_chart_says_something(client, result.run_id)
    assert len(run.outputs.model_outputs) == 4
    print(f"charts of the run: {len(charts)} in {len({k.rsplit('/', 1)[0] for k in charts})} sections")
    assert sorted(steps(client, result.run_id, "eval/head_acc")) == [0, 1, 2]
    assert run.data.params["plan.concurrency"] and "plan.client_num_cpus" in run.data.params
    assert run.data.tags[SCHEMA_TAG] == "3"
    # issue 26: the Model metrics tab (sections = key prefixes, sorted as text) opens on a global section,
    # the per-client sections sort last, no constant per-client chart; the run says what ran
    sections = sorted({k.rsplit("/", 1)[0] for k in keys})
    assert sections[0] == "eval" and all(x.startswith("zz_client/") for x in sections[-3:]), sections
    assert min(k for k in keys if k.startswith("eval/")) != "eval/clients_nonfinite"
    assert not any(k.startswith(("zz_client/", "client/")) and "samples" in k for k in keys)
    assert run.info.run_name == f"fedproto digits seed={cfg.seed} {result.run_id[:6]}"
    assert run.data.tags["dataset"] == "digits" and "tracking.output_dir" not in run.data.params
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # old names stay readable through the helper (one release)
    with pytest.warns(DeprecationWarning):
        old = get_metric_history(client, result.run_id, "head_acc")
    assert [m.value for m in sorted(old, key=lambda m: m.step)] == [result.history[i]["eval/head_acc"] for i in range(3)]
    # the history artifact uses the logged names
    hist = mlflow.artifacts.download_artifacts(run_id=result.run_id, artifact_path="history.csv", tracking_uri=uri)
    assert "eval/head_acc" in open(hist).readline().split(",")

    # 2. per-client series for every client (4 <= limit), and the final table
    for c in range(4):
        for name in ("head_acc", "proto_acc", "train_loss", "samples"):
            if name != "samples":
                assert client_key(c, name) in keys, (c, name)
        assert sorted(steps(client, result.run_id, client_key(c, "head_acc"))) == [0, 1, 2]
    n = np.array(json.loads(run.data.params["client.test_samples"]))  # constant: a param, not a chart
    acc = np.array([steps(client, result.run_id, client_key(c, "head_acc"))[2] for c in range(4)])
    assert (acc * n).sum() / n.sum() == pytest.approx(run.data.metrics["eval/head_acc"])  # sample-weighted mean
    table = mlflow.load_table("tables/clients.json", run_ids=[result.run_id])
    assert sorted(table["client_id"]) == [0, 1, 2, 3]
    assert np.allclose(table.sort_values("client_id")["final_head_acc"].to_numpy(), acc)
    partition_table = mlflow.load_table("tables/partition.json", run_ids=[result.run_id])
    assert len(partition_table) == 4 and (partition_table["train_samples"] > 0).all()
    assert run.data.tags["rayfed_proto.client_series"] == "all 4 clients"

    # 4. datasets: the whole set and each split, with digests and contexts
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert {"digits", "digits/train", "digits/test"} <= set(inputs)
    contexts = {name: {t.key: t.value for t in i.tags}.get("mlflow.data.context") for name, i in inputs.items()}
    assert contexts["digits/train"] == "training" and contexts["digits/test"] == "testing"
    assert all(i.dataset.digest for i in inputs.values())

    # 5. context: version and commit tags, a description holding the summary
    assert run.data.tags["rayfed_proto.version"]
    assert "Run summary" in run.data.tags["mlflow.note.content"]

    # 3. every client's model loads and reproduces the reported accuracy on that client's test split
    models = {m.name: m for m in client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                             filter_string=f"source_run_id = '{result.run_id}'")}
    assert set(models) == {f"client_{c}" for c in range(4)}
    partition = Partition.load_parquet(result.output_dir / "partition.parquet")
    dataset = load_dataset(cfg.data, cfg.seed)
    for c in (0, 3):
        model = mlflow.pytorch.load_model(models[f"client_{c}"].model_uri)
        x, y = dataset.tensors(partition.clients[c].test_idx)
        measured = predict_accuracy(model, x, y)
        assert measured == pytest.approx(steps(client, result.run_id, client_key(c, "head_acc"))[2], abs=1e-9)
        assert measured == pytest.approx(float(models[f"client_{c}"].params["head_acc"]), abs=1e-6)  # its param
    assert models["client_0"].tags.get("architecture") != models["client_1"].tags.get("architecture")
    # issue 38: a constant is no chart: the test-split size is the model's tag; why it was logged, its description
    assert models["client_0"].tags["test_samples"] == str(n[0]) and not any(k.startswith("model/") for k in keys)
    assert models["client_0"].tags["mlflow.note.content"] == "client_0: tracking.log_models: all"


def test_fedavg_default_logs_the_server_model_and_it_reproduces_global_accuracy(ray_session, tracking):
    uri, track = tracking
    cfg = build_config({}, SMALL + track + ["algorithm.name=fedavg", "model.group=HtFE1", "federation.num_clients=3",
                                            "federation.rounds=2", "data.global_test_fraction=0.2"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    models = {m.name: m for m in client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                             filter_string=f"source_run_id = '{result.run_id}'")}
    assert set(models) == {"server"}  # tracking.log_models=auto and FedAvg holds a model
    assert_every_chart_says_something(client, result.run_id)  # issue 49: the defaults' charts, every one moves
    # issue 38, defaults: no per-client metric, every client's series in client_history.parquet and two plots
    assert not any(k.startswith("zz_client/") for k in run.data.metrics)
    assert "tracking.per_client_metrics: false" in run.data.tags["rayfed_proto.client_series"]
    artifacts = {a.path for a in client.list_artifacts(result.run_id)} | {a.path for a in client.list_artifacts(result.run_id, "plots")}
    assert {"client_history.parquet", "plots/client_head_acc.png", "plots/client_head_acc_heatmap.png"} <= artifacts
    per_client = pd.read_parquet(result.output_dir / "client_history.parquet")
    assert sorted(per_client["client_id"].unique()) == [0, 1, 2] and sorted(per_client["version"].unique()) == [0, 1, 2]
    model = mlflow.pytorch.load_model(models["server"].model_uri)
    partition = Partition.load_parquet(result.output_dir / "partition.parquet")
    x, y = load_dataset(cfg.data, cfg.seed).tensors(partition.global_test_idx)
    assert predict_accuracy(model, x, y) == pytest.approx(steps(client, result.run_id, "eval/global_acc")[2], abs=1e-9)
    assert "digits/global_test" in {i.dataset.name for i in run.inputs.dataset_inputs}


def test_large_federation_logs_a_seeded_sample_plus_worst_and_best(ray_session, tracking):
    uri, track = tracking
    cfg = build_config({}, SMALL + track + ["algorithm.name=fedproto", "federation.num_clients=12",
                                            "federation.participation=0.5", "federation.rounds=2",
                                            "resources.clients_per_actor=4", "tracking.client_series_limit=6",
                                            "tracking.client_series_sample=3", "tracking.log_models=per_architecture",
                                            "tracking.per_client_metrics=true"])
    result = run_experiment(cfg, progress=False, echo=lambda s: None)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    logged = {int(k.rsplit("_", 1)[1]) for k in run.data.metrics if k.startswith("zz_client/head_acc/")}
    sample = ClientSeries(12, 6, 3, cfg.seed).chosen  # seeded: the same clients for the same seed
    assert len(sample) == 3 and set(sample) <= logged
    final = {c: client.get_metric_history(result.run_id, client_key(c, "head_acc")) for c in logged}
    final = {c: max(h, key=lambda m: m.step).value for c, h in final.items()}
    table = mlflow.load_table("tables/clients.json", run_ids=[result.run_id]).set_index("client_id")
    assert len(table) == 12  # the table has every client
    ranked = sorted((table.loc[c, "final_head_acc"], c) for c in range(12))
    extremes = {c for _, c in ranked[:EXTREMES]} | {c for _, c in ranked[-EXTREMES:]}
    assert logged == set(sample) | extremes and len(logged) < 12
    for c in logged:  # back-filled: every evaluation, not only the last
        assert sorted(m.step for m in client.get_metric_history(result.run_id, client_key(c, "head_acc"))) == [0, 1, 2]
        assert final[c] == pytest.approx(table.loc[c, "final_head_acc"])
    assert "seeded sample of 3 of 12 clients" in run.data.tags["rayfed_proto.client_series"]
    # issue 38: per architecture, a client that trained (the most updates of its architecture), and why
    from rayfed_proto.models import arch_for_client

    models = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                         filter_string=f"source_run_id = '{result.run_id}'")
    archs = {c: arch_for_client(cfg.model.group, c) for c in range(12)}
    assert sorted(m.tags["architecture"] for m in models) == sorted(set(archs.values()))
    for m in models:
        c = int(m.name.split("_")[1])
        assert result.client_updates.get(c, 0) == max(result.client_updates.get(o, 0) for o in archs if archs[o] == archs[c])
        assert "the most local updates" in m.tags["mlflow.note.content"] and m.tags["rayfed_proto.chosen_because"]

