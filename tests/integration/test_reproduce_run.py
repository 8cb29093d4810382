"""``rayfed-proto reproduce`` end to end (issue 47 item 9), as small as it goes: FedSA's Table 2 at
small scale, FedSA only, one seed, 2 rounds of 4 clients. The table is written and logged to the
reproduction's MLflow parent run, with the seed group nested under it."""

from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.cli import main

pytestmark = pytest.mark.integration


def test_reproduce_writes_and_logs_the_table(ray_session, tracking, tmp_path, capsys):
    uri, track = tracking
    out = tmp_path / "table"
    argv = ["reproduce", "fedsa", "table2", "--methods", "fedsa", "--seeds", "0", "--no-progress", "--out", str(out),
            "--set", "federation.rounds=2", "--set", "federation.num_clients=4", "--set", "data.image_size=16",
            "--set", "model.feature_dim=64", "--set", "tracking.system_metrics=false"]
    assert main([*argv, *[a for item in track for a in ("--set", item)]]) == 0
    printed = capsys.readouterr().out
    assert "Small scale, NOT the paper's experiment" in printed

    csv = pd.read_csv(out / "reproduce.csv")
    (row,) = csv.to_dict("records")
    assert (row["column"], row["row"], row["metric"], row["paper_value"], row["n"]) == \
        ("HtFE8", "FedSA", "eval/proto_acc (best)", 35.68, 1)
    assert 0.0 < row["ours_mean"] <= 100.0 and row["difference"] == pytest.approx(row["ours_mean"] - 35.68)
    assert "| HtFE8 | FedSA | eval/proto_acc (best) | 35.68 ± 0.17 |" in (out / "reproduce.md").read_text()

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("reproduce_fedsa")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("rayfed_proto.reproduce") == "fedsa/table2/small"]
    assert parent.info.status == "FINISHED" and parent.data.params["seeds"] == "0"
    assert parent.data.metrics["reproduce/FedSA/HtFE8/ours_mean"] == pytest.approx(row["ours_mean"])
    assert parent.data.metrics["reproduce/FedSA/HtFE8/paper"] == 35.68
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id)) == ["reproduce.csv", "reproduce.md"]
    groups = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert [g.info.run_name for g in groups] == ["fedsa-digits-seeds-0"]
    assert Path(track[1].split("=", 1)[1]).is_dir()  # the runs went where --set tracking.output_dir said
