"""A federation policy plug-in (entry point group ``rayfed_proto.policies``): rounds over the
clients in a fixed rotation, selected by ``federation.mode: plugin_round_robin``."""

from __future__ import annotations

from rayfed_proto.runtime.policies import POLICIES, SyncRounds, clients_per_round


@POLICIES.register("plugin_round_robin", "rounds over the clients in a fixed rotation (plug-in example)")
class RoundRobin(SyncRounds):
    @classmethod
    def build(cls, federation, clock, rng, real_slots) -> RoundRobin:
        return cls(federation.num_clients, clients_per_round(federation), rng, clock)

    def _sample(self) -> list[int]:
        start = (self.port.version * self.per_round) % self.num_clients  # resumes where the rotation was
        return [(start + i) % self.num_clients for i in range(self.per_round)]
