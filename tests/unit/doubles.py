"""Test doubles shared by the unit tests: algorithm fixtures, the fake port policies are driven
through and the fake system model the virtual clock reads."""

import numpy as np
import torch

from rayfed_proto.messages import PrototypeSet


class FixedModel(torch.nn.Module):
    """features(x) = x, logits = x @ W with W = 0: a test chooses the features exactly, and CE is
    ln(num_classes) whatever x is."""

    def __init__(self, dim=2, num_classes=3):
        super().__init__()
        self.head = torch.nn.Linear(dim, num_classes, bias=False)
        torch.nn.init.zeros_(self.head.weight)

    def features(self, x):
        return x

    def forward_features(self, x):
        return x, self.head(x)


def pset(ids, vecs, counts):
    return PrototypeSet(np.array(ids, np.int64), np.array(vecs, np.float32), np.array(counts, np.int64))


class FakePort:
    """The scheduler's side of a federation policy (:class:`rayfed_proto.runtime.policies.Port`),
    by hand: an in-flight table ``{client: Pending}`` and a log of what the policy asked for
    (``logged``: the kinds of event recorded; a test of one decision logs only those)."""

    EVENTS = ("dispatch", "submit", "hand_over", "step", "account", "offline", "deadline", "over_selection")

    def __init__(self, clients: int, actor_of=None, rounds: int = 5, logged=EVENTS):
        from rayfed_proto.runtime.inflight import Pending

        self.version, self.rounds, self._pending = 0, rounds, Pending
        self.actor_of = actor_of or {c: c for c in range(clients)}
        self.logged = set(logged)
        self.log: list[tuple] = []
        self.in_flight: dict = {}  # client -> its Pending

    def _note(self, *event) -> None:
        if event[0] in self.logged:
            self.log.append(event)

    def accepting(self) -> bool:
        return self.version < self.rounds

    def clients(self, kind: str) -> list[int]:
        """The clients of the logged events of ``kind``, in order."""
        return [c for what, *c in self.log if what == kind for c in c]

    def dispatch(self, client: int):
        """A local update of ``client``; its update (``update_ref``) is ``(client, version it trains on)``."""
        self._note("dispatch", client)
        p = self.in_flight[client] = self._pending(handler=None, kind="train", client=client,
                                                   update_ref=(client, self.version))
        return p

    def dispatch_group(self, clients):
        return [self.dispatch(c) for c in clients]

    def submit(self, p, meta) -> None:
        self._note("submit", p.client)
        self.in_flight.pop(p.client, None)  # a test may have taken it out already (the update came back)

    def hand_over(self, update, client: int, meta) -> bool:
        self._note("hand_over", client)
        return True

    def request_step(self) -> None:
        self._note("step")

    def eligible(self, one_per_actor: bool = False) -> list[int]:
        busy_actors = {self.actor_of[c] for c in self.in_flight} if one_per_actor else set()
        return [c for c in sorted(self.actor_of) if c not in self.in_flight and self.actor_of[c] not in busy_actors]

    def training(self) -> int:
        return len(self.in_flight)

    def account(self, client: int, meta) -> None:
        self._note("account", client)

    def dropped_offline(self, client: int, meta) -> None:
        self._note("offline", client)

    def dropped_by_round(self, client: int, meta, reason: str) -> None:
        self._note(reason, client)


class FakeSystem:
    """What :class:`~rayfed_proto.runtime.simclock.VirtualClock` reads of a system model, by hand:
    ``compute_s`` per client, transfers at ``bytes_per_s`` both ways, a server step of ``step_s``
    simulated seconds, and ``windows``: ``{client: (start, end)}``, when a client is online (the
    others always are)."""

    def __init__(self, compute_s, bytes_per_s: float = 100.0, step_s: float = 0.0, windows=None):
        self.compute_s = np.asarray(compute_s, float)
        self.bytes_per_s, self.step_s, self.windows = bytes_per_s, step_s, dict(windows or {})

    def compute_at(self, c, version=0):
        return float(self.compute_s[c])

    def update_duration(self, c, down, up, version=0):
        return self.compute_at(c, version) + down / self.bytes_per_s + up / self.bytes_per_s

    def server_step_s(self, updates, uploaders=0):
        return self.step_s

    def _online(self, c, t) -> bool:
        return c not in self.windows or self.windows[c][0] <= t < self.windows[c][1]

    def online_clients(self, candidates, t, rng):
        return [c for c in candidates if self._online(c, t)]

    def next_online_time(self, candidates, t):
        """When one of ``candidates`` is online next (None: never again)."""
        times = [t if c not in self.windows else max(self.windows[c][0], t)
                 for c in candidates if c not in self.windows or t < self.windows[c][1]]
        return min(times, default=None)
