"""Local multi-node clusters for the cluster tests, started and stopped without touching any other
Ray instance on the machine.

``FakeAutoscalingHead``: what ``ray.cluster_utils.AutoscalingCluster`` does (a ``ray start --head``
with ``RAY_FAKE_CLUSTER=1`` and an autoscaling config whose provider is ``fake_multinode``: Ray's
``FakeMultiNodeProvider`` starts each "node" as a raylet on this machine), with three changes:
Ray 2.60's wheel lacks the ``fake_multi_node/example.yaml`` that AutoscalingCluster reads; its
start/shutdown run ``ray stop --force``, which kills every Ray process on the machine (other
users' clusters too); and it uses the fixed port 6379. Here the head gets a free port and its own
``--temp-dir`` (so no other ``ray.init()`` on the machine finds it through
``/tmp/ray/ray_current_cluster``), and ``stop()`` kills only the processes whose command line
names this head's GCS address or temp dir, by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    import ray._private.services

    return ray._private.services.get_node_ip_address()


def _gone(p: psutil.Process) -> bool:
    """Exited, or a zombie waiting for its parent (``ray start`` exited: pid 1) to reap it: a zombie's pid
    still exists, so psutil.wait_procs would wait the whole timeout for it."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_cluster_processes(markers: list[str], timeout: float = 15.0, gcs_grace_s: float = 2.0) -> int:
    """Kill (by pid) every process whose command line contains one of ``markers`` (this cluster's
    GCS address, its temp dir): never by name, so other Ray instances are left alone.

    SIGTERM in three waves, each waited for: the head's helpers (autoscaler monitor, dashboard,
    agents, workers), then the raylets, then the GCS. Sent all at once, the raylets and the GCS
    (and the monitor) could outlive the whole timeout; in this order each wave ends within about a
    second. The GCS of a head whose autoscaler had launched nodes sometimes ignores its SIGTERM
    (it then sat out the whole 15 s, once per autoscaling test): it gets ``gcs_grace_s``, then
    SIGKILL (the cluster's temp dir is deleted next; nothing of it is kept). Whatever else is left
    when ``timeout`` runs out is killed too."""
    me = os.getpid()
    victims = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid != me and any(m in cmd for m in markers):
            exe = cmd.split(" ", 1)[0]
            victims.append((2 if exe.endswith("/gcs_server") else 1 if exe.endswith("/raylet") else 0, p))
    deadline = time.monotonic() + timeout
    for wave in (0, 1, 2):
        procs = [p for w, p in victims if w == wave]
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        until = min(deadline, time.monotonic() + gcs_grace_s) if wave == 2 else deadline
        while not all(_gone(p) for p in procs) and time.monotonic() < until:
            time.sleep(0.05)
    for _, p in victims:
        if not _gone(p):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    return len(victims)


def ray_bin() -> str:
    return str(Path(sys.executable).parent / "ray")


class FakeAutoscalingHead:
    """A head with ``head_resources`` and an autoscaler that launches ``worker_node_types`` (the
    autoscaling config's ``available_node_types`` entries) as local raylets."""

    def __init__(self, head_resources: dict, worker_node_types: dict, max_workers: int = 4, idle_timeout_minutes: float = 1.0,
                 autoscaler_v2: bool = False):
        self.autoscaler_v2 = autoscaler_v2
        self.port = free_port()
        self.ip = node_ip()
        self.address = f"{self.ip}:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="rfas", dir="/tmp")  # short: unix socket paths
        types = {"ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}}
        types.update(worker_node_types)
        self.config = {
            "cluster_name": "rayfed-fake", "max_workers": max_workers, "upscaling_speed": 10.0,
            "idle_timeout_minutes": idle_timeout_minutes, "docker": {},
            # as Ray's fake_multi_node example.yaml: no SSH updaters (they would fail and "launch failed" the node)
            "provider": {"type": "fake_multinode", "gcs_address": self.address, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "auth": {"ssh_user": "ubuntu"}, "available_node_types": types, "head_node_type": "ray.head.default",
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }
        self.head_resources = dict(head_resources)
        if autoscaler_v2:  # as AutoscalingCluster(autoscaler_v2=True) sets it up
            from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

            self.config["provider"].update(launch_multiple=True, head_node_id=FAKE_HEAD_NODE_ID)

    def start(self) -> str:
        cfg = Path(self.temp_dir) / "autoscaling.yaml"
        cfg.write_text(yaml.safe_dump(self.config))
        res = dict(self.head_resources)
        cmd = [ray_bin(), "start", "--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
               f"--autoscaling-config={cfg}", f"--num-cpus={res.pop('CPU', 0)}", f"--num-gpus={res.pop('GPU', 0)}",
               "--include-dashboard=false", "--disable-usage-stats"]
        if res:
            cmd.append(f"--resources={json.dumps(res)}")
        # RAY_AUTH_MODE unset + a ~/.ray/auth_token on the machine would turn token auth on for this head only
        # AUTOSCALER_HEARTBEAT_TIMEOUT_S: on a loaded machine a fresh raylet can miss the default 30 s, and the
        # autoscaler then terminates it ("lost contact with raylet") under the actors placed there
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "disabled",
               "AUTOSCALER_HEARTBEAT_TIMEOUT_S": "600"}
        env.pop("RAY_ADDRESS", None)
        if self.autoscaler_v2:
            from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

            env.update(RAY_enable_autoscaler_v2="1", RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID,
                       RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID)
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
        return self.address

    def stop(self) -> None:
        logs = Path(self.temp_dir) / "session_latest" / "logs"
        for name in ("monitor.log", "monitor.out"):  # kept for a failing test's post-mortem
            if (logs / name).is_file():
                shutil.copy(logs / name, Path(tempfile.gettempdir()) / f"rayfed-fake-autoscaler-{name}")
        kill_cluster_processes([self.address, f"gcs_server_port={self.port}", self.temp_dir])
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def standing_request() -> list:
    """The autoscaler request standing in the connected cluster's GCS (what ``request_resources``
    wrote there for the v1 autoscaler to read; [] when withdrawn or never made)."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


@contextlib.contextmanager
def outside_shared_ray(num_cpus: int = 2, num_gpus: int = 2):
    """Shut the suite's shared local Ray instance (tests/conftest.py: ray_session) down for the
    block and start it again afterwards with the same settings, so that later tests using the
    session fixture still find it."""
    import ray

    was = ray.is_initialized()
    if was:
        ray.shutdown()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if was:
            ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)


@contextlib.contextmanager
def local_cluster(head_args: dict, workers: list[dict]):
    """A ``ray.cluster_utils.Cluster`` (head + worker nodes as local raylets), connected. Its head
    normally writes its address to /tmp/ray/ray_current_cluster, where every other ``ray.init()``
    on the machine would find it and connect (another session's tests included): that write is
    suppressed."""
    import ray
    import ray._private.utils as ray_utils
    from ray.cluster_utils import Cluster

    # The head's address goes to its own temp dir only: `ray job submit`'s supervisor finds the
    # cluster there (ray_current_cluster in the node's temp dir); no other ray.init() looks there.
    temp_dir = tempfile.mkdtemp(prefix="rfc", dir="/tmp")  # short: unix socket paths
    real = ray_utils.write_ray_address
    ray_utils.write_ray_address = lambda address, *a, **k: real(address, temp_dir)
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**head_args, "temp_dir": temp_dir})
    finally:
        ray_utils.write_ray_address = real
    try:
        for w in workers:
            cluster.add_node(**w)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        import ray._common.utils as common

        real_reset = common.reset_ray_address  # would delete /tmp/ray/ray_current_cluster, which is not ours
        common.reset_ray_address = lambda *a, **k: None
        try:
            cluster.shutdown()
        finally:
            common.reset_ray_address = real_reset
            shutil.rmtree(temp_dir, ignore_errors=True)
