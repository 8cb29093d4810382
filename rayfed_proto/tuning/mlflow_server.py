"""One MLflow tracking server for a sweep, so that concurrent trials never share a sqlite file.

Trials running at once each log a child run. Writing to one sqlite file from several processes
risks ``database is locked`` and lost metrics; instead the sweep starts ``mlflow server`` over
that sqlite store (one worker process: the only writer of the file) and every trial logs over
HTTP. The server has no authentication, so it binds 127.0.0.1 only; reach it from elsewhere
through an SSH tunnel. A tracking URI that is already http(s) is used as given.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_remote_uri(uri: str) -> bool:
    return uri.startswith(("http://", "https://", "databricks"))


def is_loopback_uri(uri: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(uri).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def server_command(backend_store_uri: str, artifact_root: Path, port: int, host: str = LOOPBACK) -> list[str]:
    """The ``mlflow server`` command line (also what the tests check for the loopback binding)."""
    return [sys.executable, "-m", "mlflow", "server",
            "--host", host, "--port", str(port),
            "--backend-store-uri", backend_store_uri,
            # artifacts go straight to this folder (trials run on this machine): a later
            # `mlflow ui --backend-store-uri <the same sqlite>` finds them without this server
            "--no-serve-artifacts", "--default-artifact-root", artifact_root.resolve().as_uri(),
            "--workers", "1"]  # one process writes the sqlite file


class LocalMlflowServer:
    """``with LocalMlflowServer(sqlite_uri) as uri:`` -> ``http://127.0.0.1:<free port>``."""

    def __init__(self, backend_store_uri: str, artifact_root: Optional[Path] = None, port: Optional[int] = None,
                 log_path: Optional[Path] = None, startup_timeout_s: float = 180.0):
        if not backend_store_uri.startswith("sqlite:///"):
            raise ValueError(f"a local MLflow server needs a sqlite store, got {backend_store_uri!r}")
        db = Path(backend_store_uri[len("sqlite:///"):])
        db.parent.mkdir(parents=True, exist_ok=True)
        self.backend_store_uri = backend_store_uri
        self.artifact_root = artifact_root or db.parent / "mlartifacts"
        self.artifact_root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.host = LOOPBACK
        self.log_path = log_path or db.parent / f"mlflow-server-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.proc: Optional[subprocess.Popen] = None

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        cmd = server_command(self.backend_store_uri, self.artifact_root, self.port, self.host)
        self._log = open(self.log_path, "ab")
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        # own process group: stop() ends the server and its worker, nothing else
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.uri
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer on {self.uri} within {self.startup_timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc = None
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
