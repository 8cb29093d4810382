"""Downloads are serialised by a file lock: the driver loads (or downloads, once) the data."""

import threading
import time

import torchvision.datasets

from rayfed_proto.data.datasets import open_torchvision


class FakeSet:
    inside = 0
    most = 0
    calls = 0
    guard = threading.Lock()

    def __init__(self, root, download, train):
        with FakeSet.guard:
            FakeSet.inside += 1
            FakeSet.calls += 1
            FakeSet.most = max(FakeSet.most, FakeSet.inside)
        time.sleep(0.2)  # long enough for another thread to try to enter (no assertion on time)
        with FakeSet.guard:
            FakeSet.inside -= 1


def test_concurrent_downloads_of_one_dataset_take_turns(tmp_path, monkeypatch):
    monkeypatch.setattr(torchvision.datasets, "FakeSet", FakeSet, raising=False)
    threads = [threading.Thread(target=open_torchvision, args=("fake", "FakeSet", tmp_path / "data", "x", True,
                                                                   [{"train": True}])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert FakeSet.calls == 3 and FakeSet.most == 1
    assert (tmp_path / "data" / ".FakeSet.download.lock").exists()
