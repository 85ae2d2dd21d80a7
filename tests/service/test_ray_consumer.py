"""The Ray service's per-consumer bookkeeping, without Ray (plain objects)."""

from __future__ import annotations

import collections
import types

from blobfeed.service import ray_service
from blobfeed.service.served import Item


class _Outlet:
    label = "0"

    def acked(self, item: Item) -> None:
        pass


class _Source:
    def __init__(self) -> None:
        self.counts = types.SimpleNamespace(acknowledged=collections.Counter(), delivered=collections.Counter(),
                                            waited=collections.Counter())
        self.released: list[Item] = []
        self.name = "train"

    def release(self, conn: object, outlet: object, unacked: list[Item]) -> None:
        self.released.extend(unacked)


class _Server:
    sources: dict[str, object] = {}
    closure_log = None

    def _forget(self, conn: object) -> None:
        pass


def test_an_acknowledgement_after_the_lease_expired_is_refused() -> None:
    """The lease thread took a silent consumer as gone and dealt its batch
    again; the consumer's acknowledgement of that batch, already on its
    way, was still answered "counted", so its run() returned a batch that
    another consumer got too."""
    conn = ray_service._RayConsumer(_Server(), 0)  # type: ignore[arg-type]
    source = _Source()
    conn.attached(source, _Outlet(), 1)  # type: ignore[arg-type]
    item = Item(0, types.SimpleNamespace(n=1, arrays=()))  # type: ignore[arg-type]
    assert conn.ledger is not None
    g = conn.ledger.number()
    conn.ledger.record(g, item)
    conn.ledger.sent(g)
    conn.leave("its lease expired")
    assert source.released == [item]
    assert conn.ack(0) is False
    assert sum(source.counts.acknowledged.values()) == 0
