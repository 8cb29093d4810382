"""Sweep files, trial placement groups, ranking and the best config (no Ray cluster needed)."""

import math
from pathlib import Path

import pytest
import yaml

from rayfed_proto.config import ConfigError, TrackingConfig, build_config, load_config
from rayfed_proto.runtime.resources import plan_resources
from rayfed_proto.tuning.mlflow_server import LOOPBACK, LocalMlflowServer, is_loopback_uri, server_command
from rayfed_proto.tuning.report import best_config, format_table, plot_metric_vs_params, rank_trials, write_best_yaml
from rayfed_proto.tuning.resources import check_fits_cluster, resolve_gpus_per_trial, trial_overrides
from rayfed_proto.tuning.spec import TrialResources, parse_distribution, parse_sweep
from rayfed_proto.tuning.trainable import TrialContext, absolute_paths, trial_config

ROOT = Path(__file__).resolve().parents[2]

BASE = {"data": {"name": "digits"}, "model": {"feature_dim": 32}, "algorithm": {"name": "fedproto"},
        "federation": {"mode": "sync", "num_clients": 4, "rounds": 3, "eval_every": 1}}


def sweep(**kw):
    raw = {"base": BASE, "search_space": {"algorithm.lam": {"choice": [0.1, 1.0]}}}
    raw.update(kw)
    return raw


def issues_of(raw, **kw):
    with pytest.raises(ConfigError) as e:
        parse_sweep(raw, "s.yaml", **kw)
    return e.value.issues


# --------------------------------------------------------------------------- distributions


def test_every_distribution_becomes_the_matching_tune_domain():
    from ray.tune.search.sample import Categorical, Float, Integer

    space = parse_sweep(sweep(search_space={
        "algorithm.lam": {"loguniform": [0.01, 10]},
        "training.lr": {"uniform": [0.001, 0.1]},
        "training.batch_size": {"randint": [4, 17]},
        "training.momentum": {"quniform": [0.0, 0.9, 0.1]},
        "federation.rounds": {"quniform": [2, 6, 2]},
        "training.optimizer": {"choice": ["sgd", "adam"]},
        "seed": {"grid": [0, 1, 2]},
    }, num_samples=2), "s.yaml").param_space()
    lam, lr, bs, mom, rounds, opt, seed = (space[k] for k in ("algorithm.lam", "training.lr", "training.batch_size",
                                                               "training.momentum", "federation.rounds",
                                                               "training.optimizer", "seed"))
    assert isinstance(lam, Float) and (lam.lower, lam.upper) == (0.01, 10) and type(lam.get_sampler()).__name__ == "_LogUniform"
    assert isinstance(lr, Float) and type(lr.get_sampler()).__name__ == "_Uniform"
    assert isinstance(bs, Integer) and (bs.lower, bs.upper) == (4, 17)
    assert isinstance(mom, Float) and mom.get_sampler().q == 0.1
    assert isinstance(rounds, Integer)  # integer steps sample ints, so int keys accept them
    assert isinstance(opt, Categorical) and opt.categories == ["sgd", "adam"]
    assert seed == {"grid_search": [0, 1, 2]}


def test_grid_multiplies_num_samples():
    spec = parse_sweep(sweep(search_space={"algorithm.lam": {"grid": [0.1, 1, 10]}, "seed": {"grid": [0, 1]}},
                             num_samples=2), "s.yaml")
    assert spec.num_trials == 12


def test_exponent_without_a_dot_is_a_number_for_bounds():
    # YAML reads 1e-3 as a string; a bound is still a number
    raw = yaml.safe_load("search_space: {algorithm.lam: {loguniform: [1e-3, 1e+1]}}")
    dist, issues = parse_distribution("algorithm.lam", raw["search_space"]["algorithm.lam"])
    assert not issues and dist.args == (0.001, 10.0)


@pytest.mark.parametrize("spec, allowed", [
    ({"uniform": [1.0, 1.0]}, "low < high"),
    ({"uniform": [2, 1]}, "low < high"),
    ({"loguniform": [0, 1]}, "0 < low < high"),
    ({"loguniform": [-1, 1]}, "0 < low < high"),
    ({"randint": [0.5, 3]}, "integer bounds"),
    ({"randint": [3, 3]}, "low < high"),
    ({"quniform": [0, 1, 0]}, "q > 0"),
    ({"quniform": [0, 1, 2]}, "at most high - low"),
    ({"quniform": [0, 1]}, "[low, high, q]"),
    ({"uniform": ["a", 1]}, "must be numbers"),
    ({"choice": []}, "non-empty list"),
    ({"normal": [0, 1]}, "distribution one of choice, grid, uniform, loguniform, randint, quniform"),
    (0.5, "a mapping with one of"),
    ({"choice": [1], "grid": [2]}, "a mapping with one of"),
])
def test_bad_distributions_name_key_value_and_what_is_allowed(spec, allowed):
    issues = issues_of(sweep(search_space={"algorithm.lam": spec}))
    assert len(issues) == 1
    assert issues[0].key == "search_space.algorithm.lam" and issues[0].value == spec
    assert allowed in issues[0].allowed


# --------------------------------------------------------------------------- sweep errors


def test_unknown_sweep_key_and_bad_scheduler_are_reported_together():
    issues = issues_of(sweep(num_sample=3, scheduler={"name": "hyperband"}, metric="acc",
                             search_space={"algorithm.lam": {"loguniform": [0, 1]}}))
    by_key = {i.key: i for i in issues}
    assert "0 < low < high" in by_key["search_space.algorithm.lam"].allowed  # one report, all problems
    assert by_key["num_sample"].allowed == "unknown key"
    assert "fifo" in by_key["scheduler.name"].allowed and "asha" in by_key["scheduler.name"].allowed
    assert "head_acc" in by_key["metric"].allowed


def test_swept_key_that_is_not_a_config_key():
    issues = issues_of(sweep(search_space={"model.feature_dims": {"choice": [32]}, "federation.mode.x": {"choice": [1]}}))
    assert {i.key for i in issues} == {"search_space.model.feature_dims", "search_space.federation.mode.x"}
    assert all("a config key" in i.allowed for i in issues)


SYSTEM_BASE = {**BASE, "system": {"speed": {"kind": "lognormal"}, "availability": {"kind": "probability"}}}


@pytest.mark.parametrize("key,dist", [
    ("system.speed.sigma", {"uniform": [0, 2]}),              # a branch of the speed union (lognormal)
    ("system.availability.p", {"uniform": [0.5, 1]}),         # a branch of the availability union
    ("system.availability.retry_s", {"choice": [10, 60]}),
    ("system.upload_bytes_per_s", {"loguniform": [1e5, 1e7]}),  # Optional[float] in Optional[SystemConfig]
    ("system.speed.kind", {"choice": ["lognormal", "constant"]}),  # the discriminator itself
    ("system.cost_per_sample.cnn", {"choice": [1e-3, 2e-3]}),     # a key of a mapping field
])
def test_system_keys_are_sweepable(key, dist):
    spec = parse_sweep(sweep(base=SYSTEM_BASE, search_space={key: dist}), "s.yaml")
    assert list(spec.space) == [key]


def test_misspelt_system_keys_are_refused_naming_the_key():
    issues = issues_of(sweep(base=SYSTEM_BASE, search_space={
        "system.speed.sigmaa": {"uniform": [0, 2]}, "system.bogus": {"choice": [1]},
        "system.availability.sigma": {"choice": [1.0]},  # a field of another union (speed), not availability
        "system.upload_bytes_per_s.x": {"choice": [1.0]}}))
    assert {i.key for i in issues} == {"search_space.system.speed.sigmaa", "search_space.system.bogus",
                                       "search_space.system.availability.sigma",
                                       "search_space.system.upload_bytes_per_s.x"}
    assert all("a config key" in i.allowed for i in issues)


def test_swept_field_of_another_union_branch_than_the_base_kind_fails_in_the_trial_check():
    # sigma is a field of the lognormal speed only: with kind constant the trial configs are refused
    issues = issues_of(sweep(base={**BASE, "system": {"speed": {"kind": "constant"}}},
                             search_space={"system.speed.sigma": {"uniform": [0, 2]}}))
    assert {i.key for i in issues} == {"system.speed.sigma"} and "unknown key" in issues[0].allowed
    # a mapping key is free for the schema, but the build checks the architecture name
    issues = issues_of(sweep(base=SYSTEM_BASE, search_space={"system.cost_per_sample.cnnn": {"choice": [1e-3]}}))
    assert issues[0].key == "system.cost_per_sample.cnnn" and "architecture names" in issues[0].allowed


def test_swept_algorithm_option_of_another_method_names_the_accepted_options():
    issues = issues_of(sweep(search_space={"algorithm.margin_threshold": {"choice": [1.0]}}))
    assert issues[0].key == "algorithm.margin_threshold"
    assert "not an option of fedproto (it belongs to" in issues[0].allowed and "fedproto accepts: lam" in issues[0].allowed


def test_every_trial_config_is_checked_at_the_bounds():
    # lam >= 0: the lower bound makes an invalid trial, reported with the trial's values
    issues = issues_of(sweep(search_space={"algorithm.lam": {"uniform": [-1, 1]}}))
    assert issues[0].key == "algorithm.lam" and issues[0].value == -1.0
    assert "greater than or equal to 0" in issues[0].allowed and "algorithm.lam=-1.0" in issues[0].allowed
    # a cross-field rule reached only by one corner: eval_every > rounds
    issues = issues_of(sweep(search_space={"federation.rounds": {"randint": [1, 5]}},
                             base={**BASE, "federation": {**BASE["federation"], "eval_every": 2}}))
    assert issues[0].key == "federation.eval_every" and "at most federation.rounds (1)" in issues[0].allowed


def test_resources_and_tracking_are_not_sweepable():
    issues = issues_of(sweep(search_space={"resources.client_num_cpus": {"choice": [1]},
                                           "tracking.experiment_name": {"choice": ["a"]}}))
    assert len(issues) == 2 and all("not sweepable" in i.allowed for i in issues)


def test_grid_with_optuna_is_refused():
    issues = issues_of(sweep(search_space={"algorithm.lam": {"grid": [0.1, 1]}}, searcher={"name": "optuna"}))
    assert issues[0].key == "searcher" and "choice instead of grid" in issues[0].allowed


def test_bad_base_is_reported_under_base():
    issues = issues_of(sweep(base={**BASE, "federation": {"participation": 2}}))
    assert issues[0].key == "base.federation.participation" and issues[0].value == 2
    issues = issues_of(sweep(base="no_such_preset"))
    assert issues[0].key == "base" and "a preset name" in issues[0].allowed


def test_base_preset_set_and_cli_overrides():
    spec = parse_sweep(sweep(base="fedsa_digits", set={"federation.rounds": 7},
                             search_space={"algorithm.alpha": {"choice": [0.9]}}), "s.yaml",
                       overrides=["federation.num_clients=6"])
    assert spec.base_config.algorithm.name == "fedsa"
    assert spec.base_config.federation.rounds == 7 and spec.base_config.federation.num_clients == 6


def test_buffer_larger_than_a_trials_concurrency_is_refused_before_ray():
    base = {**BASE, "federation": {"mode": "async", "num_clients": 4, "rounds": 3, "eval_every": 1, "buffer_size": 3}}
    issues = issues_of(sweep(base=base, trial_resources={"client_actors": 2}))
    assert issues[0].key == "federation.buffer_size" and "trial's concurrency (2" in issues[0].allowed


# --------------------------------------------------------------------------- shipped sweeps


def _sweep_files():
    return sorted((ROOT / "tune_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", _sweep_files(), ids=lambda p: p.name)
def test_shipped_sweep_files_validate(path):
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.tuning.spec import load_sweep

    method = path.stem.split("_")[0]
    if method not in ALGORITHMS:  # a sweep shipped ahead of its method (fedprotokd while it is written)
        pytest.skip(f"{method} is not registered yet")
    spec = load_sweep(path)
    assert spec.num_trials >= 2
    if path.stem.endswith("_cpu"):
        assert spec.base_config.data.name == "digits" and spec.file.trial_resources.gpus_per_trial == "auto"


def test_every_sweep_has_a_cpu_variant():
    names = {p.stem for p in _sweep_files()}
    assert {"fedsa_lambda", "fedproto_lambda", "fedtgp_lambda", "fedsa_alpha", "fedprotokd_zeta", "fedtgp_tau",
            "fedsap_s", "fedsap_warmup"} <= names
    assert all(f"{n}_cpu" in names for n in names if not n.endswith("_cpu"))


# --------------------------------------------------------------------------- placement groups


def _trial_cfg(**fed):
    return build_config({**BASE, "federation": {**BASE["federation"], **fed}})


def test_cpu_only_bundles_driver_server_and_one_per_client_actor():
    cfg = _trial_cfg(num_clients=4)
    plan = trial_overrides(cfg, TrialResources(driver_cpus=0.25, server_cpus=0.25, client_cpus=0.25, client_actors=2), 0.0)
    assert plan.bundles == [{"CPU": 0.25}] * 4
    assert plan.num_actors == 2 and plan.clients_per_actor == 2 and plan.concurrency == 2
    assert plan.overrides["resources.client_num_gpus"] == 0.0 and plan.overrides["resources.server_num_gpus"] == 0.0


def test_gpu_bundles_split_the_trials_gpus_over_server_and_clients():
    cfg = _trial_cfg(num_clients=5)  # 5 clients, 3 actors wanted -> 2 per actor -> 3 actors
    plan = trial_overrides(cfg, TrialResources(driver_cpus=1, server_cpus=1, client_cpus=0.5, client_actors=3), 1.0)
    assert plan.num_actors == 3 and plan.clients_per_actor == 2
    assert plan.bundles[0] == {"CPU": 1.0}  # the driver holds no GPU
    assert plan.bundles[1] == {"CPU": 1.0, "GPU": 0.25}
    assert plan.bundles[2:] == [{"CPU": 0.5, "GPU": 0.25}] * 3
    assert math.isclose(plan.gpus(), 1.0)


def test_the_actors_the_driver_creates_fit_exactly_in_the_bundles():
    """The trial config's fixed resources.* make the driver's own plan ask for exactly the
    bundles, whatever the cluster's totals (plan_resources sees the whole cluster)."""
    ctx = TrialContext(sweep_name="s", base_raw={**BASE, "federation": {**BASE["federation"], "num_clients": 7}},
                       space_keys=["algorithm.lam"], trial_resources={"client_actors": 3, "client_cpus": 0.5},
                       gpus_per_trial=0.5, metric="eval/head_acc", tracking_uri="http://127.0.0.1:5000",
                       parent_run_id="p", output_dir="/tmp/out", driver_pin={"node:10.0.0.1": 0.001})
    cfg, plan = trial_config(ctx, {"algorithm.lam": 0.3}, run_name="s-1")
    for cluster_cpus, cluster_gpus in ((2, 2), (64, 8)):
        run_plan = plan_resources(cfg, cluster_cpus, cluster_gpus)
        assert run_plan.num_actors == len(plan.bundles) - 2
        assert {"CPU": run_plan.server_num_cpus, "GPU": run_plan.server_num_gpus} == plan.bundles[1]
        assert all({"CPU": run_plan.client_num_cpus, "GPU": run_plan.client_num_gpus} == b for b in plan.bundles[2:])
        assert run_plan.concurrency == plan.concurrency and run_plan.torch_threads == 1
    assert plan.bundles[0] == {"CPU": 0.25, "node:10.0.0.1": 0.001}
    assert cfg.algorithm.options()["lam"] == 0.3
    assert cfg.tracking.parent_run_id == "p" and cfg.tracking.tracking_uri == "http://127.0.0.1:5000"
    assert cfg.tracking.run_name == "s-1" and cfg.tracking.output_dir == "/tmp/out"


def test_gpus_per_trial_auto():
    assert resolve_gpus_per_trial("auto", 0, 2) == 0.0
    assert resolve_gpus_per_trial("auto", 2, 2) == 1.0
    assert resolve_gpus_per_trial("auto", 1, 3) == 0.33
    assert resolve_gpus_per_trial("auto", 8, 2) == 1.0
    assert resolve_gpus_per_trial(0.5, 8, 2) == 0.5


def test_a_trial_larger_than_the_cluster_is_refused_not_left_waiting():
    plan = trial_overrides(_trial_cfg(num_clients=4), TrialResources(client_cpus=1, server_cpus=1, driver_cpus=1,
                                                                     client_actors=4), 0.0)
    issues = check_fits_cluster(plan, [{"CPU": 2.0}], {"CPU": 2.0})
    assert issues and issues[0].key == "trial_resources" and "2 CPUs" in issues[0].allowed
    small = trial_overrides(_trial_cfg(num_clients=4), TrialResources(), 0.0)
    assert check_fits_cluster(small, [{"CPU": 2.0}], {"CPU": 2.0}) == []


def test_relative_data_paths_become_absolute(tmp_path):
    raw = {"data": {"root": "./data", "path": "sets/x.npz"}}
    absolute_paths(raw, tmp_path)
    assert raw["data"] == {"root": str(tmp_path / "data"), "path": str(tmp_path / "sets" / "x.npz")}


# --------------------------------------------------------------------------- ranking and best config


def test_rank_puts_best_first_and_trials_without_a_value_last():
    rows = [{"trial": "a", "eval/head_acc": 0.5}, {"trial": "b", "eval/head_acc": None}, {"trial": "c", "eval/head_acc": 0.9},
            {"trial": "d", "eval/head_acc": float("nan")}, {"trial": "e", "eval/head_acc": 0.7}]
    assert [r["trial"] for r in rank_trials([dict(r) for r in rows], "eval/head_acc", "max")][:3] == ["c", "e", "a"]
    ranked = rank_trials([dict(r) for r in rows], "eval/head_acc", "min")
    assert [r["trial"] for r in ranked][:3] == ["a", "e", "c"] and [r["rank"] for r in ranked] == [1, 2, 3, 4, 5]
    table = format_table(ranked, ["algorithm.lam"], "eval/head_acc")
    assert table.splitlines()[0].split()[:3] == ["rank", "trial", "algorithm.lam"]


def test_best_config_is_a_runnable_yaml_with_the_best_values(tmp_path):
    spec = parse_sweep(sweep(base={**BASE, "tracking": {"output_dir": "runs"}},
                             search_space={"algorithm.lam": {"loguniform": [0.01, 10]},
                                           "algorithm.alignment_schedule.length": {"randint": [1, 5]}}), "s.yaml")
    best = {"trial": "t1", "algorithm.lam": 0.37, "algorithm.alignment_schedule.length": 3, "eval/head_acc": 0.8, "version": 3}
    cfg = best_config(spec, {k: best[k] for k in spec.space}, "sqlite:////abs/mlflow.db")
    path = write_best_yaml(tmp_path / "best.yaml", cfg, spec, best, "eval/head_acc")
    loaded = load_config(path)  # what `rayfed-proto run best.yaml` does first
    assert loaded.algorithm.options()["lam"] == 0.37 and loaded.algorithm.options()["alignment_schedule"]["length"] == 3
    assert loaded.tracking.tracking_uri == "sqlite:////abs/mlflow.db" and loaded.tracking.parent_run_id is None
    assert loaded.resources.client_num_cpus == "auto"  # the base's resources, not a trial's bundle shares
    assert path.read_text().startswith("# Best trial of sweep s")


def test_plot_of_metric_vs_swept_params(tmp_path):
    spec = parse_sweep(sweep(search_space={"algorithm.lam": {"loguniform": [0.01, 10]},
                                           "training.optimizer": {"choice": ["sgd", "adam"]}}), "s.yaml")
    rows = [{"algorithm.lam": 0.1, "training.optimizer": "sgd", "eval/head_acc": 0.5, "eval/head_acc_best": 0.6},
            {"algorithm.lam": 1.0, "training.optimizer": "adam", "eval/head_acc": None, "eval/head_acc_best": float("nan")}]
    out = plot_metric_vs_params(rows, spec.space, "eval/head_acc", tmp_path / "p.png")
    assert out.stat().st_size > 1000


# --------------------------------------------------------------------------- MLflow


def test_local_mlflow_server_binds_loopback_only(tmp_path):
    cmd = server_command(f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "art", 5055)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "0.0.0.0" not in cmd
    assert cmd[cmd.index("--workers") + 1] == "1"  # one process writes the sqlite file
    server = LocalMlflowServer(f"sqlite:///{tmp_path / 'm.db'}")
    assert server.host == LOOPBACK and server.uri.startswith("http://127.0.0.1:")
    assert is_loopback_uri(server.uri) and not is_loopback_uri("http://10.0.0.5:5000")


def test_tracker_starts_the_run_as_a_child_of_parent_run_id(tmp_path):
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("nest")
    parent = client.create_run(exp, run_name="sweep").info.run_id
    tracker = MlflowTracker(TrackingConfig(tracking_uri=uri, experiment_name="nest", parent_run_id=parent))
    child = tracker.start({"a": 1}, tags={"algorithm": "x"})
    tracker.end()
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["algorithm"] == "x"
    plain = MlflowTracker(TrackingConfig(tracking_uri=uri, experiment_name="nest"))
    run_id = plain.start({})
    plain.end()
    assert "mlflow.parentRunId" not in client.get_run(run_id).data.tags


def test_closing_a_sweep_marks_stopped_trials_killed_and_keeps_real_failures(tmp_path):
    """A trial killed with an interrupted sweep may end its run RUNNING or FAILED (actors torn
    down under it): both become KILLED; a trial Tune recorded as errored stays FAILED."""
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tuning.sweep import _close_children

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    spec = parse_sweep(sweep(), "s.yaml")
    exp = client.create_experiment(spec.base_config.tracking.experiment_name)
    parent = client.create_run(exp, run_name="s").info.run_id
    runs = {}
    for trial, status in [("a_00000", "FINISHED"), ("a_00001", "RUNNING"), ("a_00002", "FAILED"), ("a_00003", "FAILED")]:
        # run names: the swept values, the method, then <sweep>-<trial id> (trial_run_name)
        run_id = client.create_run(exp, run_name=f"lam=0.1 fedproto s-{trial}", tags={"mlflow.parentRunId": parent}).info.run_id
        if status != "RUNNING":
            client.set_terminated(run_id, status=status)
        runs[trial] = run_id
    outsider = client.create_run(exp, run_name="s-a_00009").info.run_id  # not a child of this sweep

    _close_children(client, spec, parent, errored={"a_00003"})
    got = {t: client.get_run(r).info.status for t, r in runs.items()}
    assert got == {"a_00000": "FINISHED", "a_00001": "KILLED", "a_00002": "KILLED", "a_00003": "FAILED"}
    assert client.get_run(runs["a_00002"]).data.tags["rayfed_proto.stopped"].startswith("by the Tune scheduler")
    assert client.get_run(outsider).info.status == "RUNNING"

    client.set_terminated(runs["a_00002"], status="FAILED")
    _close_children(client, spec, parent, errored=None)  # trial states unknown: a FAILED run may be a real failure
    assert client.get_run(runs["a_00002"]).info.status == "FAILED"


def test_a_trial_resumes_the_newest_unfinished_run_with_a_complete_checkpoint(tmp_path):
    from rayfed_proto.runtime.checkpoint import CheckpointStore
    from rayfed_proto.tuning.trainable import resumable_run, trial_output_dir

    ctx = TrialContext(sweep_name="s", base_raw=BASE, space_keys=[], trial_resources={}, gpus_per_trial=0.0,
                       metric="eval/head_acc", tracking_uri=None, parent_run_id=None, output_dir=str(tmp_path),
                       experiment_name="s-20261121-120000")
    folder = trial_output_dir(ctx, "abc_00001")
    assert folder == tmp_path / "s-20261121-120000" / "abc_00001"
    cfg = build_config(BASE)
    assert resumable_run(folder, cfg) is None  # never ran

    def run_folder(name: str, checkpoint: bool, finished: bool = False):
        d = folder / name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("{}")
        (d / "partition.parquet").write_bytes(b"")
        if checkpoint:
            CheckpointStore(d / "checkpoints").save(3, server={}, clients=[], actor_rng={}, driver={}, run_id="r")
        if finished:
            (d / "summary.txt").write_text("done")
        return d

    run_folder("20261121-120001-000000-fedproto-digits", checkpoint=True, finished=True)
    assert resumable_run(folder, cfg) is None  # the newest run finished: nothing to continue
    newest = run_folder("20261121-120002-000000-fedproto-digits", checkpoint=False)
    assert resumable_run(folder, cfg) is None  # stopped before its first checkpoint: start again
    (newest / "checkpoints" / ".tmp-v000002-1-1").mkdir(parents=True)  # a save cut short is not a checkpoint
    assert resumable_run(folder, cfg) is None
    CheckpointStore(newest / "checkpoints").save(2, server={}, clients=[], actor_rng={}, driver={}, run_id="r")
    assert resumable_run(folder, cfg) == newest


def test_cli_tune_check_exit_codes(tmp_path, capsys):
    from rayfed_proto.cli import main

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(sweep(num_samples=3)))
    assert main(["tune", str(good), "--check"]) == 0
    assert "sweep OK: good, 3 trials" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep(search_space={"algorithm.lam": {"uniform": [1, 0]}})))
    assert main(["tune", str(bad), "--check"]) == 2
    assert "search_space.algorithm.lam" in capsys.readouterr().err
    assert main(["tune"]) == 2


def test_asha_counts_server_versions_and_defaults_max_t_to_rounds():
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from rayfed_proto.tuning.sweep import _scheduler

    spec = parse_sweep(sweep(scheduler={"name": "asha", "grace_period": 2, "reduction_factor": 3}), "s.yaml")
    asha = _scheduler(spec)
    assert isinstance(asha, ASHAScheduler) and asha._time_attr == "version"
    assert asha._max_t == spec.base_config.federation.rounds and asha._reduction_factor == 3
    assert isinstance(_scheduler(parse_sweep(sweep(), "s.yaml")), FIFOScheduler)


def test_optuna_searcher_is_built_with_its_seed():
    from ray.tune.search.optuna import OptunaSearch

    from rayfed_proto.tuning.sweep import _searcher

    spec = parse_sweep(sweep(searcher={"name": "optuna", "seed": 3}), "s.yaml")
    assert isinstance(_searcher(spec), OptunaSearch)
    assert _searcher(parse_sweep(sweep(), "s.yaml")) is None


def test_a_driver_pinned_to_a_cpu_less_head_is_refused_with_the_fix():
    head = {"CPU": 0.0, "node:10.0.0.1": 1.0}
    worker = {"CPU": 8.0, "GPU": 1.0, "node:10.0.0.2": 1.0}
    plan = trial_overrides(_trial_cfg(num_clients=4), TrialResources(), 0.5, driver_pin={"node:10.0.0.1": 0.001})
    issues = check_fits_cluster(plan, [head, worker], {"CPU": 8.0, "GPU": 1.0})
    assert issues[0].key == "trial_resources.driver_cpus" and "driver_cpus: 0" in issues[0].allowed
    plan = trial_overrides(_trial_cfg(num_clients=4), TrialResources(driver_cpus=0), 0.5, driver_pin={"node:10.0.0.1": 0.001})
    assert plan.bundles[0] == {"node:10.0.0.1": 0.001}
    assert check_fits_cluster(plan, [head, worker], {"CPU": 8.0, "GPU": 1.0}) == []


def test_a_trials_source_is_the_command_and_its_tracking_uri_tag_the_store():
    """Issue 49: the trials' Source was Ray's default_worker.py, their tracking.tracking_uri the
    sweep's temporary server (dead once the sweep ends), and MLflow printed links to it."""
    import json

    from rayfed_proto.tuning.trainable import TrialContext, trial_context_env, trial_run_tags

    ctx = TrialContext(sweep_name="s", base_raw=BASE, space_keys=[], trial_resources={}, gpus_per_trial=0.0,
                       metric="eval/head_acc", tracking_uri="http://127.0.0.1:5123", parent_run_id="p",
                       output_dir="/o", store_uri="sqlite:////tmp/x/mlflow.db", source="sweeps/lam.yaml")
    env = trial_context_env(ctx)
    assert json.loads(env["MLFLOW_RUN_CONTEXT"])["mlflow.source.name"] == "rayfed-proto tune sweeps/lam.yaml"
    assert env["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
    assert trial_run_tags(ctx) == {"tracking.tracking_uri": "sqlite:////tmp/x/mlflow.db",
                                   "tracking.server_uri": "http://127.0.0.1:5123"}
    remote = TrialContext(**{**ctx.__dict__, "tracking_uri": "https://mlflow.example", "store_uri": "https://mlflow.example"})
    assert trial_run_tags(remote) == {}  # a lasting server: the config's URI is the store


def test_the_best_trial_is_marked_in_the_run_list_and_a_former_best_unmarked(tmp_path):
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tuning.sweep import BEST_TAG, _mark_best_trial, best_trial_name

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "a"))
    parent = client.create_run(exp, run_name="sw").info.run_id
    kids = [client.create_run(exp, run_name=f"lam={v} fedsa sw-{v}", tags={"mlflow.parentRunId": parent}).info.run_id
            for v in (1, 2)]
    _mark_best_trial(client, parent, kids[0], "eval/head_acc")
    assert client.get_run(kids[0]).info.run_name == "[best] lam=1 fedsa sw-1" == best_trial_name("[best] lam=1 fedsa sw-1")
    assert client.get_run(kids[0]).data.tags[BEST_TAG] == "true"
    _mark_best_trial(client, parent, kids[1], "eval/head_acc")  # a resumed sweep found a better one
    assert [client.get_run(k).info.run_name for k in kids] == ["lam=1 fedsa sw-1", "[best] lam=2 fedsa sw-2"]
    assert BEST_TAG not in client.get_run(kids[0]).data.tags
