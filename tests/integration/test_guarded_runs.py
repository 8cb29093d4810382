"""Issue 16 through real actors and a real MLflow store: a run that makes no progress stops and
fails with its counters logged; a sync run whose updates are all refused says so; a finished run
is not rerun by --resume but can be extended; a damaged newest checkpoint falls back to the older
one."""

import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.config import InputError, build_config
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.runtime.preparation import checkpoint_store
from rayfed_proto.runtime.signals import RunInterrupted
from rayfed_proto.tracking import metric_names as names

pytestmark = pytest.mark.integration

SMALL = ["algorithm.name=fedproto", "data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20",
         "model.group=small_hetero", "model.feature_dim=32", "federation.num_clients=4", "federation.eval_every=1"]
QUIET = {"progress": False, "echo": lambda s: None}


def _points(client, run_id, name):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def test_async_run_where_every_update_is_refused_stops_failed_with_its_counters(ray_session, tracking):
    from rayfed_proto.runtime.progress import NoProgressError

    uri, track = tracking
    cfg = build_config({}, SMALL + track + ["federation.mode=async", "federation.rounds=4", "federation.buffer_size=2",
                                            "checkpoint.every=0", "faults.corrupt_clients=[0,1,2,3]",
                                            "reliability.max_consecutive_refusals=6"])
    with pytest.raises(NoProgressError, match="last 6 submitted updates were all refused"):
        run_experiment(cfg, **QUIET)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id])
    assert run.info.status == "FAILED"
    assert "max_consecutive_refusals=6" in run.data.tags["failure_reason"]
    assert run.data.metrics[names.FEDERATION_UPDATES_REFUSED] >= 6
    assert names.FEDERATION_UPDATES_ACCEPTED not in run.data.metrics  # 0 all run: no flat chart (issue 49)


def test_sync_rounds_that_aggregated_nothing_are_counted(ray_session, tracking, caplog):
    uri, track = tracking
    cfg = build_config({}, SMALL + track + ["federation.mode=sync", "federation.rounds=2", "checkpoint.every=0",
                                            "faults.corrupt_clients=[0,1,2,3]"])
    with caplog.at_level("WARNING", logger="rayfed_proto"):
        result = run_experiment(cfg, **QUIET)
    assert "version 2 aggregated NO update" in caplog.text
    points = _points(MlflowClient(uri), result.run_id, names.FEDERATION_VERSIONS_EMPTY)
    # read when each evaluation is logged (which may be after the next version exists): rising to 2 of 2
    assert points[-1] == (2, 2.0) and [v for _, v in points] == sorted(v for _, v in points)
    last = result.history[-1]
    assert last[names.FEDERATION_VERSIONS_EMPTY] == 2 and last[names.FEDERATION_UPDATES_ACCEPTED] == 0


def test_a_finished_run_is_not_rerun_but_can_be_extended_and_its_stop_tags_go(ray_session, tracking):
    uri, track = tracking
    common = SMALL + track + ["federation.mode=sync", "federation.rounds=2", "checkpoint.every=1"]
    with pytest.raises(RunInterrupted) as stopped:
        run_experiment(build_config({}, common + ["faults.stop_at_version=1"]), **QUIET)
    out = stopped.value.output_dir
    # resumed with the config as the folder stored it: the stop it asked for happened, it does not fire again
    done = run_experiment(build_config({}, common + ["faults.stop_at_version=1"]), resume_dir=out, **QUIET)
    client = MlflowClient(uri)
    tags = client.get_run(done.run_id).data.tags
    assert "stopped" not in tags and "resume_from" not in tags  # it finished: those no longer hold
    assert [s for s, _ in _points(client, done.run_id, names.EVAL_HEAD_ACC)] == [0, 1, 2]  # one point per step
    assert _points(client, done.run_id, names.RELIABILITY_CLIENT_FAILURES) == []  # a counter that stayed 0 (issue 38)
    assert checkpoint_store(build_config({}, common), out).latest().version == 2  # a checkpoint at the end

    with pytest.raises(InputError, match="already finished at version 2"):
        run_experiment(build_config({}, common), resume_dir=out, **QUIET)
    assert [s for s, _ in _points(client, done.run_id, names.EVAL_HEAD_ACC)] == [0, 1, 2]  # nothing logged again

    more = run_experiment(build_config({}, common[:-2] + ["federation.rounds=3", "checkpoint.every=1"]), resume_dir=out, **QUIET)
    assert more.run_id == done.run_id and more.final_version == 3
    assert [s for s, _ in _points(client, done.run_id, names.EVAL_HEAD_ACC)] == [0, 1, 2, 3]
    assert client.get_run(done.run_id).info.status == "FINISHED"

    # a crafted newest checkpoint is refused before anything starts: the FINISHED run stays FINISHED
    import hashlib
    import json

    import torch

    store = checkpoint_store(build_config({}, common), out)
    final = store.latest()
    assert final.version == 3
    server_pt = final.path / "server.pt"
    saved = server_pt.read_bytes()
    torch.save({"core": _RunsCode(str(out / "pwned"))}, server_pt)
    manifest = json.loads((final.path / "manifest.json").read_text())
    data = server_pt.read_bytes()
    manifest["files"]["server.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (final.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="server.pt") as refused:
        run_experiment(build_config({}, common[:-2] + ["federation.rounds=4", "checkpoint.every=1"]), resume_dir=out, **QUIET)
    assert "weights_only" not in str(refused.value) and not (out / "pwned").exists()
    assert client.get_run(done.run_id).info.status == "FINISHED" and "failure_reason" not in client.get_run(done.run_id).data.tags

    # the final checkpoint lost (damaged): extended from the older one, the versions after it redone
    server_pt.write_bytes(saved[: len(saved) // 2])
    said = []
    longer = run_experiment(build_config({}, common[:-2] + ["federation.rounds=4", "checkpoint.every=1"]), resume_dir=out,
                            progress=False, echo=said.append)
    assert longer.final_version == 4 and any("version 2" in s for s in said if s.startswith("resuming from"))
    assert client.get_run(done.run_id).data.tags["superseded_steps"] == "3"
    assert [s for s, _ in _points(client, done.run_id, names.EVAL_HEAD_ACC)] == [0, 1, 2, 3, 3, 4]
    assert client.get_run(done.run_id).info.status == "FINISHED"


class _RunsCode:
    """An object whose unpickling would run code (what a hostile checkpoint would hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_resume_falls_back_to_the_older_checkpoint_when_the_newest_is_damaged(ray_session, tracking):
    uri, track = tracking
    common = SMALL + track + ["federation.mode=sync", "federation.rounds=3", "checkpoint.every=1", "checkpoint.keep=2"]
    with pytest.raises(RunInterrupted) as stopped:
        run_experiment(build_config({}, common + ["faults.stop_at_version=2"]), **QUIET)
    out = stopped.value.output_dir
    store = checkpoint_store(build_config({}, common), out)
    newest = store.latest()
    assert newest.version == 2
    data = (newest.path / "server.pt").read_bytes()
    (newest.path / "server.pt").write_bytes(data[: len(data) // 3])
    said = []
    result = run_experiment(build_config({}, common), resume_dir=out, progress=False, echo=said.append)
    assert any("version 1" in s for s in said if s.startswith("resuming from"))
    assert result.final_version == 3 and MlflowClient(uri).get_run(result.run_id).info.status == "FINISHED"
    # version 2 was logged before the stop and is evaluated again: recorded in a tag (MLflow keeps both
    # points), and exactly one row per version in history.parquet
    client = MlflowClient(uri)
    assert client.get_run(result.run_id).data.tags["superseded_steps"] == "2"
    assert [s for s, _ in _points(client, result.run_id, names.EVAL_HEAD_ACC)] == [0, 1, 2, 2, 3]
    import pandas as pd

    assert list(pd.read_parquet(out / "history.parquet")["version"]) == [0, 1, 2, 3]
