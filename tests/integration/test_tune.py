"""Real sweeps on the shared Ray instance (2 CPUs, 2 logical GPUs): two trials at once, each a
whole federated run in its own placement group, logged as MLflow child runs through the sweep's
own 127.0.0.1 tracking server; the best config runs; an interrupted sweep resumes."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rayfed_proto.cli import main
from rayfed_proto.config import load_config
from rayfed_proto.tuning.mlflow_server import LocalMlflowServer
from rayfed_proto.tuning.spec import parse_sweep
from rayfed_proto.tuning.sweep import run_sweep

pytestmark = pytest.mark.integration

ROUNDS = 2


def tiny_sweep(tmp_path, **kw):
    raw = {
        "name": "tiny",
        "base": {"data": {"name": "digits", "partition": {"name": "dirichlet", "beta": 0.5, "min_samples": 20}},
                 "model": {"group": "small_hetero", "feature_dim": 32},
                 "algorithm": {"name": "fedproto"},
                 "federation": {"mode": "sync", "num_clients": 4, "rounds": ROUNDS, "eval_every": 1},
                 "tracking": {"experiment_name": "tune_test", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                              "output_dir": str(tmp_path / "runs")}},
        "search_space": {"algorithm.lam": {"grid": [0.1, 1.0]}},
        "num_samples": 1,
        "max_concurrent_trials": 2,
        # 0.25 + 0.25 + 2 x 0.25 = 1 CPU per trial: two trials fill the 2-CPU instance exactly
        "trial_resources": {"driver_cpus": 0.25, "server_cpus": 0.25, "client_cpus": 0.25, "client_actors": 2},
        "storage_path": str(tmp_path / "tune"),
    }
    raw.update(kw)
    return parse_sweep(raw, "tiny.yaml", tmp_path)


def children(client, parent_run_id):
    exp = client.get_experiment_by_name("tune_test")
    return client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")


def steps(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _listening_addresses(port: int) -> list[str]:
    import psutil

    return [c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_two_concurrent_trials_log_child_runs_and_the_best_config_runs(ray_session, tmp_path, monkeypatch,
                                                                       empty_mlflow_store, capsys):
    # the sweep's server opens a store with its tables made (the interrupted sweep's server, started
    # by the CLI, creates its own)
    shutil.copyfile(empty_mlflow_store, tmp_path / "mlflow.db")
    # the sweep's own MLflow server has no authentication: it listens on loopback only, checked
    # as soon as it answers (what test_local_mlflow_server_listens_on_loopback_only checked on a
    # server of its own, with a start of its own)
    listening: list[str] = []
    start = LocalMlflowServer.start

    def start_and_look(server):
        uri = start(server)
        listening.extend(_listening_addresses(int(uri.rsplit(":", 1)[1])))
        return uri

    monkeypatch.setattr(LocalMlflowServer, "start", start_and_look)
    # ASHA stops every trial at its report of version max_t (= rounds): the run must still end
    # FINISHED with its final artifacts (the last evaluation is reported after the run)
    spec = tiny_sweep(tmp_path, scheduler={"name": "asha", "grace_period": ROUNDS})
    started = time.monotonic()
    result = run_sweep(spec, verbose=0, echo=print)
    print(f"2-trial sweep (2 concurrent): {time.monotonic() - started:.1f} s wall")
    assert listening and set(listening) == {"127.0.0.1"}

    assert [r["status"] for r in result.ranked] == ["done", "done"]
    assert sorted(r["algorithm.lam"] for r in result.ranked) == [0.1, 1.0]
    assert result.ranked[0]["eval/head_acc"] >= result.ranked[1]["eval/head_acc"]

    # the sweep's server is gone; the runs are in the sqlite store it served
    client = MlflowClient(result.tracking_uri)
    assert result.tracking_uri.startswith("sqlite:///")
    parent = client.get_run(result.parent_run_id)
    # issue 49: the counts are tags (one value: no one-point chart), no errors no tag; MLflow printed no links to
    # the sweep's temporary server
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep/trials"] == "2"
    assert not parent.data.metrics.keys() & {"sweep/trials", "sweep/trials_errored"}
    # the parent's own eval/head_acc is the best trial's: sorting the run list by it keeps the nesting
    assert parent.data.metrics["eval/head_acc"] == pytest.approx(result.ranked[0]["eval/head_acc"])
    assert "sweep/trials_errored" not in parent.data.tags
    assert "View run" not in capsys.readouterr().out
    arts = {f.path for f in client.list_artifacts(result.parent_run_id)}
    assert {"trials.csv", "trials.txt", "best.yaml", "plots"} <= arts
    assert [f.path for f in client.list_artifacts(result.parent_run_id, "plots")] == [
        "plots/eval_head_acc_vs_params.png", "plots/parallel_coordinates.png"]
    kids = children(client, result.parent_run_id)
    # issue 38: parents are one filter away (tags.rfp.role != 'parent'); the compare page's parallel coordinates
    # open on the params that differ (sorted: exactly the swept ones) and on the metric each run logged first
    # (the system-metrics thread starts after the first evaluation)
    assert parent.data.tags["rfp.role"] == "parent" and {k.data.tags["rfp.role"] for k in kids} == {"child"}
    assert {p for p in set(kids[0].data.params) | set(kids[1].data.params)
            if kids[0].data.params.get(p) != kids[1].data.params.get(p)} == {"algorithm.lam"}
    assert [list(k.data.metrics)[0] for k in kids] == ["eval/head_acc", "eval/head_acc"]
    assert len(kids) == 2 and {k.info.run_id for k in kids} == {r["mlflow_run_id"] for r in result.ranked}
    for kid in kids:  # concurrent writers lost nothing: every version of both runs is there
        assert kid.info.status == "FINISHED"
        assert "summary.txt" in {f.path for f in client.list_artifacts(kid.info.run_id)}
        assert steps(client, kid.info.run_id, "eval/head_acc") == list(range(ROUNDS + 1))
        assert steps(client, kid.info.run_id, "eval/proto_acc") == list(range(1, ROUNDS + 1))
        assert kid.data.params["resources.client_num_cpus"] == "0.25"  # the trial's bundle shares
        # issue 26: the name leads with the swept value, then the method (a cut name still tells trials apart)
        lam = kid.data.params["algorithm.lam"]
        best = kid.info.run_id == result.ranked[0]["mlflow_run_id"]  # issue 49: marked in the run list
        assert kid.info.run_name.startswith(f"{'[best] ' if best else ''}lam={float(lam):.4g} fedproto tiny-"), \
            kid.info.run_name
        assert kid.data.tags.get("rayfed_proto.best_trial") == ("true" if best else None)
        # issue 49: the Source is the command, not Ray's default_worker.py; the store, not the dead server URL
        assert kid.data.tags["mlflow.source.name"] == "rayfed-proto tune tiny.yaml"
        assert kid.data.tags["tracking.tracking_uri"] == result.tracking_uri
        assert kid.data.tags["tracking.server_uri"].startswith("http://127.0.0.1:")
        # per-trial bookkeeping is tags, not params (the compare view's parallel coordinates open on lam)
        assert "tracking.output_dir" not in kid.data.params and "tracking.run_name" not in kid.data.params
        assert kid.data.tags["tracking.output_dir"]
    # the parent names and links its best child in its description
    best_id = result.ranked[0]["mlflow_run_id"]
    note = parent.data.tags["mlflow.note.content"]
    assert (f"Best child run: [{best_id}](#/experiments/{parent.info.experiment_id}/runs/{best_id}"
            "?workflowType=machine_learning)") in note
    assert "```" in note and "rank  trial" in note  # a padded text table, not a markdown one (issue 38)
    assert parent.data.tags["best.run_id"] == best_id

    # the best config is a runnable YAML: validate it, then run it with `rayfed-proto run` (the CLI's
    # entry point in this process, from the sweep's folder: no second interpreter to start and import
    # torch, Ray and MLflow)
    cfg = load_config(result.best_yaml)
    assert cfg.algorithm.options()["lam"] == result.ranked[0]["algorithm.lam"]
    assert cfg.tracking.parent_run_id is None and cfg.tracking.tracking_uri == result.tracking_uri
    address = ray_session.get_runtime_context().gcs_address
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(result.best_yaml), "--no-progress", "--set", "federation.rounds=1",
                 "--set", f"resources.address={address}"]) == 0
    runs = [r for r in client.search_runs([client.get_experiment_by_name("tune_test").experiment_id])
            if "mlflow.parentRunId" not in r.data.tags and r.info.run_id != result.parent_run_id]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert float(runs[0].data.params["algorithm.lam"]) == result.ranked[0]["algorithm.lam"]
    assert steps(client, runs[0].info.run_id, "eval/head_acc") == [0, 1]


def _finished_trials(storage: Path, rounds: int = ROUNDS) -> int:
    done = 0
    for result in storage.glob("tiny-*/rayfed_trial_*/result.json"):
        lines = [ln for ln in result.read_text().splitlines() if ln.strip()]
        done += bool(lines) and json.loads(lines[-1]).get("version") == rounds
    return done


def _checkpointed_unfinished_runs(runs: Path) -> list[Path]:
    """Run folders (<output_dir>/<sweep folder>/<trial id>/<run>) with a complete checkpoint and no summary yet."""
    return [d for d in runs.glob("tiny-*/*/*") if (d / "config.yaml").is_file() and not (d / "summary.txt").exists()
            and any(d.glob("checkpoints/v*/manifest.json"))]


def test_an_interrupted_sweep_resumes_and_its_unfinished_trial_continues_from_its_checkpoint(ray_session, tmp_path):
    """Ctrl-C the CLI once the first of two one-at-a-time trials is done and the second has a
    checkpoint, then --resume: the second trial continues its own run (same MLflow run, same
    output folder) from that checkpoint instead of starting again at version 0."""
    rounds = 12
    spec = tiny_sweep(tmp_path)
    base = {**spec.base_raw, "checkpoint": {"every": 1}}
    base["federation"] = {**base["federation"], "rounds": rounds}
    sweep_file = tmp_path / "tiny.yaml"
    raw = {**spec.file.model_dump(mode="json"), "base": base, "max_concurrent_trials": 1}
    sweep_file.write_text(yaml.safe_dump(raw))
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-m", "rayfed_proto.cli", "tune", str(sweep_file), "--address", address,
                             "--quiet"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = tmp_path / "runs"
    deadline = time.monotonic() + 600
    while not (_finished_trials(tmp_path / "tune", rounds) >= 1 and _checkpointed_unfinished_runs(runs)) \
            and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    (interrupted,) = _checkpointed_unfinished_runs(runs)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out
    (folder,) = (tmp_path / "tune").glob("tiny-*")
    assert f"rayfed-proto tune --resume {folder}" in out
    assert not (interrupted / "summary.txt").exists()

    # its MLflow store moved (as when the server went with its cluster): --tracking-uri names the new one
    moved = tmp_path / "moved" / "mlflow.db"
    moved.parent.mkdir()
    shutil.move(tmp_path / "mlflow.db", moved)
    resumed = run_sweep(resume=str(folder), tracking_uri=f"sqlite:///{moved}", verbose=0)
    assert resumed.tracking_uri == f"sqlite:///{moved}"
    assert resumed.experiment_path == str(folder) and not resumed.interrupted
    assert len(resumed.ranked) == 2 and all(r["version"] == rounds and r["status"] == "done" for r in resumed.ranked)
    assert sorted(r["algorithm.lam"] for r in resumed.ranked) == [0.1, 1.0]

    # the interrupted trial went on in the same folder: one run folder per trial, now finished
    assert (interrupted / "summary.txt").is_file()
    assert sorted(p.parent.parent.name for p in (runs / folder.name).glob("*/*/summary.txt")) == sorted(
        r["trial"] for r in resumed.ranked)
    client = MlflowClient(resumed.tracking_uri)
    kids = children(client, resumed.parent_run_id)
    # one MLflow run per trial, both FINISHED: a restart from version 0 would have left a KILLED run beside a new one
    assert len(kids) == 2 and {k.info.status for k in kids} == {"FINISHED"}
    for row in resumed.ranked:
        history = steps(client, row["mlflow_run_id"], "eval/head_acc")
        # versions after the checkpoint that were logged before the interrupt are logged again
        # (same step), those before it are not: version 0 once, so the run was not restarted
        assert sorted(set(history)) == list(range(rounds + 1)) and history.count(0) == 1
    assert client.get_run(resumed.parent_run_id).info.status == "FINISHED"
    assert load_config(resumed.best_yaml).algorithm.name == "fedproto"


def test_a_failed_trial_is_retried_from_its_tune_checkpoint_not_from_scratch(ray_session, tmp_path, empty_mlflow_store):
    """The trial fails at version 2 and its local run folder is deleted (as if its node went down
    with its disk); Tune retries it (max_failures 1) and the trial continues its run from the Tune
    checkpoint persisted under storage_path: the same MLflow run, version 0 logged once."""
    # the sweep's server opens a store with its tables made (the interrupted sweep's CLI creates its own)
    shutil.copyfile(empty_mlflow_store, tmp_path / "mlflow.db")
    rounds = 3
    spec = tiny_sweep(tmp_path)
    base = {**spec.base_raw, "checkpoint": {"every": 1}, "faults": {"fail_trial_at_version": 2}}
    base["federation"] = {**base["federation"], "rounds": rounds}
    raw = {**spec.file.model_dump(mode="json"), "base": base, "search_space": {"algorithm.lam": {"grid": [0.5]}},
           "max_concurrent_trials": 1}
    result = run_sweep(parse_sweep(raw, "tiny.yaml", tmp_path), verbose=0, echo=print)
    assert [(r["status"], r["version"]) for r in result.ranked] == [("done", rounds)]
    (trial_dir,) = (tmp_path / "tune").glob("tiny-*/rayfed_trial_*")
    assert list(trial_dir.glob("checkpoint_*")), "no Tune checkpoint was persisted"
    reported = [json.loads(ln)["version"] for ln in (trial_dir / "result.json").read_text().splitlines() if ln.strip()]
    # failed after reporting version 2 (with the checkpoint of version 1); the retry went on from
    # version 1 and reported 2 and 3 (Tune 2.60 keeps only the restored attempt's rows in
    # result.json; appended, the file would read 0, 1, 2, 2, 3). From scratch it would report 0 and 1 again.
    # or 0, 1, 2, 3 when the failure came before version 2 was reported; a restart from scratch can
    # read the same here, so what tells them apart is MLflow below: one run, version 0 logged once
    assert reported in ([2, 3], [0, 1, 2, 3], [0, 1, 2, 2, 3]), reported
    client = MlflowClient(result.tracking_uri)
    (kid,) = children(client, result.parent_run_id)  # a restart from scratch would have made a second run
    assert kid.info.status == "FINISHED"
    history = steps(client, kid.info.run_id, "eval/head_acc")
    assert sorted(set(history)) == list(range(rounds + 1)) and history.count(0) == 1

