"""The server's time on the virtual clock (issue 39 item 1): a server step takes the work its method
declares at ``system.server``'s speed; updates arriving meanwhile wait for the next step and
replacements train against the current version, as with the real runtime's training thread."""

import math

import numpy as np
import pytest
from doubles import FakePort, FakeSystem

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.algorithms.base import ServerPass, ServerSizes
from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.runtime.policies import ServerNeeds, VirtualAsync
from rayfed_proto.runtime.simclock import VirtualClock
from rayfed_proto.runtime.stepping import SimulatedSteps
from rayfed_proto.system import SystemModel, server_speed, server_step_work_s


class Federation(FakePort):
    """The scheduler's port with a server by hand: buffer, versions, staleness at submission. A
    client is in flight (not eligible) until its update is handed over or lost."""

    def __init__(self, policy, rounds: int, k: int):
        super().__init__(policy.num_clients, rounds=rounds, logged=())
        self.k, self.policy = k, policy
        self.buffer, self.staleness, self.trained_on, self.versions_at = [], [], [], []
        self.arrived, self.dispatches = [], []  # updates in arrival order; (client, version, time) per dispatch
        self.taken = []  # per version: (client, base version) of the updates it aggregated

    def dispatch(self, client):
        self.trained_on.append((client, self.version))
        self.dispatches.append((client, self.version, self.policy.clock.now))
        return super().dispatch(client)  # its update: (client, base version)

    def hand_over(self, update, client, meta):
        self.in_flight.pop(client)
        self.staleness.append(self.version - update[1])
        self.buffer.append(update)
        self.arrived.append(update)
        self.policy.on_receipt({"accepted": True, "version": self.version})
        return True

    def step_now(self):
        self.taken.append(self.buffer[: self.k])
        self.buffer = self.buffer[self.k:]
        self.version += 1
        self.versions_at.append(self.policy.clock.now)
        self.policy.on_new_version(self.version)
        return True

    def version_at(self, t):
        """The newest version formed by simulated time ``t``."""
        return sum(1 for at in self.versions_at if at <= t)

    def dropped_offline(self, client, meta):
        self.in_flight.pop(client)


def system(n: int, step_s: float) -> FakeSystem:
    """Clients of different speeds; a server step of ``step_s`` simulated seconds."""
    return FakeSystem(10.0 + 7.0 * (np.arange(n) % 5), step_s=step_s)


def run(step_s: float, rounds: int = 12, k: int = 3, n: int = 10, concurrency: int = 5, seed: int = 0):
    clock = VirtualClock(system(n, step_s), seed)
    policy = VirtualAsync(n, concurrency, ServerNeeds(SimulatedSteps(k), math.inf),
                          np.random.default_rng(seed), clock)
    fed = Federation(policy, rounds, k)
    policy.bind(fed)
    while fed.version < rounds:
        policy.fill()
        for e in [e for e in clock.entries.values() if not e.exact]:  # the real computations come back
            policy.on_update(e.token, {"download_bytes": 0, "upload_bytes": 0})
    return fed


def test_a_heavy_server_step_shows_more_staleness_exactly_and_reproducibly():
    free, heavy = run(0.0), run(8.0)
    assert np.mean(heavy.staleness) > np.mean(free.staleness)
    # a step takes 8 simulated seconds: versions come at least that far apart
    assert all(b - a >= 8.0 for a, b in zip(heavy.versions_at, heavy.versions_at[1:], strict=False))
    again = run(8.0)  # exactly the same run
    assert (again.staleness, again.trained_on, again.versions_at, again.taken) == (
        heavy.staleness, heavy.trained_on, heavy.versions_at, heavy.taken)


def test_a_version_takes_the_k_oldest_updates_and_later_arrivals_wait_for_the_next_step():
    fed = run(8.0)
    handed = [u for version in fed.taken for u in version]
    assert all(len(t) == 3 for t in fed.taken)
    arrived = fed.arrived[: len(handed)]
    assert handed == arrived  # versions take the updates in arrival order, K each, none skipped
    # while a step runs (it ends less than 8 s later), replacements still train against the version before it
    assert any(at_dispatch < fed.version_at(t + 7.9) for _, at_dispatch, t in fed.dispatches)


def test_a_free_server_steps_at_the_instant_the_kth_update_arrives():
    fed = run(0.0)
    # the replacement dispatched with the K-th arrival trains against the new version: versions and
    # handovers interleave as with the inline aggregation before system.server existed
    assert fed.taken[0] == sorted(fed.taken[0], key=lambda u: fed.trained_on.index(u))[:3]
    assert [base for _, base in fed.trained_on[5:8]] == [0, 0, 1]  # replacements of arrivals 1, 2, 3 (= K)


def test_fedtgp_declares_its_generator_epochs_and_fedproto_nothing():
    sizes = ServerSizes(updates=5, num_classes=10, feature_dim=64, classes_per_update=4.0, uploaders=20)
    tgp = ALGORITHMS.get("fedtgp")
    opts = build_config({}, ["algorithm.name=fedtgp", "algorithm.server_epochs=100",
                             "algorithm.server_batch_size=10", "algorithm.hidden_dim=0",
                             "algorithm.aggregation_scope=buffer"]).algorithm_options()
    work = tgp.Server.server_work(opts, sizes)
    steps = 100 * 2  # 5 updates x 4 classes = 20 pairs: 2 batches of 10, for 100 epochs
    assert work[0] == ServerPass("generator", steps * 10, backward=True, macs=2 * 64 * 64)
    # 200 steps x 10 classes x 2 x 64 x 64 MACs x 2 FLOPs x 3 passes, plus distances and the bank, at 1 GFLOP/s
    expected = (steps * 10 * 2 * 64 * 64 * 2 * 3 + steps * 10 * 10 * 64 * 2 * 3 + 10 * 2 * 64 * 64 * 2) / 1e9
    assert server_step_work_s(work, {}, 1e9) == pytest.approx(expected)
    opts_latest = opts.model_copy(update={"aggregation_scope": "latest"})
    # 20 uploaders x 4 = 80 pairs; server_work per_update (the default) trains 100 x 5 / 20 = 25
    # epochs on them, the reference's work per client update, as the step itself does (epochs_for)
    assert tgp.Server.server_work(opts_latest, sizes)[0].samples == 25 * 8 * 10
    per_version = opts_latest.model_copy(update={"server_work": "per_version"})
    assert tgp.Server.server_work(per_version, sizes)[0].samples == 100 * 8 * 10
    proto = ALGORITHMS.get("fedproto")
    assert proto.Server.server_work(build_config({}, ["algorithm.name=fedproto"]).algorithm_options(), sizes) == []


def test_fedprotokd_declares_its_server_model_on_the_public_set_in_its_architecture():
    kd = ALGORITHMS.get("fedprotokd")
    opts = build_config({}, ["algorithm.name=fedprotokd", "data.public_size=100"]).algorithm_options()
    work = kd.Server.server_work(opts, ServerSizes(updates=5, num_classes=10, feature_dim=64, public=100,
                                                   classes_per_update=4.0))
    model = [p for p in work if p.what == "server_model"]
    assert model == [ServerPass("server_model", opts.server_epochs * 100, backward=True, arch=opts.server_arch),
                     ServerPass("server_model", 2 * 100, backward=False, arch=opts.server_arch)]
    # an architecture's pass costs its seconds per training sample, a third of it forward only
    assert server_step_work_s(model, {opts.server_arch: 0.5}, 1e9) == pytest.approx(
        opts.server_epochs * 100 * 0.5 + 200 * 0.5 / 3)


def test_system_server_speed_forms_and_the_model_charges_the_declared_work():
    cfg = build_config({"system": {}})
    assert cfg.system.server.kind == "constant" and server_speed(cfg.system.server, 0) == 1.0  # default: the median client
    assert server_speed(build_config({"system": {"server": {"kind": "free"}}}).system.server, 0) is None
    draw = server_speed(build_config({"system": {"server": {"kind": "lognormal", "sigma": 1.0}}}).system.server, 3)
    assert draw == server_speed(build_config({"system": {"server": {"kind": "lognormal", "sigma": 1.0}}}).system.server, 3)
    with pytest.raises(ConfigError, match=r"system.server.kind = 'csv': one of constant, lognormal, free"):
        build_config({"system": {"server": {"kind": "csv"}}})
    work = lambda updates, uploaders: [ServerPass("g", 10 * updates, backward=True, macs=1000)]  # noqa: E731
    model = SystemModel([1.0, 1.0], ["cnn", "cnn"], {"cnn": 0.01}, [5, 5], 1, server_speed=2.0, server_work=work)
    assert model.server_step_s(3) == pytest.approx(30 * 1000 * 2 * 3 / 1e9 / 2.0)
    free = SystemModel([1.0, 1.0], ["cnn", "cnn"], {"cnn": 0.01}, [5, 5], 1, server_speed=None, server_work=work)
    assert free.server_step_s(3) == 0.0
