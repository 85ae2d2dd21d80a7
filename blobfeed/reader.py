"""The reader seam: one way in to a source for any consumer.

A local net, the feeding service's per-consumer outlet, a remote consumer
or a test reads a source the same way:

* :func:`init_reader` wires a source's workers without a net and returns
  its first :class:`BatchReader`; ``GlobalCoordinator.add_reader(name,
  reader_name)`` adds another to a wired source;
* ``GlobalCoordinator.open_source(name)`` describes what a source is wired
  with (a frozen :class:`SourceInfo`);
* ``Net.add_reader(reader)`` feeds a net from a reader;
* ``GlobalCoordinator.open_inlet(...)`` makes a source its caller feeds with
  whole batches (a remote consumer's end of a served source), read through
  its :class:`Inlet`'s reader.

A reader's enqueuer thread belongs to the coordinator: ``start()`` starts
it, ``stop()`` / ``stop_coordinator(name)`` stop and join it with its source.
"""

from .coordinator import init_reader
from .feeders.chunks import Batch, EpochEnd
from .feeders.reading import BatchReader, Inlet, SourceInfo

__all__ = ["Batch", "BatchReader", "EpochEnd", "Inlet", "SourceInfo", "init_reader"]
