"""cluster.yaml stays a valid Ray cluster launcher config that launches: one pinned Ray version, an
rsync filter, an autoscaler that can plan from its node types, services off public interfaces,
results (MLflow runs, artifacts) off the head's disk; nodes that set themselves up on a stock
Ubuntu image, no secret in any file, workers that reach the head's MLflow server (issue 27)."""

import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import ray
import yaml

from rayfed_proto.runtime.autoscale import launchable_nodes, launcher_node_types

ROOT = Path(__file__).resolve().parents[2]


def _config():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _mlflow_command() -> str:
    commands = [c for c in _config()["head_start_ray_commands"] if "mlflow-server.sh" in c]
    assert len(commands) == 1
    return commands[0]


def _run_mlflow_script(tmp_path, env: dict) -> tuple[list[str], dict]:
    """Run deploy/mlflow-server.sh with a stand-in `mlflow` (and `python`, for the Secrets Manager
    read) in a fake venv: what it would start, and with which environment."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "mlflow").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT/args"\nenv > "$OUT/env"\n')
    (venv / "python").write_text('#!/usr/bin/env bash\ncat > /dev/null\necho "postgresql://mlflow:from-$2-in-$3@db:5432/mlflow"\n')
    for f in venv.iterdir():
        f.chmod(0o755)
    full = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "RAYFED_VENV": str(tmp_path / "venv"), "OUT": str(tmp_path),
            "MLFLOW_ARTIFACTS_DESTINATION": "s3://bucket/mlflow-artifacts", **env}
    done = subprocess.run(["bash", str(ROOT / "deploy" / "mlflow-server.sh")], env=full, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().split("\n")[:-1]
    server_env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    return args, server_env


def test_cluster_yaml_matches_rays_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(_config(), schema)


def test_every_node_installs_the_ray_version_the_package_is_tested_with():
    setup = _config()["setup_commands"]
    pins = [c for c in setup if "ray[" in c]
    assert len(pins) == 1 and f'"ray[default,tune]=={ray.__version__}"' in pins[0]
    # the pin comes before the package, whose looser requirement then finds it met
    editable = next(i for i, c in enumerate(setup) if "pip install -q -e ~/rayfed_proto" in c)
    assert setup.index(pins[0]) < editable
    assert "download.pytorch.org/whl/cu" in " ".join(setup)


def test_local_environments_data_and_results_are_not_synced():
    cfg = _config()
    excluded = set(cfg["rsync_exclude"])
    assert {"**/.venv", "data", "runs", "mlflow.db", "mlruns"} <= excluded
    assert cfg["rsync_filter"] == [".gitignore"]


def test_dashboard_on_loopback_and_mlflow_on_the_private_address_only(tmp_path):
    head = " ".join(_config()["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    args, _ = _run_mlflow_script(tmp_path, {"MLFLOW_BACKEND_STORE_URI": "postgresql://u:p@db/mlflow"})
    private = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    assert args[:2] == ["server", "--host"] and args[2] == private  # the head's private IP, not 0.0.0.0 or a public one
    assert "0.0.0.0" not in (ROOT / "deploy" / "mlflow-server.sh").read_text()


def test_mlflow_results_outlive_the_cluster_and_its_password_is_in_no_file(tmp_path):
    command = _mlflow_command()
    assert "postgresql://" not in (ROOT / "cluster.yaml").read_text().split("head_start_ray_commands:")[1]
    assert "MLFLOW_ARTIFACTS_DESTINATION=s3://" in command and "RAYFED_MLFLOW_SECRET=" in command
    # from the environment when the head has it ...
    args, env = _run_mlflow_script(tmp_path, {"MLFLOW_BACKEND_STORE_URI": "postgresql://u:p@db/mlflow"})
    assert "--serve-artifacts" in args and "--no-serve-artifacts" not in args
    assert args[args.index("--artifacts-destination") + 1] == "s3://bucket/mlflow-artifacts"
    assert "--backend-store-uri" not in args and env["MLFLOW_BACKEND_STORE_URI"] == "postgresql://u:p@db/mlflow"  # not in `ps`
    # ... else from AWS Secrets Manager (the stand-in python answers for boto3), in the given region
    args, env = _run_mlflow_script(tmp_path, {"RAYFED_MLFLOW_SECRET": "rayfed/db", "AWS_REGION": "eu-west-1"})
    assert env["MLFLOW_BACKEND_STORE_URI"] == "postgresql://mlflow:from-rayfed/db-in-eu-west-1@db:5432/mlflow"
    assert "--backend-store-uri" not in args
    assert {"psycopg2-binary", "boto3"} <= set(" ".join(_config()["head_setup_commands"]).split())
    policy = json.loads((ROOT / "deploy" / "iam" / "head-policy.json").read_text())
    secret = next(s for s in policy["Statement"] if s["Action"] == "secretsmanager:GetSecretValue")
    assert "rayfed-proto/mlflow-backend-store-uri" in secret["Resource"] and "rayfed-proto/mlflow-backend-store-uri" in command


def test_no_credentials_in_any_file_of_the_deployment():
    credential = re.compile(r"[a-z0-9+]+://[^\s:/@'\"]+:([^\s@/'\"]+)@")
    for path in [ROOT / "cluster.yaml", *sorted((ROOT / "deploy").rglob("*"))]:
        if path.is_file():
            for password in credential.findall(path.read_text()):
                assert password == "PASSWORD", (path, password)  # a placeholder in a comment, never a value
    for path in (ROOT / "deploy").rglob("*.yaml"):
        assert all((doc or {}).get("kind") != "Secret" for doc in yaml.safe_load_all(path.read_text())), path


def test_a_stock_ubuntu_image_gets_python3_venv_before_the_venv_is_made():
    setup = _config()["setup_commands"]
    venv = next(i for i, c in enumerate(setup) if "python3 -m venv" in c)
    apt = next(i for i, c in enumerate(setup) if "apt-get" in c and "install" in c and "python3-venv" in c)
    assert apt < venv and "-y" in setup[apt].split()


def test_workers_reach_the_heads_mlflow_server(tmp_path):
    """The setup commands run on a worker with RAY_HEAD_IP set (the launcher exports it for that
    command only); every later shell on the worker, where it is unset, must get the head's address."""
    commands = [c for c in _config()["setup_commands"] if "MLFLOW_TRACKING_URI" in c]
    assert commands
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    for c in commands:
        subprocess.run(["bash", "-c", f"export RAY_HEAD_IP=10.1.2.3; {c}"], env=env, check=True, timeout=30)
    later = subprocess.run(["bash", "-c", ". ~/.bashrc; echo $MLFLOW_TRACKING_URI"], env=env, capture_output=True,
                           text=True, timeout=30)
    assert later.stdout.strip() == "http://10.1.2.3:5000"
    # on the head (no RAY_HEAD_IP): its own private address
    head_home = tmp_path / "head"
    head_home.mkdir()
    env["HOME"] = str(head_home)
    for c in commands:
        subprocess.run(["bash", "-c", c], env=env, check=True, timeout=30)
    own = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    later = subprocess.run(["bash", "-c", ". ~/.bashrc; echo $MLFLOW_TRACKING_URI"], env=env, capture_output=True, text=True)
    assert later.stdout.strip() == f"http://{own}:5000"


def test_autoscaler_starts_from_zero_and_runs_can_plan_from_the_node_types(tmp_path):
    cfg = _config()
    assert cfg["available_node_types"]["head"]["resources"] == {"CPU": 0}
    gpu = cfg["available_node_types"]["gpu_worker"]
    assert gpu["min_workers"] == 0 and gpu["min_workers"] <= gpu["max_workers"] <= cfg["max_workers"]
    # what the head's ~/ray_bootstrap_config.yaml will hold: the run reads the node types from it
    types, cluster_max = launcher_node_types(ROOT / "cluster.yaml")
    grown = launchable_nodes(types, cluster_max, alive=[])
    assert {k: sum(n[k] for n in grown) for k in ("CPU", "GPU")} == {"CPU": 32.0, "GPU": 4.0}


def test_head_profile_keeps_what_the_autoscaler_needs():
    cfg = _config()
    head_arn = cfg["available_node_types"]["head"]["node_config"]["IamInstanceProfile"]["Arn"]
    worker_arn = cfg["available_node_types"]["gpu_worker"]["node_config"]["IamInstanceProfile"]["Arn"]
    assert head_arn != worker_arn  # workers do not get the right to launch instances
    policy = json.loads((ROOT / "deploy" / "iam" / "head-policy.json").read_text())
    actions = {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert {"ec2:RunInstances", "ec2:TerminateInstances", "ec2:DescribeInstances", "ec2:CreateTags",
            "ec2:DescribeImages", "ec2:DescribeInstanceTypes", "iam:PassRole"} <= actions
    passrole = next(s for s in policy["Statement"] if s["Action"] == "iam:PassRole")
    assert passrole["Resource"].endswith(":role/" + worker_arn.rsplit("/", 1)[1])
    text = (ROOT / "cluster.yaml").read_text()
    for action in ("ec2:RunInstances", "iam:PassRole"):  # the comment says exactly what the profile needs
        assert action in text
    assert re.search(r"deploy/iam/head-policy\.json", text)
