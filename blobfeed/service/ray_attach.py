"""The consumer's end of a service that runs as a named Ray actor.

``attach_source(net, ..., address="ray://NAME")`` (or
``ray://NAMESPACE/NAME``) lands here.  The net gets the same feed as from
a socket service: the reader of an :class:`~blobfeed.reader.Inlet`
(``Net.add_reader``), so ``net.run()``, ``EndOfEpoch``,
``EndOfInput``, timeouts and errors behave as with a local source.  Only
the transport differs, and it is Ray's own:

* a **receiver** thread keeps one ``take`` call on the service actor
  outstanding; its reply (a list of plain tuples and numpy arrays) travels
  through Ray's object store, and the arrays are read-only views of it on
  this node (zero-copy once the reply is in the local store);
* the net's ``run()`` tells the service the number of the item it returns
  (``ack``) and waits for the answer before it returns the item: a call
  still on its way when this process dies could be lost, and the service
  would deal the batch again (one round trip per batch, about a millisecond
  on one node);
* a **heartbeat** thread calls at least every :data:`HEARTBEAT_S` while the
  net does not: that renews this consumer's lease on the service, which
  takes a consumer it has not heard from for its ``lease`` as dead and
  deals its unacknowledged batches again;
* every wait on Ray is a bounded ``ray.wait``; the service actor's death
  ends the outstanding ``take`` with a Ray error at once, and ``run()``
  raises :class:`~blobfeed.errors.ServiceError` naming the service.

Ray deserialises what an actor returns with pickle: this end trusts the
cluster as Ray does, and checks the reply's shape and types anyway
(:func:`check_reply`), so that a service of another version fails clearly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from ..errors import FetcherError, ServiceError
from ..net import Net
from .remote import Attached, open_inlet
from .wire import PROTOCOL, BatchCheck, WireError

__all__ = [
    "HEARTBEAT_S", "POLL_S", "RAY_SCHEME", "TAKE_WAIT_S", "RayAttachment", "check_reply", "parse_ray_address",
]

logger = logging.getLogger("blobfeed.service")

#: the address scheme of a service running as a Ray actor
RAY_SCHEME = "ray://"
#: seconds between a consumer's calls when it has nothing new to acknowledge (its lease's heartbeat)
HEARTBEAT_S = 0.5
#: seconds the service holds a ``take`` call open when it has nothing for the consumer
TAKE_WAIT_S = 0.25
#: bound of each ``ray.wait`` here (then the attachment looks whether it was stopped)
POLL_S = 0.1
#: seconds an acknowledgement (or a heartbeat) may take before it is given up (logged)
ACK_TIMEOUT_S = 30.0
#: the ends a take reply may carry, as the socket's ``end`` record's kinds (plus ``gone``:
#: the service does not know this consumer any more, its lease expired)
END_KINDS = frozenset({"end", "fetcher", "stopped", "gone"})
#: dtype kinds a batch may have (as on the socket): numbers and booleans
_KINDS = frozenset("biufc?")


def parse_ray_address(address: str) -> tuple[str | None, str]:
    """``ray://NAME`` -> (None, NAME): the caller's namespace;
    ``ray://NAMESPACE/NAME`` -> (NAMESPACE, NAME).

    Raises:
        ValueError: not a ``ray://`` address, or an empty name.
    """
    if not address.startswith(RAY_SCHEME):
        raise ValueError(f"{address!r} is not a Ray service address (ray://NAME or ray://NAMESPACE/NAME)")
    rest = address[len(RAY_SCHEME):]
    namespace, _, name = rest.rpartition("/")
    if not name or (_ and not namespace):
        raise ValueError(f"{address!r}: expected ray://NAME or ray://NAMESPACE/NAME")
    return (namespace or None), name


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError(
            "a ray:// service needs Ray: pip install -e '.[ray]' in the clone of blobfeed, or pip install 'ray>=2.9'"
        ) from exc
    return ray


def ray_failure(err: BaseException, service: str) -> ServiceError:
    """A Ray error of a call on the service actor, as the consumer's ServiceError."""
    ray = _ray()
    if isinstance(err, ray.exceptions.RayActorError):
        text = " ".join(ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.startswith("\t"))
        error = ServiceError(f"{service}: its Ray actor died ({type(err).__name__}: {text})")
    else:
        error = ServiceError(f"{service}: {type(err).__name__}: {err}")
    error.__cause__ = err
    return error


def check_reply(reply: Any, batch_check: BatchCheck, next_g: int, limit: int, where: str) -> list[tuple[Any, ...]]:
    """The records of a ``take`` reply, each checked: ``("batch", g, n,
    [arrays])`` (plain numeric arrays that pass ``batch_check``, the
    check every carrier makes: one per blob, ``n <= batch_size`` rows each,
    the first batch's layout),
    ``("epoch_end", g, epoch, dropped)``, ``("end", kind, text)``; the
    ``g`` numbers consecutive from ``next_g``; at most ``limit`` records.

    Raises:
        WireError: naming what did not fit.
    """
    if type(reply) is not list or len(reply) > limit:
        raise WireError(
            f"{where} answered a take with {type(reply).__name__} (expected a list of at most {limit} records)"
        )
    g = next_g
    for rec in reply:
        if type(rec) is not tuple or not rec or rec[0] not in ("batch", "epoch_end", "end"):
            raise WireError(f"{where} sent a record that is not one of batch, epoch_end, end: {str(rec)[:60]}")
        kind = rec[0]
        if kind == "end":
            if len(rec) != 3 or rec[1] not in END_KINDS or not (rec[2] is None or type(rec[2]) is str):
                raise WireError(f"{where} sent a malformed end record: {str(rec)[:80]}")
            continue
        if len(rec) != 4 or not all(type(x) is int for x in rec[1:3]) or rec[1] != g:
            raise WireError(f"{where} sent a {kind} record numbered {str(rec[1:2])[:20]}; expected item {g}")
        g += 1
        if kind == "epoch_end":
            if type(rec[3]) is not int or not (0 <= rec[2] < 1 << 40 and 0 <= rec[3] < 1 << 62):
                raise WireError(f"{where} sent a malformed epoch_end record: {str(rec)[:80]}")
            continue
        n, arrays = rec[2], rec[3]
        if type(arrays) is not list:
            raise WireError(f"{where} sent batch {rec[1]} of {n} samples in {type(arrays).__name__}, not a list")
        batch_check.rows(n, len(arrays), f"{where}: batch {rec[1]}")
        for i, a in enumerate(arrays):
            if type(a) is not np.ndarray:
                raise WireError(f"{where} sent batch {rec[1]} whose blob {i} is a {type(a).__name__}, not an array")
            dt = a.dtype
            if dt.kind not in _KINDS or dt.hasobject or dt.fields is not None or a.ndim < 1 or a.shape[0] != n:
                raise WireError(
                    f"{where} sent batch {rec[1]} whose blob {i} is {dt} of shape {a.shape} (expected a plain "
                    f"number type with {n} rows)"
                )
        batch_check.arrays(n, [(a.dtype, a.shape) for a in arrays], f"{where}: batch {rec[1]}")
    return reply


class RayAttachment(Attached):
    """A net attached to a source of a service that runs as a Ray actor
    (what :func:`blobfeed.attach_source` returns for a ``ray://`` address).

    As :class:`~blobfeed.service.Attachment`: ``stop()`` (or leaving a
    ``with`` block) detaches, and the service takes back what this
    consumer had not acknowledged; ``state_dict()`` asks the service.
    """

    def __init__(
        self,
        net: Net,
        names: list[str],
        batch_size: int,
        source_name: str,
        address: str,
        index: int | None,
        num: int | None,
        timeout: float,
        connect_timeout: float,
        coordinator: Any,
    ) -> None:
        namespace, name = parse_ray_address(address)
        super().__init__(net, names, source_name, address)
        ray = _ray()
        if not ray.is_initialized():
            # the service is on a running cluster: join it, never start one
            try:
                ray.init(address="auto", logging_level=logging.WARNING)
            except Exception as err:
                raise ServiceError(
                    f"cannot attach to source {source_name!r}: no Ray cluster to find the {self._service} on "
                    f"({type(err).__name__}: {err}); call ray.init(address=...) first"
                ) from err
        try:
            self._actor = ray.get_actor(name, namespace=namespace)
        except ValueError as err:
            ns = namespace if namespace is not None else ray.get_runtime_context().namespace
            raise ServiceError(
                f"cannot attach to source {source_name!r}: no {self._service} (no Ray actor named {name!r} in "
                f"namespace {ns!r}; a service in another job's namespace is ray://NAMESPACE/NAME)"
            ) from err
        self._closed = False
        self._deadline: float | None = None
        hello = {
            "t": "hello", "protocol": PROTOCOL, "source": source_name, "blobs": names, "batch_size": batch_size,
            "index": index, "num": num, "pid": os.getpid(),
        }
        self._connect_timeout = connect_timeout
        self._deadline = time.monotonic() + connect_timeout
        ref = None
        try:
            ref = self._actor.hello.options(concurrency_group="control").remote(hello)
            welcome = self._call(ref)
        except BaseException as err:  # a Ctrl-C while it waited for the answer (where an attach spends its time),
            if ref is not None:       # or none within connect_timeout: one that comes late is told bye
                self._bye_for(ref)
            if isinstance(err, ServiceError):
                raise ServiceError(f"cannot attach to source {source_name!r}: {err}") from err.__cause__
            raise
        finally:
            self._deadline = None
        # Past the welcome the service counts this consumer as attached: an
        # exception from here on (a Ctrl-C at any bytecode) detaches it at
        # once, not when its lease runs out.
        try:
            self._attached(welcome, names, batch_size, source_name, address, timeout, net, coordinator)
        except BaseException:
            self._bye_for(ref)
            raise
        self._open([(self._receive, f"blobfeed-attach-ray-recv-{source_name}"),
                    (self._heartbeat, f"blobfeed-attach-ray-ack-{source_name}")])
        logger.info("attached to %s", self._service)

    def _attached(
        self, welcome: Any, names: list[str], batch_size: int, source_name: str, address: str, timeout: float,
        net: Net, coordinator: Any,
    ) -> None:
        """(The constructor, once the service answered.)  The welcome
        checked, and the net's inlet open."""
        welcome = self._check_welcome(welcome)
        self._cid: str = welcome["cid"]
        self._slots: int = welcome["slots"]
        self._lease: float = welcome["lease"]
        self.consumer: int = welcome["consumer"]
        self._service = f"service at {address} (source {source_name!r}, consumer {self.consumer})"
        #: the number of the last item the net's run() returned
        self._acked = -1
        self._next_g = 0
        self._names = names
        self._batch_check = BatchCheck(batch_size, len(names))
        #: set when the attachment stops (ends the heartbeat)
        self._wake = threading.Event()
        self._ack_call = self._actor.ack.options(concurrency_group="ack")
        self._threads = []
        self.inlet = open_inlet(net, names, batch_size, source_name, self._slots, timeout, self._ack, coordinator)

    def _bye_for(self, ref: Any) -> None:
        """``attach_source()`` failed once it had asked the service to attach
        this consumer (``ref``: the answer): the service may count it, its
        index taken until its lease ran out.  The answer, read within 1 s,
        names it: it is told bye."""
        self._closed = True
        try:
            welcome = _ray().get(ref, timeout=1.0)
        except Exception:
            return  # no answer: nothing was attached, or the service is gone
        if type(welcome) is dict and type(welcome.get("cid")) is str:
            self._cid, self._acked = welcome["cid"], -1
            self._bye(1.0, 0.0)

    # -- calls on the service actor ----------------------------------------------------
    def _call(self, ref: Any, timeout: float | None = None) -> Any:
        """The result of a call on the service; None once this attachment
        stopped.  Waits in bounded steps.

        Raises:
            ServiceError: the actor died, the call failed, or ``timeout``
                (or the attach's deadline) passed.
        """
        ray = _ray()
        deadline = self._deadline if timeout is None else time.monotonic() + timeout
        while True:
            ready, _ = ray.wait([ref], timeout=POLL_S)
            if ready:
                try:
                    return ray.get(ref)
                except ray.exceptions.RayError as err:
                    raise ray_failure(err, self._service) from None
            if self._closed:
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise ServiceError(f"{self._service} did not answer within "
                                   f"{timeout if timeout is not None else self._connect_timeout:g} s")

    def _check_welcome(self, welcome: Any) -> dict[str, Any]:
        where = self._service
        if type(welcome) is not dict or type(welcome.get("t")) is not str:
            raise ServiceError(f"{where} answered the attach with {type(welcome).__name__}, not a record")
        if welcome["t"] == "refused":
            raise ValueError(f"{where} refused the attach: {welcome.get('error')}")
        fields = {"t": str, "cid": str, "consumer": int, "slots": int, "service": str, "lease": float}
        if welcome["t"] != "welcome" or set(welcome) != set(fields) or not all(
            type(welcome[k]) is v for k, v in fields.items()
        ):
            raise ServiceError(f"{where} answered the attach with a malformed welcome: {str(welcome)[:200]}")
        if not 3 <= welcome["slots"] <= 1024 or not 0 < len(welcome["cid"]) <= 64:
            raise ServiceError(f"{where} offered {welcome['slots']} slots")
        return welcome

    # -- threads -----------------------------------------------------------------------
    def _ack(self, g: int) -> None:
        """The net's run() returned item ``g`` (its thread): the service
        counts it before run() returns it.

        Waited for (one round trip to the service actor per batch): a Ray
        call that is only submitted when this process dies may never reach
        the service, which would then deal the batch again.  On a socket the
        kernel delivers what was sent; Ray has no such send.

        Raises:
            ServiceError: the service did not count it (it is gone, or took
                this consumer as gone and dealt the batch again): run()
                raises instead of returning a batch another consumer gets
                too, or a resumed service deals again.
        """
        self._acked = g
        if self._closed:
            return
        try:
            counted = self._call(self._ack_call.remote(self._cid, g, self._waited()), timeout=ACK_TIMEOUT_S)
        except ServiceError as err:
            self.inlet.fail(err)
            raise
        if counted is False:
            gone = ServiceError(
                f"{self._service} no longer counts this consumer as attached (it was silent for longer than "
                f"its lease of {self._lease:.3g} s, or detached): what it had not acknowledged was dealt again"
            )
            self.inlet.fail(gone)
            raise gone

    def _heartbeat(self) -> None:
        """Renew the lease while the net does not call run() (a long step,
        a consumer that is done but still attached)."""
        while not self._wake.wait(HEARTBEAT_S):
            try:
                self._call(self._ack_call.remote(self._cid, self._acked, self._waited()), timeout=ACK_TIMEOUT_S)
            except ServiceError:
                return  # the receiver (or the next run()) reports the service's end

    def _receive(self) -> None:
        inlet = self.inlet
        take = self._actor.take.options(concurrency_group="take")
        try:
            while not self._closed:
                # The service sends items while its count of this consumer's
                # unacknowledged ones is below `slots`; acknowledgements in
                # transit only make that count higher than what is held here,
                # so the queue (slots + 1) never blocks the receiver.
                reply = self._call(take.remote(self._cid, self._acked), timeout=60.0)
                if reply is None:
                    return
                for rec in check_reply(reply, self._batch_check, self._next_g, self._slots + 2, self._service):
                    kind = rec[0]
                    if kind == "batch":
                        _, g, n, arrays = rec
                        for a in arrays:
                            a.flags.writeable = False  # batches are read-only everywhere in blobfeed
                        self._next_g = g + 1
                        if not inlet.put(arrays, n, g):
                            return
                    elif kind == "epoch_end":
                        _, g, epoch, dropped = rec
                        self._next_g = g + 1
                        if not inlet.end_epoch(epoch, dropped, g):
                            return
                    else:
                        self._ended(rec[1], rec[2])
                        return
        except (WireError, ServiceError) as err:
            if self._closed:
                return
            error = err if isinstance(err, ServiceError) else ServiceError(f"{self._service}: {err}")
            if error is not err:
                error.__cause__ = err
            self.inlet.fail(error)
        except Exception as exc:
            logger.exception("receiver of %s failed", self._service)
            error = ServiceError(f"{self._service}: the receiver failed: {exc!r}")
            error.__cause__ = exc
            self.inlet.fail(error)

    def _ended(self, kind: str, text: str | None) -> None:
        if kind == "end" and text is None:
            self.inlet.finish()  # what is queued, then EndOfInput
        elif kind == "fetcher":
            # the stream reached an error of the service's workers: what came before it first
            self.inlet.end_with(FetcherError(f"{self._service}: {text}"))
        else:
            # The heartbeat goes on: a run() that took a batch just before
            # this still acknowledges it, and the service saves its state
            # once every consumer said bye (or a second after telling them).
            self.inlet.fail(ServiceError(f"{self._service}: {text}"))

    # -- the user's side ---------------------------------------------------------------
    def state_dict(self, timeout: float = 10.0) -> dict[str, Any]:
        """The service's state (every source's position, as of what its
        consumers acknowledged, this one's last ``run()`` included).

        Raises:
            ValueError: the service's source is not resumable.
            ServiceError: the service is gone or did not answer in ``timeout``.
        """
        if self._closed:
            raise ServiceError(f"{self._service}: this attachment was stopped")
        reply = self._call(
            self._actor.state.options(concurrency_group="control").remote(self._cid, self._acked), timeout
        )
        if type(reply) is not dict or set(reply) != {"state", "error"}:
            raise ServiceError(f"{self._service} answered for its state with {str(reply)[:100]}")
        if reply["error"] is not None:
            raise ValueError(str(reply["error"]))
        if type(reply["state"]) is not dict:
            raise ServiceError(f"{self._service} sent a state that is not a dict")
        return reply["state"]

    def _bye(self, timeout: float, waited: float) -> None:
        """Tell the service this consumer leaves (what it acknowledged so far
        counts; its run() waited ``waited`` s in all), waiting up to
        ``timeout`` for it to take that in: the index is free for the next
        consumer once this returns."""
        try:
            ref = self._actor.bye.options(concurrency_group="control").remote(self._cid, self._acked, waited)
            _ray().wait([ref], timeout=timeout)
        except Exception as err:  # the service is gone: nothing to take back
            logger.debug("%s: bye: %r", self._service, err)

    def stop(self, timeout: float = 10.0) -> bool:
        """Detach: the service takes back what was not acknowledged.
        Idempotent: a stop that was interrupted (a Ctrl-C) is finished by
        the next call.  Returns True when this attachment's threads ended."""
        deadline = time.monotonic() + timeout
        if not self._closed:
            self._closed = True
            self._wake.set()
            self._bye(min(timeout, 5.0), self._waited())
        # each step below may run again (an interrupted stop's next call)
        self.inlet.stop()
        for t in self._threads:
            if t.ident is not None:  # (one interrupted before it started is not)
                t.join(max(0.0, deadline - time.monotonic()))
        ended = self.inlet.close(max(0.0, deadline - time.monotonic()))
        return ended and not any(t.is_alive() for t in self._threads)
