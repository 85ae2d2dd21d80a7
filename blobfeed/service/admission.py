"""Admission: whether a consumer's hello fits a source, for every carrier.

A consumer says hello (the protocol it speaks, the source, its blobs and
batch size, its index among ``num_consumers``, or none: first come); the
Unix socket, TCP and Ray carriers all answer it with :func:`admit`, which
either claims the consumer's outlet of the source or refuses it, naming
what did not fit (and, for another protocol, both versions).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..log_throttle import LogThrottle
from .served import IndexOutlet, ServedSource, SharedOutlet
from .wire import PROTOCOL, shown

__all__ = ["ClosureLog", "Refused", "RefusalLog", "admit"]

logger = logging.getLogger("blobfeed.service")

#: consumers refused (or closed in their handshake) logged one by one per window
REFUSALS_LOGGED = 10
#: seconds of that window; the refusals past it are told in one line at the next
REFUSAL_WINDOW_S = 10.0


class Refused(Exception):
    """The consumer's hello does not fit the source (sent back as ``refused``)."""


def admit(
    hello: dict[str, Any], sources: Callable[[str], ServedSource], consumer: Any,
) -> tuple[ServedSource, IndexOutlet | SharedOutlet]:
    """The source ``hello`` (checked by :func:`.wire.check`) asks for and
    the outlet claimed for ``consumer`` there.

    Args:
        sources: looks a source up by name (raises :class:`Refused` naming
            those served).
        consumer: the carrier's object for the consumer (it holds the outlet).

    Raises:
        Refused: another protocol, blobs, batch size, num_consumers or
            index than the source's; a failed source; an index taken.
    """
    if hello["protocol"] != PROTOCOL:
        raise Refused(f"protocol {hello['protocol']} (this service speaks {PROTOCOL}): upgrade blobfeed on one side")
    source = sources(hello["source"])  # Refused naming the sources it has
    t = source.terms
    blobs = hello["blobs"]
    if blobs != list(t.blob_names):
        raise Refused(
            f"source {t.name!r} carries blobs {shown(list(t.blob_names), 400)}; the consumer asked for {shown(blobs)}"
        )
    if hello["batch_size"] != t.batch_size:
        raise Refused(
            f"source {t.name!r} is served in batches of {t.batch_size}; the consumer asked for "
            f"batch_size={hello['batch_size']}"
        )
    num, index = hello["num"], hello["index"]
    if t.num_consumers is None:
        if num is not None or index is not None:
            raise Refused(
                f"source {t.name!r} is served first come, first served (no num_consumers); the consumer "
                f"asked for consumer_index={index}, num_consumers={num}: serve the source with "
                "num_consumers=N to deal it by index"
            )
    else:
        if num is not None and num != t.num_consumers:
            raise Refused(
                f"source {t.name!r} is dealt to {t.num_consumers} consumers; the consumer asked for "
                f"num_consumers={num}"
            )
        if index is not None and not 0 <= index < t.num_consumers:
            raise Refused(
                f"source {t.name!r} is dealt to {t.num_consumers} consumers (indexes 0 to "
                f"{t.num_consumers - 1}); the consumer asked for consumer_index={index}"
            )
    if source.error is not None:
        raise Refused(f"source {t.name!r} failed: {source.error}")
    try:
        return source, source.claim(consumer, index)
    except ValueError as err:
        raise Refused(str(err)) from None


class RefusalLog(LogThrottle):
    """A service's log of the consumers it refused or closed in their
    handshake: the first :data:`REFUSALS_LOGGED` of each
    :data:`REFUSAL_WINDOW_S` window one line each, the others counted and
    told in one line (with the last of them) once that window is over, or
    when the service stops.  Anyone who can connect can be refused as often
    as it likes: that must not flood the log."""

    def __init__(self) -> None:
        super().__init__(
            logger, REFUSALS_LOGGED, REFUSAL_WINDOW_S,
            f"service: %d more consumers refused or closed in their handshake (the most logged one by one: "
            f"{REFUSALS_LOGGED} per {REFUSAL_WINDOW_S:.0f} s); the last: %s",
        )

    def refused(self, peer: str, why: str) -> None:
        """Log (or count) one refusal: ``peer`` and ``why`` (bounded text)."""
        self.event("service: %s refused: %s", peer, why)


class ClosureLog:
    """A service's log of the connections it closed after their handshake
    (a consumer that broke the protocol) and of the consumers that left
    holding batches: as :class:`RefusalLog`, since a peer that says a good
    hello and then garbage, or leaves at once holding batches, can make as
    many as it likes.  Each kind has a budget of its own, so that a flood of
    one (every killed consumer leaves holding batches) never hides the
    other."""

    def __init__(self) -> None:
        share = f"(the most logged one by one: {REFUSALS_LOGGED} per {REFUSAL_WINDOW_S:.0f} s); the last: %s"
        self._closed = LogThrottle(
            logger, REFUSALS_LOGGED, REFUSAL_WINDOW_S,
            f"service: %d more connections closed for breaking the protocol {share}",
        )
        self._left = LogThrottle(
            logger, REFUSALS_LOGGED, REFUSAL_WINDOW_S, f"service: %d more consumers left holding batches {share}",
        )

    def event(self, msg: str, *args: Any) -> None:
        """A connection closed for breaking the protocol: ``msg % args``."""
        self._closed.event(msg, *args)

    def departure(self, msg: str, *args: Any) -> None:
        """A consumer left holding batches: ``msg % args``."""
        self._left.event(msg, *args)

    def flush_due(self) -> None:
        """Tell what each kind held back once its window is over."""
        self._closed.flush_due()
        self._left.flush_due()

    def flush(self) -> None:
        """Tell what is held back now (the service stops)."""
        self._closed.flush()
        self._left.flush()
