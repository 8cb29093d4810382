"""A seed group's parent run in MLflow and the seeds' run names (issue 49, items 4, 5 and 7): the
mean over the seeds under the metric's own name per version (one chart with the seeds' runs, and a
value the run list sorts by), the std beside it, the one-value figures as tags, no single-point
chart; names that put what differs first. No Ray: histories written by hand, a sqlite store."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from rayfed_proto.config import build_config
from rayfed_proto.runtime import seeds

HEAD = {0: [0.10, 0.30, 0.50], 1: [0.20, 0.50, 0.60]}
LOSS = {0: [2.0, 1.5, 1.0], 1: [2.2, 1.3, 0.8]}


@pytest.fixture
def group(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("seeds")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": "fedproto"}}))
    records = {}
    for seed in (0, 1):
        folder = tmp_path / "g" / f"seed-{seed}" / "run"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("seed: 0\n")  # what makes it the seed's run folder
        pd.DataFrame({"version": [0, 1, 2], "eval/head_acc": HEAD[seed], "train/loss": LOSS[seed]}).to_parquet(
            folder / "history.parquet")
        run_id = client.create_run(exp, run_name=f"seed={seed}").info.run_id
        records[seed] = seeds.SeedRecord("finished", str(folder), run_id=run_id, final_version=2)
    parent = client.create_run(exp, run_name="fedproto-digits-seeds-0-1").info.run_id
    g = seeds.SeedGroup(tmp_path / "g", [0, 1], "fedproto-digits-seeds-0-1", parent, uri, "seeds", records)
    seeds._summarise(g)
    seeds._log_summary(g)
    return g, client


def test_parent_logs_the_mean_over_seeds_under_the_metrics_own_name(group):
    g, client = group
    run = client.get_run(g.parent_run_id)
    assert set(run.data.metrics) == {"eval/head_acc", "eval/head_acc_seed_std", "train/loss", "train/loss_seed_std"}
    mean = {m.step: m.value for m in client.get_metric_history(g.parent_run_id, "eval/head_acc")}
    std = {m.step: m.value for m in client.get_metric_history(g.parent_run_id, "eval/head_acc_seed_std")}
    assert mean == pytest.approx({0: 0.15, 1: 0.40, 2: 0.55})
    assert std == pytest.approx({0: 0.05, 1: 0.10, 2: 0.05})
    # the run list shows (and sorts by) the last value: the mean of the seeds' final values
    assert run.data.metrics["eval/head_acc"] == pytest.approx(np.mean([HEAD[0][-1], HEAD[1][-1]]))
    assert {m.step: m.value for m in client.get_metric_history(g.parent_run_id, "train/loss")} == pytest.approx(
        {0: 2.1, 1: 1.4, 2: 0.9})
    # no single-point chart: every series spans the versions
    assert all(len(client.get_metric_history(g.parent_run_id, k)) == 3 for k in run.data.metrics)


def test_parent_keeps_one_value_figures_as_tags_and_links_its_seeds(group):
    g, client = group
    run = client.get_run(g.parent_run_id)
    tags = run.data.tags
    assert tags["seeds/eval/head_acc_final"] == "0.5500 ± 0.0500 (n=2)"
    assert tags["seeds/eval/head_acc_best"] == "0.5500 ± 0.0500 (n=2)"
    assert tags["rayfed_proto.seeds_finished"] == "2"
    note = tags["mlflow.note.content"]
    assert "mean of the seeds' final values" in note and "Seeds summary: fedproto-digits-seeds-0-1" in note
    ids = [g.records[s].run_id for s in (0, 1)]
    assert f"[Compare the seeds' runs](#/compare-runs?runs=%5B%22{ids[0]}%22%2C%22{ids[1]}%22%5D" in note
    assert "workflowType=machine_learning" in note
    paths = {a.path for a in client.list_artifacts(g.parent_run_id)}
    assert {"summary.txt", "seeds.csv", "plots", "tables"} <= paths


def test_one_seed_logs_no_std():

    from rayfed_proto.tracking.group_metrics import curve_points

    xs, mean, std = np.array([0.0, 1.0]), np.array([0.1, 0.2]), np.array([0.0, 0.0])
    assert curve_points("eval/head_acc", (xs, mean, std), runs=1) == [("eval/head_acc", 0.1, 0), ("eval/head_acc", 0.2, 1)]
    assert [k for k, _, _ in curve_points("eval/head_acc", (xs, mean, std), runs=2)].count("eval/head_acc_seed_std") == 2


def test_seed_run_names_put_what_differs_first(tmp_path):
    cfg = build_config({"algorithm": {"name": "fedsa"}, "data": {"name": "digits"}})
    assert seeds.seed_run_name(cfg, 1) == "seed=1 fedsa digits"  # in a group of one method: the seed
    assert seeds.seed_run_name(cfg, 1, method_first=True) == "fedsa seed=1 digits"  # several methods: the method
    named = build_config({"algorithm": {"name": "fedsa"}, "tracking": {"run_name": "abl"}})
    assert seeds.seed_run_name(named, 2) == "seed=2 abl"
    assert seeds.seed_run_name(named, 2, method_first=True) == "fedsa seed=2 abl"
    # the choice is kept in seeds.json: a resumed group names the seeds it starts the same way
    g = seeds.SeedGroup(tmp_path, [0, 1], "n", None, None, "e", {0: seeds.SeedRecord(), 1: seeds.SeedRecord()},
                        method_first=True)
    g.save()
    again = seeds.SeedGroup.load(tmp_path)
    assert again.method_first is True
    shared = build_config({"algorithm": {"name": "fedsa"}, "data": {"name": "digits"}})
    assert again.seed_config(shared, 1).tracking.run_name == "fedsa seed=1 digits"
