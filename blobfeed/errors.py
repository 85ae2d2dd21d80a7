"""The few exceptions blobfeed raises, and who causes each.

* :class:`DequeueTimeout` -- the *producer side* was too slow: no batch came
  within the source's ``timeout``.
* :class:`FetcherError` -- the *user's* ``fetch_fun`` raised; the original
  exception is the ``__cause__``.
* :class:`ChunkError` -- the *user's* ``fetch_fun`` returned a malformed chunk.
* :class:`EndOfInput` -- the stream ended normally: every fetcher raised
  ``StopIteration`` and the last batch was consumed, or the source was
  stopped.
* :class:`EndOfEpoch` -- an epoch of a source with ``epochs`` ended and
  another follows (a kind of :class:`EndOfInput`, so ``for out in net``
  runs one epoch).
* :class:`ServiceError` -- the *feeding service* a consumer attached to
  stopped, died or dropped the connection (a kind of :class:`FetcherError`:
  the source failed for this consumer).

And one warning category, :class:`BlobfeedWarning`, for a use of the library
the program should change (a ``fetch_fun`` returning ``None``): issued with
:func:`warnings.warn`, so it shows on stderr whether or not logging is set up.
"""

from __future__ import annotations

import traceback

__all__ = [
    "BlobfeedError",
    "BlobfeedWarning",
    "ChunkError",
    "DequeueTimeout",
    "EndOfEpoch",
    "EndOfInput",
    "FetcherError",
    "ServiceError",
]


class BlobfeedError(Exception):
    """Base class of every error blobfeed raises on purpose."""


class BlobfeedWarning(UserWarning):
    """Something the program should change, said once through
    :mod:`warnings` (shown on stderr by default, even without logging set
    up; silence or turn into errors with ``warnings.filterwarnings``).
    Ongoing conditions are logged under the ``blobfeed`` logger besides."""


class DequeueTimeout(BlobfeedError, TimeoutError):
    """No batch arrived within the allowed time (``Net.run`` / ``BlobsQueue.get``)."""


class EndOfInput(BlobfeedError):
    """The input is exhausted or its source was stopped; no batch will follow."""


class EndOfEpoch(EndOfInput):
    """An epoch of the source ended and the next one follows: the next
    ``run()`` returns its first batch.

    Attributes:
        source: the input source whose epoch ended.
        epoch: the epoch that ended (0, 1, ...).
    """

    def __init__(self, source: str, epoch: int) -> None:
        super().__init__(f"source {source!r}: epoch {epoch} ended; the next run() starts epoch {epoch + 1}")
        self.source = source
        self.epoch = epoch

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return (type(self), (self.source, self.epoch))


class FetcherError(BlobfeedError):
    """A user ``fetch_fun`` raised; ``__cause__`` is the original exception."""


class ChunkError(FetcherError, ValueError):
    """A user ``fetch_fun`` returned a malformed chunk.

    The message names the source, the worker id, the blob and what was
    expected versus what came.
    """


class ServiceError(FetcherError):
    """The feeding service a consumer attached to (``attach_source``)
    stopped, died or broke the protocol; the message names the service."""


def release_frames(err: BaseException, keep: BaseException | None = None) -> BaseException:
    """``err``, with the local variables of its traceback's finished frames
    cleared, and those of the exceptions it was raised from (its causes and
    contexts, all of them).

    For an error blobfeed hands to a caller who may keep it (a source's
    failure, a service's error): the frames of its traceback would keep
    alive whatever they held (a Ray stream, an object reference, a batch)
    for as long as the error lives.  The tracebacks still print; frames
    still running are left as they are.

    ``keep``: the exception the caller was handling when it called in
    (``sys.exc_info()[1]`` on the way in): it and what it chains are the
    caller's, and are not touched (clearing a suspended generator's frame
    would close the generator).
    """
    done: set[int] = set()
    todo: list[BaseException | None] = [keep]
    while todo:  # the caller's, first: marked done, never cleared
        e = todo.pop()
        if e is not None and id(e) not in done:
            done.add(id(e))
            todo += [e.__cause__, e.__context__]
    todo = [err]
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in done:
            done.add(id(e))
            traceback.clear_frames(e.__traceback__)
            todo += [e.__cause__, e.__context__]
    return err
