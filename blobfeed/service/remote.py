"""The consumer end's dealer, whatever carries the batches.

A consumer's net reads a source whose only worker is the service: a
:class:`RemoteDealer` holds one queue that the transport's receiver thread
fills (a Unix or TCP socket in :mod:`.consumer`, Ray's object store in
:mod:`.ray_attach`), and tells the transport, through ``send_ack``, the
service's number of each item the net's ``run()`` returned.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..feeders import Feed
from ..feeders.dealing import ArrivalDealer
from ..feeders.source import InputSource

if TYPE_CHECKING:
    from ..net import Net

__all__ = ["Attached", "RemoteDealer", "remote_feed"]


_A = TypeVar("_A", bound="Attached")


class Attached:
    """What every attachment of a net to a served source has, whatever
    carries the batches (:class:`~.consumer.Attachment` on a socket,
    :class:`~.ray_attach.RayAttachment` on Ray): the net checked and named
    sources, the wait its ``run()`` reports to the service, ``stop()`` on
    leaving a ``with`` block."""

    #: set by the transport once its feed is wired (see remote_feed)
    feed: Feed

    def __init__(self, net: "Net", names: list[str], source_name: str, address: str) -> None:
        net._check_attach(source_name, names)
        self.address = address
        self.source_name = source_name
        self._service = f"service at {address}"

    def _waited(self) -> float:
        """Seconds this attachment's ``run()`` has waited for its batches in
        all (the feed's ``blobfeed_dequeue_wait_seconds``), told the service
        with every acknowledgement and the ``bye``: it shows per consumer
        which one is starved.  Never decreases (a sum of waits)."""
        return float(self.feed.consume_stats.wait.total)

    def stop(self, timeout: float = 10.0) -> bool:
        raise NotImplementedError

    def __enter__(self: _A) -> _A:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._service}>"


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


def remote_feed(
    net: "Net", names: list[str], batch_size: int, source_name: str, slots: int, timeout: float,
    send_ack: Callable[[int], None], coordinator: Any,
) -> tuple[InputSource, RemoteDealer, Feed]:
    """The net's end of a served source, one more reader of a source: an
    :class:`InputSource` whose dealer is a :class:`RemoteDealer` (``slots``
    + 1 items deep) and an ordinary :class:`Feed` on ``net`` that takes the
    service's whole batches as they come (no re-batching, one batch ahead),
    started; its enqueuer (``feed.run``) is the caller's thread to run.
    Their metrics go to ``coordinator``'s registry (None: the global one's)."""
    from ..coordinator import global_coordinator

    hub = (coordinator if coordinator is not None else global_coordinator)._hub
    source = InputSource(
        source_name, slots + 1, len(names), [0] * len(names), hub,
        dealer=lambda src: RemoteDealer(source_name, slots + 1, src.fail, send_ack),
    )
    feed = Feed(
        source, net.name, net._place, names, batch_size, timeout=timeout, device_queue_capacity=1,
        dont_rebatch=True, drop_last=False, hub=hub, model_inputs=net.input_specs, writable=net.writable,
    )
    net._attach(feed)
    source.add_feed(feed)
    feed.mark_started()
    return source, source.dealer, feed  # type: ignore[return-value]
