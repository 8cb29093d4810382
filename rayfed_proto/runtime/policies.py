"""Federation policies: how local updates are handed out and when the server aggregates.

A policy is the federation mode as one object. It declares what the rest of the runtime needs to
know (:class:`ServerNeeds`: when the server steps, as a :mod:`stepping strategy
<rayfed_proto.runtime.stepping>`, and the staleness bound; whether the driver learns of versions by waiting on the server) and
works the federation through a narrow :class:`Port` (dispatch a local update, submit an update,
ask for a server step, the clients that may be dispatched). A policy class is registered under
its ``federation.mode`` name in :data:`POLICIES` and owns that mode: its config rules, the real
slots and local updates it needs, how it is built, its summary rows. Nothing else in the project
branches on the mode: the config, the resource planners and the driver ask the registered class.

* :class:`SyncRounds`: a seeded sample of ceil(rho N) clients per round, all dispatched at once
  (they queue on their workers); the server steps once every update of the round is in;
* :class:`AsyncSlots`: ``concurrency`` updates in flight in real time; the server's training
  thread aggregates every K accepted updates (FedBuff-style) and the driver waits for versions;
* :class:`VirtualAsync`: the same federation in simulated time (``system:`` profiles): updates
  are handed to the server strictly in order of simulated finish time
  (:mod:`rayfed_proto.runtime.simclock`), so a run's results do not depend on real timing.
  :class:`SyncRounds` takes the clock too: a round lasts as long as its slowest client, or, with
  ``federation.round_deadline_s`` / ``over_selection`` (FedScale), until its deadline or its first
  K finished updates (the rest dropped and counted).

Adding a policy: subclass :class:`BasePolicy` (the methods of :class:`FederationPolicy`, and the
class methods it overrides) and register it, ``@POLICIES.register("round_robin")``, in any module
imported before the config is built (tests/integration/test_policy_registry.py defines one in the
test module and runs it), or in a package's module declared as an entry point of group
``rayfed_proto.policies`` (loaded at the end of this module, so CLI and Tune processes see it
too); docs/architecture.md walks through one.
No Ray here: policies are tested with a fake port.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from rayfed_proto.registry import Registry, load_plugins
from rayfed_proto.runtime.inflight import Pending
from rayfed_proto.runtime.simclock import VirtualClock
from rayfed_proto.runtime.stepping import OnRequest, ServerThread, SimulatedSteps, Stepping


@dataclass(frozen=True)
class ServerNeeds:
    """What a policy asks of the server actor (:class:`rayfed_proto.runtime.server_core.ServerCore`)."""

    stepping: Stepping  # when a version forms (runtime/stepping.py): the behaviour, not flags
    max_staleness: float  # accepted updates trained at most this many versions ago

    @property
    def buffer_size(self) -> Optional[int]:
        """K accepted updates per version; None: the driver asks for each step."""
        return self.stepping.buffer_size


class Port(Protocol):
    """What a policy may do to the federation; the scheduler implements it."""

    version: int  # the newest version the driver knows
    rounds: int

    def accepting(self) -> bool: ...  # new work may start: versions left, not draining for a checkpoint or stop

    def dispatch(self, client: int) -> Pending: ...  # a local update against the newest version

    def dispatch_group(self, clients: list[int]) -> list[Pending]: ...  # several at once (one batched call per worker)

    def submit(self, p: Pending, meta: dict[str, Any]) -> None: ...  # hand an update over; the receipt comes back

    def hand_over(self, update: Any, client: int, meta: dict[str, Any]) -> bool: ...  # submit and take the receipt now; False: the server died

    def request_step(self) -> None: ...  # aggregate what the server holds into the next version

    def step_now(self) -> bool: ...  # aggregate K buffered updates now and take the version; False: the server died

    def eligible(self, one_per_actor: bool = False) -> list[int]: ...  # not excluded, nothing in flight

    def training(self) -> int: ...  # local updates in flight (real)

    def account(self, client: int, meta: dict[str, Any]) -> None: ...  # count a local update's cost and terms

    def lost_at_server(self, n: int) -> None: ...  # updates back but never handed over (a server died)

    def dropped_offline(self, client: int, meta: dict[str, Any]) -> None: ...  # its client went offline before it finished

    def dropped_by_round(self, client: int, meta: dict[str, Any], reason: str) -> None: ...  # sync: "deadline" | "over_selection"


class FederationPolicy(Protocol):
    needs: ServerNeeds
    waits_for_versions: bool  # the server produces versions on its own; the driver waits for them
    concurrency: int  # updates in flight at once (simulated ones with a clock)
    clock: Optional[VirtualClock]
    rng: np.random.Generator  # the client sampling stream (checkpointed)

    def bind(self, port: Port) -> None: ...
    def fill(self) -> None: ...  # dispatch what may start now (virtual clock: release finished updates too)
    def on_update(self, p: Pending, meta: dict[str, Any]) -> None: ...  # a local update came back
    def on_late(self, p: Pending, meta: dict[str, Any]) -> bool: ...  # came back after the last version; kept?
    def on_receipt(self, receipt: dict[str, Any]) -> None: ...
    def on_server_report(self, backlog: int, version: int) -> None: ...  # the buffer's fill, read at a version
    def on_lost(self, p: Pending) -> None: ...  # its actor died
    def on_new_version(self, version: int) -> None: ...
    def may_lose(self, client: int) -> bool: ...  # an update dispatched now may be lost (keep the state before it)
    def exclude(self, client: int) -> None: ...
    def quiet(self) -> bool: ...  # nothing the policy holds back is real work in flight
    def at_server(self) -> int: ...  # updates the server holds that a restart would lose
    def held_back(self) -> int: ...  # updates back but never handed over (end of run)
    def server_restarted(self, version: int) -> None: ...
    def sim_now(self) -> float: ...
    def state_dict(self, resolve: Callable[[Any], Any]) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], store: Callable[[Any], Any]) -> None: ...
    def concurrency_label(self) -> str: ...  # what runs at once, in words (the summary)
    def start_label(self, real_slots: int) -> str: ...  # the same, on the planned real slots (the start line)
    def server_counters(self, ref: Any, fetch: Callable[[Any], Any]) -> Any: ...  # read now or later
    def summary_rows(self, stats) -> dict[str, str]: ...  # the summary's rows of this policy's counters


POLICIES: Registry[type] = Registry("federation mode")
"""``federation.mode`` -> the policy class that owns it (its config rules, resource needs, build, rows)."""

Issue = tuple[str, Any, str]  # (dotted config key, its value, what is allowed): config.py makes a ConfigIssue of it


def policy_class(federation) -> type[BasePolicy]:
    """The class registered for ``federation.mode`` (an unknown mode names the registered ones)."""
    return POLICIES.get(federation.mode)


def make_policy(federation, system, *, seed: int, real_slots: int) -> FederationPolicy:
    """The run's policy, built by the class registered for ``federation.mode``, with a virtual clock
    when a ``system`` model is present. ``real_slots``: updates that can run at once on the workers."""
    rng = np.random.default_rng([seed, 0x5C4ED])  # client sampling stream
    clock = VirtualClock(system, seed) if system is not None else None
    return policy_class(federation).build(federation, clock, rng, real_slots)


def min_real_slots(federation, virtual_clock: bool) -> Optional[int]:
    """The real slots the run's policy needs, checked when resources are planned (None: any)."""
    return policy_class(federation).min_real_slots(federation, virtual_clock)


def min_update_starts(federation, start_version: int = 0) -> int:
    """The fewest local updates that must start for the run to go from ``start_version`` to
    ``federation.rounds`` (the availability check before Ray starts)."""
    return max(0, federation.rounds - start_version) * policy_class(federation).updates_per_version(federation)


def clients_per_round(federation) -> int:
    """ceil(rho N): a sync round's sample, and a virtual clock's default simulated concurrency."""
    return max(1, math.ceil(federation.participation * federation.num_clients))


def simulated_concurrency(federation) -> int:
    """Virtual clock (``system:``): how many clients train at once in the simulated federation,
    whatever the real slots: ``federation.concurrency``, or with ``auto`` as many as a sync round
    samples (ceil(participation x num_clients)), so that sync and async compare like for like."""
    return int(federation.concurrency) if federation.concurrency != "auto" else clients_per_round(federation)


ROUND_ONLY_KEYS = (("round_deadline_s", None), ("over_selection", 1.0))  # federation.* keys only simulated rounds read


def round_only_key_issues(federation, virtual_clock: bool) -> list[Issue]:
    """``round_deadline_s`` and ``over_selection`` left at their defaults: only sync rounds with a
    virtual clock have finish times to keep or drop updates by."""
    issues = []
    for key, default in ROUND_ONLY_KEYS:
        value = getattr(federation, key)
        if value != default:
            issues.append((f"federation.{key}", value, (
                f"{'null' if default is None else '1'} unless federation.mode is sync with a virtual clock (a system: "
                f"section): only simulated rounds have finish times to keep or drop updates by (here mode "
                f"{federation.mode}, {'system: set' if virtual_clock else 'no system:'})")))
    return issues


class BasePolicy:
    """Defaults shared by the policies (each overrides what it does differently).

    The class methods are what the rest of the project asks of a mode before a run starts (config
    rules, resource needs, the availability bound); the instance is the running federation."""

    in_rounds: bool = True  # the federation runs in rounds (False: an algorithm's roundless_config_defaults apply)
    waits_for_versions = False
    clock: Optional[VirtualClock] = None
    port: Port

    @classmethod
    def build(cls, federation, clock: Optional[VirtualClock], rng: np.random.Generator,
              real_slots: int) -> FederationPolicy:
        raise NotImplementedError

    @classmethod
    def config_issues(cls, federation, virtual_clock: bool) -> list[Issue]:
        """The mode's rules on ``federation.*``, checked with the rest of the config."""
        return round_only_key_issues(federation, virtual_clock)

    @classmethod
    def min_real_slots(cls, federation, virtual_clock: bool) -> Optional[int]:
        """Updates that must run at once on the workers for a version to form (None: any number)."""
        return None

    @classmethod
    def updates_per_version(cls, federation) -> int:
        """The fewest local updates that must start per version (the availability bound)."""
        return 1

    def concurrency_label(self) -> str:
        """The summary's and the start line's words for what runs at once."""
        return f"concurrency {self.concurrency}" + (" simulated" if self.clock is not None else "")

    def start_label(self, real_slots: int) -> str:
        """The start line's words for what runs at once, on ``real_slots`` planned real slots."""
        if self.clock is None:
            return f"concurrency {real_slots}"
        return f"virtual clock: {self.concurrency} clients at once simulated on {real_slots} real slots"

    def server_counters(self, ref: Any, fetch: Callable[[Any], Any]) -> Any:
        """The server's counters as a version forms (``ref``: their pending read): with a virtual
        clock fetched at once (reproducible), else left to arrive while the run goes on."""
        return fetch(ref) if self.clock is not None else ref

    def summary_rows(self, stats) -> dict[str, str]:
        """Rows of the run's summary that this policy's counters fill (``stats``: SchedulerStats)."""
        if self.clock is None:
            return {}
        return {"updates dropped offline": f"{stats.updates_dropped_offline} of {stats.dispatched} dispatched (client "
                                          "offline before the update finished)"}

    def bind(self, port: Port) -> None:
        self.port = port

    def on_late(self, p: Pending, meta: dict[str, Any]) -> bool:
        return False

    def on_receipt(self, receipt: dict[str, Any]) -> None:
        pass

    def on_server_report(self, backlog: int, version: int) -> None:
        pass

    def on_new_version(self, version: int) -> None:
        pass

    def may_lose(self, client: int) -> bool:
        """Virtual clock: ``client`` may go offline before an update dispatched now finishes."""
        return self.clock is not None and self.clock.may_go_offline(client)

    def exclude(self, client: int) -> None:
        pass

    def quiet(self) -> bool:
        return True

    def held_back(self) -> int:
        return 0

    def sim_now(self) -> float:
        return self.clock.now if self.clock is not None else float("nan")

    def state_dict(self, resolve) -> dict[str, Any]:
        return {"clock": self.clock.state_dict(resolve)} if self.clock is not None else {}

    def load_state_dict(self, state: dict[str, Any], store) -> None:
        if self.clock is not None and "clock" in state:
            self.clock.load_state_dict(state["clock"], store)


@POLICIES.register("sync", "rounds: a sample of ceil(participation x num_clients) clients, one server step per round")
class SyncRounds(BasePolicy):
    """A round: sample ceil(rho N) clients (online ones, with a virtual clock), dispatch them all;
    once every update is submitted (or lost), ask the server to step."""

    @classmethod
    def build(cls, federation, clock, rng, real_slots) -> SyncRounds:
        return cls(federation.num_clients, clients_per_round(federation), rng, clock,
                   deadline_s=federation.round_deadline_s, over_selection=federation.over_selection)

    @classmethod
    def config_issues(cls, federation, virtual_clock: bool) -> list[Issue]:
        issues = [] if virtual_clock else round_only_key_issues(federation, virtual_clock)
        k, n = clients_per_round(federation), federation.num_clients
        if federation.over_selection != 1.0 and math.ceil(federation.over_selection * k) > n:
            issues.append(("federation.over_selection", federation.over_selection, (
                f"at most federation.num_clients / ceil(participation x num_clients) = {n} / {k} = {n / k:g}: "
                f"ceil(over_selection x {k}) clients are selected per round")))
        return issues

    def summary_rows(self, stats) -> dict[str, str]:
        """With a deadline or over-selection, the updates the rounds dropped, of those dispatched, by
        reason (each counted once, offline first: those are in the "updates dropped offline" row)."""
        rows = super().summary_rows(stats)
        if not self.selective:
            return rows
        reasons = []
        if math.isfinite(self.deadline_s):
            reasons.append(f"{stats.updates_dropped_deadline} after the deadline ({self.deadline_s:g} s from the round start)")
        if self.selected > self.per_round:
            reasons.append(f"{stats.updates_dropped_over_selection} beyond the first {self.per_round} to finish "
                           f"({self.selected} selected per round)")
        total = stats.updates_dropped_deadline + stats.updates_dropped_over_selection
        return {**rows, "updates dropped by the round": f"{total} of {stats.dispatched} dispatched: " + ", ".join(reasons)}

    def __init__(self, num_clients: int, per_round: int, rng: np.random.Generator, clock: Optional[VirtualClock],
                 deadline_s: Optional[float] = None, over_selection: float = 1.0):
        self.num_clients, self.per_round, self.rng, self.clock = num_clients, per_round, rng, clock
        # FedScale's deadline and over-commitment (virtual clock only; config refuses them otherwise):
        # select ceil(factor x K), keep the first K to finish by round start + deadline_s, drop the rest
        self.deadline_s = math.inf if deadline_s is None else float(deadline_s)
        self.selected = min(num_clients, math.ceil(over_selection * per_round))
        self.selective = clock is not None and (deadline_s is not None or self.selected > per_round)
        self.kept = 0  # selective: updates of the running round submitted so far
        self.round_start = 0.0  # virtual clock: when the running round started
        self.concurrency = self.selected  # updates a round has in flight
        self.needs = ServerNeeds(OnRequest(), max_staleness=math.inf)
        self.outstanding = 0  # dispatched in this round, receipt not back yet
        self.in_round = False  # a round is running (its step not yet asked for)
        self.stepping = False  # its step is asked for, the version not yet seen
        self.submitted = 0  # submitted in the running round (lost at the server if it dies)
        self.round_end = 0.0  # virtual clock: when the round's slowest update finishes

    def _sample(self) -> list[int]:
        pool = self.port.eligible()
        if self.clock is not None:
            online = self.clock.online(pool)
            while not online:
                self.clock.wait_for_online(pool)
                online = self.clock.online(pool)
            pool = online
        if len(pool) == self.num_clients:  # the unchanged draw when everyone can be sampled: resumed and
            chosen = self.rng.choice(self.num_clients, size=self.selected, replace=False)  # uninterrupted runs alike
        else:
            chosen = self.rng.choice(np.array(pool), size=min(self.selected, len(pool)), replace=False)
        return sorted(int(c) for c in chosen)

    def fill(self) -> None:
        if self.in_round or self.stepping or not self.port.accepting():
            return
        # Every client of the round is dispatched at once: each queues on its host actor, so a
        # worker goes from one client to the next without waiting for the driver (with
        # resources.batch_clients auto, in one call per worker: its clients may step as one batch).
        chosen = self._sample()
        self.in_round, self.outstanding = True, len(chosen)
        self.round_end = self.round_start = self.clock.now if self.clock is not None else 0.0
        self.kept = 0
        for c, p in zip(chosen, self.port.dispatch_group(chosen), strict=True):
            if self.clock is not None:
                p.entry = self.clock.start(c, p, self.port.version)

    def on_update(self, p: Pending, meta: dict[str, Any]) -> None:
        if self.selective:
            self.clock.finish(p.entry, meta, p)  # decided in simulated finish order
            self._release()
            return
        if p.entry is not None:
            self.clock.finish(p.entry, meta, None)
            self.round_end = max(self.round_end, p.entry.finish)  # a dropped one: until its client went offline
            self.clock.drop(p.entry)
            if p.entry.dropped:  # lost: the round goes on without it, as without a lost actor's update
                self.port.dropped_offline(p.client, meta)
                self.outstanding -= 1
                self._maybe_step()
                return
        self.port.account(p.client, meta)
        self.port.submit(p, meta)
        self.submitted += 1

    def on_receipt(self, receipt: dict[str, Any]) -> None:
        self.outstanding -= 1
        self._maybe_step()

    def on_lost(self, p: Pending) -> None:
        if p.entry is not None:
            self.clock.drop(p.entry)
        self.outstanding -= 1  # the round goes on without this update
        if self.selective:
            self._release()  # the lost one may have held back an update that finished after it
        self._maybe_step()

    def _release(self) -> None:
        """Deadline / over-selection: decide the round's updates in simulated finish order, each once
        every update still running is known to finish after it. The first ``per_round`` that finish
        by round start + ``deadline_s`` are submitted; the round closes at the last of them, or at
        the deadline when one was too late. The others are dropped and counted once each (never
        submitted: the server never sees them; their clients keep the local training, as after a
        refused update), by the first reason that holds: lost offline (it never finished; ``finish``
        is when its client left), then the deadline (it finished too late), then over-selection (it
        finished in time, but after the round's first K)."""
        deadline_at = self.round_start + self.deadline_s
        while (e := self.clock.first()) is not None and e.exact:
            self.clock.drop(e)
            p = e.update
            closed = self.kept >= self.per_round  # the round closed at the K-th finish, before this one
            if not closed:  # when the round closes: at this release, or at the deadline if that is earlier
                self.round_end = max(self.round_end, min(e.finish, deadline_at))
            if e.dropped:  # its client went offline before it finished
                self.port.dropped_offline(e.client, e.meta)
            elif e.finish > deadline_at:
                self.port.dropped_by_round(e.client, e.meta, "deadline")
            elif closed:
                self.port.dropped_by_round(e.client, e.meta, "over_selection")
            else:
                self.kept += 1
                self.port.account(p.client, e.meta)
                self.port.submit(p, e.meta)
                self.submitted += 1
                continue
            self.outstanding -= 1
        self._maybe_step()

    def _maybe_step(self) -> None:
        if self.in_round and self.outstanding == 0:
            self.in_round, self.stepping = False, True
            self.port.request_step()

    def on_new_version(self, version: int) -> None:
        if self.clock is not None:  # the next round starts once the server's step is done
            self.clock.now = max(self.clock.now, self.round_end) + self.clock.server_step_s(self.submitted)
        self.submitted, self.stepping = 0, False  # the round's step consumed them

    def quiet(self) -> bool:
        return not (self.in_round or self.stepping)

    def at_server(self) -> int:
        return self.submitted

    def server_restarted(self, version: int) -> None:
        self.outstanding, self.in_round, self.stepping, self.submitted = 0, False, False, 0  # the round is abandoned
        if self.clock is not None:
            self.clock.entries.clear()


class _Buffered(BasePolicy):
    """What the two asynchronous policies share before a run: a version every K accepted updates."""

    in_rounds = False

    @classmethod
    def config_issues(cls, federation, virtual_clock: bool) -> list[Issue]:
        issues = super().config_issues(federation, virtual_clock)
        # virtual clock: 'auto' simulates as many clients at once as a sync round samples
        auto = federation.concurrency == "auto"
        conc = simulated_concurrency(federation) if virtual_clock else (federation.num_clients if auto else federation.concurrency)
        if federation.buffer_size > conc:
            issues.append(("federation.buffer_size", federation.buffer_size, (
                f"at most federation.concurrency ({conc}"
                + (", simulated: ceil(participation x num_clients) for 'auto'" if virtual_clock and auto else "")
                + "): with more updates per version than in flight, every version waits for clients that started after it")))
        return issues

    @classmethod
    def min_real_slots(cls, federation, virtual_clock: bool) -> Optional[int]:
        """In real time the server aggregates every K accepted updates: with fewer than K in flight at
        once no version would ever form; a virtual clock simulates its slots."""
        return None if virtual_clock else federation.buffer_size

    @classmethod
    def updates_per_version(cls, federation) -> int:
        return federation.buffer_size

    @classmethod
    def needs_for(cls, federation, clock: Optional[VirtualClock]) -> ServerNeeds:
        k = federation.buffer_size  # the driver steps the server when its simulated step ends; else a thread does
        return ServerNeeds(SimulatedSteps(k) if clock is not None else ServerThread(k), federation.max_staleness)


@POLICIES.register("async", "FedBuff-style: a version every buffer_size accepted updates, clients never wait for a round")
class AsyncSlots(_Buffered):
    """Keep ``concurrency`` updates in flight in real time (one per idle worker); the server's
    training thread aggregates whenever K accepted updates wait, and reports its versions."""

    waits_for_versions = True

    @classmethod
    def build(cls, federation, clock, rng, real_slots) -> _Buffered:
        """In real time, or with a virtual clock :class:`VirtualAsync` (the same federation simulated)."""
        needs = cls.needs_for(federation, clock)
        if clock is None:
            return cls(federation.num_clients, real_slots, needs, rng)
        return VirtualAsync(federation.num_clients, simulated_concurrency(federation), needs, rng, clock)

    def __init__(self, num_clients: int, concurrency: int, needs: ServerNeeds, rng: np.random.Generator):
        self.num_clients, self.concurrency, self.needs, self.rng = num_clients, concurrency, needs, rng
        self.backlog = 0  # accepted updates waiting at the server (latest report) ...
        self.backlog_version = 0  # ... and the server version it was read at
        self.unreported = 0  # submitted, receipt not back yet

    def fill(self) -> None:
        # Backpressure: while a full next version already waits at the server, a new update would
        # only wait there too and grow stale; let the server catch up first.
        while (self.port.accepting() and self.port.training() < self.concurrency
               and self.backlog + self.unreported < self.needs.buffer_size):
            idle = self.port.eligible(one_per_actor=True)
            if not idle:
                break
            self.port.dispatch(pick_one(self.rng, idle))

    def on_update(self, p: Pending, meta: dict[str, Any]) -> None:
        self.port.account(p.client, meta)
        self.port.submit(p, meta)
        self.unreported += 1

    def on_server_report(self, backlog: int, at_version: int) -> None:
        # readings can arrive out of order: a receipt taken before the server's last step must
        # not overwrite a later reading (it would stall dispatch until the next one)
        if at_version >= self.backlog_version:
            self.backlog, self.backlog_version = backlog, at_version

    def on_receipt(self, receipt: dict[str, Any]) -> None:
        self.unreported -= 1
        if "backlog" in receipt:
            self.on_server_report(receipt["backlog"], receipt["version"])

    def on_lost(self, p: Pending) -> None:
        pass

    def at_server(self) -> int:
        return self.backlog + self.unreported

    def server_restarted(self, version: int) -> None:
        self.backlog = self.unreported = 0
        self.backlog_version = version


def pick_one(rng: np.random.Generator, items: list[int]) -> int:
    """One of ``items`` uniformly: the same draw, and the same stream afterwards, as
    ``int(rng.choice(items))`` (``tests/unit/test_policies.py`` checks it), without converting the
    list to an array first (200 us for 10,000 clients, at every dispatch)."""
    return int(items[int(rng.integers(0, len(items)))])


class VirtualAsync(_Buffered):
    """Asynchronous FL in simulated time: ``concurrency`` clients train at once in the simulated
    federation (any number of real slots run them); each finished update goes to the server in
    order of simulated finish time, and a replacement is dispatched at that simulated instant
    against the newest version. The server is a simulated resource, as the real runtime's training
    thread: once K accepted updates wait and it is idle, a step starts and takes the method's
    declared server work (``clock.server_step_s``); updates arriving meanwhile are buffered against
    the current version and wait for the next step, and replacements train against the current
    version until the step ends. The version a replacement trains against is decided by the
    simulated order alone (a free server steps at once, as an inline aggregation)."""

    def __init__(self, num_clients: int, concurrency: int, needs: ServerNeeds, rng: np.random.Generator,
                 clock: VirtualClock):
        self.num_clients, self.concurrency, self.needs, self.rng, self.clock = num_clients, concurrency, needs, rng, clock
        self.buffered = 0  # accepted and not yet taken by a step (lost at the server if it dies)
        self.step_done: Optional[float] = None  # simulated time at which the running server step ends
        self.uploaders: set[int] = set()  # clients whose upload the server holds (a step's declared work)

    def _dispatch_free_slots(self) -> None:
        # backpressure, as AsyncSlots: while a full next version already waits for the busy server, a
        # new update would only wait there too and grow stale (never with a free server: it steps at once)
        while (self.port.accepting() and self.clock.in_flight() < self.concurrency
               and self.buffered < self.needs.buffer_size):
            taken = self.clock.clients_in_flight()
            pool = [c for c in self.port.eligible() if c not in taken]
            online = self.clock.online(pool)
            if not online:
                if self.clock.in_flight():
                    return  # someone is training: try again when the next update lands
                self.clock.wait_for_online(pool)
                continue
            c = pick_one(self.rng, online)
            p = self.port.dispatch(c)
            p.entry = self.clock.start(c, p, self.port.version)

    def fill(self) -> None:
        """Dispatch up to the simulated concurrency, then take the events known to be next in
        simulated time: a server step ending (the version is out), or an update arriving (handed
        over, a step started if K wait, the replacement dispatched at that instant)."""
        if not self._start_step():  # K may wait from before a checkpoint's drain
            return
        self._dispatch_free_slots()
        while self.port.accepting():
            if self._step_ends_next():
                if not self._end_step():
                    return  # the server died: the policy was told (server_restarted)
                self._dispatch_free_slots()  # slots held back while a full version waited
                continue
            e = self.clock.pop_ready()
            if e is None:
                return
            if e.dropped:  # its client went offline first: lost there, the slot is free at that instant
                self.port.dropped_offline(e.client, e.meta)
                self._dispatch_free_slots()
                continue
            self.port.account(e.client, e.meta)  # counters move in simulated order, not in the order work returned
            if not self.port.hand_over(e.update, e.client, e.meta):
                return  # the server died: the policy was told (server_restarted)
            self.uploaders.add(e.client)
            if not self._start_step():  # a free server's step ends at once: the replacement trains on it
                return
            self._dispatch_free_slots()

    def _step_ends_next(self) -> bool:
        """The running server step ends before any update can arrive (an update still computing is
        keyed by a lower bound of its finish; at a tie the version is out first)."""
        e = self.clock.first()
        return self.step_done is not None and (e is None or e.finish >= self.step_done)

    def _start_step(self) -> bool:
        """The server is idle and K accepted updates wait: a step starts now and ends after the
        method's declared server work; a free one ends at once. False: the server died."""
        if self.step_done is not None or self.buffered < self.needs.buffer_size or not self.port.accepting():
            return True
        self.buffered -= self.needs.buffer_size  # the step takes the K oldest (the server's buffer keeps them until it ends)
        self.step_done = self.clock.now + self.clock.server_step_s(self.needs.buffer_size, len(self.uploaders))
        return self._end_step() if self.step_done <= self.clock.now else True

    def _end_step(self) -> bool:
        """The running step ends: the clock moves there, the server aggregates the K oldest buffered
        updates into the next version (those that arrived meanwhile wait), and the next step starts
        if K wait again."""
        self.clock.now = max(self.clock.now, self.step_done)
        self.step_done = None
        if not self.port.step_now():
            return False
        return self._start_step()

    def on_update(self, p: Pending, meta: dict[str, Any]) -> None:
        self.clock.finish(p.entry, meta, p.update_ref)  # released by fill(), in simulated order

    def on_late(self, p: Pending, meta: dict[str, Any]) -> bool:
        self.clock.finish(p.entry, meta, p.update_ref)  # kept in the final checkpoint: a continued run hands it over
        return True

    def on_receipt(self, receipt: dict[str, Any]) -> None:
        self.buffered += bool(receipt.get("accepted"))

    def on_lost(self, p: Pending) -> None:
        self.clock.drop(p.entry)

    def at_server(self) -> int:
        return self.buffered + (self.needs.buffer_size if self.step_done is not None else 0)

    def held_back(self) -> int:
        return sum(1 for e in self.clock.entries.values() if e.exact and not e.dropped)

    def server_restarted(self, version: int) -> None:
        # updates back but not handed over trained against versions that no longer exist
        self.port.lost_at_server(self.held_back())
        self.clock.entries.clear()  # the rest are orphans: counted lost when they return
        self.buffered, self.step_done = 0, None

    def state_dict(self, resolve) -> dict[str, Any]:
        return {**super().state_dict(resolve), "buffered": self.buffered, "step_done": self.step_done,
                "uploaders": sorted(self.uploaders)}

    def load_state_dict(self, state: dict[str, Any], store) -> None:
        super().load_state_dict(state, store)
        self.buffered = int(state.get("buffered", 0))  # absent: a checkpoint of an inline server (none buffered)
        self.step_done = state.get("step_done")
        self.uploaders = {int(c) for c in state.get("uploaders", [])}


load_plugins("rayfed_proto.policies", "federation policy")  # after the built-ins: a plug-in module registers its own
