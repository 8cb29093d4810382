"""A sweep's plan (issue 37, item 5): computed once per ``run_sweep`` and read by whoever needs it
(the cluster check, the autoscaler request and its narrowing). No Ray cluster: the capacity, the
request, Tune's run and the summary are faked; the trial configs are real."""

from types import SimpleNamespace

import pytest
from ray import tune

from rayfed_proto.config import ConfigError
from rayfed_proto.runtime.autoscale import Capacity
from rayfed_proto.tuning import plan as plan_mod
from rayfed_proto.tuning import sweep as sweep_mod
from rayfed_proto.tuning.spec import corner_values, parse_sweep
from rayfed_proto.tuning.trainable import trial_config

BASE = {"data": {"name": "digits"}, "model": {"feature_dim": 32}, "algorithm": {"name": "fedproto"},
        "federation": {"mode": "sync", "num_clients": 4, "rounds": 3, "eval_every": 1}, "tracking": {"enabled": False}}
ONE_TRIAL = [{"CPU": 0.25}] * 4  # driver, server, 2 client actors (the default trial_resources)


def spec_of(tmp_path, **kw):
    raw = {"base": BASE, "search_space": {"algorithm.lam": {"choice": [0.1, 1.0]}}, "num_samples": 3,
           "max_concurrent_trials": 2, "storage_path": str(tmp_path / "tune")}
    return parse_sweep({**raw, **kw}, "s.yaml", tmp_path)


@pytest.fixture
def fakes(monkeypatch):
    """Counts the capacity reads and trial builds of the plan; records the autoscaler request,
    its withdrawal and the callbacks Tune would get; Tune's run yields no trial."""
    seen = SimpleNamespace(capacity=0, trial_configs=0, requests=[], withdrawn=0, callbacks=None,
                           cluster=Capacity(8.0, 0.0, [{"CPU": 8.0}]))

    def capacity(resources):
        seen.capacity += 1
        return seen.cluster

    def counted_trial_config(ctx, values, *a, **kw):
        seen.trial_configs += 1
        return trial_config(ctx, values, *a, **kw)

    def tuner(spec, trainable, exp_path, resume, stop, verbose, echo, callbacks=None):
        seen.callbacks = callbacks
        return SimpleNamespace(fit=lambda: [])

    monkeypatch.setattr(plan_mod, "capacity", capacity)
    monkeypatch.setattr(plan_mod, "trial_config", counted_trial_config)
    monkeypatch.setattr(plan_mod, "request_if_short", lambda bundles: seen.requests.append(bundles) or True)
    monkeypatch.setattr(sweep_mod, "withdraw_request", lambda: setattr(seen, "withdrawn", seen.withdrawn + 1))
    monkeypatch.setattr(sweep_mod, "_connect_ray", lambda address, spec: None)
    monkeypatch.setattr(sweep_mod, "_tuner", tuner)
    monkeypatch.setattr(sweep_mod, "_summarise", lambda grid, spec, exp_path, *a: sweep_mod.SweepResult(exp_path, None, None))
    monkeypatch.setattr(sweep_mod, "_interrupted", lambda exp_path, ranked: False)
    monkeypatch.setattr(tune, "with_resources", lambda trainable, resources: trainable)
    return seen


def test_run_sweep_reads_the_capacity_once_and_builds_each_corner_trial_once(fakes, tmp_path):
    spec = spec_of(tmp_path)
    sweep_mod.run_sweep(spec, verbose=0, echo=lambda s: None)
    assert fakes.capacity == 1
    assert fakes.trial_configs == len(corner_values(spec.space)) == 2  # the cluster check's; the bundles are read
    (narrow,) = fakes.callbacks
    assert narrow.trial_bundles == ONE_TRIAL and (narrow.concurrent, narrow.num_trials) == (2, 3)
    assert fakes.requests == [ONE_TRIAL * 2]  # the same bundles, for max_concurrent_trials trials
    assert fakes.withdrawn == 1


def test_a_sweep_the_cluster_cannot_hold_is_refused_before_asking_for_nodes(fakes, tmp_path):
    fakes.cluster = Capacity(0.5, 0.0, [{"CPU": 0.5}])
    with pytest.raises(ConfigError) as e:
        sweep_mod.run_sweep(spec_of(tmp_path), verbose=0, echo=lambda s: None)
    assert e.value.source == "s.yaml (against the cluster)"
    assert len(e.value.issues) == 1 and e.value.issues[0].key == "trial_resources"  # both corners: one issue
    assert fakes.capacity == 1 and fakes.requests == [] and fakes.withdrawn == 0


def test_the_plan_resolves_gpus_per_trial_against_the_capacity_it_read(fakes, tmp_path):
    fakes.cluster = Capacity(8.0, 1.0, [{"CPU": 8.0, "GPU": 1.0}])
    spec = spec_of(tmp_path, num_samples=1)  # one trial: max_concurrent_trials 2 asks for one trial's group
    plan = plan_mod.plan_sweep(spec, spec.base_raw, tracking_uri=None, parent_run_id=None, output_dir=str(tmp_path),
                               driver_pin={}, experiment_name="s")
    assert fakes.capacity == 1 and plan.capacity is fakes.cluster
    assert plan.ctx.gpus_per_trial == 0.5 and plan.concurrent == 1  # auto: 1 GPU / max_concurrent_trials
    assert [p.bundles for p in plan.corner_plans] == [trial_config(plan.ctx, v)[1].bundles for v in corner_values(spec.space)]
    assert plan.trial_bundles == plan.corner_plans[0].bundles and plan.trial_bundles[1]["GPU"] > 0
    assert plan_mod.request_for_trials(plan) and fakes.requests == [plan.trial_bundles]
