"""Test doubles shared by the unit tests: algorithm fixtures and the fake port policies are driven through."""

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

    EVENTS = ("dispatch", "submit", "step", "account", "offline", "deadline", "over_selection")

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

    def dispatch(self, client: int):
        self._note("dispatch", client)
        p = self.in_flight[client] = self._pending(handler=None, kind="train", client=client)
        return p

    def dispatch_group(self, clients):
        return [self.dispatch(c) for c in clients]

    def submit(self, p, meta) -> None:
        self._note("submit", p.client)
        self.in_flight.pop(p.client, None)  # a test may have taken it out already (the update came back)

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
