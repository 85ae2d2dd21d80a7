"""The consumer end of a served source, whatever carries the batches.

A consumer's net reads a source whose only worker is the service: an
:class:`~blobfeed.reader.Inlet` (``GlobalCoordinator.open_inlet``) that the
transport's receiver thread fills (a Unix or TCP socket in :mod:`.consumer`,
Ray's object store in :mod:`.ray_attach`) and that tells the transport,
through ``send_ack``, the service's number of each item the net's ``run()``
returned.  The inlet has no thread: the receiver puts each whole batch
straight on the queue ``run()`` reads.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from ..coordinator import global_coordinator
from ..reader import BatchReader, Inlet

if TYPE_CHECKING:
    from ..net import Net

__all__ = ["Attached", "open_inlet"]


_A = TypeVar("_A", bound="Attached")


class Attached:
    """What every attachment of a net to a served source has, whatever
    carries the batches (:class:`~.consumer.Attachment` on a socket,
    :class:`~.ray_attach.RayAttachment` on Ray): the net checked and named
    sources, the wait its ``run()`` reports to the service, ``stop()`` on
    leaving a ``with`` block."""

    #: set by the transport once its inlet is open (see open_inlet)
    inlet: Inlet
    reader: BatchReader
    #: the transport's threads, once started (see _open)
    _threads: list[threading.Thread]

    def __init__(self, net: "Net", names: list[str], source_name: str, address: str) -> None:
        net.check_reader(source_name, names)
        self.address = address
        self.source_name = source_name
        self._service = f"service at {address}"

    def _waited(self) -> float:
        """Seconds this attachment's ``run()`` has waited for its batches in
        all (the reader's ``blobfeed_dequeue_wait_seconds``), told the service
        with every acknowledgement and the ``bye``: it shows per consumer
        which one is starved.  Never decreases (a sum of waits)."""
        return self.reader.waited()

    def _open(self, threads: Sequence[tuple[Callable[[], None], str]], **hooks: Any) -> None:
        """(The transport's constructor, once its inlet is open and the
        service counts this consumer.)  The net's reader, with ``hooks``
        set on it, and the transport's threads ``(target, name)``, started.
        Anything raised here (a Ctrl-C at any bytecode) stops what was
        attached before it goes on: the caller has no attachment to stop."""
        try:
            self.reader = self.inlet.reader
            for name, hook in hooks.items():
                setattr(self.reader, name, hook)
            for target, thread_name in threads:
                t = threading.Thread(target=target, name=thread_name, daemon=True)
                self._threads.append(t)  # before it starts: one interrupted in start() is joined too
                t.start()
        except BaseException:
            self.stop(1.0)
            raise

    def stop(self, timeout: float = 10.0) -> bool:
        raise NotImplementedError

    def __enter__(self: _A) -> _A:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._service}>"


def open_inlet(
    net: "Net", names: list[str], batch_size: int, source_name: str, slots: int, timeout: float,
    send_ack: Callable[[int], None], coordinator: Any,
) -> Inlet:
    """The net's end of a served source: an inlet ``slots`` + 1 items deep
    whose reader feeds ``net`` (the service's whole batches as they come, one
    ahead); started.  Its metrics go to ``coordinator``'s registry (None: the
    global one's), whose lifecycle stops and retires it."""
    gc = coordinator if coordinator is not None else global_coordinator
    inlet = gc.open_inlet(
        source_name, names, net.name, batch_size=batch_size, capacity=slots + 1, timeout=timeout, on_returned=send_ack,
    )
    try:
        net.add_reader(inlet.reader)
        inlet.start()
    except BaseException:  # (a Ctrl-C too: the coordinator would keep the inlet, and the caller with it)
        inlet.close(1.0)
        raise
    return inlet
