"""The virtual clock: releases in simulated finish order whatever order real work returns in."""

import itertools

import pytest
from doubles import FakeSystem

from rayfed_proto.runtime.simclock import VirtualClock


def system(compute_s):
    """compute_s per client; transfers at 100 bytes/s both ways; client 2 online in [50, 60) only."""
    return FakeSystem(compute_s, bytes_per_s=100.0, windows={2: (50.0, 60.0)})


def meta(down=0, up=0):
    return {"download_bytes": down, "upload_bytes": up}


def run_order(return_order):
    """Three updates started at t=0 (compute 5, 1, 3 s; uploads 0, 600, 0 bytes): whatever order
    the real computations return in, releases follow simulated finish times 3 (c2), 5 (c0), 7 (c1)."""
    clock = VirtualClock(system([5.0, 1.0, 3.0]), seed=0)
    entries = {c: clock.start(c, token=c) for c in range(3)}
    uploads = {0: 0, 1: 600, 2: 0}
    released = []
    for c in return_order:
        clock.finish(entries[c], meta(up=uploads[c]), update=f"u{c}")
        while (e := clock.pop_ready()) is not None:
            released.append((e.client, e.finish, clock.now))
    return released


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_release_order_is_simulated_finish_order_for_every_real_return_order(order):
    assert run_order(order) == [(2, 3.0, 3.0), (0, 5.0, 5.0), (1, 7.0, 7.0)]


def test_an_entry_is_not_released_while_an_unfinished_one_may_finish_earlier():
    clock = VirtualClock(system([5.0, 1.0]), seed=0)
    slow, fast = clock.start(0, 0), clock.start(1, 1)
    clock.finish(slow, meta(), "u0")  # exact 5.0; client 1's lower bound 1.0 is smaller
    assert clock.pop_ready() is None
    clock.finish(fast, meta(down=100), "u1")  # exact 1 + 1 = 2.0
    assert clock.pop_ready().client == 1 and clock.now == 2.0
    assert clock.pop_ready().client == 0 and clock.now == 5.0


def test_ties_break_by_dispatch_order():
    clock = VirtualClock(system([2.0, 2.0]), seed=0)
    a, b = clock.start(0, 0), clock.start(1, 1)
    clock.finish(b, meta(), "u1")
    clock.finish(a, meta(), "u0")
    assert [clock.pop_ready().client, clock.pop_ready().client] == [0, 1]


def test_offline_clients_are_not_offered_and_the_clock_waits_for_a_window():
    clock = VirtualClock(system([1.0, 1.0, 1.0]), seed=0)
    assert clock.online([0, 1, 2]) == [0, 1]
    clock.wait_for_online([2])
    assert clock.now == 50.0 and clock.online([2]) == [2]
    clock.now = 61.0
    from rayfed_proto.runtime.progress import NoProgressError

    with pytest.raises(NoProgressError, match="system.availability"):  # the driver's clean failure, not a crash
        clock.wait_for_online([2])


def test_state_round_trip_keeps_clock_draws_and_pending_updates():
    clock = VirtualClock(system([5.0, 1.0]), seed=3)
    e0, e1 = clock.start(0, 0), clock.start(1, 1)
    clock.finish(e0, meta(), "ref0")
    clock.finish(e1, meta(up=100), "ref1")
    clock.rng.random(4)
    state = clock.state_dict(resolve=lambda ref: "update-of-" + ref)
    again = VirtualClock(system([5.0, 1.0]), seed=99)
    again.load_state_dict(state, store=lambda u: "new-" + u)
    assert again.now == clock.now and again.seq == clock.seq
    assert again.rng.random() == clock.rng.random()
    out = [again.pop_ready() for _ in range(2)]
    assert [(e.client, e.finish, e.update) for e in out] == [(1, 2.0, "new-update-of-ref1"), (0, 5.0, "new-update-of-ref0")]
