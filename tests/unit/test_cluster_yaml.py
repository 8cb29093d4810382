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
