"""``rayfed-proto list | head``: a reader that goes away ends the command quietly (issue 40.5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_list_into_a_closed_pipe_ends_quietly():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write fails with EPIPE
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run([sys.executable, "-m", "rayfed_proto.cli", "list"], stdout=write, stderr=subprocess.PIPE,
                              env=env, timeout=120, text=True)
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 141
