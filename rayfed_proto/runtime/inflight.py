"""The scheduler's in-flight table: every remote call the driver waits on, typed and indexed.

One map from an ObjectRef to its :class:`Pending` entry (Ray's ``ActorPool`` keeps one map from
futures to actors), kept in the order the calls started (``ray.wait`` takes the first ready ref
of the list it is given: the order is part of a reproducible run), with indexes by kind, by
worker and by training client, so that "which clients are busy", "what runs on this worker" and
"is any server work outstanding" are lookups, not scans. No Ray here: refs are opaque keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from rayfed_proto.runtime.simclock import SimEntry

__all__ = ["InFlight", "Kind", "Pending"]


class Kind(str, Enum):
    """What an in-flight call is."""

    TRAIN = "train"  # a local update's metadata (its upload goes straight to the server)
    RECEIPT = "receipt"  # the server's receipt for a submitted update
    STEP = "step"  # a server step the driver asked for
    EVAL = "eval"  # one worker's part of an evaluation
    VERSIONS = "versions"  # async: the server's wait_versions
    DISCARD = "discard"  # a dropped update's undo on its worker

    def __str__(self) -> str:
        return self.value


SERVER_WORK = frozenset({Kind.RECEIPT, Kind.STEP})  # an update on its way into a version
ON_WORKER = frozenset({Kind.TRAIN, Kind.EVAL})  # queued on a worker: lost when it dies


@dataclass
class Pending:
    """One entry of the in-flight table: what the ref is and who handles it."""

    handler: Optional[Callable[[Any, Pending], None]]
    kind: Kind
    client: int = -1
    update_ref: Any = None
    version: int = -1
    actor: int = -1
    entry: Optional[SimEntry] = None  # virtual clock: the update's simulated timing
    update_no: int = -1  # the client's local updates done after this one (train: known once back)
    ticket: int = -1  # receipt: its submission's number (evaluations wait for earlier receipts)

    def __post_init__(self) -> None:
        self.kind = Kind(self.kind)  # a kind given by name ("train") is the same kind


class InFlight:
    """``{ref: Pending}`` in start order, indexed by kind, by worker and by training client."""

    def __init__(self) -> None:
        self._all: dict[Any, Pending] = {}
        self._by_kind: dict[Kind, dict[Any, None]] = {k: {} for k in Kind}
        self._by_actor: dict[int, dict[Any, None]] = {}
        self._training: dict[int, dict[Any, None]] = {}  # client -> refs of its local updates in flight

    # ---------------------------------------------------------------------------- entries
    def add(self, ref: Any, p: Pending) -> Pending:
        self._all[ref] = p
        self._by_kind[p.kind][ref] = None
        if p.actor >= 0:
            self._by_actor.setdefault(p.actor, {})[ref] = None
        if p.kind is Kind.TRAIN:
            self._training.setdefault(p.client, {})[ref] = None
        return p

    def pop(self, ref: Any) -> Pending:
        p = self._all.pop(ref)
        del self._by_kind[p.kind][ref]
        if p.actor >= 0:
            _discard(self._by_actor, p.actor, ref)
        if p.kind is Kind.TRAIN:
            _discard(self._training, p.client, ref)
        return p

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, ref: Any) -> bool:
        return ref in self._all

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._all))

    def items(self) -> Iterator[tuple[Any, Pending]]:
        return iter(list(self._all.items()))

    # ---------------------------------------------------------------------------- lookups
    def refs(self, kinds: Iterable[Kind]) -> list[Any]:
        """The refs of these kinds, in start order."""
        kinds = set(kinds)
        if len(kinds) == 1:
            return list(self._by_kind[next(iter(kinds))])
        return [r for r, p in self._all.items() if p.kind in kinds]

    def count(self, kind: Kind) -> int:
        return len(self._by_kind[kind])

    def any(self, kinds: Iterable[Kind]) -> bool:
        return any(self._by_kind[k] for k in kinds)

    def busy_clients(self) -> set[int]:
        """Clients with a local update in flight."""
        return set(self._training)

    def update_refs(self) -> list[Any]:
        """The upload refs of the local updates in flight."""
        return [self._all[r].update_ref for r in self._by_kind[Kind.TRAIN]]

    def drop_on_actor(self, actor: int, kinds: frozenset[Kind] = ON_WORKER) -> list[Pending]:
        """The entries of these kinds queued on worker ``actor``, taken out of the table (in start order)."""
        refs = [r for r in self._by_actor.get(actor, {}) if self._all[r].kind in kinds]
        return [self.pop(r) for r in refs]


def _discard(index: dict[int, dict[Any, None]], key: int, ref: Any) -> None:
    refs = index[key]
    del refs[ref]
    if not refs:
        del index[key]
