"""Issue 30, items 1 and 3: ``rayfed-proto run --seeds`` as one MLflow parent run with a nested
run per seed, stopped and resumed as a group, and the Python API's result of that group.

One group, four short runs in all (the suite's time budget): ``--seeds 0 1`` with
``faults.stop_at_version=1`` stops seed 0 at version 1; ``--resume GROUP`` finishes seed 0 from
its checkpoint (the stop does not fire again on a resume) and starts seed 1, which stops at
version 1 too; ``rayfed_proto.run(resume=GROUP)`` then skips seed 0 (finished), finishes seed 1
from its checkpoint and returns the group's result.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.cli import main

pytestmark = pytest.mark.integration

TINY = ["data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20", "model.group=small_hetero",
        "model.feature_dim=64", "federation.num_clients=4", "federation.mode=sync", "federation.rounds=2",
        "federation.eval_every=1", "checkpoint.every=1", "algorithm.name=fedproto", "tracking.log_models=none",
        "tracking.system_metrics=false"]


def _sets(items):
    return [a for item in items for a in ("--set", item)]


def _state(group: Path) -> dict:
    return json.loads((group / "seeds.json").read_text())


def test_seeds_group_stopped_resumed_and_summarised(ray_session, tracking, capsys):
    from rayfed_proto import run
    from rayfed_proto.api import SeedsResult

    uri, track = tracking
    client = MlflowClient(uri)

    # 1. the group stops in seed 0 (stop_at_version): exit 130, the message names the group to resume
    code = main(["run", "--no-progress", "--seeds", "0", "1", *_sets(TINY + track + ["faults.stop_at_version=1"])])
    err = capsys.readouterr().err
    assert code == 130
    (group,) = (Path(track[1].split("=", 1)[1])).iterdir()
    assert group.name.endswith("-fedproto-digits-seeds-0-1")
    assert f"Resume the group with: rayfed-proto run --resume {group}" in err
    state = _state(group)
    assert state["seeds"] == [0, 1]
    assert state["runs"]["0"]["status"] == "interrupted" and state["runs"]["1"]["status"] == "pending"
    seed0_folder = state["runs"]["0"]["output_dir"]
    assert Path(seed0_folder).parent == group / "seed-0"
    parent = client.get_run(state["parent_run_id"])
    assert parent.info.status == "KILLED" and parent.data.tags["resume_from"] == str(group)
    assert parent.info.run_name == "fedproto-digits-seeds-0-1"
    assert parent.data.tags["rayfed_proto.seeds"] == "0,1"
    assert parent.data.params["seeds"] == "0,1" and "seed" not in parent.data.params
    assert parent.data.params["federation.rounds"] == "2"  # the shared config

    # 2. resumed: seed 0 goes on from its checkpoint and finishes, seed 1 starts and stops at version 1
    assert main(["run", "--no-progress", "--resume", str(group)]) == 130
    state = _state(group)
    assert state["runs"]["0"]["status"] == "finished" and state["runs"]["0"]["output_dir"] == seed0_folder
    assert state["runs"]["1"]["status"] == "interrupted"
    assert client.get_run(state["parent_run_id"]).info.status == "KILLED"

    # 3. the Python API resumes it again: seed 0 skipped, seed 1 finished; the group's result
    lines: list[str] = []
    result = run(resume=group, progress=False, echo=lines.append)
    assert isinstance(result, SeedsResult) and result.status == "FINISHED"
    assert any(line.startswith("seed 0 (1 of 2): finished already") for line in lines)
    assert any(line.startswith("seed 1 (2 of 2): resuming") for line in lines)
    state = _state(group)
    assert [state["runs"][s]["status"] for s in ("0", "1")] == ["finished", "finished"]
    assert sorted(p.name for p in group.iterdir()) == [".lock", "config.yaml", "seed-0", "seed-1", "seeds.csv",
                                                       "seeds.json", "seeds_mean_std.png", "summary.txt"]
    assert [len(list((group / f"seed-{s}").iterdir())) for s in (0, 1)] == [1, 1]  # resumed in place, no new folders

    # MLflow: one parent, FINISHED, with exactly the two seed runs nested under it, each resumed in place
    parent = client.get_run(result.run_id)
    assert parent.info.status == "FINISHED" and "stopped" not in parent.data.tags
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{result.run_id}'")
    by_seed = {int(c.data.params["seed"]): c for c in children}
    assert sorted(by_seed) == [0, 1] and len(children) == 2
    for seed, child in by_seed.items():
        # issue 38: what differs first (the run list cuts names short); children and parent told apart by a tag
        assert child.info.run_name == f"seed={seed} fedproto digits" and child.info.status == "FINISHED"
        assert child.data.tags["rfp.role"] == "child"
        assert child.info.run_id == state["runs"][str(seed)]["run_id"] == result.results[seed].run_id
    assert by_seed[0].info.run_id == json.loads((Path(seed0_folder) / "run.json").read_text())["run_id"]

    # the parent's mean and std are those of the children's final (and best) values, as MLflow holds them
    finals = [by_seed[s].data.metrics["eval/head_acc"] for s in (0, 1)]
    bests = [max(m.value for m in client.get_metric_history(by_seed[s].info.run_id, "eval/head_acc")) for s in (0, 1)]
    proto = [by_seed[s].data.metrics["eval/proto_acc"] for s in (0, 1)]
    tags = parent.data.tags
    assert tags["seeds/eval/head_acc_final"] == f"{np.mean(finals):.4f} ± {np.std(finals):.4f} (n=2)"
    assert tags["seeds/eval/head_acc_best"] == f"{np.mean(bests):.4f} ± {np.std(bests):.4f} (n=2)"
    assert tags["seeds/eval/proto_acc_final"] == f"{np.mean(proto):.4f} ± {np.std(proto):.4f} (n=2)"
    assert tags["rayfed_proto.seeds_finished"] == "2"
    # issue 49: per version, the mean over the seeds under the metric's own name (one chart with the seeds'
    # runs; its last value, the mean of the finals, sorts the parent among them) and the std beside it
    m = parent.data.metrics
    assert m["eval/head_acc"] == pytest.approx(np.mean(finals), abs=1e-12)
    assert parent.data.tags["rfp.role"] == "parent"
    not_parents = {r.info.run_id for r in client.search_runs([parent.info.experiment_id], "tags.rfp.role != 'parent'")}
    assert result.run_id not in not_parents and {c.info.run_id for c in children} <= not_parents
    per_version = {s: {p.step: p.value for p in client.get_metric_history(by_seed[s].info.run_id, "eval/head_acc")}
                   for s in (0, 1)}
    mean = {p.step: p.value for p in client.get_metric_history(result.run_id, "eval/head_acc")}
    std = {p.step: p.value for p in client.get_metric_history(result.run_id, "eval/head_acc_seed_std")}
    assert sorted(mean) == sorted(std) == [0, 1, 2]
    for v in (0, 1, 2):
        assert mean[v] == pytest.approx(np.mean([per_version[s][v] for s in (0, 1)]), abs=1e-12)
        assert std[v] == pytest.approx(np.std([per_version[s][v] for s in (0, 1)]), abs=1e-12)
    assert "eval/proto_acc" in m and "train/loss_seed_std" in m
    assert all(len(client.get_metric_history(result.run_id, k)) >= 2 for k in m)  # no single-point chart
    assert "plots/seeds_mean_std.png" in {a.path for a in client.list_artifacts(result.run_id, "plots")}
    note = parent.data.tags["mlflow.note.content"]
    assert "Seeds summary: fedproto-digits-seeds-0-1 (2 of 2 seeds finished)" in note and "| mean" in note
    assert {a.path for a in client.list_artifacts(result.run_id)} >= {"summary.txt", "seeds.csv"}
    assert (group / "summary.txt").read_text().strip() == result.summary

    # the API's result: per-seed histories as DataFrames, the final metrics, the run ids, the table
    seed1 = result.results[1]
    assert list(seed1.history["version"]) == [0, 1, 2] and "eval/head_acc" in seed1.history.columns
    assert seed1.final["eval/head_acc"] == pytest.approx(finals[1]) and seed1.final["version"] == 2
    assert seed1.output_dir.parent == group / "seed-1" and seed1.final_version == 2
    assert list(result.per_seed.index) == [0, 1] and list(result.per_seed["status"]) == ["finished", "finished"]
    assert result.stats.loc["mean", "eval/head_acc_final"] == pytest.approx(np.mean(finals))
    assert result.stats.loc["std", "eval/head_acc_final"] == pytest.approx(np.std(finals))
    assert int(result.stats.loc["mean", "n"]) == 2
