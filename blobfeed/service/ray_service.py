"""The feeding service as a named Ray actor: ``serve_on_ray``.

``serve_on_ray(name, setup)`` starts one Ray actor named ``name``; inside
it, ``setup()`` wires sources with :func:`blobfeed.serve_source` (the same
function ``blobfeed serve MODULE:FUNCTION`` calls), and a
:class:`RayFeedServer` serves them.  Consumers anywhere on the cluster (Ray
Train workers, tasks, actors, other drivers) attach with
``blobfeed.attach_source(net, ..., address="ray://NAME")``
(:mod:`.ray_attach`).

Why an actor the service runs in, and not ``FeedServer(listen="ray://...")``
in the caller's process: consumers find a service by name only if it is an
actor; a driver is not one.  A server in the driver that an actor fronted
would send every batch twice (driver -> actor -> consumer).  Running the
whole server in the actor, with its workers (threads or processes beside
it, or Ray actors of a :class:`~blobfeed.ray.RayBackend` that fate-share
with it), the batches go once, from the actor's node to each consumer's,
through Ray's object store, and a detached service outlives its driver.

What is the same as on a socket: the server is a :class:`FeedServer`; its
sources, outlets, dealing by index or first come, ``equal=True``, the grace
period, acknowledgements, ``state_dict``/resume and metrics are its own.
Only the way in differs: a consumer calls the actor's methods (``hello``,
``take``, ``ack``, ``bye``, ``state``) instead of writing records on a
socket, and the batches come back as the return value of ``take``.

What is Ray's: a consumer process that dies closes no socket.  A consumer
holds a *lease* instead: it calls the service at least every
:data:`~.ray_attach.HEARTBEAT_S`; one the service has not heard from for
``lease`` seconds is taken as dead, and what it had not acknowledged is
dealt again (first come) or kept for its index (grace period), exactly as
for a socket consumer that went away.  The service's own death ends every
consumer's outstanding ``take`` with a Ray error at once.

Trust: Ray pickles the arguments and return values of actor calls.  Between
this actor and :mod:`.ray_attach` go only plain dicts, lists, tuples,
strings, numbers and numpy arrays of plain number types, and each end
checks what it got; a member of the Ray cluster who wants to run code on it
can do so through Ray itself, so the cluster is trusted, as Ray requires
(docs/SERVICE.md).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping

from ..errors import ServiceError, release_frames
from ..reader import EpochEnd
from .admission import Refused, admit
from .ledger import Ledger
from .ray_attach import HEARTBEAT_S, POLL_S, TAKE_WAIT_S, parse_ray_address, ray_failure
from .served import End, IndexOutlet, ServedSource, SharedOutlet
from .server import FeedServer, serving
from .wire import WireError, check, seconds

__all__ = ["RayFeedServer", "RayService", "serve_on_ray"]

logger = logging.getLogger("blobfeed.service")
#: stops the service's coordinator as a user would (see coordinator.lifecycle.STOPS_AS_A_USER)
_blobfeed_stops_as_a_user = True

#: threads of the actor that serve ``take`` (consumers served at once without queueing)
TAKE_THREADS = 64
#: threads for acknowledgements and heartbeats (never blocked by anything slow)
ACK_THREADS = 16
#: threads for the rest: hello (which may wait for an index's lease), state, bye, stop, ...
CONTROL_THREADS = 16
#: how often leases are looked at
LEASE_CHECK_S = 0.1
#: a holder of an index heard from this long after another consumer asked for the index is alive
ALIVE_AFTER_S = 0.2


def _ray() -> Any:
    from .ray_attach import _ray as ray

    return ray()


class _RayConsumer:
    """One consumer attached through the actor's methods: what a socket
    :class:`~.connection.Connection` is, without the socket.

    It has what :class:`FeedServer` and :class:`ServedSource` use of a
    connection (``label``, ``peer``, ``closed``, ``receiver``,
    ``tell_stopped``, ``close``); what it sent and what came back is its
    :class:`~.ledger.Ledger` (made at admission), as a socket's is.
    """

    def __init__(self, server: "RayFeedServer", number: int) -> None:
        self.server = server
        self.number = number
        self.cid = secrets.token_hex(8)
        self.label = str(number)
        #: where its leaving with batches unacknowledged is logged (the service's, throttled)
        self.closures = server.closure_log
        self.peer = f"Ray consumer {number}"
        #: said bye, its lease expired, or the service closed it
        self.closed = threading.Event()
        #: it left: what it had not acknowledged was handed back
        self.gone = threading.Event()
        #: FeedServer.stop joins a socket connection's receiver thread; this has none
        self.receiver: threading.Thread | None = None
        self.heard = time.monotonic()
        self.source: ServedSource | None = None
        self.outlet: IndexOutlet | SharedOutlet | None = None
        #: what was sent and not acknowledged (made at admission)
        self.ledger: Ledger | None = None
        #: one take at a time; leave() waits for the running one
        self._busy = threading.Lock()
        self._waited_lock = threading.Lock()
        self._told: str | None = None
        self._ended = False
        #: it left (leave() ran); also before it was admitted
        self._left = False
        self._leave_lock = threading.Lock()
        self._wake = threading.Event()
        #: the seconds the consumer's run() has waited in all, the most it said so far
        self._run_waited = 0.0

    def attached(self, source: ServedSource, outlet: IndexOutlet | SharedOutlet, pid: int) -> None:
        self.source, self.outlet = source, outlet
        self.label = outlet.label if isinstance(outlet, IndexOutlet) else str(self.number)
        self.peer = f"consumer {self.label} of source {source.name!r} (pid {pid}, over Ray)"
        # Ray runs a consumer's calls on several threads: its acknowledgements may come out of order
        self.ledger = Ledger(outlet, source.counts, self.label, ordered=False)
        self.ledger.peer = self.peer

    # -- the consumer's calls ----------------------------------------------------------
    def ack(self, upto: int, waited: float | None = None) -> bool:
        """Items up to ``upto`` were returned by the consumer's run()
        (cumulative, so a late or repeated call changes nothing).  False:
        the consumer was taken as gone (its lease expired) before this
        came, and what it held is dealt again: its run() must not return it.

        ``waited``: the seconds its run() has waited in all (checked by the
        caller); what it grew by counts.  Ray runs a consumer's calls on
        several threads, so an older total may come after a newer one: the
        largest stands (a socket's records come in order, and there a
        total that shrinks is refused).

        Raises:
            WireError: ``upto`` was never sent.
        """
        assert self.source is not None and self.ledger is not None
        counted, _ = self.ledger.ack(upto)
        if not counted:
            return False
        with self._waited_lock:
            if waited is not None and waited > self._run_waited:
                self.source.counts.run_waited[self.label] += waited - self._run_waited
                self._run_waited = waited
        self._wake.set()  # a take waiting for room
        return True

    def take(self) -> list[tuple[Any, ...]]:
        """What goes to the consumer now: items while it holds fewer than
        ``slots`` unacknowledged ones, or an end; waits up to
        :data:`TAKE_WAIT_S` for the first (an acknowledgement that makes
        room wakes it)."""
        source, outlet, ledger = self.source, self.outlet, self.ledger
        assert source is not None and outlet is not None and ledger is not None
        if not self._busy.acquire(timeout=4 * TAKE_WAIT_S):
            return []  # a take of this consumer still runs (a retried call): nothing twice
        try:
            out: list[tuple[Any, ...]] = []
            counts = source.counts
            slots = source.slots
            deadline = time.monotonic() + TAKE_WAIT_S
            while not self.closed.is_set() and not self._ended:
                if self._told is not None:
                    self._ended = True
                    out.append(("end", "stopped", self._told))
                    break
                held = ledger.in_flight()
                left = deadline - time.monotonic()
                if held >= slots:
                    if out or left <= 0:
                        break
                    # no room until an acknowledgement comes: only an end (a stop) can go
                    self._wake.wait(min(left, POLL_S))
                    self._wake.clear()
                    continue
                if out and left <= 0:
                    break
                t0 = time.perf_counter()
                item = outlet.next(self, 0.001 if out else max(0.001, min(POLL_S, left)))
                counts.waited[self.label] += time.perf_counter() - t0
                if item is None:
                    if out or time.monotonic() >= deadline:
                        break
                    continue
                if isinstance(item, End):
                    if item.error is None and isinstance(outlet, SharedOutlet) and self.server._held_elsewhere(self):
                        # The data is done, but another consumer holds batches
                        # it has not acknowledged: if it died (its lease runs
                        # out), they are dealt again, to those still here, so
                        # the end waits for them.
                        if out or time.monotonic() >= deadline:
                            break
                        self._wake.wait(min(POLL_S, max(0.0, deadline - time.monotonic())))
                        self._wake.clear()
                        continue
                    # the consumer still acknowledges what it has, and says bye when done
                    self._ended = True
                    out.append(_end_record(item))
                    break
                g = ledger.number()
                ledger.record(g, item)
                ledger.sent(g)
                batch = item.batch
                if type(batch) is EpochEnd:
                    out.append(("epoch_end", g, batch.epoch, batch.dropped))
                else:
                    out.append(("batch", g, batch.n, list(batch.arrays)))
                    counts.delivered[self.label] += 1
            return out
        finally:
            self._busy.release()

    # -- what the server does with it --------------------------------------------------
    def tell_stopped(self, reason: str) -> None:
        """The service stops: the consumer's next (or running) take says so."""
        if not self._ended and self._told is None:
            self._told = reason
            self._wake.set()

    def close(self) -> None:
        self.leave("the service stopped")

    def leave(self, why: str) -> None:
        """The consumer is gone (bye, lease, stop): what it had not
        acknowledged goes back to its outlet.  Idempotent."""
        if self.ledger is not None and not self.ledger.close():
            return
        with self._leave_lock:
            if self._left:
                return
            self._left = True
        self.closed.set()
        self._wake.set()
        with self._busy:
            pass  # a running take ends within POLL_S once closed is set
        self.server._forget(self)
        source, outlet, ledger = self.source, self.outlet, self.ledger
        if source is not None and outlet is not None and ledger is not None:
            unacked = ledger.hand_back()
            source.release(self, outlet, unacked)
            logger.info("service: %s left (%s; %d unacknowledged)", self.peer, why, len(unacked))
        self.gone.set()


def _end_record(end: End) -> tuple[str, str, str | None]:
    err = end.error
    if err is None:
        return ("end", "end", None)
    return ("end", "stopped" if getattr(err, "service_stop", False) else "fetcher", str(err))


def _int(name: str, value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise WireError(f"a Ray consumer sent {name}={str(value)[:20]} (expected an int in [{low}, {high}])")
    return value


class RayFeedServer(FeedServer):
    """A :class:`FeedServer` whose consumers come through a Ray actor's
    methods (:class:`_ServiceActor`) instead of a socket.

    Args:
        address: its ``ray://NAMESPACE/NAME``, for messages.
        lease: seconds without a call after which a consumer is taken as dead.

    The other arguments are :class:`FeedServer`'s (there is no ``listen``).
    """

    def __init__(self, address: str, *, lease: float = 5.0, **kwargs: Any) -> None:
        super().__init__(None, **kwargs)
        self.ray_address = address
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not lease >= 4 * HEARTBEAT_S:
            raise ValueError(f"lease must be a number of seconds >= {4 * HEARTBEAT_S} (4 heartbeats), got {lease!r}")
        self.lease = float(lease)
        self._by_cid: dict[str, _RayConsumer] = {}

    def _bind(self) -> None:
        # no socket: the actor's methods are the way in
        self.address = self.ray_address

    def _accept_loop(self) -> None:
        """Nothing to accept (consumers call the actor): this thread ends
        the leases of consumers that went silent."""
        while not self._stopping.wait(LEASE_CHECK_S):
            now = time.monotonic()
            for c in list(self._by_cid.values()):
                if not c.closed.is_set() and now - c.heard > self.lease:
                    logger.warning(
                        "service: %s: nothing heard for %.1f s (lease %.3g s): taken as gone", c.peer,
                        now - c.heard, self.lease,
                    )
                    c.leave(f"lease of {self.lease:.3g} s expired")

    def _forget(self, conn: _RayConsumer) -> None:
        with self._lock:
            self._connections.discard(conn)
            self._by_cid.pop(conn.cid, None)

    def _held_elsewhere(self, me: _RayConsumer) -> bool:
        """Does another consumer of ``me``'s source hold unacknowledged items?"""
        return any(
            c is not me and c.source is me.source and c.ledger is not None and c.ledger.holds_any()
            for c in list(self._by_cid.values())
        )

    def _consumer(self, cid: Any) -> _RayConsumer | None:
        if type(cid) is not str:
            raise WireError(f"a Ray consumer sent a {type(cid).__name__} as its id")
        conn = self._by_cid.get(cid)
        if conn is None or conn.closed.is_set():
            return None
        conn.heard = time.monotonic()
        return conn

    def _gone(self) -> list[tuple[Any, ...]]:
        return [("end", "gone", (
            f"service at {self.ray_address} does not know this consumer any more: it was silent for its "
            f"lease ({self.lease:.3g} s) and taken as gone, or it detached, or the service stopped"
        ))]

    # -- the actor's methods -----------------------------------------------------------
    def hello(self, record: Any) -> dict[str, Any]:
        """A consumer attaches: a welcome, or why it is refused."""
        try:
            if type(record) is not dict or type(record.get("t")) is not str:
                raise WireError(f"a Ray consumer's hello is a {type(record).__name__}, not a record")
            hello = check(record, ("hello",), "a Ray consumer")
            if self._stop_requested():
                raise Refused(f"service at {self.ray_address} is stopping")
            conn = _RayConsumer(self, next(self._numbers))
            self._await_index(hello)
            source, outlet = admit(hello, self.source_for, conn)
        except (WireError, Refused) as err:
            self._refusals.refused("a Ray consumer", str(err))
            return {"t": "refused", "error": str(err), "kind": "value"}
        conn.attached(source, outlet, hello["pid"])
        with self._lock:
            stopping = self._stop_requested()
            if not stopping:
                self._connections.add(conn)  # type: ignore[arg-type]  # FeedServer.stop tells and closes it
                self._by_cid[conn.cid] = conn
        if stopping:
            conn.leave("the service is stopping")
            return {"t": "refused", "error": f"service at {self.ray_address} is stopping", "kind": "value"}
        logger.info("service: %s attached", conn.peer)
        return {
            "t": "welcome", "cid": conn.cid,
            "consumer": outlet.index if isinstance(outlet, IndexOutlet) else conn.number,
            "slots": source.slots, "service": self.ray_address, "lease": self.lease,
        }

    def _await_index(self, hello: dict[str, Any]) -> None:
        """An index whose consumer died (killed, its node lost) is free once
        its lease expires: a consumer that comes back for it (a restarted
        Ray Train worker) waits for that instead of being refused.  A
        holder that calls after this hello arrived is alive: then the hello
        is refused (by ``admit``) within about a heartbeat."""
        source, index = self.sources.get(hello["source"]), hello["index"]
        if source is None or type(index) is not int or not 0 <= index < len(source.outlets):
            return
        holder = source.outlets[index].holder
        if not isinstance(holder, _RayConsumer):
            return
        # calls a dead consumer sent just before it died arrive within
        # milliseconds; one heard this much later came from a live one
        alive_after = time.monotonic() + ALIVE_AFTER_S
        while not holder.gone.is_set() and not self._stop_requested():
            now = time.monotonic()
            if holder.heard > alive_after or now > holder.heard + self.lease + 1.0:
                return
            holder.gone.wait(LEASE_CHECK_S)

    def take(self, cid: Any, upto: Any) -> list[tuple[Any, ...]]:
        conn = self._consumer(cid)
        if conn is None:
            return self._gone()
        try:
            conn.ack(_int("upto", upto, -1, 1 << 62))
        except WireError as err:
            logger.warning("service: %s; taken as gone", str(err))
            conn.leave("it broke the protocol")
            return [("end", "gone", str(err))]
        return conn.take()

    def ack(self, cid: Any, upto: Any, waited: Any) -> bool:
        conn = self._consumer(cid)
        if conn is None:
            return False
        try:
            return conn.ack(_int("upto", upto, -1, 1 << 62), seconds(waited, f"{conn.peer} sent waited"))
        except WireError as err:
            logger.warning("service: %s; taken as gone", str(err))
            conn.leave("it broke the protocol")
            return False

    def bye(self, cid: Any, upto: Any, waited: Any) -> None:
        conn = self._consumer(cid)
        if conn is None:
            return
        try:
            conn.ack(_int("upto", upto, -1, 1 << 62), seconds(waited, f"{conn.peer} sent waited"))
        except WireError as err:
            logger.warning("service: %s", str(err))
        conn.leave("it detached")

    def consumer_state(self, cid: Any, upto: Any) -> dict[str, Any]:
        """The state, after the asking consumer's last acknowledgement (if a
        consumer asks: its source must be resumable)."""
        source = None
        if cid is not None:
            conn = self._consumer(cid)
            if conn is not None:
                source = conn.source.name if conn.source is not None else None
                try:
                    conn.ack(_int("upto", upto, -1, 1 << 62))
                except WireError as err:
                    return {"state": None, "error": str(err)}
        try:
            return {"state": self.state_dict(source), "error": None}
        except (ValueError, RuntimeError) as err:
            return {"state": None, "error": str(err)}

    def stats(self) -> dict[str, Any]:
        """Per source: the counts the service's metrics show, as plain dicts."""
        out = {}
        for name, s in self.sources.items():
            c = s.counts
            out[name] = {
                "delivered": dict(c.delivered), "acknowledged": dict(c.acknowledged), "redealt": dict(c.redealt),
                "waited": dict(c.waited), "run_waited": dict(c.run_waited),
                "connected": s.connected,
                "error": None if s.error is None else str(s.error),
            }
        return out

    def stop(self, reason: str | None = None) -> bool:
        """As :meth:`FeedServer.stop`; the consumers are told with this service's ``ray://`` name."""
        why = reason or self.stop_reason or "stopped"
        with self._lock:
            self._stopping.set()  # no hello gets in after the consumers were told
            conns = list(self._by_cid.values())
        for c in conns:
            c.tell_stopped(f"service at {self.ray_address} stopped ({why})")
        # FeedServer.stop removes the socket file named by `address` when it
        # did not make a private directory: there is no file here
        self.address = None
        return super().stop(reason)


class _ServiceActor:
    """The actor a service runs in (made a Ray actor class by :func:`_actor_class`)."""

    def __init__(self, address: str, setup: Callable[[], Any], options: dict[str, Any]) -> None:
        self.error: BaseException | None = None
        self.server: RayFeedServer | None = None
        self._private_dir: str | None = None
        try:
            resume_state = options.pop("resume_state", None)
            if resume_state is not None:
                # through a file, so that it is checked as --resume checks one
                if options.get("state_file") is None:
                    self._private_dir = tempfile.mkdtemp(prefix="blobfeed-ray-")
                    options["state_file"] = os.path.join(self._private_dir, "state.json")
                with open(options["state_file"], "w") as f:
                    f.write(resume_state)
                options["resume"] = True
            self.server = RayFeedServer(address, **options)
            with serving(self.server):
                setup()
            self.server.start()
        except BaseException as exc:  # ready() raises it in the caller
            self.error = exc
            if self.server is not None:
                self.server.stop("its setup failed")
        finally:
            if self._private_dir is not None:
                # The state handed in was read by start(); what a stop saves
                # goes back in stop()'s answer: no file stays on this node,
                # whatever happens to the actor later.
                if self.server is not None:
                    self.server.state_file = None
                shutil.rmtree(self._private_dir, ignore_errors=True)
                self._private_dir = None

    def ready(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        import ray

        assert self.server is not None
        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(), "node_id": ctx.get_node_id(), "sources": sorted(self.server.sources),
            "namespace": ctx.namespace,
        }

    def hello(self, record: Any) -> dict[str, Any]:
        assert self.server is not None
        return self.server.hello(record)

    def take(self, cid: Any, upto: Any) -> list[tuple[Any, ...]]:
        assert self.server is not None
        return self.server.take(cid, upto)

    def ack(self, cid: Any, upto: Any, waited: Any) -> bool:
        assert self.server is not None
        return self.server.ack(cid, upto, waited)

    def bye(self, cid: Any, upto: Any, waited: Any) -> None:
        assert self.server is not None
        self.server.bye(cid, upto, waited)

    def state(self, cid: Any = None, upto: Any = -1) -> dict[str, Any]:
        assert self.server is not None
        return self.server.consumer_state(cid, upto)

    def stats(self) -> dict[str, Any]:
        assert self.server is not None
        return self.server.stats()

    def wait(self, timeout: float) -> bool:
        assert self.server is not None
        return self.server.wait(min(max(float(timeout), 0.0), 1.0))

    def stop(self, reason: str | None) -> dict[str, Any]:
        """Stop serving; the state as of what the consumers acknowledged."""
        assert self.server is not None
        clean = self.server.stop(reason)
        try:
            state, error = self.server.state_dict(), None
        except (ValueError, RuntimeError) as err:
            state, error = None, str(err)
        return {"clean": clean, "state": state, "error": error}


_actor_cls: Any = None
_actor_cls_lock = threading.Lock()


def _actor_class() -> Any:
    global _actor_cls
    with _actor_cls_lock:
        if _actor_cls is None:
            _actor_cls = _ray().remote(
                concurrency_groups={"take": TAKE_THREADS, "ack": ACK_THREADS, "control": CONTROL_THREADS}
            )(_ServiceActor)
        return _actor_cls


def _control(actor: Any, method: str) -> Any:
    return getattr(actor, method).options(concurrency_group="control")


class RayService:
    """A handle on a service that runs as a named Ray actor (what
    :func:`serve_on_ray` returns; ``RayService("ray://NAME")`` finds one
    by name, from any driver or worker of the cluster).

    ``address`` (``ray://NAMESPACE/NAME``) is what consumers give
    :func:`blobfeed.attach_source`.  A context manager: leaving it stops
    the service.

    Raises:
        ServiceError: no service of that name.
    """

    def __init__(self, address: str, *, _actor: Any = None) -> None:
        ray = _ray()
        namespace, name = parse_ray_address(address)
        if _actor is None:
            if not ray.is_initialized():
                ray.init(address="auto", logging_level=logging.WARNING)
            try:
                _actor = ray.get_actor(name, namespace=namespace)
            except ValueError as err:
                raise ServiceError(f"no service at {address} (no Ray actor named {name!r})") from err
        if namespace is None:
            namespace = ray.get_runtime_context().namespace
        self.name = name
        self.namespace = namespace
        #: what consumers attach to
        self.address = f"ray://{namespace}/{name}"
        #: the Ray actor the service runs in
        self.actor = _actor
        self._final: dict[str, Any] | None = None
        self._stopped = False

    def _get(self, call: Callable[[], Any], timeout: float, *, raised: bool = False) -> Any:
        """The result of the call ``call()`` makes (it returns the call's
        ``ObjectRef``), waited for in bounded steps.  ``raised``: an
        exception the method raised is raised as Ray raises it (an instance
        of its class too); else every Ray error is a ServiceError."""
        outer = sys.exc_info()[1]  # the caller's: its frames stay as they are
        try:
            return self._wait_for(call(), timeout, raised)
        except BaseException as err:
            # The caller keeps the error; the frames of its traceback, and of
            # Ray's error it was raised from, must not keep the call's object
            # alive with it (made in call(), the reference lives only there)
            release_frames(err, keep=outer)
            raise

    def _wait_for(self, ref: Any, timeout: float, raised: bool) -> Any:
        ray = _ray()
        deadline = time.monotonic() + timeout
        while True:
            ready, _ = ray.wait([ref], timeout=min(POLL_S * 5, max(0.0, deadline - time.monotonic())))
            if ready:
                try:
                    return ray.get(ref)
                except ray.exceptions.RayError as err:
                    if raised and isinstance(err, ray.exceptions.RayTaskError):
                        raise
                    raise ray_failure(err, f"service at {self.address}") from None
            if time.monotonic() >= deadline:
                raise ServiceError(f"service at {self.address} did not answer within {timeout} s")

    def state_dict(self, timeout: float = 30.0) -> dict[str, Any]:
        """Every source's position, as of the batches its consumers
        acknowledged (after :meth:`stop`: as of the stop).

        Raises:
            ValueError: a source is not resumable (not ``deterministic=True``).
            ServiceError: the service is gone.
        """
        if self._stopped:
            if self._final is None or self._final["state"] is None:
                raise ValueError(f"service at {self.address} stopped without a state: "
                                 f"{None if self._final is None else self._final['error']}")
            return self._final["state"]
        reply = self._get(lambda: _control(self.actor, "state").remote(None, -1), timeout)
        if reply["error"] is not None:
            raise ValueError(reply["error"])
        return reply["state"]

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """Per source: batches delivered, acknowledged, re-dealt (per consumer), consumers attached."""
        return self._get(lambda: _control(self.actor, "stats").remote(), timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the service is asked to stop, or every source ended
        (:meth:`FeedServer.wait`); True if so.

        Raises:
            ServiceError: the service died.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            if self._get(lambda: _control(self.actor, "wait").remote(step), step + 30.0):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def stop(self, reason: str | None = None, timeout: float = 60.0) -> bool:
        """Stop the service (tell every consumer, let their last
        acknowledgements arrive, save the state if it has a ``state_file``,
        stop the workers), then end its actor.  Idempotent.  Returns True
        when it stopped cleanly; :meth:`state_dict` then gives the state
        as of the stop."""
        if self._stopped:
            return bool(self._final and self._final["clean"])
        ray = _ray()
        self._stopped = True
        try:
            self._final = self._get(lambda: _control(self.actor, "stop").remote(reason), timeout)
        except ServiceError as err:
            logger.warning("%s", str(err))  # the text: a kept log record keeps no error alive
            self._final = {"clean": False, "state": None, "error": str(err)}
        ray.kill(self.actor, no_restart=True)
        self._wait_gone(timeout)
        return bool(self._final["clean"])

    def _wait_gone(self, timeout: float) -> None:
        """Until Ray no longer knows the actor by its name (free for the next service)."""
        ray = _ray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                found = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError:
                return
            if found._actor_id != self.actor._actor_id:
                return  # another service took the name already
            time.sleep(POLL_S)  # a poll of Ray's registry: nothing to wait on
        logger.warning("service at %s: Ray still lists its actor %.0f s after it was killed", self.address, timeout)

    def __enter__(self) -> "RayService":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<RayService {self.address}>"


def serve_on_ray(
    name: str,
    setup: Callable[[], Any],
    *,
    namespace: str | None = None,
    detached: bool = False,
    actor_options: Mapping[str, Any] | None = None,
    lease: float = 5.0,
    state_file: str | os.PathLike[str] | None = None,
    resume: bool = False,
    resume_state: Mapping[str, Any] | None = None,
    save_every: float = 60.0,
    log_interval: float = 60.0,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    start_timeout: float = 120.0,
) -> RayService:
    """Run a feeding service as the Ray actor ``name``; consumers attach
    with ``blobfeed.attach_source(..., address="ray://NAME")`` (or the
    returned handle's ``address``, which names the namespace too).

    Args:
        name: the actor's name (no ``/``).
        setup: called once inside the actor, with no arguments; it wires
            the sources with :func:`blobfeed.serve_source` (as the
            function ``blobfeed serve MODULE:FUNCTION`` calls).  Ray sends
            it with cloudpickle: a module-level function of a module every
            node can import, or anything cloudpickle sends by value.
        namespace: the Ray namespace of the name (default: this job's).
        detached: the service outlives this driver (``lifetime="detached"``);
            stop it with ``RayService(address).stop()``.
        actor_options: for the actor's ``.options()``: ``num_cpus``
            (default 1), ``resources``, ``scheduling_strategy``,
            ``runtime_env``, ...
        lease: seconds a consumer may be silent before it is taken as dead
            (it calls every 0.5 s while alive).
        state_file, resume, save_every, log_interval, metrics_port,
            metrics_addr: as :class:`FeedServer`'s; paths and ports are the
            actor's node's.
        resume_state: continue from this state (from :meth:`RayService.state_dict`
            or an attachment's), checked as ``resume`` checks a state file.
        start_timeout: seconds to wait for the actor to be placed and set up.

    Returns:
        A :class:`RayService` handle.

    Raises:
        ValueError: a bad argument, the name is taken, or ``setup`` raised
            it (whatever ``setup`` raises is raised here, as Ray raises it).
        ServiceError: the actor did not start within ``start_timeout``.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name must be a non-empty str without '/', got {name!r}")
    if not callable(setup):
        raise TypeError(f"setup must be callable (it wires the sources), got {type(setup).__name__}")
    if resume_state is not None and resume:
        raise ValueError("give resume_state, or resume=True with a state_file, not both")
    options: dict[str, Any] = {
        "lease": lease, "state_file": os.fspath(state_file) if state_file is not None else None, "resume": resume,
        "save_every": save_every, "log_interval": log_interval, "metrics_port": metrics_port,
        "metrics_addr": metrics_addr,
    }
    if resume_state is not None:
        options["resume_state"] = json.dumps(resume_state)  # plain data only, checked in the actor
    ray = _ray()
    if not ray.is_initialized():
        logger.info("connecting to Ray")
        ray.init(logging_level=logging.WARNING)
    if namespace is None:
        namespace = ray.get_runtime_context().namespace
    address = f"ray://{namespace}/{name}"
    opts: dict[str, Any] = {"num_cpus": 1}
    opts.update(actor_options or {})
    for key in ("name", "namespace", "lifetime", "max_restarts", "max_concurrency"):
        if key in opts:
            raise ValueError(f"actor_options: {key!r} is serve_on_ray's to set")
    opts.update(name=name, namespace=namespace, max_restarts=0, max_concurrency=4)
    if detached:
        opts["lifetime"] = "detached"
    try:
        actor = _actor_class().options(**opts).remote(address, setup, options)
    except ValueError as err:
        raise ValueError(f"cannot serve at {address}: {err}") from err
    handle = RayService(address, _actor=actor)
    try:
        info = handle._get(lambda: _control(actor, "ready").remote(), start_timeout, raised=True)
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    logger.info(
        "service at %s: serving %s (pid %s on node %s)", address, info["sources"], info["pid"], info["node_id"][:12]
    )
    return handle
