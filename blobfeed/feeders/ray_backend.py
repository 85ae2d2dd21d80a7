"""Fetchers as Ray actors: ``blobfeed.ray.RayBackend`` (extra ``blobfeed[ray]``).

Beside the process backend, and re-exported by :mod:`blobfeed.ray`.  Ray is
imported only when a backend is used (``_ray()``): importing this module
needs no Ray.

Each worker id is one Ray actor, placed by Ray's scheduler wherever its
resources are free (``actor_options``: ``num_cpus``, custom ``resources``
to pin fetchers to nodes, ``runtime_env``, ...).  The actor runs the worker
loop every backend runs (:func:`~blobfeed.feeders.worker_loop.worker_events`),
and streams its events (:mod:`~blobfeed.feeders.messages`) to this process
through one Ray streaming generator per actor.  This process keeps one receiver thread per worker (as the process
backend does) that hands each result to the worker's
:class:`~blobfeed.feeders.source.WorkerIntake`, so the contract (validation,
exact batches, order, errors, metrics) lives where it lives for every
backend.

Transport, given what a Ray object costs (about 0.4 ms each whatever its
size, and bandwidth only from a few MB up):

* **Bundles.**  The actor packs the arrays of consecutive results into one
  contiguous buffer and yields it as one object once it holds
  ``bundle_bytes`` or its oldest result has waited ``bundle_delay_s``
  (counting the next fetch); a result at least ``bundle_bytes`` big travels
  alone.  Everything else (exceptions, ``None``, malformed results, the
  fetcher's state) rides in the same object, in call order.
* **Backpressure.**  At most ``max_in_flight`` bundles per actor are produced
  and not yet taken by this process (Ray's generator backpressure); the
  receiver takes the next only once the intake accepted the last one, which
  blocks while the internal queue is full.  So the actor's node never holds
  more than ``max_in_flight`` bundles of it, and this process no more than
  ``max_pinned`` (below).
* **No head-of-line blocking.**  Each receiver waits on its own actor only:
  a slow, stuck or lost actor never holds up the others.
* **Zero copy, bounded.**  A bundle of 100 KiB or more arrives as a
  read-only view of Ray's object store (on this machine), and the chunks in
  it are views of that: the object stays pinned in the store while any of
  them (or a batch that is a view of one) lives.  At most ``max_pinned``
  bundles of a worker are held so; past that a bundle's chunks are copied
  out at once and the object released, and batches the user keeps may view
  at most ``max_pinned - 2`` of them (later ones are copied), so kept
  batches can neither fill the object store nor stall the workers.
  **Batches from Ray are read-only** (``numpy`` raises "assignment
  destination is read-only" on a write): copy one (``np.array(batch)``)
  before writing into it.

Faults: an actor that dies (killed, crashed, ``os._exit``, its node lost)
ends its stream with a Ray error at once; its receiver reports it through
``intake.died`` naming the worker, the actor, its pid and node, and Ray's
reason -- a ``FetcherError`` while the other workers go on.  With
``max_restarts`` > 0 Ray restarts the actor instead (on any node with room)
and the receiver starts it again from the last result it delivered: a
stateful ``fetch_fun`` (``state_dict``/``load_state_dict``) from the state
that came with that result, any other by replaying the calls of the current
epoch and discarding their results -- bundles the dead actor had produced
but not delivered are fetched again, never lost or doubled.  Each death
counts in ``blobfeed_worker_deaths_total``.

Stop: the receivers stop taking bundles, and every actor is killed
(``ray.kill``), a stuck one included; ``join`` waits until Ray reports each
of them dead.  Nothing of the pipeline is left on the cluster afterwards,
except the objects that batches the user still holds view (they go with
those batches).  blobfeed connects to Ray if it is not connected yet
(``ray.init(address=...)``) and never disconnects or shuts Ray down: a
cluster costs seconds to start and a program may build many pipelines; call
``ray.shutdown()`` yourself when done.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import FetcherError, release_frames
from ..worker_info import WorkerInfo
from .backends import FetchFun, LaunchPlan, WorkerGroup, WorkerInitFun, WorkerPlan, thread_main
from .chunks import GrantPin
from .indexed import UnitReader
from .read_units import HOLDERS
from .ray_calls import GivenUnits, Newest
from .ray_pins import _PinTracker
from .messages import (
    Arrays, EpochDone, Exhausted, Raised, Result, arrays_nbytes, plain_arrays, read_arrays, sendable, write_arrays,
)
from .replay import Replayed
from .transport import pack_exception, unpack_exception
from .worker_loop import deliver, skips, worker_events

__all__ = ["RayBackend"]

logger = logging.getLogger("blobfeed.ray")

#: Ray returns objects smaller than this inline (a copy in this process's
#: heap); larger ones live in the object store and arrive as views of it
ZERO_COPY_MIN_BYTES = 100 * 1024
#: seconds a receiver waits for its actor's next bundle before it looks at
#: the source again (stopped, failed) and at the batch-size hint
POLL_S = 0.1
#: seconds after which an actor Ray has not placed yet is logged
PLACEMENT_WARN_S = 10.0
#: seconds stop() lets the receivers end by themselves before the actors are killed
STOP_GRACE_S = 0.25
#: seconds a restarted actor may take to come back before its worker is given up
RESTART_TIMEOUT_S = 60.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError(
            "blobfeed.ray.RayBackend needs Ray: pip install -e '.[ray]' in the clone of blobfeed, "
            "or pip install 'ray>=2.9'"
        ) from exc
    return ray


class RayBackend:
    """Workers are Ray actors, one per worker id (``backend=RayBackend(...)``).

    Args:
        address: the cluster to join, as ``ray.init(address=...)`` takes it;
            ``None`` joins the running cluster or starts a local one, as
            ``ray.init`` does.  Used only when Ray is not initialised yet in
            this process; blobfeed never shuts Ray down.
        actor_options: passed to each actor's ``.options()``: ``num_cpus``
            (default 1), ``resources`` (pin fetchers to nodes that have a
            custom resource), ``runtime_env``, ``scheduling_strategy``, ...
            (``max_concurrency`` must stay >= 2; ``max_restarts`` is the
            argument below).
        bundle_bytes: small results are packed together into one Ray
            object of about this size (a result at least this big travels
            alone).
        bundle_delay_s: ... or sent once the oldest of them has waited this
            long (counting the next fetch), whichever comes first.
        max_in_flight: bundles per actor produced and not yet taken by this
            process (backpressure).
        max_pinned: bundles per worker that this process holds as views of
            Ray's object store (queued, being re-batched, or viewed by
            batches) before it copies chunks out instead; >= 3.
        max_restarts: restarts per actor after a death (0: a death is a
            ``FetcherError``).  A restarted actor resumes after the last
            result it delivered.
        init_options: more keyword arguments for ``ray.init`` when blobfeed
            is the one to call it.

    ``fetch_fun`` and ``worker_init_fun`` must pickle (cloudpickle), and
    blobfeed and numpy must be importable on every node that runs actors.
    """

    #: runs random-access sources (gives its workers read units: LaunchPlan.units)
    random_access = True
    #: can add and remove actors of a running fetch_fun source (LaunchPlan.elastic,
    #: WorkerGroup.retire: a removed actor sends what it fetched and is killed)
    elastic = True
    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        actor_options: Mapping[str, Any] | None = None,
        bundle_bytes: int = 4 * 1024 * 1024,
        bundle_delay_s: float = 0.02,
        max_in_flight: int = 4,
        max_pinned: int = 8,
        max_restarts: int = 0,
        init_options: Mapping[str, Any] | None = None,
    ) -> None:
        from ..arguments import check_index, check_timeout

        self.address = address
        self.actor_options = dict(actor_options or {})
        if int(self.actor_options.get("max_concurrency", 2)) < 2:
            raise ValueError("actor_options: max_concurrency must be >= 2 (the hint and stop calls run beside the fetch loop)")
        if "max_restarts" in self.actor_options:
            raise ValueError("pass max_restarts=... to RayBackend itself, not in actor_options")
        self.bundle_bytes = check_index("bundle_bytes", bundle_bytes, minimum=1)
        self.bundle_delay_s = check_timeout("bundle_delay_s", bundle_delay_s, allow_zero=True)
        self.max_in_flight = check_index("max_in_flight", max_in_flight, minimum=1)
        self.max_pinned = check_index("max_pinned", max_pinned, minimum=3)
        self.max_restarts = check_index("max_restarts", max_restarts, minimum=0)
        self.init_options = dict(init_options or {})

    def check(self, fetch_fun: FetchFun, worker_init_fun: WorkerInitFun | None) -> None:
        """Refuse a ``fetch_fun``/``worker_init_fun`` that does not pickle (``TypeError``)."""
        _payload(fetch_fun, worker_init_fun)

    def launch(self, plan: LaunchPlan) -> WorkerGroup:
        """Connect to Ray if needed, start one actor per worker, and return the group."""
        ray = _ray()
        payload = _payload(plan.fetch_fun, plan.worker_init_fun)
        if not ray.is_initialized():
            logger.info("connecting to Ray (address=%r)", self.address)
            ray.init(address=self.address, **self.init_options)
        return _RayGroup(self, plan, payload)

    def __repr__(self) -> str:
        return (
            f"RayBackend(address={self.address!r}, actor_options={self.actor_options!r}, "
            f"bundle_bytes={self.bundle_bytes}, bundle_delay_s={self.bundle_delay_s}, "
            f"max_in_flight={self.max_in_flight}, max_pinned={self.max_pinned}, "
            f"max_restarts={self.max_restarts})"
        )


def _payload(fetch_fun: FetchFun, worker_init_fun: WorkerInitFun | None) -> tuple[Any, Any]:
    """``(fetch_fun, worker_init_fun)``, checked to pickle for the actors.

    Raises:
        TypeError: naming what does not pickle, before anything starts.
    """
    dumps = _ray().cloudpickle.dumps  # Ray's own: what it will send the actors with

    for what, obj in (("fetch_fun", fetch_fun), ("worker_init_fun", worker_init_fun)):
        try:
            dumps(obj)
        except Exception as exc:
            raise TypeError(
                f"{what} {obj!r} cannot be sent to a Ray actor: {exc!r}. With a RayBackend it "
                "must pickle (a module-level function, or anything cloudpickle handles) "
                "together with what it refers to"
            ) from exc
    return (fetch_fun, worker_init_fun)


# ---------------------------------------------------------------------------------------------
# the actor (runs on the cluster)
# ---------------------------------------------------------------------------------------------
def _packed(event: Raised) -> Raised:
    """``event`` with its exception pickled, its traceback as text."""
    data, tb = pack_exception(event.error)
    return event._replace(error=data, tb=tb)


def _bundle(events: list[Any]) -> tuple[list[Any], np.ndarray | None]:
    """One Ray object: the events, each result's plain arrays written into
    one buffer (64-byte aligned) and replaced by an :class:`Arrays` whose
    ``where`` is their offset in it."""
    plain = [plain_arrays(ev.raw) if type(ev) is Result else None for ev in events]
    total = sum(arrays_nbytes(a) for a in plain if a is not None)
    buf = np.empty(total, np.uint8) if total else None
    out: list[Any] = []
    off = 0
    for ev, arrays in zip(events, plain):
        if arrays is not None:
            out.append(ev._replace(raw=write_arrays(arrays, buf, off, off, isinstance(ev.raw, tuple))))
            off += arrays_nbytes(arrays)
        else:
            out.append(ev)
    return out, buf


class _FetchActor:
    """One worker on the cluster.  Threaded (``max_concurrency`` 2): ``run``
    streams results while ``set_hint``, ``give_units`` and ``stop`` come in
    beside it.  Ray runs those in any order, so the first two are numbered
    by the driver (:mod:`.ray_calls`)."""

    def __init__(
        self, payload: list[Any], worker_id: int, index: int, num_workers: int, source: str, seed: int,
        on_error: str, track_state: bool,
    ) -> None:
        self.worker_id = worker_id
        self.info = WorkerInfo(worker_id, index, num_workers, source, seed, np.random.default_rng(seed))
        self.on_error = on_error
        self.hint: Newest[int] = Newest(1)
        self.stopping = False
        self.load_error: BaseException | None = None
        self.fetch_fun: Any = None
        self.worker_init_fun: Any = None
        try:
            import ray

            # the reference came inside a list, so Ray did not resolve it
            # before __init__: a fetch_fun this node cannot load is our error
            self.fetch_fun, self.worker_init_fun = ray.get(payload[0])
        except BaseException as exc:
            err = RuntimeError(
                f"fetch_fun / worker_init_fun could not be loaded in the Ray actor: {exc!r} "
                "(blobfeed, numpy and what fetch_fun imports must be installed on every node, "
                "or fetch_fun defined where cloudpickle sends it by value)"
            )
            err.__cause__ = exc
            self.load_error = err
            return
        if isinstance(self.fetch_fun, UnitReader):
            # a random-access source: the driver gives this actor its read units
            self.units = GivenUnits(f"source {source!r}, worker {worker_id}", lambda: self.stopping, POLL_S)
            self.fetch_fun.units = self.units
            return
        # restarts need the fetcher's state with each result (or the count
        # of its calls, which Replayed replays): wrap a plain fetch_fun
        if track_state and not isinstance(self.fetch_fun, Replayed):
            self.fetch_fun = Replayed(self.fetch_fun, {})

    def where(self) -> dict[str, Any]:
        """Where this actor runs: node id and address, host name, pid."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(), "pid": os.getpid(), "actor_id": ctx.get_actor_id(),
        }

    def set_hint(self, seq: int, batch_size: int) -> None:
        """The batch-size hint, as the driver's call ``seq`` (an older call that
        overtook a newer one changes nothing)."""
        self.hint.set(seq, batch_size)

    def give_units(self, holder: int, seq: int, units: list[tuple[int, int, int] | None]) -> None:
        """Read units for a random-access source's fetch_fun (None: no more),
        as call ``seq`` of the driver's ``holder``: read in the order of the
        calls, whatever order they run in."""
        self.units.give(holder, seq, units)

    def stop(self) -> None:
        self.stopping = True

    def run(
        self, hint: tuple[int, int], holder: int | None, epoch: int, epochs: int | None,
        resume: tuple[int, Any] | None, bundle_bytes: int, bundle_delay_s: float,
    ) -> Any:
        """Call ``fetch_fun`` epoch after epoch; yield bundles (see :func:`_pack`).

        ``hint``: ``(seq, batch size)``, as :meth:`set_hint` takes it.
        ``holder``: a random-access source's: the driver's holder whose units
        this stream reads.  ``resume``: ``(calls, state)`` after a restart:
        restore the fetcher's state, or replay that many calls of this epoch."""
        self.hint.set(*hint)
        if holder is not None and self.load_error is None:
            self.units.start(holder)
        wid = self.worker_id
        if self.load_error is not None:
            yield _bundle([_packed(Raised(0.0, self.load_error, True))])
            return
        fetch = self.fetch_fun
        if resume is not None:
            if not isinstance(fetch, Replayed):  # pragma: no cover - track_state wraps it
                fetch = self.fetch_fun = Replayed(fetch, {})
            fetch.start[wid] = resume
        dumps = _ray().cloudpickle.dumps
        perf = time.perf_counter
        items: list[Any] = []
        nbytes = 0
        oldest = 0.0
        events = worker_events(
            fetch, self.worker_init_fun, wid, self.info, lambda: self.hint.value, lambda: self.stopping, epochs, epoch,
        )
        try:
            # stopped: the loop ends, and the driver discards what would follow
            for event in events:
                if type(event) is Result:
                    arrays = plain_arrays(event.raw)
                    if arrays is None:
                        event = event._replace(raw=sendable(event.raw, dumps))
                    now = perf()
                    if not items:
                        oldest = now - event.seconds
                    items.append(event)
                    nbytes += arrays_nbytes(arrays) if arrays is not None else 64
                    # another fetch would hold these past the delay bound: send now
                    if nbytes >= bundle_bytes or now - oldest + event.seconds >= bundle_delay_s:
                        out = _bundle(items)
                        items, nbytes = [], 0
                        yield out
                elif type(event) is Raised:
                    items.append(_packed(event))
                    if not skips(self.on_error, event):
                        yield _bundle(items)
                        return
                else:
                    items.append(event)  # the epoch's end rides with the next bundle
                    if type(event) is Exhausted:
                        yield _bundle(items)
                        return
            # stopped (a stop, or set_num_workers removed this actor): what
            # it fetched goes out (after a stop the driver discards it)
            if items:
                yield _bundle(items)
        finally:
            events.close()


_actor_class: Any = None
_actor_class_lock = threading.Lock()


def _remote_actor_class() -> Any:
    global _actor_class
    with _actor_class_lock:
        if _actor_class is None:
            _actor_class = _ray().remote(_FetchActor)
        return _actor_class


# ---------------------------------------------------------------------------------------------
# the driver's side
# ---------------------------------------------------------------------------------------------
class _Restart(Exception):
    """Internal: the actor died and will be started again."""


class _Worker:
    """This process's end of one actor: its receiver thread."""

    def __init__(self, group: "_RayGroup", w: WorkerPlan, actor: Any) -> None:
        self.group = group
        self.plan = w
        self.actor = actor
        self.name = f"blobfeed-recv-{group.source}-{w.worker_id}"
        self.tracker = _PinTracker(group.backend.max_pinned)
        self.where: dict[str, Any] | None = None
        self._where_ref = actor.where.remote()
        self.restarts_left = group.backend.max_restarts
        self.epoch = group.first_epoch
        #: calls of the current epoch delivered (counting a resumed run's start)
        self.epoch_calls = 0
        start = getattr(group.plan.fetch_fun, "start", None) if isinstance(group.plan.fetch_fun, Replayed) else None
        if start and w.worker_id in start:
            self.epoch_calls = int(start[w.worker_id][0])
        #: the fetcher's state after the last result delivered, if it has one
        self.last_state: Any = None
        self._hint_sent = -1
        #: the number of the last hint call (the actor keeps the newest: :mod:`.ray_calls`)
        self._hint_seq = -1
        self.killed = False
        self.thread = threading.Thread(
            target=thread_main, args=(self.name, self._receive, group.plan.on_thread_exit),
            name=self.name, daemon=True,
        )
        #: a random-access source's read units: this actor incarnation's name
        #: with the dispenser, and the threads that give it its units
        self.units = group.plan.units
        self.holder = next(HOLDERS)
        self.feeders: list[threading.Thread] = []

    #: read units an actor holds at most (being read, or queued in it)
    UNITS_AHEAD = 2

    def _start_feeder(self) -> None:
        """Give the actor (this incarnation of it) its read units, on a thread."""
        name = f"blobfeed-units-{self.group.source}-{self.plan.worker_id}"
        t = threading.Thread(
            target=thread_main, args=(name, self._feed_units, self.group.plan.on_thread_exit),
            name=name, daemon=True,
        )
        self.feeders.append(t)
        t.start()

    def _feed_units(self) -> None:
        units, holder, actor = self.units, self.holder, self.actor
        wid = self.plan.worker_id
        # the calls are numbered: the actor reads the units in this order
        # (the end last), whatever order Ray runs the calls in
        seq = 0
        try:
            while True:
                r = units.take(wid, self.UNITS_AHEAD, holder)
                if r is None:
                    if not units.closed and not units.retired(holder):
                        actor.give_units.remote(holder, seq, [None])  # the data ended
                    return
                actor.give_units.remote(holder, seq, [(r.unit, r.lo, r.hi)])
                seq += 1
        except Exception as err:  # the actor is gone: its receiver says why
            logger.debug("%s: give_units: %r", self.name, err)

    # -- where the actor is -----------------------------------------------------------------
    def describe(self) -> str:
        wh = self.where
        if wh is None:
            return f"Ray actor {self.actor._actor_id.hex()[:16]} (not placed yet)"
        return (
            f"Ray actor {str(wh['actor_id'])[:16]} (pid {wh['pid']} on node {str(wh['node_id'])[:12]} "
            f"at {wh['ip']}, host {wh['host']})"
        )

    def _locate(self) -> bool:
        """Wait until the actor runs (logging when Ray cannot place it);
        False when the source stopped meanwhile or the actor died."""
        ray = _ray()
        t0 = time.monotonic()
        warned = False
        # (removed by set_num_workers before it ran: it never runs)
        while not self._halted() and not self.plan.intake.retired:
            ready, _ = ray.wait([self._where_ref], timeout=POLL_S)
            if ready:
                try:
                    self.where = ray.get(self._where_ref)
                except Exception as err:  # died before it ran: the stream says how
                    logger.debug("%s: where() failed: %r", self.name, err)
                self._where_ref = None
                return True
            if not warned and time.monotonic() - t0 > PLACEMENT_WARN_S:
                warned = True
                logger.warning(
                    "source %r, worker %d: Ray has not placed its actor after %.0f s (it asks for %s); "
                    "is the cluster big enough?", self.group.source, self.plan.worker_id,
                    PLACEMENT_WARN_S, self.group.actor_resources,
                )
        return False

    def _halted(self) -> bool:
        return self.group.stopping or self.plan.intake.halted

    # -- the receiver thread ----------------------------------------------------------------
    def _receive(self) -> None:
        intake = self.plan.intake
        exhausted = False
        intake.started()
        try:
            if not self._locate():
                return
            if self.units is not None:
                self._start_feeder()
            while True:
                outcome = self._stream()
                if outcome is True:
                    exhausted = True
                    return
                if outcome is False:
                    return
                # the actor died.  Ray keeps the error of a failed stream in
                # a reference cycle with the stream (its generator, the
                # frames of the error's traceback), and with it the stream's
                # objects: collected now (once per death), not whenever the
                # garbage collector next runs, so a lost actor leaves no
                # object behind.
                err = outcome
                del outcome
                gc.collect()
                if self._halted():
                    return
                if self.units is not None:
                    # a random-access source: the units it held are read again
                    poison = self.units.retire(self.holder)
                    if poison:
                        intake.died(f"{self.describe()} died: {_reason(err)}; the actors reading "
                                    f"{self.units.name_of(poison[0][0])} died {poison[0][1]} times")
                        return
                if self.restarts_left > 0:
                    self.restarts_left -= 1
                    intake.stats.deaths[intake.backend] += 1
                    logger.warning(
                        "source %r, worker %d: %s died (%s); restarting it (%d restarts left), "
                        "from call %d of epoch %d", self.group.source, self.plan.worker_id,
                        self.describe(), _reason(err), self.restarts_left, self.epoch_calls, self.epoch,
                    )
                    self._where_ref = self.actor.where.remote()
                    if not self._wait_restart():
                        return
                    if self.units is not None:
                        self.holder = next(HOLDERS)
                        self._start_feeder()
                    continue
                if self.units is not None:
                    self.units.release(self.plan.worker_id)  # not restarted: any worker reads them
                intake.died(f"{self.describe()} died: {_reason(err)}")
                return
        except Exception as exc:
            # A bundle this thread cannot take (or a bug of blobfeed's): the
            # source fails now, rather than its consumer waiting for a timeout
            # behind a dead receiver.  The actor is killed below.
            logger.exception("source %r, worker %d: the receiver failed", self.group.source, self.plan.worker_id)
            # The caller keeps the error; its traceback's frames (the
            # stream's generator in them) must not keep the stream's objects
            # alive with it, nor this running frame this worker (so it goes
            # from the traceback: it starts at the frame that failed).
            if exc.__traceback__ is not None:
                exc.__traceback__ = exc.__traceback__.tb_next
            release_frames(exc)
            failure = FetcherError(
                f"source {self.group.source!r}, worker {self.plan.worker_id}: blobfeed cannot take "
                f"its results: {exc!r}"
            )
            failure.__cause__ = exc
            intake.source.fail(failure)
        finally:
            self.kill()
            intake.finished(exhausted)

    def _wait_restart(self) -> bool:
        """Wait until the restarted actor runs; False when the source
        stopped meanwhile or it did not come back (then reported)."""
        ray = _ray()
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while not self._halted():
            ready, _ = ray.wait([self._where_ref], timeout=POLL_S)
            if ready:
                try:
                    self.where = ray.get(self._where_ref)
                    self._where_ref = None
                    return True
                except ray.exceptions.ActorUnavailableError:
                    self._where_ref = self.actor.where.remote()  # still restarting
                except Exception as err:
                    self.plan.intake.died(f"{self.describe()} died and could not be restarted: {_reason(err)}")
                    return False
            if time.monotonic() > deadline:
                self.plan.intake.died(
                    f"{self.describe()} died and was not back {RESTART_TIMEOUT_S:.0f} s later "
                    f"(it asks for {self.group.actor_resources})"
                )
                return False
        return False

    def _stream(self) -> bool | BaseException:
        """Take the actor's bundles until its stream ends.  True: the worker
        is done (StopIteration of its last epoch); False: it must stop (the
        source stopped or failed, or it reported an error); an exception:
        the actor died."""
        ray = _ray()
        backend = self.group.backend
        resume = None
        if self.units is None and (self.epoch_calls or self.last_state is not None):
            resume = (self.epoch_calls, self.last_state)
        # a random-access source's actor waits for its next unit between
        # results: each goes at once (the driver gives more once it has them)
        delay = 0.0 if self.units is not None else backend.bundle_delay_s
        hint = self.group.plan.batch_size_hint()
        self._hint_sent = hint
        self._hint_seq += 1
        gen = self.actor.run.options(
            num_returns="streaming", _generator_backpressure_num_objects=backend.max_in_flight,
        ).remote((self._hint_seq, hint), None if self.units is None else self.holder, self.epoch, self.group.epochs,
                 resume, backend.bundle_bytes, delay)
        try:
            while True:
                if self._halted():
                    return False
                try:
                    ready, _ = ray.wait([gen], timeout=POLL_S)
                    if not ready:
                        self._send_hint()
                        continue
                    ref = next(gen)
                except StopIteration:
                    # the stream ended without "done": the actor stopped on request
                    return False
                except Exception as err:
                    # without its traceback: its frames (Ray's generator among
                    # them) would keep the stream's objects alive in a cycle
                    return _untraced(err)
                try:
                    bundle = ray.get(ref)
                except Exception as err:
                    return _untraced(err)
                del ref
                go = self._handle(bundle)
                del bundle
                if go is not True:
                    return go is None
                self._send_hint()
        finally:
            del gen

    def _send_hint(self) -> None:
        hint = self.group.plan.batch_size_hint()
        if hint != self._hint_sent:
            self._hint_sent = hint
            self._hint_seq += 1
            self.actor.set_hint.remote(self._hint_seq, hint)

    def _handle(self, bundle: tuple[list[Any], np.ndarray | None]) -> bool | None:
        """Hand one bundle to the intake.  True: go on; False: stop; None: done."""
        intake = self.plan.intake
        items, buf = bundle
        root = None
        key = None
        copy_out = False
        if buf is not None:
            # A root whose base is not an ndarray: numpy then collapses every
            # view's base to it, so it lives exactly as long as some view does.
            root = np.frombuffer(memoryview(buf), np.uint8)  # type: ignore[arg-type]
            if root.nbytes >= ZERO_COPY_MIN_BYTES:
                key = self.tracker.hold(root)
                copy_out = key is None
        del buf, bundle
        share = (root.nbytes if root is not None else 0) // max(1, len(items))
        pin = GrantPin(self.tracker, key) if key is not None else None
        units = self.units
        for event in items:
            kind = type(event)
            if units is not None and (kind is Result or kind is Raised):
                if not units.delivered(self.holder, event.state if kind is Result else None) and kind is Result:
                    continue  # read by an incarnation that died: another reads it again
            if kind is Result:
                raw = event.raw
                if type(raw) is Arrays:
                    arrays = read_arrays(None if root is None else root[raw.where:], raw)
                    if copy_out:
                        copied = []
                        for a in arrays:
                            a = np.array(a)
                            a.flags.writeable = False
                            copied.append(a)
                        arrays = tuple(copied) if raw.as_tuple else copied
                    go = deliver(intake, event._replace(raw=arrays), pin, share)
                else:
                    go = deliver(intake, event, None, share)
                self._delivered(event.state)
            elif kind is Raised:
                go = deliver(intake, event._replace(error=unpack_exception(event.error, event.tb)))
                if not event.fatal:
                    self.epoch_calls += 1
            elif kind is EpochDone:
                self.epoch += 1
                self.epoch_calls = 0
                # a restarted actor starts the next epoch from its fetcher's state then
                self.last_state = event.state
                go = deliver(intake, event)
            else:
                go = deliver(intake, event)
            if go is not True:
                return go
        return True

    def _delivered(self, state: Any) -> None:
        self.epoch_calls += 1
        if state is not None:
            self.last_state = state

    # -- ending -------------------------------------------------------------------------------
    def kill(self) -> None:
        """Kill the actor for good (idempotent, never waits for it to die)."""
        if self.killed:
            return
        self.killed = True
        try:
            _ray().kill(self.actor, no_restart=True)
        except Exception as err:  # already gone, or Ray shut down under us
            logger.debug("%s: ray.kill: %r", self.name, err)


def _untraced(err: BaseException) -> BaseException:
    """``err`` and the exceptions it chains without their tracebacks: their
    frames (Ray's generator among them, which keeps its error) would hold
    the stream and its objects in a reference cycle until a garbage
    collection."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return err


def _reason(err: BaseException) -> str:
    """Ray's reason for a death, on one line (its own lines, not its fields)."""
    text = str(err)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("\t")]
    fields = [ln.strip() for ln in text.splitlines() if ln.startswith("\t") and ln.strip().startswith(("pid", "ip"))]
    out = " ".join(lines) or type(err).__name__
    if fields:
        out += f" ({', '.join(fields)})"
    return f"{type(err).__name__}: {out}"


class _RayGroup:
    """The actors of one ``init_data_input_workers`` call and their receivers."""

    def __init__(self, backend: RayBackend, plan: LaunchPlan, payload: tuple[Any, Any]) -> None:
        ray = _ray()
        self.backend = backend
        self.plan = plan
        self.source = plan.source
        self.epochs: int | None = plan.epochs
        self.first_epoch: int = plan.first_epoch
        self.stopping = False
        self._join_lock = threading.Lock()
        self._released = False
        options: dict[str, Any] = {"num_cpus": 1, "max_concurrency": 2}
        options.update(backend.actor_options)
        options["max_restarts"] = backend.max_restarts
        options.setdefault("max_task_retries", 0)
        self.actor_resources = {k: options[k] for k in ("num_cpus", "num_gpus", "resources", "memory") if k in options}
        track_state = backend.max_restarts > 0
        cls = _remote_actor_class().options(**options)
        # kept while the group lives: a restarted actor loads it again
        self._payload_ref = payload_ref = ray.put(payload)
        self.workers: list[_Worker] = []
        try:
            for w in plan.workers:
                info = w.info
                actor = cls.remote(
                    [payload_ref], w.worker_id, info.index, info.num_workers, info.source, info.seed,
                    w.intake.on_error, track_state,
                )
                self.workers.append(_Worker(self, w, actor))
        except BaseException:
            for wk in self.workers:
                wk.kill()
            raise
        for wk in self.workers:
            wk.thread.start()
        logger.info(
            "source %r: %d Ray actors started (%s)", self.source, len(self.workers), self.actor_resources,
        )

    def request_stop(self) -> None:
        self.stopping = True
        for wk in self.workers:
            if not wk.killed:
                try:
                    wk.actor.stop.remote()
                except Exception:  # pragma: no cover - Ray shut down under us
                    pass

    def retire(self, worker_ids: Sequence[int]) -> None:
        """Tell the actors ``worker_ids`` (their intakes' ``retired`` set) to
        make no further call: each sends what it fetched and its stream
        ends; the receiver hands every bundle over, then kills the actor
        (not a death: its CPUs return to the cluster).  Never waits."""
        ids = set(worker_ids)
        for wk in self.workers:
            if wk.plan.worker_id in ids and not wk.killed:
                try:
                    wk.actor.stop.remote()
                except Exception:  # pragma: no cover - Ray shut down under us
                    pass

    def join(self, deadline: float | None) -> list[str]:
        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._join_lock:
            if self._released:
                return []
            if self.stopping:
                grace_end = time.monotonic() + STOP_GRACE_S
                if deadline is not None:
                    grace_end = min(grace_end, deadline)
                for wk in self.workers:
                    wk.thread.join(max(0.0, grace_end - time.monotonic()))
                for wk in self.workers:
                    wk.kill()
            stuck = []
            for wk in self.workers:
                wk.thread.join(left())
                if wk.thread.is_alive():
                    stuck.append(wk.thread.name)
                for t in wk.feeders:
                    t.join(left())
                    if t.is_alive():
                        stuck.append(t.name)
            if stuck:
                return stuck
            stuck = self._wait_dead(deadline)
            if not stuck:
                self._release()
            return stuck

    def _wait_dead(self, deadline: float | None) -> list[str]:
        """Wait until Ray reports every actor dead: then nothing of ours is
        left on the cluster.  Returns the names of those still alive."""
        ray = _ray()
        if not ray.is_initialized():
            return []
        probes = {}
        for wk in self.workers:
            wk.kill()
            try:
                probes[wk.actor.where.remote()] = wk
            except Exception:
                pass
        pending = list(probes)
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            if deadline is not None and time.monotonic() >= deadline:
                break
        return [f"ray-actor-{probes[r].plan.worker_id}" for r in pending]

    def _release(self) -> None:
        self._released = True
        self._payload_ref = None
        # no reference cycle through us (coordinator -> group -> plan -> coordinator)
        self.plan = None  # type: ignore[assignment]
        for wk in self.workers:
            wk.group = None  # type: ignore[assignment]

    def alive(self) -> list[str]:
        if self._released:
            return []
        return [t.name for wk in self.workers for t in [wk.thread, *wk.feeders] if t.is_alive()]
