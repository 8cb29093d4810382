"""Federation policies through a fake port, the evaluation bookkeeping, and the states a worker
keeps for evaluations: all without Ray (runtime/policies.py, runtime/evaluations.py, ClientHost)."""

import math

import numpy as np
import pytest
import torch
from doubles import FakePort, FakeSystem

from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState
from rayfed_proto.runtime.client_core import ClientHost
from rayfed_proto.runtime.evaluations import Evaluations
from rayfed_proto.runtime.inflight import InFlight, Kind, Pending
from rayfed_proto.runtime.policies import AsyncSlots, ServerNeeds, SyncRounds, VirtualAsync, make_policy
from rayfed_proto.runtime.scheduler import SchedulerStats
from rayfed_proto.runtime.stepping import OnRequest, ServerThread, SimulatedSteps


def fed(**over):
    return build_config({}, [f"federation.{k}={v}" for k, v in over.items()]).federation


# ----------------------------------------------------------------------------- make_policy


def test_make_policy_is_the_one_reader_of_the_mode_and_declares_the_servers_needs():
    sync = make_policy(fed(mode="sync", num_clients=10, participation=0.25), None, seed=0, real_slots=2)
    assert isinstance(sync, SyncRounds) and sync.per_round == 3  # ceil(0.25 x 10)
    assert sync.needs == ServerNeeds(OnRequest(), max_staleness=math.inf)  # the driver asks; a round in client order
    assert not sync.waits_for_versions and sync.clock is None
    real = make_policy(fed(mode="async", buffer_size=3, max_staleness=7), None, seed=0, real_slots=2)
    assert isinstance(real, AsyncSlots) and real.concurrency == 2
    assert real.needs == ServerNeeds(ServerThread(3), max_staleness=7) and real.waits_for_versions
    virtual = make_policy(fed(mode="async", buffer_size=3, num_clients=6, concurrency=4), FakeSystem(np.ones(6)), seed=0, real_slots=2)
    assert isinstance(virtual, VirtualAsync) and virtual.concurrency == 4 and virtual.clock is not None
    # no inline step: the policy steps the server when its simulated step ends (the server's time on the clock)
    assert virtual.needs == ServerNeeds(SimulatedSteps(3), max_staleness=20) and virtual.needs.buffer_size == 3
    assert not virtual.waits_for_versions
    sync_clock = make_policy(fed(mode="sync"), FakeSystem(np.ones(6)), seed=0, real_slots=2)
    assert isinstance(sync_clock, SyncRounds) and sync_clock.clock is not None


# ----------------------------------------------------------------------------- policies on a fake port


def test_sync_rounds_dispatch_a_seeded_sample_and_step_once_every_update_is_in_or_lost():
    policy = make_policy(fed(mode="sync", num_clients=6, participation=0.5), None, seed=3, real_slots=2)
    port = FakePort(6)
    policy.bind(port)
    policy.fill()
    chosen = [c for kind, c in (e for e in port.log if e[0] == "dispatch")]
    assert len(chosen) == 3 and chosen == sorted(chosen)
    policy.fill()  # a round is running: nothing more
    assert len([e for e in port.log if e[0] == "dispatch"]) == 3
    first, second, third = (port.in_flight[c] for c in chosen)
    policy.on_update(first, {})
    policy.on_receipt({"accepted": True})
    policy.on_lost(second)  # its actor died: the round goes on without it
    assert ("step",) not in port.log
    policy.on_update(third, {})
    policy.on_receipt({"accepted": True})
    assert port.log.count(("step",)) == 1 and not policy.quiet()
    policy.on_new_version(1)
    assert policy.quiet() and policy.at_server() == 0
    # the same seed draws the same rounds
    again = make_policy(fed(mode="sync", num_clients=6, participation=0.5), None, seed=3, real_slots=2)
    port2 = FakePort(6)
    again.bind(port2)
    again.fill()
    assert [e for e in port2.log if e[0] == "dispatch"] == [("dispatch", c) for c in chosen]


def test_async_slots_fill_idle_actors_up_to_the_concurrency_and_hold_back_when_a_version_waits():
    policy = AsyncSlots(4, concurrency=2, needs=ServerNeeds(ServerThread(2), 20), rng=np.random.default_rng(0))
    port = FakePort(4, actor_of={0: 0, 1: 0, 2: 1, 3: 1})
    policy.bind(port)
    policy.fill()
    assert port.training() == 2 and {port.actor_of[c] for c in port.in_flight} == {0, 1}  # one per actor
    c = next(iter(port.in_flight))
    policy.on_update(port.in_flight[c], {})
    policy.fill()  # one submitted, receipt not back: one more may start (K = 2)
    assert port.training() == 2
    c = next(iter(port.in_flight))
    policy.on_update(port.in_flight[c], {})
    policy.fill()  # two unreported: a full next version may wait at the server, hold back
    assert port.training() == 1
    policy.on_receipt({"accepted": True, "backlog": 0, "version": 1})
    policy.fill()
    assert port.training() == 2


# ----------------------------------------------------------------------------- evaluations


def make_evals(counts, eval_every=1, rounds=5):
    logged = {}
    evals = Evaluations(eval_every, rounds, counts, 0, SchedulerStats(), lambda v, m: logged.__setitem__(v, m),
                        real_slots=1, resolve=lambda ref: ref)
    return evals, logged


def test_as_of_is_each_clients_latest_update_handled_before_the_version():
    evals, _ = make_evals({0: 0, 1: 0})
    launched = []
    evals.handed(0, 1, at=0)  # client 0's first update, handled while the server was at version 0
    evals.formed(1, "state1", lambda: ())
    evals.handed(0, 2, at=1)  # its second update arrived after version 1 was formed
    evals.handed(1, 1, at=1)
    evals.formed(2, "state2", lambda: ())
    evals.start_ready(lambda v, ref, as_of: launched.append((v, ref, as_of)) or 1)
    assert launched == [(1, "state1", {0: 1, 1: 0}), (2, "state2", {0: 2, 1: 1})]


def test_an_evaluation_waits_for_the_receipts_of_submissions_made_before_its_version_was_seen():
    evals, _ = make_evals({0: 0})
    launched = []
    ticket = evals.ticket()  # submitted; the server reports version 1 before this receipt is back
    evals.formed(1, "s1", lambda: ())
    evals.start_ready(lambda v, ref, as_of: launched.append((v, as_of)) or 1)
    assert launched == []  # the update may have been accepted before version 1
    later = evals.ticket()  # made after version 1 was seen: does not hold it back
    evals.handed(0, 1, at=0, ticket=ticket)
    evals.start_ready(lambda v, ref, as_of: launched.append((v, as_of)) or 1)
    assert launched == [(1, {0: 1})]
    evals.handed(0, 2, at=1, ticket=later)


def test_keep_from_is_the_oldest_state_an_evaluation_not_started_may_ask_for():
    evals, _ = make_evals({0: 0}, eval_every=1)
    evals.handed(0, 1, at=0)
    assert evals.keep_from(0) == 1  # the next version (1) will see update 1 or later
    evals.formed(1, "s1", lambda: ())  # formed, not started yet
    evals.handed(0, 2, at=1)
    assert evals.keep_from(0) == 1  # version 1's evaluation still asks for update 1
    evals.start_ready(lambda v, ref, as_of: 1)
    assert evals.keep_from(0) == 2


def test_a_result_newer_than_its_version_breaks_the_invariant_loudly():
    evals, logged = make_evals({0: 0})
    evals.formed(1, "s1", lambda: (SchedulerStats(), 1.0, float("nan"), {}))
    evals.start_ready(lambda v, ref, as_of: 1)
    with pytest.raises(RuntimeError, match="saw client 0 after 1 local updates"):
        evals.result(1, [{"client_id": 0, "state_version": 1, "update": 1, "n": 1, "head_correct": 1}])
    assert logged == {}


def test_after_a_server_restart_the_redone_versions_see_the_updates_the_dead_server_handled():
    evals, _ = make_evals({0: 0})
    launched = []
    evals.handed(0, 1, at=0)
    for v in (1, 2, 3):
        evals.formed(v, f"s{v}", lambda: ())
    evals.handed(0, 2, at=2)  # handled by the server that dies at version 3
    evals.start_ready(lambda v, ref, as_of: 1)
    evals.server_restarted(1)  # back to the checkpoint of version 1; the client keeps its state
    evals.formed(2, "s2 again", lambda: ())
    evals.start_ready(lambda v, ref, as_of: launched.append((v, as_of)) or 1)
    assert launched == [(2, {0: 2})]
    assert evals.keep_from(0) == 2


def test_evaluations_are_logged_in_version_order_whichever_finishes_first():
    order = []
    evals = Evaluations(1, 5, {0: 0, 1: 0}, 0, SchedulerStats(), lambda v, m: order.append(v), real_slots=1,
                        resolve=lambda ref: ref)
    server = {"margin": (1.0, 2.0), "staleness_mean": 0.0, "staleness_max": 0, "accepted": 0, "dropped_stale": 0,
              "late": 0, "rolled_back": 0, "refused": 0, "server_train_s": 0.0}
    for v in (1, 2):
        evals.formed(v, f"s{v}", lambda: (SchedulerStats(), 1.0, float("nan"), server))
    evals.start_ready(lambda v, ref, as_of: 2)  # two workers each
    result = {"state_version": 0, "update": 0, "n": 1, "head_correct": 1, "proto_correct": 0}
    for c in (0, 1):  # version 2's workers answer first (version 1 has a slow worker)
        evals.result(2, [{**result, "client_id": c, "state_version": 2}])
    evals.result(1, [{**result, "client_id": 0, "state_version": 1}])
    assert order == [] and evals.busy()  # version 2 is done, but version 1 is still running
    evals.result(1, [{**result, "client_id": 1, "state_version": 1}])
    assert order == [1, 2] and not evals.busy()


def test_a_server_restart_drops_the_evaluations_of_versions_that_no_longer_exist():
    evals, _ = make_evals({0: 0})
    for v in (1, 2, 3):
        evals.formed(v, f"s{v}", lambda: ())
    evals.start_ready(lambda v, ref, as_of: 1)
    evals.server_restarted(1)
    assert sorted(evals.running) == [1] and evals.newest == 1


# ----------------------------------------------------------------------------- the states a worker keeps


@pytest.fixture(scope="module")
def host_data():
    cfg = build_config({}, ["algorithm.name=fedproto", "federation.num_clients=3", "model.feature_dim=16",
                            "data.partition.beta=1.0"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 3, cfg.seed, cfg.data.test_fraction)
    return cfg, ds, part


@pytest.mark.parametrize("park", [False, True])
def test_a_worker_evaluates_the_state_asked_for_after_later_updates_ran(host_data, park):
    cfg, ds, part = host_data
    cpu = torch.device("cpu")
    host = ClientHost(cfg, ds, part.clients, cpu, park=park)
    reference = ClientHost(cfg, ds, part.clients, cpu, park=park)  # the same client, evaluated at each step
    state = GlobalState(version=0)
    at = {0: reference.evaluate([0], state)[0]}
    for n in (1, 2):
        reference.train(0, state)
        at[n] = reference.evaluate([0], state)[0]
    host.train(0, state, keep_from=0)  # update 1; the initial state is kept
    host.train(0, state, keep_from=0)  # update 2; state 1 is kept too
    same = lambda got, want: repr(got) == repr([want])  # noqa: E731  (NaN train loss before the first update)
    assert same(host.evaluate([0], state, as_of={0: 0}), at[0])
    assert same(host.evaluate([0], state, as_of={0: 1}), at[1])
    assert same(host.evaluate([0], state, as_of={0: 2}), at[2])  # the newest, and the client is left as it was
    assert same(host.evaluate([0], state), at[2])
    assert at[0]["head_correct"] != at[2]["head_correct"] and at[1]["train_loss"] != at[2]["train_loss"]
    with pytest.raises(RuntimeError, match="asks for its state after 1 local updates"):
        host.evaluate([0], state, as_of={0: 1})  # dropped: an evaluation asked for 2 already
    assert host.update_counts() == {0: 2, 1: 0, 2: 0}


def test_a_worker_keeps_nothing_no_evaluation_can_ask_for(host_data):
    cfg, ds, part = host_data
    host = ClientHost(cfg, ds, part.clients, torch.device("cpu"))
    state = GlobalState(version=0)
    host.train(1, state)  # no keep_from: no evaluation will ask
    assert host.kept == {}
    host.train(1, state, keep_from=1)  # state 1 may be asked for
    host.train(1, state, keep_from=2)  # only 2 and later now
    assert sorted(host.kept[1]) == [2]


def test_pick_one_draws_exactly_what_rng_choice_draws_and_leaves_the_stream_where_it_would():
    from rayfed_proto.runtime.policies import pick_one

    for seed in range(50):
        for n in (1, 2, 7, 10_000):
            items = list(range(5, 5 + n))
            a, b = np.random.default_rng(seed), np.random.default_rng(seed)
            assert [int(a.choice(items)) for _ in range(3)] == [pick_one(b, items) for _ in range(3)]
            assert a.random() == b.random()


def test_eligible_clients_are_the_idle_not_excluded_ones_in_client_order():
    from types import SimpleNamespace

    from rayfed_proto.runtime.scheduler import Scheduler

    actor_of = {c: c % 3 for c in range(50)}
    inflight = InFlight()
    for i, (k, c) in enumerate([(Kind.TRAIN, 4), (Kind.EVAL, 5), (Kind.TRAIN, 30)]):
        inflight.add(i, Pending(None, k, client=c, actor=actor_of[c]))
    s = SimpleNamespace(inflight=inflight, actor_of=actor_of, stats=SimpleNamespace(excluded=[7, 4]))
    want = [c for c in range(50) if c not in (4, 7, 30)]  # an evaluation in flight does not make a client busy
    assert Scheduler.eligible(s) == want and all(type(c) is int for c in Scheduler.eligible(s))
    assert Scheduler.eligible(s, one_per_actor=True) == [c for c in want if actor_of[c] == 2]  # workers 1, 0 busy
    s.stats.excluded, s.inflight = [], InFlight()
    assert Scheduler.eligible(s) == list(range(50))


@pytest.mark.parametrize("park", [False, True, "disk"])
def test_a_lost_update_is_discarded_the_client_goes_back_to_its_state_before_it(host_data, park, tmp_path):
    """Issue 35 item 9: an update dispatched ``undoable`` (its client may go offline first) and then
    lost is discarded: the client's whole state (model, optimizer, RNG streams, count) goes back to
    before it, so the next update is the one the lost update would have been, from the same state."""
    from rayfed_proto.runtime.parking import ParkedStates

    cfg, ds, part = host_data
    cpu = torch.device("cpu")

    def make():
        store = ParkedStates.on_disk(str(tmp_path)) if park == "disk" else None
        return ClientHost(cfg, ds, part.clients, cpu, park=bool(park), parked=store)

    host, reference = make(), make()
    state = GlobalState(version=0)
    host.train(0, state)
    reference.train(0, state)
    lost_meta, lost = host.train(0, state, undoable=True)
    assert host.discard(0) and host.update_counts()[0] == 1
    assert not host.discard(0)  # nothing kept any more: a second discard changes nothing
    meta, again = host.train(0, state)
    ref_meta, expected = reference.train(0, state)
    assert meta["update"] == ref_meta["update"] == 2
    assert torch.equal(torch.as_tensor(again.prototypes.vectors), torch.as_tensor(expected.prototypes.vectors))
    same = host.evaluate([0], state)[0], reference.evaluate([0], state)[0]
    assert same[0]["head_correct"] == same[1]["head_correct"] and same[0]["train_loss"] == same[1]["train_loss"]
    # a client whose first update is lost goes back to its seeded initial state
    host.train(1, state, undoable=True)
    assert host.discard(1) and host.update_counts()[1] == 0
    assert host.evaluate([1], state)[0]["head_correct"] == reference.evaluate([1], state)[0]["head_correct"]
    # an update not dispatched undoable keeps its training (a worker restored from a checkpoint since)
    host.train(2, state)
    assert not host.discard(2) and host.update_counts()[2] == 1


def test_eval_clients_is_a_fixed_seeded_sample_and_its_states_alone_are_asked_for():
    """Issue 39 item 2: federation.eval_clients: all, a number or a fraction, drawn once from the seed
    (the same clients at every version); the others are never evaluated, so no state is kept for them."""
    from rayfed_proto.config import ConfigError
    from rayfed_proto.runtime.evaluations import eval_sample

    assert eval_sample("all", 10, 0) is None and eval_sample(10, 10, 0) is None and eval_sample(1.0, 10, 0) is None
    three = eval_sample(3, 10, 0)
    assert len(three) == 3 and three == sorted(three) and three == eval_sample(3, 10, 0)
    assert eval_sample(0.25, 10, 0) == eval_sample(3, 10, 0)  # ceil(0.25 x 10) = 3, the same draw
    assert any(eval_sample(3, 10, s) != three for s in (1, 2, 3))  # the seed decides
    sample = eval_sample(2, 4, 7)
    logged = {}
    evals = Evaluations(1, 5, {c: 0 for c in range(4)}, 0, SchedulerStats(), lambda v, m: logged.__setitem__(v, m),
                        real_slots=1, resolve=lambda ref: ref, sample=sample)
    asked = []
    evals.formed(1, "s1", lambda: ())
    evals.start_ready(lambda v, ref, as_of: asked.append(as_of) or 1)
    assert [sorted(a) for a in asked] == [sample]
    others = [c for c in range(4) if c not in sample]
    assert all(evals.keep_from(c) is None for c in others) and all(evals.keep_from(c) == 0 for c in sample)
    with pytest.raises(ConfigError, match=r"federation.eval_clients = 0: must be all, a number of clients >= 1"):
        build_config({}, ["federation.eval_clients=0"])
    with pytest.raises(ConfigError, match=r"federation.eval_clients = 30: all, at most federation.num_clients \(20\)"):
        build_config({}, ["federation.eval_clients=30"])


def test_start_ready_trims_only_the_clients_whose_log_can_shrink():
    """Issue 39 item 4: trimming every client's log at every scheduler step cost 15 ms per update at
    10,000 clients. Only clients with more than one entry are kept in ``long`` and trimmed; the logs
    are as short as before and every state asked for is the same."""
    evals, _ = make_evals({c: 0 for c in range(1000)}, eval_every=5, rounds=10)
    assert evals.long == set()
    for c in range(0, 1000, 100):
        evals.handed(c, 1, 0)  # handed at version 0: counts for version 1 on
    evals.formed(1, "s1", lambda: ())  # not due (eval_every 5): the oldest asked moves to 2
    evals.start_ready(lambda v, ref, as_of: 1)
    assert evals.long == set() and all(len(log) == 1 for log in evals.log.values())
    assert evals.keep_from(100) == 1 and evals.keep_from(101) == 0
    evals.formed(5, "s5", lambda: ())  # due: queued until earlier receipts are back
    t = evals.ticket()
    evals.handed(200, 2, 5, t)  # at version 5: the evaluation of 5 still asks for state 1
    assert evals.long == {200} and evals.keep_from(200) == 1
    asked = []
    evals.start_ready(lambda v, ref, as_of: asked.append(as_of) or 1)
    assert asked[0][200] == 1 and asked[0][100] == 1 and asked[0][101] == 0
    # started: no evaluation waits any more, later ones ask for state 2 at the earliest, the log shrinks
    assert evals.long == set() and evals.log[200] == [(2, 5)]
