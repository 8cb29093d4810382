"""A run and a two-trial sweep that start on an autoscaling cluster with zero workers (a head with
CPU 0 and Ray's fake multi-node autoscaler, see fakecluster.py) and finish once the autoscaler has
added the nodes they asked for.

This module's name sorts before every other integration module: its tests pass when they are the
first Ray clusters this pytest process connects to; run after test_multinode.py's cluster in the
same process, the actors they create were cancelled ("Actor creation cancelled") before any node
was launched, a cause not found yet (see docs/cluster.md).
"""

import shutil

import pytest
import ray
from fakecluster import FakeAutoscalingHead, outside_shared_ray
from test_multinode import QUIET, SMALL, SPREAD, _client_nodes, _workers_alive

from rayfed_proto.config import build_config
from rayfed_proto.runtime.driver import run_experiment

pytestmark = pytest.mark.integration


@pytest.fixture
def autoscaling():
    """A head with CPU 0 and an autoscaler that may add up to two 2-CPU workers (none at start):
    one per test (a fresh head is quicker than waiting for idle workers to be removed; and nodes
    holding placement-group bundles whose actors are still starting count as idle to the v1
    autoscaler, so a short idle timeout would remove them under the run)."""
    head = FakeAutoscalingHead({"CPU": 0}, {"cpu2": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0,
                                                      "max_workers": 2}}, max_workers=2, idle_timeout_minutes=10)
    with outside_shared_ray():
        head.start()
        try:
            ray.init(address=head.address, log_to_driver=False)
            yield head
        finally:
            ray.shutdown()
            head.stop()


class TestAutoscalingFromZero:
    def test_run_asks_for_nodes_and_finishes_on_them(self, autoscaling, tracking):
        assert ray.cluster_resources().get("CPU", 0) == 0 and not _workers_alive()
        _, track = tracking
        # the cluster reports 0 CPUs; the run plans for the 4 its workers will bring
        cfg = build_config({}, SMALL + SPREAD + track + ["federation.mode=sync", "federation.rounds=1", "resources.cluster_cpus=4"])
        result = run_experiment(cfg, **QUIET)
        assert result.final_version == 1
        assert len(_workers_alive()) == 2 and len(set(_client_nodes(result))) == 2

    def test_two_trial_sweep_starts_the_nodes_it_needs(self, autoscaling, tmp_path, empty_mlflow_store):
        from rayfed_proto.tuning.spec import parse_sweep
        from rayfed_proto.tuning.sweep import run_sweep

        assert not _workers_alive()
        # the sweep's MLflow server opens a store with its tables made (test_tune.py's interrupted sweep creates its own)
        shutil.copyfile(empty_mlflow_store, tmp_path / "mlflow.db")
        raw = {
            "name": "scale", "num_samples": 1, "max_concurrent_trials": 2, "storage_path": str(tmp_path / "tune"),
            "base": {"data": {"name": "digits", "partition": {"name": "dirichlet", "beta": 0.5, "min_samples": 20}},
                     "model": {"group": "small_hetero", "feature_dim": 32}, "algorithm": {"name": "fedproto"},
                     "federation": {"mode": "sync", "num_clients": 4, "rounds": 1, "eval_every": 1},
                     "resources": {"cluster_cpus": 2, "placement_timeout_s": 240},
                     "tracking": {"experiment_name": "scale", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                  "output_dir": str(tmp_path / "runs")}},
            "search_space": {"algorithm.lam": {"grid": [0.1, 1.0]}},
            # the sweep's own MLflow server listens on 127.0.0.1: trial drivers are pinned to its node, the
            # head, which has no CPUs (as on cluster.yaml's head): driver_cpus 0
            "trial_resources": {"driver_cpus": 0, "server_cpus": 0.25, "client_cpus": 0.25, "client_actors": 2},
        }
        result = run_sweep(parse_sweep(raw, "scale.yaml", tmp_path), verbose=0, echo=print)
        assert [r["status"] for r in result.ranked] == ["done", "done"]
        assert _workers_alive()  # the trials ran on workers the autoscaler added
