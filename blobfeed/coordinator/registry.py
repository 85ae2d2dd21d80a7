"""What a :class:`GlobalCoordinator` knows: its groups, the input sources by
name, and the worker ids handed out so far.

Not locked on its own: the owner holds its lock around every call that
changes or reads more than one reference (a single read of a list is safe
without, which ``request_stop()`` in a signal handler relies on).
"""

from __future__ import annotations

from ..feeders import InputSource
from .groups import WorkerCoordinator


class Registry:
    """The groups not yet known to have ended, the sources, the worker ids."""

    def __init__(self) -> None:
        #: every group not yet known to have ended: pending, running, or
        #: stopped with threads still alive.  A group leaves this list only
        #: once all its threads have ended, so a stop that was cut short (a
        #: timeout, a Ctrl-C) is finished by the next one.
        self.groups: list[WorkerCoordinator] = []
        self.sources: dict[str, InputSource] = {}
        #: sources whose groups were all retired, by name, until the name is
        #: wired again: state_dict() still reads their last position (a
        #: requested stop retires them on the stopper thread, possibly before
        #: the checkpoint that follows it)
        self.ended: dict[str, InputSource] = {}
        #: per source (by id; the source kept alive with it): the base seed of
        #: each group wired to it, in wiring order, retired ones included
        self._seeds: dict[int, tuple[InputSource, list[int]]] = {}
        self.next_worker_id = 0

    def allocate(self, n: int) -> list[int]:
        """``n`` new worker ids, never given before (ids are never reused)."""
        ids = list(range(self.next_worker_id, self.next_worker_id + n))
        self.next_worker_id += n
        return ids

    def worker_ids(self) -> list[int]:
        return list(range(self.next_worker_id))

    def add(self, group: WorkerCoordinator) -> None:
        self.groups.append(group)
        source = group.source
        if source is not None and group.seed is not None:
            self._seeds.setdefault(id(source), (source, []))[1].append(group.seed)

    def source(self, name: str) -> InputSource | None:
        """The source named ``name``: the wired one, else the last one whose
        groups all ended.  Reads references only: safe without the lock (a
        signal handler may call it)."""
        source = self.sources.get(name)
        return source if source is not None else self.ended.get(name)

    def seeds_of(self, source: InputSource) -> list[int]:
        """The base seed of each group wired to ``source``, in wiring order."""
        entry = self._seeds.get(id(source))
        return list(entry[1]) if entry is not None and entry[0] is source else []

    def seed_of(self, name: str) -> int | None:
        """The base seed of the first group wired to the live source ``name``:
        what a later call with ``seed=None`` shares, so a source draws (and
        logs) one seed however many nets it feeds.  None when there is no
        such source, or it was stopped (a new wiring starts afresh)."""
        source = self.sources.get(name)
        if source is None or source.stopped:
            return None
        seeds = self.seeds_of(source)
        return seeds[0] if seeds else None

    def named(self, name: str | None) -> list[WorkerCoordinator]:
        """The groups named ``name`` (a source or worker name); None: all."""
        return [g for g in self.groups if name is None or g.name == name]

    def of_source(self, source: InputSource) -> list[WorkerCoordinator]:
        """The groups fed from ``source``, in wiring order."""
        return [g for g in self.groups if g.source is source]

    def retire(self, group: WorkerCoordinator) -> bool:
        """Forget ``group`` if every thread of it has ended (and its source
        once no other group uses it); False if it is still running or gone."""
        if group not in self.groups or group._alive():
            return False
        self.groups.remove(group)
        source = group.source
        if source is not None and self.sources.get(group.name) is source and not self.of_source(source):
            del self.sources[group.name]
            old = self.ended.get(group.name)
            if old is not None and old is not source:
                self._seeds.pop(id(old), None)
            self.ended[group.name] = source
        elif source is not None and not self.of_source(source) and self.ended.get(group.name) is not source:
            self._seeds.pop(id(source), None)  # replaced by a new wiring of its name meanwhile
        group._retire()
        return True

    def forget_after_fork(self) -> None:
        """In a child made by ``os.fork()``: the parent's groups do not run
        here.  Mark them (their nets refuse to run) and forget them; worker
        ids keep counting."""
        for group in self.groups:
            group.mark_forked()
        self.groups = []
        self.sources = {}
        self.ended = {}
        self._seeds = {}
