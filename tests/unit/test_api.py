"""Issue 30, items 1, 3 and 6: the Python API's input checks and import cost, and the CLI's small
things (--version, the MLflow hint for a server, sweeps found by name from any folder), and the
refusals of --seeds before Ray starts; a seed group whose driver is faked (a failed seed, a resume).
Nothing here starts Ray: tests/integration/test_seeds.py runs real seeds."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayfed_proto.cli import main
from rayfed_proto.config import ConfigError, InputError, load_config
from rayfed_proto.preset_files import resolve_config_arg


def test_import_rayfed_proto_keeps_ray_torch_mlflow_and_pandas_out():
    # a fresh interpreter: this one has imported them already
    code = ("import sys, json\n"
            "import rayfed_proto\n"
            "from rayfed_proto import run, load_config\n"
            "import rayfed_proto.api\n"
            "assert callable(run) and callable(load_config) and run is rayfed_proto.api.run\n"
            "assert not hasattr(rayfed_proto, 'runn')  # the lazy exports answer only their own names\n"
            "print(json.dumps(sorted(m for m in ('ray', 'torch', 'mlflow', 'pandas') if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_api_bad_config_names_the_key_the_value_and_what_is_allowed():
    from rayfed_proto import run

    with pytest.raises(ConfigError) as e:
        run("fedsa_digits", set={"federation.participation": 1.5, "federation.mode": "sometimes"})
    text = str(e.value)
    assert "federation.participation = 1.5: must be in (0, 1]" in text
    assert "federation.mode = 'sometimes'" in text and "sync" in text  # the allowed values are named
    assert "fedsa_digits.yaml" in text  # and the file

    with pytest.raises(ConfigError, match="<config> = 'fedsa_digitz'.*did you mean fedsa_digits"):
        run("fedsa_digitz")
    with pytest.raises(ConfigError, match=r"set = 'federation.rounds=2': a list of 'KEY=VALUE' strings"):
        run("fedsa_digits", set="federation.rounds=2")
    with pytest.raises(ConfigError, match="config = 'int': a preset name, a YAML path"):
        run(42)


def test_api_bad_seeds_and_resume_arguments_are_refused_before_ray():
    from rayfed_proto import run

    with pytest.raises(ConfigError, match=r"seeds = -1: one or more distinct integers from 0 to 2\*\*32 - 1"):
        run("fedsa_digits", seeds=[0, -1])
    with pytest.raises(ConfigError, match=r"seeds = \[0, 0\]: .*repeated: 0"):
        run("fedsa_digits", seeds=[0, 0])
    with pytest.raises(ConfigError, match="seeds = 3: one or more"):
        run("fedsa_digits", seeds=3)
    with pytest.raises(ConfigError, match="seed = 5: not with seeds"):
        run("fedsa_digits", seeds=[0, 1], set=["seed=5"])
    with pytest.raises(ConfigError, match="config = 'fedsa_digits': None with resume"):
        run("fedsa_digits", resume="runs/x")
    with pytest.raises(ConfigError, match="training.lr = 0.1: with --resume only how the run goes on"):
        run(resume="runs/x", set={"training.lr": 0.1})


def test_api_resume_of_a_folder_that_is_no_run(tmp_path):
    from rayfed_proto import run

    with pytest.raises(InputError, match="not the output folder of a run or seed group"):
        run(resume=tmp_path)


def test_load_config_takes_presets_paths_mappings_and_dict_overrides(tmp_path):
    from rayfed_proto import load_config

    cfg = load_config("fedsa_digits", {"federation.rounds": 6, "tracking.run_name": "a: b", "federation.participation": 0.5})
    assert (cfg.algorithm.name, cfg.federation.rounds, cfg.federation.participation) == ("fedsa", 6, 0.5)
    assert cfg.tracking.run_name == "a: b"  # a mapping's string stays a string (not YAML-parsed into a mapping)
    path = tmp_path / "my.yaml"
    path.write_text("algorithm: {name: fedproto}\nfederation: {rounds: 4, eval_every: 2}\n")
    assert load_config(path, ["federation.mode=sync"]).federation.mode == "sync"
    assert load_config({"algorithm": {"name": "fedproto"}}).algorithm.name == "fedproto"
    assert load_config(cfg, {"seed": 3}).seed == 3 and cfg.seed == 0  # a copy
    assert load_config().algorithm.name == "fedtgp"  # the default preset
    with pytest.raises(ConfigError, match="overrides = 'seed': a list of 'KEY=VALUE'"):
        load_config(None, "seed")


# ------------------------------------------------------------------------------ the CLI

def test_version_flag_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rayfed-proto {importlib.metadata.version('rayfed_proto')}"


def test_browse_hint_opens_a_server_and_serves_a_local_store():
    from rayfed_proto.cli import browse_hint

    # issue 38: links that land on the runs (model-training view), and that outlive the process that printed them
    assert browse_hint("http://10.0.0.5:5000/", "abc123", "7") == \
        "open http://10.0.0.5:5000/#/experiments/7/runs/abc123?workflowType=machine_learning"
    assert browse_hint("https://mlflow.example.org") == "open https://mlflow.example.org"
    assert browse_hint("sqlite:////tmp/m.db", "abc", "1") == ("browse with: rayfed-proto ui --tracking-uri sqlite:////tmp/m.db, "
                                                             "then open http://127.0.0.1:5000/#/experiments/1/runs/abc"
                                                             "?workflowType=machine_learning")


def test_ui_prints_the_experiments_runs_link_in_the_model_training_view(tmp_path, capsys):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert main(["ui", "--tracking-uri", uri, "--no-serve"]) == 2  # no store there yet: says so, creates none
    assert "no MLflow store at" in capsys.readouterr().err and not (tmp_path / "m.db").exists()
    client = MlflowClient(uri)
    mlflow.set_tracking_uri(uri)
    first = client.create_experiment("older", artifact_location=(tmp_path / "a").as_uri())
    client.create_run(first)
    latest = client.create_experiment("mine", artifact_location=(tmp_path / "b").as_uri())
    client.create_run(latest)
    assert main(["ui", "--tracking-uri", uri, "--no-serve", "--port", "5123"]) == 0
    out = capsys.readouterr().out
    assert f"experiment 'mine': http://127.0.0.1:5123/#/experiments/{latest}/runs?workflowType=machine_learning" in out
    assert main(["ui", "--tracking-uri", uri, "--no-serve", "--experiment", "older"]) == 0
    assert f"/#/experiments/{first}/runs?workflowType=machine_learning" in capsys.readouterr().out
    assert main(["ui", "--tracking-uri", uri, "--no-serve", "--experiment", "nope"]) == 2
    assert "no experiment 'nope'" in capsys.readouterr().err


def test_ui_on_a_port_in_use_exits_2_at_once_naming_the_port(tmp_path, capsys, monkeypatch):
    """Issue 45 item 3: no ``mlflow ui`` started to fail after seconds and exit 0."""
    import socket
    import subprocess

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    MlflowClient(uri).search_experiments()  # the store exists
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("mlflow ui started on a port in use"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["ui", "--tracking-uri", uri, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot serve the MLflow UI on 127.0.0.1:{port}" in err and f"--port {port + 1}" in err, err


def test_sweep_names_and_relative_paths_are_found_from_any_folder(tmp_path, monkeypatch):
    import rayfed_proto
    from rayfed_proto.cli import resolve_sweep_arg

    repo = Path(rayfed_proto.__file__).resolve().parent.parent
    monkeypatch.chdir(tmp_path)
    assert resolve_sweep_arg("fedsa_lambda_cpu") == repo / "tune_configs" / "fedsa_lambda_cpu.yaml"
    assert resolve_sweep_arg("tune_configs/fedsa_lambda_cpu.yaml") == repo / "tune_configs" / "fedsa_lambda_cpu.yaml"
    (tmp_path / "tune_configs").mkdir()
    (tmp_path / "tune_configs" / "fedsa_lambda_cpu.yaml").write_text("name: mine\n")
    assert resolve_sweep_arg("fedsa_lambda_cpu") == tmp_path / "tune_configs" / "fedsa_lambda_cpu.yaml"  # here first
    with pytest.raises(ConfigError) as e:
        resolve_sweep_arg("fedsa_lambda_cpux")
    text = str(e.value)
    assert "<sweep> = 'fedsa_lambda_cpux'" in text
    assert str(tmp_path / "tune_configs" / "fedsa_lambda_cpux.yaml") in text  # where it looked
    assert str(repo / "tune_configs" / "fedsa_lambda_cpux.yaml") in text
    assert "fedsa_lambda_cpu," in text  # what there is


def _cli(args, capsys):
    code = main(args)
    return code, capsys.readouterr().err


def test_cli_seeds_refusals_exit_2_before_ray(tmp_path, capsys):
    import ray

    ray_before = ray.is_initialized()
    code, err = _cli(["run", "fedsa_digits", "--seeds", "0", "0"], capsys)
    assert code == 2 and "--seeds = [0, 0]" in err and "repeated: 0" in err
    code, err = _cli(["run", "fedsa_digits", "--seeds", "1", "2", "--set", "seed=4"], capsys)
    assert code == 2 and "seed = 4: not with --seeds" in err
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "config.yaml").write_text("seed: 0\n")
    code, err = _cli(["run", "--resume", str(run_folder), "--seeds", "1"], capsys)
    assert code == 2 and "--seeds = [1]: omit it with --resume of a single run" in err
    assert ray.is_initialized() == ray_before
    assert not (tmp_path / "runs").exists()


def test_a_seed_above_2_32_is_refused_before_the_group_folder_or_parent_run_exist(tmp_path, capsys, monkeypatch):
    """Issue 45 item 2: every seed is checked first, whichever place it has in --seeds."""
    from rayfed_proto.runtime import seeds as seed_groups

    monkeypatch.chdir(tmp_path)
    track = ["--set", f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}", "--set", f"tracking.output_dir={tmp_path / 'runs'}"]
    for seeds in (["4294967296", "1"], ["0", "4294967296"]):
        code, err = _cli(["run", "fedsa_digits", *track, "--seeds", *seeds], capsys)
        assert code == 2 and "--seeds = 4294967296: one or more distinct integers from 0 to 2**32 - 1" in err, err
    cfg = load_config(resolve_config_arg("fedsa_digits"), [track[1], track[3]])
    with pytest.raises(ConfigError, match="4294967296"):
        seed_groups.run_seeds(cfg, [0, 2**32])
    ran = []
    monkeypatch.setattr(seed_groups, "check_seeds", lambda seeds: list(seeds))  # the per-seed config check alone
    monkeypatch.setattr("rayfed_proto.runtime.driver.run_experiment", lambda *a, **k: ran.append(a))
    with pytest.raises(ConfigError, match="seed = 4294967296"):
        seed_groups.run_seeds(cfg, [0, 2**32])
    assert not ran and not (tmp_path / "runs").exists() and not (tmp_path / "m.db").exists()


# ------------------------------------------------------------------------------ a seed group, driver faked

def _fake_driver(fail_seeds):
    """Stands in for run_experiment: writes a finished run folder whose history holds seed-made
    accuracies, or fails as a run without progress does."""
    import pandas as pd

    from rayfed_proto.runtime import runfolder
    from rayfed_proto.runtime.progress import NoProgressError
    from rayfed_proto.runtime.run_state import RunResult

    calls = []

    def run_experiment(cfg, progress=True, echo=print, resume_dir=None, **kwargs):
        calls.append((cfg.seed, resume_dir))
        if cfg.seed in fail_seeds:
            raise NoProgressError(f"no new server version for 5 s (seed {cfg.seed})", 1)
        out = Path(cfg.tracking.output_dir) / f"20260101-000000-000000-{cfg.algorithm.name}-{cfg.data.name}"
        out.mkdir(parents=True)
        (out / "config.yaml").write_text(cfg.to_yaml())
        history = [{"version": v, "eval/head_acc": 0.1 * (cfg.seed + 1) + 0.01 * v} for v in range(3)]
        pd.DataFrame(history).to_parquet(out / "history.parquet")
        runfolder.write_run_info(out, None, None)
        runfolder.mark_finished(out, 2, None)
        return RunResult(None, None, out, 2, history, summary=f"summary of seed {cfg.seed}")

    return run_experiment, calls


def test_a_failed_seed_does_not_stop_the_others_and_a_resume_retries_it(tmp_path, monkeypatch):
    from rayfed_proto import run
    from rayfed_proto.runtime import driver

    base = {"federation": {"rounds": 2, "eval_every": 1}, "tracking": {"enabled": False, "output_dir": str(tmp_path / "runs")}}
    fake, calls = _fake_driver(fail_seeds={1})
    monkeypatch.setattr(driver, "run_experiment", fake)
    group = run(base, seeds=[0, 1, 2], echo=None)
    assert group.status == "FAILED" and "seed 1: no new server version" in group.reason
    assert [s for s, _ in calls] == [0, 1, 2]  # seed 2 ran after seed 1 failed
    assert list(group.per_seed["status"]) == ["finished", "failed", "finished"]
    assert sorted(group.results) == [0, 2] and group.results[2].final == {"version": 2, "eval/head_acc": pytest.approx(0.32)}
    assert group.stats.loc["mean", "eval/head_acc_final"] == pytest.approx((0.12 + 0.32) / 2)
    assert group.stats.loc["std", "eval/head_acc_final"] == pytest.approx(0.1)  # population std of two values
    assert group.run_id is None  # tracking off: no parent run, the table is still written
    assert "| 1    | failed" in (group.output_dir / "summary.txt").read_text()

    fake, calls = _fake_driver(fail_seeds=set())
    monkeypatch.setattr(driver, "run_experiment", fake)
    again = run(resume=group.output_dir, echo=None)
    assert calls == [(1, None)]  # the finished seeds skipped; seed 1 had no folder: started afresh
    assert again.status == "FINISHED" and sorted(again.results) == [0, 1, 2]
    assert again.stats.loc["mean", "eval/head_acc_final"] == pytest.approx((0.12 + 0.22 + 0.32) / 3)
    assert list(again.per_seed["final_version"]) == [2, 2, 2]


def test_cli_seed_group_prints_the_table_and_exits_1_when_a_seed_failed(tmp_path, monkeypatch, capsys):
    from rayfed_proto.runtime import driver

    fake, calls = _fake_driver(fail_seeds={1})
    monkeypatch.setattr(driver, "run_experiment", fake)
    code = main(["run", "--no-progress", "--seeds", "0", "1", "--set", "tracking.enabled=false", "--set",
                 f"tracking.output_dir={tmp_path / 'runs'}", "--set", "federation.rounds=2", "--set", "federation.eval_every=1"])
    out, err = capsys.readouterr()
    (group,) = (tmp_path / "runs").iterdir()
    assert code == 1 and [s for s, _ in calls] == [0, 1]
    assert "Seeds summary: fedtgp-digits-seeds-0-1 (1 of 2 seeds finished)" in out and f"outputs: {group}" in out
    assert "| 1    | failed" in out and "| mean | n=1" in out
    assert f"error: seed 1: no new server version for 5 s (seed 1); continue the failed seeds with: rayfed-proto run --resume {group}" in err


def test_a_plain_keyboard_interrupt_stops_the_group_with_its_resume_command(tmp_path, monkeypatch, capsys):
    from rayfed_proto.runtime import driver

    fake, calls = _fake_driver(fail_seeds=set())

    def interrupted_at_seed_1(cfg, **kwargs):
        if cfg.seed == 1:
            raise KeyboardInterrupt  # e.g. Ctrl-C while the seed's data loads, before its stop handlers exist
        return fake(cfg, **kwargs)

    monkeypatch.setattr(driver, "run_experiment", interrupted_at_seed_1)
    code = main(["run", "--no-progress", "--seeds", "0", "1", "2", "--set", "tracking.enabled=false", "--set",
                 f"tracking.output_dir={tmp_path / 'runs'}", "--set", "federation.rounds=2", "--set", "federation.eval_every=1"])
    err = capsys.readouterr().err
    (group,) = (tmp_path / "runs").iterdir()
    assert code == 130
    assert "seed group stopped at once (at seed 1)" in err and "finished seeds: 0" in err and "still to run: 2" in err
    assert f"Resume the group with: rayfed-proto run --resume {group}" in err
    runs = json.loads((group / "seeds.json").read_text())["runs"]
    assert [runs[s]["status"] for s in ("0", "1", "2")] == ["finished", "interrupted", "pending"]


def test_cli_methods_runs_each_method_over_the_seeds_and_names_the_compare_command(tmp_path, monkeypatch, capsys):
    from rayfed_proto.runtime import driver

    fake, calls = _fake_driver(fail_seeds=set())
    seen = []
    monkeypatch.setattr(driver, "run_experiment", lambda cfg, **kw: (seen.append(cfg.algorithm.name), fake(cfg, **kw))[1])
    common = ["--set", "tracking.enabled=false", "--set", f"tracking.output_dir={tmp_path / 'runs'}", "--set",
              "federation.rounds=2", "--set", "federation.eval_every=1", "--set", "tracking.experiment_name=methods"]
    code = main(["run", "--no-progress", "--methods", "fedproto", "fedsa", "--seeds", "0", "1", *common])
    out, _ = capsys.readouterr()
    assert code == 0 and seen == ["fedproto", "fedproto", "fedsa", "fedsa"] and [s for s, _ in calls] == [0, 1, 0, 1]
    assert "== fedproto ==" in out and "== fedsa ==" in out and "rayfed-proto compare methods" in out
    assert len(list((tmp_path / "runs").iterdir())) == 2  # one seed group per method
    # every method's config is checked before anything runs; algorithm.name is --methods' to set
    code, err = _cli(["run", "--methods", "fedproto", "nosuchmethod", *common], capsys)
    assert code == 2 and "nosuchmethod" in err and seen == ["fedproto", "fedproto", "fedsa", "fedsa"]
    code, err = _cli(["run", "--methods", "fedproto", "--set", "algorithm.name=fedsa", *common], capsys)
    assert code == 2 and "omit it with --methods" in err
    code, err = _cli(["run", "--methods", "fedproto", "fedproto", *common], capsys)
    assert code == 2 and "distinct algorithm names" in err


def test_the_end_of_a_run_prints_its_page_in_the_model_training_view_and_how_to_serve_it(tmp_path, monkeypatch, capsys):
    """Issue 38 item 1: a link that lands on the runs view and outlives the run."""
    from mlflow.tracking import MlflowClient

    from rayfed_proto.runtime import driver
    from rayfed_proto.runtime.run_state import RunResult

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("linked", artifact_location=(tmp_path / "a").as_uri())
    run_id = client.create_run(exp).info.run_id
    monkeypatch.setattr(driver, "run_experiment",
                        lambda cfg, **kw: RunResult(run_id, uri, tmp_path, 2, [], summary="the summary"))
    assert main(["run", "--no-progress", "--set", f"tracking.tracking_uri={uri}"]) == 0
    out = capsys.readouterr().out
    assert f"MLflow: run {run_id} in experiment " in out
    assert f"; browse with: rayfed-proto ui --tracking-uri {uri}, " \
           f"then open http://127.0.0.1:5000/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning" in out
