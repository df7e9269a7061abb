"""The Ray router counts a request as load on its replica from the moment it ranks it, not only once Ray sends
it: Ray ranks a burst of arrivals before it sends any, and a flood must still spill over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the router runs inside Ray Serve (pip install 'pagedserve[ray]')")

from pagedserve.distributed import request_router as router_module  # noqa: E402
from pagedserve.distributed.prefix_index import routing_hashes  # noqa: E402
from pagedserve.distributed.request_router import PagedServeRequestRouter  # noqa: E402

PREFIX = routing_hashes(list(range(64)), 16, None)
THRESHOLD = 8


def replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


REPLICAS = [replica("a"), replica("b")]


def router() -> PagedServeRequestRouter:
    """The router's own state without Ray's (no queue-length cache, no controller)."""
    r = PagedServeRequestRouter.__new__(PagedServeRequestRouter)
    r._use_replica_queue_len_cache = False
    r.initialize_state(imbalance_threshold=THRESHOLD)
    return r


def call(call_id: str, hashes=PREFIX) -> SimpleNamespace:
    return SimpleNamespace(kwargs={"routing": hashes, "call_id": call_id},
                           routing_context=SimpleNamespace(should_backoff=False),
                           metadata=SimpleNamespace(internal_request_id="http-1"))


def first_choice(r: PagedServeRequestRouter, pending) -> str:
    ranks = asyncio.run(r.choose_replicas(REPLICAS, pending))
    return ranks[0][0].replica_id.unique_id


def send(r: PagedServeRequestRouter, pending, name: str) -> None:
    r.on_send_request(SimpleNamespace(unique_id=name))
    r.on_request_routed(pending, SimpleNamespace(unique_id=name), None)


def test_a_burst_ranked_before_any_send_spills_past_the_threshold():
    r = router()
    r.policy.routed(PREFIX, "a")  # the prefix lives on a
    firsts = [first_choice(r, call(f"c{i}")) for i in range(3 * THRESHOLD)]
    assert firsts[:THRESHOLD + 1] == ["a"] * (THRESHOLD + 1)  # the holder takes its share first ...
    assert firsts.count("b") >= THRESHOLD - 1, firsts       # ... and the rest spread, none sent yet
    assert r.loads(["a", "b"]) == {"a": firsts.count("a"), "b": firsts.count("b")}


def test_a_send_turns_the_reservation_into_one_request_in_flight_and_completion_ends_it():
    r = router()
    pending = call("c0")
    chosen = first_choice(r, pending)
    assert r.loads(["a", "b"])[chosen] == 1
    send(r, pending, chosen)
    assert r.loads(["a", "b"])[chosen] == 1 and r.in_flight[chosen] == 1
    r.on_request_completed(SimpleNamespace(unique_id=chosen), "http-1")
    assert r.loads(["a", "b"]) == {"a": 0, "b": 0}


def test_a_request_sent_past_its_first_choice_leaves_no_load_on_the_first():
    r = router()
    r.policy.routed(PREFIX, "a")
    pending = call("c0")
    assert first_choice(r, pending) == "a"
    send(r, pending, "b")  # a refused it (full): Ray sent it to the next rank
    assert r.loads(["a", "b"]) == {"a": 0, "b": 1}


def test_a_call_cancelled_before_its_send_stops_counting_after_the_ttl(monkeypatch):
    r = router()
    r.policy.routed(PREFIX, "a")
    now = [1000.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: now[0])
    assert first_choice(r, call("c0")) == "a"
    assert r.loads(["a", "b"])["a"] == 1
    now[0] += router_module.RESERVATION_TTL_S + 1
    assert r.loads(["a", "b"])["a"] == 0
