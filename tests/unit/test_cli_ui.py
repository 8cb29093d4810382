"""``rayfed-proto ui`` (issue 49, item 8): the link is printed once the server answers, after a
"ready" line; SIGTERM stops the server and its workers (its whole process group) as Ctrl-C does.
The server is a stand-in: a tiny Python HTTP server that answers late and starts a worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rayfed_proto import cli

ROOT = Path(__file__).resolve().parents[2]

FAKE_SERVER = textwrap.dedent("""
    import http.server, os, subprocess, sys, time
    port, pids, ignore_term = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    if ignore_term:
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # as mlflow's workers
    open(pids, "w").write(f"{os.getpid()} {worker.pid}")
    time.sleep(1.0)  # answers late, as mlflow ui on a loaded machine
    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Quiet).serve_forever()
""")

DRIVER = textwrap.dedent("""
    import sys
    from rayfed_proto import cli
    from rayfed_proto.tracking import links
    fake, pids, uri, port = sys.argv[1:5]
    links.ui_server_command = lambda tracking_uri, host, p: [sys.executable, fake, str(p), pids, "0"]
    sys.exit(cli.main(["ui", "--tracking-uri", uri, "--port", port]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_run(client.create_experiment("ui_demo"))
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    (tmp_path / "driver.py").write_text(DRIVER)
    return uri, tmp_path


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
def test_link_printed_once_the_server_answers_and_sigterm_stops_its_group(store):
    uri, tmp = store
    port, pids = _free_port(), tmp / "pids"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen([sys.executable, str(tmp / "driver.py"), str(tmp / "fake_server.py"), str(pids), uri,
                               str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in driver.stdout:
            lines.append(line)
            if line.startswith("MLflow UI, experiment 'ui_demo'"):
                with socket.create_connection(("127.0.0.1", port), timeout=5):  # it answers when the link appears
                    break
        assert lines[0].startswith(f"starting the MLflow UI at http://127.0.0.1:{port}")
        assert any(line.startswith(f"MLflow UI ready at http://127.0.0.1:{port}") for line in lines[:-1])
        assert "/#/experiments/" in lines[-1] and "workflowType=machine_learning" in lines[-1]
        server, worker = map(int, pids.read_text().split())
        assert _alive(server) and _alive(worker)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 143
        assert not _alive(server) and not _alive(worker)  # the server and its worker: the whole group
        assert cli.group_members(server) == []
    finally:
        if driver.poll() is None:
            driver.kill()
        if pids.is_file():
            for pid in map(int, pids.read_text().split()):
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
def test_a_server_that_ignores_sigterm_is_killed(store):
    uri, tmp = store
    pids = tmp / "pids"
    proc = subprocess.Popen([sys.executable, str(tmp / "fake_server.py"), str(_free_port()), str(pids), "1"],
                            start_new_session=True)
    try:
        while not (pids.is_file() and pids.read_text()):
            assert proc.poll() is None
        server, worker = map(int, pids.read_text().split())
        cli._stop_group(proc, grace_s=0.5)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not _alive(server) and not _alive(worker)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_server_that_exits_is_an_error(store, capsys, monkeypatch):
    from rayfed_proto.tracking import links

    uri, _ = store
    monkeypatch.setattr(links, "ui_server_command", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"])
    assert cli.main(["ui", "--tracking-uri", uri, "--port", str(_free_port())]) == 3
    out, err = capsys.readouterr()
    assert "error: the MLflow UI did not answer" in err and "exited with status 3" in err
    assert "MLflow UI, experiment" not in out  # no link to a server that is not there
