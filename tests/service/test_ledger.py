"""One consumer's ledger (blobfeed/service/ledger.py), shared by the Unix,
TCP and Ray carriers: numbering, cumulative acknowledgement and its checks,
slots freed early, hand-back on leave.  Plain objects, no sockets."""

from __future__ import annotations

import collections
import inspect
import types

import pytest

from blobfeed.feeders.chunks import EpochEnd
from blobfeed.service import connection, ray_service
from blobfeed.service.ledger import Ledger
from blobfeed.service.served import Item
from blobfeed.service.wire import WireError


class _Outlet:
    def __init__(self) -> None:
        self.acked_items: list[Item] = []

    def acked(self, item: Item) -> None:
        self.acked_items.append(item)


def _batch(s: int) -> Item:
    return Item(s, types.SimpleNamespace(n=1, arrays=()))  # type: ignore[arg-type]


def _ledger(ordered: bool = True) -> tuple[Ledger, _Outlet, types.SimpleNamespace]:
    outlet = _Outlet()
    counts = types.SimpleNamespace(acknowledged=collections.Counter())
    return Ledger(outlet, counts, "0", ordered=ordered), outlet, counts


def test_in_order_an_acknowledgement_must_move_past_the_last_and_below_what_was_sent() -> None:
    ledger, outlet, counts = _ledger()
    items = [_batch(0), _batch(1), Item(2, EpochEnd(0, 0))]  # type: ignore[call-arg]
    for item in items:
        g = ledger.number()
        ledger.record(g, item)
    ledger.sent(1)
    with pytest.raises(WireError, match="up to 2; its next unacknowledged item is 0 and the last sent 1"):
        ledger.ack(2)
    assert ledger.ack(0) == (True, [])
    with pytest.raises(WireError, match="up to 0; its next unacknowledged item is 1"):
        ledger.ack(0)  # a repeat on one socket is a lie
    ledger.sent(2)
    assert ledger.ack(2) == (True, [])
    assert outlet.acked_items == items and counts.acknowledged == {"0": 2}  # the epoch's end is no batch
    assert ledger.in_flight() == 0 and not ledger.holds_any()


def test_out_of_order_a_late_acknowledgement_changes_nothing_and_none_counts_after_leaving() -> None:
    ledger, outlet, counts = _ledger(ordered=False)
    for s in range(3):
        g = ledger.number()
        ledger.record(g, _batch(s))
        ledger.sent(g)
    assert ledger.ack(1) == (True, [])
    assert ledger.ack(0) == (True, []) and ledger.ack(-1) == (True, [])
    with pytest.raises(WireError, match="acknowledged item 3; 3 were sent"):
        ledger.ack(3)
    assert counts.acknowledged == {"0": 2} and ledger.in_flight() == 1
    assert ledger.close() is True and ledger.close() is False
    assert ledger.ack(2) == (False, [])
    assert [i.s for i in ledger.hand_back()] == [2] and counts.acknowledged == {"0": 2}


def test_a_slot_freed_before_its_acknowledgement_comes_back_with_it() -> None:
    ledger, _, _ = _ledger()
    for slot in (0, 1):
        ledger.hold(slot)
        g = ledger.number()
        ledger.record(g, _batch(g), slot, meta=[])
    ledger.sent(1)
    assert ledger.free([1]) == []  # early: kept until acknowledged
    with pytest.raises(WireError, match="freed slot 1, which it does not hold"):
        ledger.free([1])
    with pytest.raises(WireError, match="freed slot 5, which it does not hold"):
        ledger.free([5])
    assert ledger.ack(1) == (True, [1])
    assert ledger.free([0]) == [0]


def test_leaving_hands_back_what_was_not_acknowledged_in_order_with_what_was_never_sent() -> None:
    ledger, _, _ = _ledger()
    a, b, c = _batch(0), _batch(1), _batch(2)
    ledger.hold(0)
    ledger.record(ledger.number(), a, 0, meta=["m"])
    ledger.record(ledger.number(), b)
    ledger.unsent(c)
    ledger.sent(1)
    assert ledger.not_returned() == {0, 1, -2}
    kept = ledger.hand_back(lambda item, slot, meta: (item, slot, meta))
    assert kept == [(a, 0, ["m"]), b, c] and not ledger.holds_any()


def test_both_carriers_keep_one_ledger_and_admit_alike() -> None:
    """The socket's Connection and Ray's consumer both keep a Ledger, and
    Ray no longer borrows the socket connection's private admission."""
    assert "Ledger(" in inspect.getsource(connection.Connection)
    assert "Ledger(" in inspect.getsource(ray_service._RayConsumer)
    assert "Connection._admit" not in inspect.getsource(ray_service)
    assert not hasattr(connection.Connection, "_admit")
