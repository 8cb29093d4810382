"""cluster.yaml stays a valid Ray cluster launcher config and keeps services off public interfaces."""

import json
from pathlib import Path

import jsonschema
import ray
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_matches_rays_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(yaml.safe_load((ROOT / "cluster.yaml").read_text()), schema)


def test_dashboard_and_mlflow_bind_loopback_only():
    head = " ".join(yaml.safe_load((ROOT / "cluster.yaml").read_text())["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    assert "mlflow server --host 127.0.0.1" in head and "0.0.0.0" not in head


def _config():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_mlflow_server_on_the_head_binds_127_0_0_1_with_one_writer():
    commands = [c for c in _config()["head_start_ray_commands"] if "mlflow server" in c]
    assert len(commands) == 1
    args = commands[0].split()
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--workers") + 1] == "1"  # a single process writes the sqlite store
    assert args[args.index("--backend-store-uri") + 1].startswith("sqlite:////")


def test_gpu_workers_install_the_package_with_cuda_torch():
    cfg = _config()
    gpu = cfg["available_node_types"]["gpu_worker"]
    assert gpu["min_workers"] <= gpu["max_workers"] <= cfg["max_workers"]
    assert cfg["available_node_types"]["head"]["resources"] == {"CPU": 0}  # drivers and MLflow only
    setup = " ".join(cfg["setup_commands"])
    assert "download.pytorch.org/whl/cu" in setup and "pip install -q -e ~/rayfed_proto" in setup
    assert "s3://" in (ROOT / "cluster.yaml").read_text()  # the Tune storage instructions
