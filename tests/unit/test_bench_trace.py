"""bench/async_vs_sync.py --scenario trace: the FedScale-format traces it writes are a function of the
seed, load through the project's restricted pickle loader (plain Python values only, no NumPy
scalar) and have FedScale's shapes; --deadline resolves per method. No Ray."""

import pickle
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import async_vs_sync as avs  # noqa: E402

from rayfed_proto.config import build_config  # noqa: E402
from rayfed_proto.system import fedscale_windows, load_behaviour_trace, load_device_trace  # noqa: E402


def test_the_trace_is_a_function_of_the_seed():
    assert avs.fedscale_traces(50, seed=3) == avs.fedscale_traces(50, seed=3)
    assert avs.fedscale_traces(50, seed=3) != avs.fedscale_traces(50, seed=4)


def test_written_pickles_load_with_the_restricted_loader_and_keep_fedscale_keys(tmp_path):
    device_path, behave_path = avs.write_traces(tmp_path, 50, seed=0)
    assert [device_path.name, behave_path.name] == ["client_device_capacity.pkl", "client_behave_trace.pkl"]
    raw_dev, raw_beh = (pickle.loads(p.read_bytes()) for p in (device_path, behave_path))
    assert sorted(raw_dev) == sorted(raw_beh) == list(range(1, 51))  # FedScale's ids start at 1
    assert set(raw_dev[1]) == {"computation", "communication"}
    assert {"active", "inactive", "finish_time", "duration", "model"} <= set(raw_beh[1])
    dev, beh = load_device_trace(device_path), load_behaviour_trace(behave_path)  # refuses any global
    assert len(dev) == len(beh) == 50
    comp = np.array([c for c, _ in dev.values()])
    comm = np.array([b for _, b in dev.values()])
    assert 15 <= comp.min() and comp.max() <= 3000 and 80 < np.median(comp) < 250  # ms per sample
    assert 100 <= comm.min() and comm.max() <= 200000 and comm.max() / comm.min() > 20  # kbit/s, spread
    online = np.array([sum(e - s for s, e in ws) / period for ws, period in beh.values()])
    assert 0.05 < online.min() and online.max() < 1.0 and 0.3 < online.mean() < 0.7
    for ws, period in beh.values():
        assert period == 3600.0 and ws and all(0 <= s < e <= period for s, e in ws)
    sessions = np.array([e - s for ws, _ in beh.values() for s, e in ws])
    assert 30 < np.median(sessions) < 120  # around --session-s (60), heavy-tailed
    windows, periods = fedscale_windows(beh, 50, seed=0)
    assert sorted(windows) == list(range(50)) and set(periods.values()) == {3600.0}


def test_the_trace_overrides_build_a_valid_config(tmp_path):
    device, behave = avs.write_traces(tmp_path, 50, seed=0)
    cfg = build_config({}, ["federation.num_clients=50", "federation.mode=sync", "federation.participation=0.2",
                            "federation.round_deadline_s=5", "federation.over_selection=1.3",
                            *avs.trace_overrides(device, behave)])
    assert (cfg.system.speed.kind, cfg.system.bandwidth.kind, cfg.system.availability.kind) == ("fedscale",) * 3
    assert cfg.system.upload_bytes_per_s is None and cfg.system.download_bytes_per_s is None


@pytest.mark.parametrize(("given", "fedavg", "fedproto"), [
    ([], 30.0, 5.0), (["12"], 12.0, 12.0), (["fedavg=40"], 40.0, 5.0), (["7", "fedproto=2"], 7.0, 2.0),
])
def test_deadline_per_method(given, fedavg, fedproto):
    args = Namespace(deadline=given)
    assert (avs.deadline_for(args, "fedavg"), avs.deadline_for(args, "fedproto")) == (fedavg, fedproto)
