"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``): a job submitted with ``ray
job submit``, and a run whose actors span the worker nodes of a head with CPU 0, with a worker
node removed mid-run. The autoscaling tests are in test_autoscaling_from_zero.py.

These tests need clusters of their own: each class starts one (class-scoped, torn down after its
last test), with the suite's shared instance shut down meanwhile and restarted after
(``outside_shared_ray``). Nothing here stops Ray processes by name (``ray stop`` would end every
Ray instance on the machine): clusters are removed node by node, or by the pids of their processes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml
from fakecluster import free_port, local_cluster, outside_shared_ray
from mlflow.tracking import MlflowClient

from rayfed_proto.config import build_config
from rayfed_proto.runtime.driver import run_experiment

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["algorithm.name=fedproto", "data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20",
         "model.group=small_hetero", "model.feature_dim=32", "federation.num_clients=4", "federation.eval_every=1",
         "resources.clients_per_actor=1", "resources.placement_timeout_s=240"]
QUIET = {"progress": False, "echo": lambda s: None}


def _workers_alive() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]


def _client_nodes(result) -> list[str]:
    return [p["node_id"] for p in result.placements[:-1] if not p.get("dead")]


@pytest.fixture(scope="class")
def cluster():
    """Head with CPU 0 (and the dashboard, for job submission) + three 2-CPU worker nodes."""
    port = free_port()
    with outside_shared_ray(), local_cluster(
            {"num_cpus": 0, "include_dashboard": True, "dashboard_port": port, "dashboard_host": "127.0.0.1"},
            [{"num_cpus": 2}, {"num_cpus": 2}, {"num_cpus": 2}]) as c:
        c.dashboard_url = f"http://127.0.0.1:{port}"
        yield c


# 2.5 CPUs: PACK puts the server and three clients on one 2-CPU node and one client on another.
# (Shares are explicit: 'auto' splits the cluster's total, 1 + 4 x 0.75 = 4 CPUs on two 2-CPU
# nodes, which no placement fits: see docs/cluster.md, "Shares on several nodes".)
SPREAD = ["resources.client_num_cpus=0.5", "resources.server_num_cpus=0.5"]


class TestLocalCluster:
    def test_ray_job_submit_runs_the_cli(self, cluster, tmp_path):
        config = tmp_path / "job.yaml"
        raw: dict = {}
        for kv in SMALL + SPREAD + ["federation.mode=sync", "federation.rounds=1", f"tracking.output_dir={tmp_path / 'runs'}",
                                    f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]:
            key, value = kv.split("=", 1)
            node = raw
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = yaml.safe_load(value)
        config.write_text(yaml.safe_dump(raw))
        env = dict(os.environ)  # the job's driver authenticates to this cluster as the test process does
        runtime_env = {"env_vars": {"PYTHONPATH": str(ROOT)}}
        cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", cluster.dashboard_url,
               "--runtime-env-json", json.dumps(runtime_env), "--",
               str(Path(sys.executable).parent / "rayfed-proto"), "run", str(config), "--set", "resources.address=auto"]
        deadline = time.monotonic() + 120
        while True:  # the head's dashboard agent registers a while after the node starts (a loaded machine: long)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if "No available agent" not in done.stderr or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "succeeded" in done.stdout
        runs = list((tmp_path / "runs").iterdir())
        assert len(runs) == 1 and (runs[0] / "summary.txt").is_file()

    def test_actors_span_workers_without_data_files_and_survive_a_removed_node(self, cluster, tracking, tmp_path):
        uri, track = tracking
        absent = tmp_path / "no-data-here"  # digits is built in: only the driver loads it, workers never read files
        before: dict[str, str] = {}
        removed: list[str] = []

        def remove_a_client_node(version, metrics):
            if version != 1 or removed:
                return
            names = [n for n in ray.util.list_named_actors() if n.startswith("rayfed:")]
            before.update({n: ray.get(ray.get_actor(n).info.remote())["node_id"] for n in names})
            server_node = next(v for k, v in before.items() if ":server:" in k)
            victim = next(v for k, v in before.items() if ":client:" in k and v != server_node)
            cluster.remove_node(next(w for w in cluster.worker_nodes if w.node_id == victim), allow_graceful=False)
            removed.append(victim)

        cfg = build_config({}, SMALL + SPREAD + track + ["federation.mode=sync", "federation.rounds=3", "checkpoint.every=1",
                                                         f"data.root={absent}"])
        result = run_experiment(cfg, on_eval=remove_a_client_node, **QUIET)
        head = ray.get_runtime_context().get_node_id()  # the driver is on the head
        assert head not in before.values() and len(set(before.values())) == 2  # on two workers, none on the head
        assert removed and result.final_version == 3 and not absent.exists()
        assert result.history[-1]["reliability/client_failures"] >= 1  # survived as a dead actor is
        nodes = _client_nodes(result)
        assert len(nodes) == 4 and removed[0] not in nodes and head not in nodes  # recreated on the nodes that remain
        assert MlflowClient(uri).get_run(result.run_id).info.status == "FINISHED"
