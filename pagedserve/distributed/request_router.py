"""PagedServeRequestRouter: RoutingPolicy as a Ray Serve RequestRouter for the engine deployment.

Ray Serve keeps one router per deployment handle, in the process that holds the handle (the ingress). The
request's routing hashes travel in its call's keyword arguments (`routing=`, computed by RemoteEngine); a call
with `replica=` goes to that replica only (the ingress's per-replica calls, e.g. a prefix-cache reset). Load
is what this router has in flight on each replica: counted when a request is sent, uncounted when Ray reports
it complete, whatever its outcome.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.distributed.routing_policy import RouterConfig, RoutingPolicy


class PagedServeRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "prefix", imbalance_threshold: int = 8,
                         index_capacity: int = 1 << 17) -> None:
        self.policy = RoutingPolicy(RouterConfig(policy, imbalance_threshold, index_capacity))
        self.in_flight: Counter[str] = Counter()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pinned = kwargs.get("replica")
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else []
        hashes = kwargs.get("routing") or ()
        order = self.policy.rank(list(by_id), {r: self.in_flight[r] for r in by_id}, hashes)
        if order:
            # Remembered now, not when Ray confirms: requests that share a prefix and arrive together follow the
            # first one instead of racing it.
            self.policy.routed(hashes, order[0])
        return [[by_id[r]] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.policy.routed(pending_request.kwargs.get("routing") or (), replica_id.unique_id)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = replica_id.unique_id
        self.in_flight[key] -= 1
        if self.in_flight[key] <= 0:
            del self.in_flight[key]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self.in_flight.pop(replica_id.unique_id, None)
