"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``): a job submitted with ``ray
job submit``, and a run whose actors span the worker nodes of a head with CPU 0, with a worker
node removed mid-run; the two shipped cluster shapes (issue 27): ``cluster.yaml``'s (a CPU-0
head, 8-CPU workers with one logical GPU each) and the KubeRay RayJob's (a CPU-0 head, two 4-CPU
workers) run the default experiment unchanged, with no resource setting, to its second version; a
failure before the first update leaves no autoscaler request behind; a run resumes from its
``file://`` checkpoint URI after its run folder was deleted. The autoscaling tests are in
test_autoscaling_from_zero.py.

These tests need clusters of their own: each class starts one (class-scoped, torn down after its
last test), with the suite's shared instance shut down meanwhile: once for the module, restarted
after its last test (``outside_shared_ray``; done per class, it was started again between two
clusters only to be shut down at once). Nothing here stops Ray processes by name (``ray stop``
would end every Ray instance on the machine): clusters are removed node by node, or by the pids
of their processes.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml
from fakecluster import free_port, local_cluster, outside_shared_ray, standing_request
from mlflow.tracking import MlflowClient

from rayfed_proto import cli
from rayfed_proto.config import build_config, load_config
from rayfed_proto.preset_files import default_config_path
from rayfed_proto.runtime.autoscale import NODE_TYPES_ENV
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.runtime.fleet import ActorFleet
from rayfed_proto.runtime.signals import RunInterrupted

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


@pytest.fixture(scope="module")
def no_shared_ray():
    """The suite's shared instance is down for this whole module (every class starts a cluster)."""
    with outside_shared_ray():
        yield


@pytest.fixture(scope="class")
def cluster(no_shared_ray):
    """Head with CPU 0 (and the dashboard, for job submission) + three 2-CPU worker nodes."""
    port = free_port()
    with local_cluster(
            {"num_cpus": 0, "include_dashboard": True, "dashboard_port": port, "dashboard_host": "127.0.0.1"},
            [{"num_cpus": 2}, {"num_cpus": 2}, {"num_cpus": 2}]) as c:
        c.dashboard_url = f"http://127.0.0.1:{port}"
        yield c


# The removed-node test leaves room for the bundles of a lost node: 2.5 CPUs, PACK puts the server
# and three clients on one 2-CPU node and one client on another, and the two nodes that remain
# can hold them all again. ('auto' plans 1 + 4 x 1 CPU over the three nodes: no room for a loss.)
SPREAD = ["resources.client_num_cpus=0.5", "resources.server_num_cpus=0.5"]


class TestLocalCluster:
    def test_ray_job_submit_runs_the_cli(self, cluster, tmp_path):
        config = tmp_path / "job.yaml"
        raw: dict = {}
        for kv in SMALL + ["federation.mode=sync", "federation.rounds=1", f"tracking.output_dir={tmp_path / 'runs'}",
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


# ----------------------------------------------------------------------------- the shipped cluster shapes
# The default experiment as `rayfed-proto run` runs it (the packaged preset), with only where its
# results go set, stopped (drained and checkpointed, as Ctrl-C does) after its second version: no
# resources.* key.
DEFAULT_TO_VERSION_2 = ["faults.stop_at_version=2"]


def _actor_nodes() -> dict[str, str]:
    """Named actor -> node id, for the run's actors alive now."""
    names = [n for n in ray.util.list_named_actors() if n.startswith("rayfed:")]
    return {n: ray.get(ray.get_actor(n).info.remote())["node_id"] for n in names}


def _launcher_file(tmp_path: Path, source: dict, max_workers: int) -> Path:
    """A copy of a launcher config whose worker types may grow to ``max_workers`` nodes in all:
    as many as the local cluster has (it is already as large as it gets), or more (the run
    plans for nodes that are not up, and asks the autoscaler for them)."""
    cfg = json.loads(json.dumps(source))
    cfg["max_workers"] = max_workers
    for name, t in cfg["available_node_types"].items():
        if name != cfg["head_node_type"]:
            t["max_workers"] = max_workers
    path = tmp_path / f"node-types-{max_workers}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cluster_yaml() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _rayjob_node_types() -> dict:
    config_map = yaml.safe_load((ROOT / "deploy" / "rayjob-node-types.yaml").read_text())
    return yaml.safe_load(next(iter(config_map["data"].values())))


def _worker(node_types: dict) -> dict:
    (worker,) = [t for n, t in node_types["available_node_types"].items() if n != node_types["head_node_type"]]
    return {"num_cpus": int(worker["resources"]["CPU"]), "num_gpus": int(worker["resources"].get("GPU", 0))}


@pytest.fixture(scope="class")
def cluster_yaml_shape(no_shared_ray):
    """cluster.yaml's shape: a head with CPU 0 and two of its gpu_worker nodes (8 CPUs, 1 GPU each:
    a logical GPU here, the actors fall back to the CPU)."""
    assert _cluster_yaml()["available_node_types"]["head"]["resources"] == {"CPU": 0}
    with local_cluster({"num_cpus": 0}, [_worker(_cluster_yaml())] * 2) as c:
        yield c


@pytest.fixture(scope="class")
def rayjob_shape(no_shared_ray):
    """The KubeRay RayJob's shape: a head with CPU 0 and its worker group at its maximum (two 4-CPU pods)."""
    types = _rayjob_node_types()
    with local_cluster({"num_cpus": 0}, [_worker(types)] * types["max_workers"]) as c:
        yield c


class TestClusterYamlShape:
    def test_the_default_experiment_runs_unchanged_on_its_workers(self, cluster_yaml_shape, tracking, tmp_path, monkeypatch):
        """Planned per node from cluster.yaml's node types (as the head reads them from
        ~/ray_bootstrap_config.yaml): 16 client actors and the server on two 8-CPU nodes. Planned
        from the totals (1 + 16 x 0.9375 CPU), 15 fit and the run waited for placement_timeout_s."""
        monkeypatch.setenv(NODE_TYPES_ENV, str(_launcher_file(tmp_path, _cluster_yaml(), max_workers=2)))
        uri, track = tracking
        cfg = load_config(default_config_path(), track + DEFAULT_TO_VERSION_2)
        assert cfg.federation.num_clients == 20 and cfg.resources.clients_per_actor == "auto"
        placed: dict[str, str] = {}
        with pytest.raises(RunInterrupted) as stopped:
            run_experiment(cfg, on_eval=lambda version, metrics: placed.update(placed or _actor_nodes()), **QUIET)
        assert stopped.value.version == 2
        assert len(placed) == 17 and len(set(placed.values())) == 2  # 16 client actors and the server on both workers
        assert ray.get_runtime_context().get_node_id() not in placed.values()  # none on the head
        run_id = json.loads((stopped.value.output_dir / "run.json").read_text())["run_id"]
        plan = MlflowClient(uri).get_run(run_id).data.params
        assert (plan["plan.num_actors"], plan["plan.server_num_cpus"], plan["plan.client_num_cpus"]) == ("16", "1.0", "0.8888")
        assert 0 < float(plan["plan.client_num_gpus"]) <= 1 / 9  # 9 actors on a node share its GPU
        assert not standing_request()

    def test_a_plan_that_cannot_fit_is_refused_before_anything_is_placed(self, cluster_yaml_shape, tracking, tmp_path,
                                                                          monkeypatch):
        monkeypatch.setenv(NODE_TYPES_ENV, str(_launcher_file(tmp_path, _cluster_yaml(), max_workers=2)))
        _, track = tracking
        cfg = load_config(default_config_path(), track + DEFAULT_TO_VERSION_2 + ["resources.client_num_cpus=1.5"])
        with pytest.raises(Exception) as e:  # at once, not after resources.placement_timeout_s (600 s)
            run_experiment(cfg, **QUIET)
        assert type(e.value).__name__ == "ConfigError", e.value
        assert "resources.client_num_cpus = 1.5" in str(e.value)
        assert "of 16 client actors fit" in str(e.value) and "1 node of 8 CPU, 1 GPU: server (1 CPU, " in str(e.value)
        assert not list((tmp_path / "runs").glob("*"))  # refused before the run's folder was kept

    def test_a_failure_before_the_first_update_leaves_no_resource_request(self, cluster_yaml_shape, tracking, tmp_path,
                                                                          monkeypatch):
        """The node types allow a third worker, which is not up: the run plans for three nodes and
        asks the autoscaler for them (no autoscaler serves this cluster: the request just stands in
        the GCS, where the autoscaler would read it). Whatever ends the run before its first update,
        the request is withdrawn."""
        monkeypatch.setenv(NODE_TYPES_ENV, str(_launcher_file(tmp_path, _cluster_yaml(), max_workers=3)))
        _, track = tracking
        cfg = load_config(default_config_path(), track + DEFAULT_TO_VERSION_2)
        seen: list = []

        def interrupted_while_waiting(self, timeout, progress):
            seen.append(standing_request())
            raise KeyboardInterrupt  # Ctrl-C while the nodes are awaited

        monkeypatch.setattr(ActorFleet, "wait_started", interrupted_while_waiting)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg, **QUIET)
        assert seen and len(seen[0]) == 21  # the server and 20 client actors were asked for
        assert not standing_request()

        # MLflow unreachable when the run starts (after its workers were started and the request made)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        unreachable = load_config(default_config_path(), track + DEFAULT_TO_VERSION_2 +
                                  [f"tracking.tracking_uri=http://127.0.0.1:{free_port()}"])
        asked: list = []
        real = ActorFleet.start_workers
        monkeypatch.setattr(ActorFleet, "start_workers", lambda self: (real(self), asked.append(standing_request())))
        with pytest.raises(Exception, match="127.0.0.1"):
            run_experiment(unreachable, **QUIET)
        assert asked and asked[0] and not standing_request()


class TestRayJobShape:
    def test_the_default_experiment_resumes_from_its_checkpoint_uri_after_the_run_folder_is_gone(
            self, rayjob_shape, tracking, tmp_path, monkeypatch):
        """Planned per node from the RayJob's node types (deploy/rayjob-node-types.yaml, named by
        RAYFED_AUTOSCALING_CONFIG as in the RayJob): 8 client actors of 0.8 CPU and the server on two
        4-CPU pods (from the totals: 1 + 8 x 0.875, which never fits). It stops at version 1 with its
        checkpoints at a file:// URI (standing in for s3://; the stop writes one, after draining the
        updates under way: version 2 or later); its run folder is deleted (the cluster is gone);
        `rayfed-proto run --resume URI` rebuilds it and finishes one more version in the same MLflow run."""
        monkeypatch.setenv(NODE_TYPES_ENV, str(_launcher_file(tmp_path, _rayjob_node_types(), max_workers=2)))
        uri, track = tracking
        store = f"file://{tmp_path / 'bucket' / 'rayfed-default'}"
        cfg = load_config(default_config_path(), track + [f"checkpoint.dir={store}", "faults.stop_at_version=1"])
        with pytest.raises(RunInterrupted) as stopped:
            run_experiment(cfg, **QUIET)
        out = stopped.value.output_dir
        run_id = json.loads((out / "run.json").read_text())["run_id"]
        client = MlflowClient(uri)
        plan = client.get_run(run_id).data.params
        assert (plan["plan.num_actors"], plan["plan.client_num_cpus"], plan["plan.server_num_cpus"]) == ("8", "0.8", "1.0")
        shutil.rmtree(out)

        # the stop drained the updates under way (async): the checkpoint may be past version 1
        saved = max(int(p.name[1:]) for p in (tmp_path / "bucket" / "rayfed-default").glob("v*"))
        assert saved >= 2
        # one more version, then the run ends (eval_every may not exceed rounds)
        assert cli.main(["run", "--resume", store, "--no-progress", "--set", f"federation.rounds={saved + 1}",
                         "--set", "federation.eval_every=1"]) == 0
        assert (out / "summary.txt").is_file() and (out / "partition.parquet").is_file()  # rebuilt, named as before
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert max(m.step for m in client.get_metric_history(run_id, "eval/head_acc")) == saved + 1
        assert len(client.search_runs([run.info.experiment_id])) == 1  # continued, not a second run
        assert not standing_request()
