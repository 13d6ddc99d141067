"""Ray Serve request routers for the engine replicas (`kvrag serve --ray-serve`), on Serve's own extension point.

    ChunkRouter       cluster/routing.py's chunk-aware ranking: warm replicas first, homes by rendezvous hash,
                      load bounded in flight and over the last routings (the default)
    RoundRobinRouter  each request to the next replica in turn: the baseline `kvrag bench cluster` compares against

A request names its chunks in the handle call's `route_chunks` keyword ((chunk id, tokens) pairs, found by the
front: cluster/serve.py). Each replica reports the chunks its memory tiers hold through Serve's routing stats
(`record_routing_stats`, every few seconds); the router counts the requests it has in flight on each replica, and
the replicas its last routings went to, itself: a request counts from the moment it is chosen for (Serve's routing
tasks run side by side: each sees the others' choices), moved if Serve routes it elsewhere, and uncounted once
completed or cancelled, so the load it bounds is never stale.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvrag.cluster.routing import BALANCE, HELD, WINDOW, RoutingConfig, rank

ROUTE_KWARG = "route_chunks"


class ChunkRouter(RequestRouter):
    def initialize_state(self, held: float = HELD, balance: float = BALANCE, window: int = WINDOW, **_) -> None:
        self.config = RoutingConfig(held, balance, window)
        self.in_flight: Counter[str] = Counter()
        self.recent: deque[list[str]] = deque(maxlen=window)  # [request id, replica] of the last routings
        self._routed: dict[str, str] = {}  # Serve's internal request id -> its replica (routed, or chosen for it)
        self._chosen: dict[str, PendingRequest] = {}  # chosen for, not routed yet
        self._held: dict[str, tuple[int, frozenset[str]]] = {}  # replica -> (its report's id, the chunks as a set)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        held = {rid: self._held_set(r) for rid, r in by_id.items()}
        chunks = () if pending_request is None else pending_request.kwargs.get(ROUTE_KWARG) or ()
        self._forget_cancelled()
        order = rank(chunks, sorted(by_id), held, self.in_flight, self.config,
                     Counter(rid for _, rid in self.recent if rid in by_id))
        if pending_request is not None and order:
            # counted now, not once routed: routing tasks run side by side, and each must see the others' choices
            self._place(pending_request.metadata.internal_request_id, order[0])
            self._chosen[pending_request.metadata.internal_request_id] = pending_request
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request = pending_request.metadata.internal_request_id
        self._chosen.pop(request, None)
        self._place(request, replica_id.unique_id)  # where it went, if not where it was counted

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed.pop(internal_request_id, None)
        if rid is not None and self.in_flight[rid] > 0:
            self.in_flight[rid] -= 1

    def _place(self, request: str, rid: str) -> None:
        """Count a request on replica `rid`, in flight and among the recent routings (moved there if it was counted
        elsewhere)."""
        before = self._routed.get(request)
        if before == rid:
            return
        if before is not None and self.in_flight[before] > 0:
            self.in_flight[before] -= 1
        self.in_flight[rid] += 1
        self._routed[request] = rid
        for entry in self.recent:  # at most `window` entries
            if entry[0] == request:
                entry[1] = rid
                return
        self.recent.append([request, rid])

    def _forget_cancelled(self) -> None:
        """Uncount the requests chosen for and cancelled before they were routed."""
        for request, pending in list(self._chosen.items()):
            if pending.future.cancelled():
                del self._chosen[request]
                self.on_request_completed(None, request)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id.unique_id, None)
        self._held.pop(replica_id.unique_id, None)

    def _held_set(self, replica: RunningReplica) -> frozenset[str]:
        """The chunks a replica last reported, as a set (built again only when a new report came)."""
        chunks = (replica.routing_stats or {}).get("chunks", ())
        kept = self._held.get(replica.replica_id.unique_id)
        if kept is None or kept[0] != id(chunks):
            kept = (id(chunks), frozenset(chunks))
            self._held[replica.replica_id.unique_id] = kept
        return kept[1]


class RoundRobinRouter(RequestRouter):
    def initialize_state(self, **_) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not replicas:
            return []
        start = next(self._turn) % len(replicas)
        return [[r] for r in replicas[start:] + replicas[:start]]


ROUTERS = {"chunk": ChunkRouter, "round-robin": RoundRobinRouter}
