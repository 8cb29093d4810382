"""Issue 37: a federation policy is a registered class that owns its mode. A round-robin policy,
defined here and registered from outside runtime/policies.py, is selected by federation.mode and
runs end to end on real Ray actors, its config rules checked by the config and its summary row
written; nothing else in the project was touched to add it."""

from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.runtime.policies import POLICIES, SyncRounds, clients_per_round

NUM_CLIENTS, PER_ROUND, ROUNDS = 6, 2, 3


class RoundRobin(SyncRounds):
    """Rounds over the clients in a fixed rotation (0, 1 | 2, 3 | 4, 5 | 0, 1 ...): every client
    takes part equally often, whatever the sampling stream."""

    @classmethod
    def build(cls, federation, clock, rng, real_slots) -> RoundRobin:
        return cls(federation.num_clients, clients_per_round(federation), rng, clock)

    @classmethod
    def config_issues(cls, federation, virtual_clock: bool):
        issues = super().config_issues(federation, virtual_clock)
        if federation.num_clients % clients_per_round(federation):
            issues.append(("federation.participation", federation.participation,
                           "a fraction whose round size divides federation.num_clients (round_robin)"))
        return issues

    def _sample(self) -> list[int]:
        start = getattr(self, "next_client", 0)
        self.next_client = (start + self.per_round) % self.num_clients
        return [(start + i) % self.num_clients for i in range(self.per_round)]

    def summary_rows(self, stats) -> dict[str, str]:
        return {**super().summary_rows(stats), "rotation": f"{self.per_round} clients per round, in client order"}


@pytest.fixture(scope="module")
def round_robin():
    POLICIES.add("round_robin", RoundRobin, "rounds over the clients in a fixed rotation (a test's policy)")
    yield
    POLICIES._items.pop("round_robin")  # the registry is process-wide: leave it as the other tests expect


def _overrides(track):
    return ["algorithm.name=fedproto", "data.name=digits", "model.group=small_hetero", "model.feature_dim=16",
            "federation.mode=round_robin", f"federation.num_clients={NUM_CLIENTS}",
            f"federation.participation={PER_ROUND / NUM_CLIENTS}", f"federation.rounds={ROUNDS}",
            f"federation.eval_every={ROUNDS}", "tracking.system_metrics=false", *track]


def test_a_policy_registered_outside_policies_py_is_checked_by_the_config(round_robin):
    assert "round_robin" in POLICIES.names()
    with pytest.raises(ConfigError) as refused:
        build_config({}, ["federation.mode=round_robin", "federation.num_clients=5", "federation.participation=0.4"])
    assert "federation.participation" in str(refused.value) and "round_robin" in str(refused.value)
    with pytest.raises(ConfigError, match="one of async, round_robin, sync"):
        build_config({}, ["federation.mode=round_robbin"])


def test_a_policy_registered_outside_policies_py_runs_end_to_end(round_robin, ray_session, tracking):
    uri, track = tracking
    result = run_experiment(build_config({}, _overrides(track)), progress=False, echo=lambda s: None)
    assert result.final_version == ROUNDS
    # the rotation, not a sample: rounds 1-3 took clients 0-1, 2-3, 4-5, one local update each
    assert result.client_updates == {c: 1 for c in range(NUM_CLIENTS)}
    assert "rotation" in result.summary and "round_robin" in result.summary
    run = MlflowClient(uri).get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mode"] == "round_robin"
    assert np.isfinite(run.data.metrics["eval/head_acc"])
