"""Prefix routing follows the cached prefix until the holder is overloaded; least-loaded and round-robin do
what their names say."""

from __future__ import annotations

import random

import pytest

from pagedserve.distributed.prefix_index import routing_hashes
from pagedserve.distributed.routing_policy import RouterConfig, RoutingPolicy

REPLICAS = ["a", "b", "c"]
PREFIX = routing_hashes(list(range(64)), 16, None)


def policy(kind: str = "prefix", threshold: int = 4) -> RoutingPolicy:
    return RoutingPolicy(RouterConfig(kind, threshold), random.Random(0))


def test_a_request_goes_to_the_replica_holding_its_longest_prefix():
    p = policy()
    p.routed(PREFIX[:2], "a")
    p.routed(PREFIX, "c")
    assert p.rank(REPLICAS, {"a": 0, "b": 0, "c": 3}, PREFIX)[0] == "c"
    assert p.rank(REPLICAS, {}, PREFIX[:2])[0] in ("a", "c")


def test_the_holder_is_left_for_the_least_loaded_past_the_threshold():
    p = policy(threshold=4)
    p.routed(PREFIX, "a")
    assert p.rank(REPLICAS, {"a": 5, "b": 1, "c": 2}, PREFIX)[0] == "a"  # 4 more than b: still a
    assert p.rank(REPLICAS, {"a": 6, "b": 1, "c": 1}, PREFIX)[0] in ("b", "c")


def test_without_a_match_the_lighter_of_two_choices_wins():
    p = policy()
    for _ in range(20):
        assert p.rank(["a", "b"], {"a": 3, "b": 1}, PREFIX)[0] == "b"
    picks = {p.rank(REPLICAS, {"a": 0, "b": 0, "c": 9}, PREFIX)[0] for _ in range(50)}
    assert picks == {"a", "b"}  # c is the heavier of every pair it is drawn in


def test_least_loaded_ignores_the_prefix():
    p = policy("least-loaded")
    p.routed(PREFIX, "a")
    assert p.index.match(PREFIX, ["a"]) == {"a": 0}  # nothing remembered
    assert p.rank(["a", "b"], {"a": 2, "b": 0}, PREFIX)[0] == "b"


def test_round_robin_takes_turns_blind_to_load_and_prefix():
    p = policy("round-robin")
    p.routed(PREFIX, "a")
    firsts = [p.rank(REPLICAS, {"a": 0, "b": 100, "c": 0}, PREFIX)[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_the_ranking_holds_every_replica_once_choice_first():
    p = policy()
    order = p.rank(REPLICAS, {"a": 2, "b": 0, "c": 1})
    assert sorted(order) == REPLICAS and len(order) == 3
    assert p.rank([], {}) == []


@pytest.mark.parametrize("kwargs,match", [({"policy": "random"}, "policy"),
                                          ({"imbalance_threshold": -1}, "threshold"),
                                          ({"index_capacity": 0}, "capacity")])
def test_bad_router_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kwargs)
