"""Parked client states on local disk (resources.park_to: disk): exact, bounded, cleaned up.
No Ray: ClientHost and the fleet's chunked restore are driven in-process."""

import copy
import gc
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime import fleet as fleet_mod
from rayfed_proto.runtime.client_core import ClientHost
from rayfed_proto.runtime.parking import SUBDIR, OnDisk, ParkedStates, remove_orphaned

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fed():
    cfg = build_config({}, ["algorithm.name=fedproto", "federation.num_clients=4", "model.feature_dim=16",
                            "data.partition.beta=1.0"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 4, cfg.seed, cfg.data.test_fraction)
    return cfg, ds, part


def _on_disk(tmp_path) -> ParkedStates:
    return ParkedStates.on_disk(str(tmp_path))


def test_a_state_on_disk_loads_bit_for_bit_and_its_file_goes_with_the_last_reference(tmp_path):
    state = {"model": {"w": torch.randn(3, 4, dtype=torch.float64)}, "algorithm": {"p": np.arange(5.0)},
             "last_loss": float("nan"), "updates": 7, "rng": torch.get_rng_state()}
    h = OnDisk(tmp_path / "a.pt", state)
    back = h.load()
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["model"]["w"].dtype == torch.float64
    assert np.array_equal(back["algorithm"]["p"], state["algorithm"]["p"]) and back["updates"] == h.updates == 7
    assert torch.equal(back["rng"], state["rng"]) and np.isnan(back["last_loss"])
    shared = [h]  # a second reference (an evaluation's kept state) keeps the file
    del h
    gc.collect()
    assert (tmp_path / "a.pt").exists()
    shared.clear()
    assert not (tmp_path / "a.pt").exists()


def test_clients_parked_on_disk_train_and_evaluate_exactly_as_live_ones_and_memory_holds_no_state(fed, tmp_path):
    cfg, ds, part = fed
    live = ClientHost(cfg, ds, part.clients, CPU, park=False)
    disk = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path))
    state = GlobalState(version=0)
    for rnd in range(3):
        for c in (2, 0, 3):
            _, ul = live.train(c, state, keep_from=rnd)
            _, ud = disk.train(c, state, keep_from=rnd)
            assert np.array_equal(ul.prototypes.vectors, ud.prototypes.vectors)
            assert disk.live_count() == 0
        state = GlobalState(version=rnd + 1, prototypes=ul.prototypes)
        as_of = {c: max(0, n - 1) for c, n in live.update_counts().items()}  # the state before the latest update
        ev_live, ev_disk = live.evaluate([0, 1, 2, 3], state, as_of), disk.evaluate([0, 1, 2, 3], state, as_of)
        assert repr(ev_live) == repr(ev_disk)
    # what stays in memory is a handle per parked (or kept) state, never a tensor
    assert all(isinstance(disk.parked.handle_of(c), OnDisk) for c in disk.parked.clients())
    assert all(isinstance(k, OnDisk) for kept in disk.kept.values() for k in kept.values() if k is not None)
    held = {id(disk.parked.handle_of(c)) for c in disk.parked.clients()}
    held |= {id(k) for kept in disk.kept.values() for k in kept.values() if k is not None}
    assert disk.parked.files() == len(held)  # one file per state held, the replaced ones deleted
    # a checkpoint's view (chunk by chunk) equals the live host's, kept states included
    a, b = live.client_states([0, 2, 3]), disk.client_states([0, 2, 3])
    assert sorted(disk.stateful_clients()) == [0, 2, 3] and sorted(b[0]["kept"]) == sorted(a[0]["kept"])
    for c in (0, 2, 3):
        for k, v in a[c]["model"].items():
            assert torch.equal(v, b[c]["model"][k])
    # restored on disk from those states, a host continues exactly as the live one
    restored = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path))
    restored.load_state_dicts(copy.deepcopy(live.state_dicts()))
    assert restored.update_counts() == live.update_counts()
    _, ul = live.train(0, state)
    _, ur = restored.train(0, state)
    assert np.array_equal(ul.prototypes.vectors, ur.prototypes.vectors)


def test_a_worker_folder_is_removed_with_its_store_and_orphans_of_dead_workers_are_swept(tmp_path):
    store = ParkedStates.on_disk(str(tmp_path))
    folder = store.folder
    store.put(5, {"model": {}, "updates": 1})
    assert folder.parent == tmp_path / SUBDIR and store.files() == 1
    del store
    gc.collect()
    assert not folder.exists()
    closed = ParkedStates.on_disk(str(tmp_path))  # a run's end: the fleet asks each worker to close
    closed.put(1, {"model": {}, "updates": 1})
    closed.close()
    assert not closed.folder.exists() and len(closed) == 0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / SUBDIR / f"{int(dead.stdout)}-abc"
    orphan.mkdir()
    (orphan / "0-1-1.pt").write_bytes(b"x")
    mine = tmp_path / SUBDIR / f"{os.getppid()}-def"  # a live process: left alone
    mine.mkdir()
    assert remove_orphaned(tmp_path / SUBDIR) == [orphan] and mine.exists()


def test_an_unwritable_park_dir_is_refused_naming_the_key(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match="resources.park_dir"):
        ParkedStates.on_disk(str(blocker))


def test_park_to_auto_is_disk_above_a_thousand_clients_and_bad_values_name_the_key():
    res = build_config({}, []).resources
    assert (res.parks_on_disk(1000), res.parks_on_disk(1001)) == (False, True)
    assert build_config({}, ["resources.park_to=memory"]).resources.parks_on_disk(10_000) is False
    with pytest.raises(Exception, match="park_to"):
        build_config({}, ["resources.park_to=cloud"])
    with pytest.raises(Exception, match="park_idle_clients=false keeps every client live"):
        build_config({}, ["resources.park_idle_clients=false", "resources.park_to=disk"])
    disk = build_config({}, ["resources.park_to=disk"]).resources  # auto parking follows the ask for disk
    assert disk.parks_clients(20) and disk.parks_on_disk(20)


class _Actor:
    """A worker that parks in memory: it declines every file offered, so each state comes as bytes."""

    def __init__(self, adopts=()):
        self.calls, self.offers, self.adopts = [], [], set(adopts)
        self.restore = self  # actor.restore.remote(states, rng)
        self.adopt_files = type("Offer", (), {"remote": lambda _, files, rng=None: self._offer(files, rng)})()

    def _offer(self, files, rng):
        self.offers.append((sorted(files), rng))
        return [c for c in files if c not in self.adopts]

    def remote(self, states, rng=None):
        self.calls.append((sorted(states), rng))
        return sorted(states)


def _ckpt(clients, checksummed=True):
    files = {c: (f"/ckpt/clients/{c}.pt", 10, "ab") for c in (clients or range(1000))} if checksummed else {}
    return type("C", (), {"manifest": {"clients": clients}, "client_bytes": lambda self, c: b"state %d" % c,
                          "client_file": lambda self, c: files.get(c)})()


def test_a_resume_offers_the_files_first_then_sends_the_rest_in_chunks_with_the_rng_once(monkeypatch):
    monkeypatch.setattr(fleet_mod.ray, "get", lambda ref: ref)  # also called with the list of the last chunks
    ckpt = _ckpt(list(range(0, 140, 2)))
    actor = _Actor()
    assert fleet_mod._restore_clients([(actor, list(range(100)), "R")], ckpt, chunk=20) == 50
    assert actor.offers == [(list(range(0, 100, 2)), "R")]  # the RNG goes with the first call, the offer
    assert [len(c) for c, _ in actor.calls] == [20, 20, 10] and [r for _, r in actor.calls] == [None, None, None]
    assert sum((c for c, _ in actor.calls), []) == list(range(0, 100, 2))
    empty = _Actor()
    assert fleet_mod._restore_clients([(empty, [1, 3], "R")], ckpt) == 0
    assert empty.offers == [([], "R")] and empty.calls == []
    # a worker that parks on disk on the driver's node takes the files: only what it declines comes as bytes
    taker = _Actor(adopts=range(0, 100, 4))
    assert fleet_mod._restore_clients([(taker, list(range(100)), "R")], ckpt, chunk=20) == 50
    assert sum((c for c, _ in taker.calls), []) == list(range(2, 100, 4))
    # a manifest without checksums offers nothing: every state is read and checked by the driver
    old = _Actor(adopts=range(100))
    assert fleet_mod._restore_clients([(old, list(range(4)), "R")], _ckpt(None, checksummed=False)) == 4
    assert old.offers == [([], "R")] and old.calls == [([0, 1, 2, 3], None)]


def test_a_resume_keeps_two_chunks_in_flight_per_worker_and_sends_the_checked_bytes(monkeypatch):
    """The driver reads the next chunk while the workers load theirs: chunks go to the workers in
    turn, the driver waits for a worker's oldest chunk only once it has two in flight, and each
    file's bytes are sent as read (the worker loads them)."""
    events = []
    monkeypatch.setattr(fleet_mod.ray, "get", lambda ref: (events.append(("get", ref)), ref)[1])
    ckpt = _ckpt(None)

    def worker(name):
        w = _Actor()
        w.remote = lambda states, rng=None: (events.append(("send", name, sorted(states), rng)), (name, dict(states)))[1]
        return w

    a, b = worker("a"), worker("b")
    assert fleet_mod._restore_clients([(a, list(range(6)), "Ra"), (b, [10, 11], "Rb")], ckpt, chunk=2) == 8
    assert (a.offers, b.offers) == ([(list(range(6)), "Ra")], [([10, 11], "Rb")])
    assert events[0] == ("get", [list(range(6)), [10, 11]])  # both offers answered (declined) first
    events = events[1:]
    assert [e[1:] for e in events if e[0] == "send"] == [
        ("a", [0, 1], None), ("b", [10, 11], None), ("a", [2, 3], None), ("a", [4, 5], None)]
    assert [e[0] if e[0] == "get" else e[1] for e in events] == ["a", "b", "a", "get", "a", "get", "get"]
    assert events[3][1] == ("a", {0: b"state 0", 1: b"state 1"})  # a's oldest chunk is waited for first
    assert events[5][1] == ("a", {2: b"state 2", 3: b"state 3"})
    assert events[6][1] == [("a", {4: b"state 4", 5: b"state 5"}), ("b", {10: b"state 10", 11: b"state 11"})]


def _checkpointed(folder: Path, c: int, state: dict) -> tuple[Path, int, str]:
    import hashlib

    path = folder / "clients" / f"{c}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    data = path.read_bytes()
    return path, len(data), hashlib.sha256(data).hexdigest()


def test_a_checkpointed_state_is_parked_by_a_link_checked_and_not_loaded(tmp_path):
    store = ParkedStates.on_disk(str(tmp_path / "park"))
    path, size, sha = _checkpointed(tmp_path / "ckpt", 3, {"model": {"w": torch.arange(4.0)}, "updates": 7})
    assert store.adopt(3, path, size, sha) == {}  # no states kept for evaluations
    handle = store.handle_of(3)
    assert os.stat(handle.path).st_ino == os.stat(path).st_ino  # a hard link: nothing copied, nothing written
    assert store.updates(3) == 7 and torch.equal(store.get(3)["model"]["w"], torch.arange(4.0))
    # damaged after the checkpoint was written (same size, one byte changed): declined, so that the
    # driver reads it, checks it and refuses the resume naming the file (test_startup_faults)
    path4, size4, sha4 = _checkpointed(tmp_path / "ckpt", 4, {"model": {"w": torch.ones(64)}, "updates": 2})
    with open(path4, "r+b") as f:
        f.seek(size4 // 2)
        byte = f.read(1)
        f.seek(size4 // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert store.adopt(4, path4, size4, sha4) is None and 4 not in store
    # what else it declines, leaving no file behind: a size other than the manifest's, a file out
    # of reach (another node), kept entries that are not states, and a store in memory
    path5, size5, sha5 = _checkpointed(tmp_path / "ckpt", 5, {"model": {}, "updates": 1, "kept": {0: [1, 2]}})
    assert store.adopt(3, path, size + 1, sha) is None
    assert store.adopt(6, tmp_path / "elsewhere" / "6.pt", 10, sha) is None
    assert store.adopt(5, path5, size5, sha5) is None
    assert ParkedStates().adopt(3, path, size, sha) is None
    assert store.files() == 1 and 5 not in store and 6 not in store
    # kept entries naming the fresh start (None: no state needed) are taken, and the host is told
    path7, size7, sha7 = _checkpointed(tmp_path / "ckpt", 7, {"model": {"w": torch.zeros(2)}, "updates": 3,
                                                              "kept": {0: None}})
    assert store.adopt(7, path7, size7, sha7) == {0: None}
    assert "kept" not in store.get(7) and store.updates(7) == 3  # the host holds them, not the parked state
    store.pop(7)
    del handle
    store.pop(3)
    gc.collect()
    assert path.exists() and store.files() == 0  # the parked link goes, the checkpoint's file stays


def test_a_checkpointed_state_on_another_file_system_is_copied(tmp_path, monkeypatch):
    store = ParkedStates.on_disk(str(tmp_path / "park"))
    path, size, sha = _checkpointed(tmp_path / "ckpt", 1, {"model": {"w": torch.full((3,), 2.0)}, "updates": 4})

    def cross_device(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    assert store.adopt(1, path, size, sha) == {}
    assert os.stat(store.handle_of(1).path).st_ino != os.stat(path).st_ino
    assert torch.equal(store.get(1)["model"]["w"], torch.full((3,), 2.0)) and store.updates(1) == 4


def test_a_host_parking_on_disk_adopts_checkpointed_states_and_trains_on_them_as_if_sent(fed, tmp_path):
    """The same client state, adopted from its file or loaded from the bytes the driver sends,
    gives the same next local update to the bit."""
    cfg, ds, part = fed
    trained = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path / "a"))
    trained.train(2, GlobalState(version=0))
    state = trained.parked.get(2)
    path, size, sha = _checkpointed(tmp_path / "ckpt", 2, state)
    adopted = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path / "b"))
    assert adopted.adopt_files({2: (str(path), size, sha), 9: (str(tmp_path / "missing.pt"), 1, "x")}) == [9]
    sent = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path / "c"))
    sent.load_state_dicts({2: state})
    assert adopted.update_counts()[2] == sent.update_counts()[2] == 1
    a, b = adopted.train(2, GlobalState(version=0)), sent.train(2, GlobalState(version=0))
    for k, v in adopted.parked.get(2)["model"].items():
        assert torch.equal(v, sent.parked.get(2)["model"][k]), k
    assert a[0]["update"] == b[0]["update"] == 2
    live = ClientHost(cfg, ds, part.clients, CPU, park=False)
    assert live.adopt_files({2: (str(path), size, sha)}) == [2]  # not parking: the bytes path


def test_a_client_state_that_cannot_be_loaded_names_the_file():
    from rayfed_proto.runtime.checkpoint import CheckpointError, load_client_bytes

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    assert torch.equal(load_client_bytes("clients/3.pt", buf.getvalue())["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match="clients/3.pt"):
        load_client_bytes("clients/3.pt", b"not a torch file")


def test_parked_states_are_files_not_memory_for_many_clients(fed, tmp_path):
    """Memory follows the clients in flight: 40 parked updates leave 40 files and no tensors."""
    cfg, ds, part = fed
    disk = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path))
    for _ in range(10):
        for c in range(4):
            disk.train(c, GlobalState(version=0))
    assert disk.parked.files() == 4 and len(disk.parked) == 4 and disk.parked._written == 40
    assert sum(p.stat().st_size for p in Path(disk.parked.folder).glob("*.pt")) > 0


def test_a_state_that_cannot_be_written_says_where_and_which_keys_to_change(tmp_path, monkeypatch):
    def full(obj, f, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="resources.park_dir") as err:
        OnDisk(tmp_path / "x.pt", {"updates": 1})
    assert "No space left" in str(err.value) and not (tmp_path / "x.pt").exists()


def test_a_state_with_one_kept_for_an_evaluation_is_linked_too_and_evaluates_as_if_sent(fed, tmp_path):
    """Issue 45 item 4: a client whose update was in simulated flight at a stop keeps the state
    before it for evaluations; its checkpointed state is linked all the same (the kept one copied
    into a file of its own), and evaluates exactly as the bytes the driver would send."""
    cfg, ds, part = fed
    state = GlobalState(version=0)
    trained = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path / "a"))
    trained.train(1, state)
    trained.train(1, state, keep_from=1)  # update 2; the state after update 1 is kept
    checkpointed = trained.client_states([1])[1]
    assert set(checkpointed["kept"]) == {1}
    path, size, sha = _checkpointed(tmp_path / "ckpt", 1, checkpointed)
    adopted = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path / "b"))
    assert adopted.adopt_files({1: (str(path), size, sha)}) == []  # linked: no bytes to send
    assert os.stat(adopted.parked.handle_of(1).path).st_ino == os.stat(path).st_ino
    assert os.stat(adopted.kept[1][1].path).st_ino != os.stat(path).st_ino
    sent = ClientHost(cfg, ds, part.clients, CPU, park=True, parked=_on_disk(tmp_path / "c"))
    sent.load_state_dicts({1: checkpointed})
    for as_of in (1, 2):
        want = repr(trained.evaluate([1], state, as_of={1: as_of}))
        assert repr(adopted.evaluate([1], state, as_of={1: as_of})) == repr(sent.evaluate([1], state, as_of={1: as_of})) == want
    # before a checkpoint the worker drops what no evaluation can ask for: then nothing is kept
    trained.train(1, state, keep_from=2)
    trained.drop_kept({1: 3})
    assert trained.kept == {} and "kept" not in trained.client_states([1])[1]
    trained.train(2, state, keep_from=0)
    trained.drop_kept({2: None})  # outside the evaluated sample: none ever
    assert trained.kept == {}
