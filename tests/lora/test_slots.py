"""SlotTable: an adapter holds one slot while requests of it run; idle slots keep their adapter for reuse
and go to other adapters, empty ones first, then the longest idle."""

from __future__ import annotations

import pytest

from pagedserve.lora.slots import SlotTable


def test_requests_of_one_adapter_share_its_slot_and_others_take_free_ones():
    table = SlotTable(2)
    assert table.acquire(10) == table.acquire(10)
    other = table.acquire(20)
    assert other != table.slot_of(10)
    assert table.active() == {10: 1 - other, 20: other}


def test_a_third_adapter_waits_until_a_slot_is_released():
    table = SlotTable(2)
    table.acquire(10)
    table.acquire(20)
    assert not table.can_acquire(30) and table.can_acquire(10)
    with pytest.raises(RuntimeError):
        table.acquire(30)
    table.release(20)
    assert table.can_acquire(30)
    assert table.acquire(30) == 1 and table.slot_of(20) is None


def test_an_idle_slot_keeps_its_adapter_until_the_slot_is_needed():
    table = SlotTable(2)
    table.acquire(10)
    table.release(10)
    assert table.active() == {} and table.slot_of(10) == 0
    assert table.acquire(10) == 0  # no copy needed: still resident


def test_idle_slots_are_reused_empty_first_then_longest_idle_first():
    table = SlotTable(3)
    for generation in (10, 20):
        table.acquire(generation)
    table.release(20)
    table.release(10)
    assert table.acquire(30) == 2  # the empty slot, though 10 and 20 are idle
    assert table.acquire(40) == 1  # 20 was released before 10
    table.forget(10)
    assert table.slot_of(10) is None


def test_releasing_an_adapter_that_holds_no_slot_is_an_error():
    with pytest.raises(RuntimeError):
        SlotTable(1).release(10)
