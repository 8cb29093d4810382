"""deploy/ for KubeRay, checked statically (no Kubernetes cluster here; issue 27, item 5): the
RayJob's node types agree with its worker groups and let the default experiment place with no
resource setting; the MLflow server it logs to is created by a manifest (Deployment and Service,
Postgres and S3 settings from a Secret no file holds); the job's log gets no progress bars."""

import shlex
from pathlib import Path

import yaml
from test_resources_per_node import bundles, pack_fits

from rayfed_proto.config import load_config
from rayfed_proto.runtime import autoscale
from rayfed_proto.runtime.resources import plan_resources

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d}


def rayjob() -> dict:
    return docs("rayjob.yaml")["RayJob"]


def runtime_env() -> dict:
    return yaml.safe_load(rayjob()["spec"]["runtimeEnvYAML"])["env_vars"]


def node_types_file(tmp_path) -> Path:
    (data,) = docs("rayjob-node-types.yaml")["ConfigMap"]["data"].items()
    path = tmp_path / data[0]
    path.write_text(data[1])
    return path


def test_the_node_types_the_driver_reads_are_the_rayjobs_worker_groups(tmp_path):
    types_, cluster_max = autoscale.launcher_node_types(node_types_file(tmp_path))
    cluster = rayjob()["spec"]["rayClusterSpec"]
    groups = [({"CPU": float(g["rayStartParams"]["num-cpus"]), **({"GPU": float(g["rayStartParams"]["num-gpus"])}
                                                                  if "num-gpus" in g["rayStartParams"] else {})},
               g["maxReplicas"]) for g in cluster["workerGroupSpecs"]]
    assert sorted(types_, key=str) == sorted(groups, key=str)
    assert cluster_max == sum(n for _, n in groups)
    assert yaml.safe_load(next(iter(docs("rayjob-node-types.yaml")["ConfigMap"]["data"].values())))[
        "available_node_types"]["head"]["resources"] == {"CPU": float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"])}


def test_the_head_mounts_the_node_types_where_the_job_driver_looks():
    head = rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    config_map = docs("rayjob-node-types.yaml")["ConfigMap"]
    volume = next(v for v in head["volumes"] if v.get("configMap", {}).get("name") == config_map["metadata"]["name"])
    (container,) = head["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    (key,) = config_map["data"]
    assert runtime_env()[autoscale.NODE_TYPES_ENV] == f"{mount['mountPath']}/{key}"


def test_the_default_experiment_places_on_the_rayjobs_pods_with_no_resource_setting(tmp_path):
    argv = shlex.split(rayjob()["spec"]["entrypoint"])
    sets = [a for a in argv[2:] if "=" in a]
    assert [s for s in sets if s.startswith("resources.")] == ["resources.address=auto"]
    cfg = load_config(None, sets)
    types_, cluster_max = autoscale.launcher_node_types(node_types_file(tmp_path))
    head = {"CPU": 0.0}
    nodes = [head] + autoscale.launchable_nodes(types_, cluster_max, alive=[head])
    plan = plan_resources(cfg, 8, 0, nodes=nodes)
    assert plan.num_actors == 8 and pack_fits(bundles(plan), nodes)
    # what the totals gave (1 + 8 x 0.875 CPU on two 4-CPU pods) never fits
    assert not pack_fits(bundles(plan_resources(cfg, 8, 0)), nodes)


def test_the_jobs_log_gets_no_progress_bars():
    argv = shlex.split(rayjob()["spec"]["entrypoint"])
    assert argv[:2] == ["rayfed-proto", "run"] and "--no-progress" in argv


def test_the_mlflow_server_the_job_logs_to_is_created_with_its_settings_from_a_secret():
    manifests = docs("mlflow.yaml")
    service, deployment = manifests["Service"], manifests["Deployment"]
    uri = runtime_env()["MLFLOW_TRACKING_URI"]
    host, port = uri.removeprefix("http://").split(":")
    assert service["metadata"]["name"] == host and service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    args = container["command"] + container["args"]
    assert args[:2] == ["mlflow", "server"] and "--serve-artifacts" in args
    assert str(service["spec"]["ports"][0]["targetPort"]) == args[args.index("--port") + 1]
    env = {e["name"]: e for e in container["env"]}
    # Postgres URI and artifact destination from the Secret; the URI never on the command line
    for name in ("MLFLOW_BACKEND_STORE_URI", "MLFLOW_ARTIFACTS_DESTINATION"):
        assert "secretKeyRef" in env[name]["valueFrom"] and "value" not in env[name]
    assert "--backend-store-uri" not in args
    assert args[args.index("--artifacts-destination") + 1] == "$(MLFLOW_ARTIFACTS_DESTINATION)"
    allowed = args[args.index("--allowed-hosts") + 1].split(",")
    assert f"{host}:*" in allowed  # MLflow refuses a Host header it does not allow: the Service's name is
    images = {c["image"] for g in [rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"],
                                   *rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"]}
    assert images == {container["image"]}  # the same image, so the same MLflow as the drivers
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "psycopg2-binary" in dockerfile and "boto3" in dockerfile
