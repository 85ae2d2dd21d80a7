"""The consumer end's dealer, whatever carries the batches.

A consumer's net reads a source whose only worker is the service: a
:class:`RemoteDealer` holds one queue that the transport's receiver thread
fills (a Unix or TCP socket in :mod:`.consumer`, Ray's object store in
:mod:`.ray_attach`), and tells the transport, through ``send_ack``, the
service's number of each item the net's ``run()`` returned.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from ..feeders.dealing import ArrivalDealer

__all__ = ["RemoteDealer"]


class _RemoteReader:
    """The net's end: the queue's methods, and acknowledgements to the service."""

    def __init__(self, dealer: "RemoteDealer") -> None:
        q = dealer.queue
        self.get_nowait = q.get_nowait
        self.wait_for_item = q.wait_for_item
        self.qsize = q.qsize
        self._dealer = dealer

    def returned(self) -> None:
        self._dealer.ack()

    def epoch_returned(self, dropped: int = 0) -> None:
        self._dealer.ack()


def _no_ack(g: int) -> None:
    pass


class RemoteDealer(ArrivalDealer):
    """A source's dealer whose worker is the service: one queue, filled by
    the receiver thread, read by one net.

    Args:
        source: the source's name.
        capacity: the queue's bound, in items.
        fail: the source's failure (``InputSource.fail``).
        send_ack: called with the service's number of each item the net's
            ``run()`` returned, in order (in the net's thread: it must not block).
    """

    def __init__(self, source: str, capacity: int, fail: Any, send_ack: Callable[[int], None]) -> None:
        super().__init__(source, capacity, fail)
        #: the service's numbers of the items queued for the net, in order
        self.numbers: collections.deque[int] = collections.deque()
        self._send_ack = send_ack

    def add_net(self) -> _RemoteReader:  # type: ignore[override]
        return _RemoteReader(self)

    def detach(self) -> None:
        """Forget the connection (the attachment stopped)."""
        self._send_ack = _no_ack

    def ack(self) -> None:
        try:
            g = self.numbers.popleft()
        except IndexError:
            return
        self._send_ack(g)
