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

A batch a reader hands out may lie in shared memory another process can
map (a worker process's slots): :data:`REGIONS` says where
(``REGIONS.locate(batch.arrays)``), so a consumer in another process can be
handed that memory once and then each batch as a reference into it.

A reader's enqueuer thread belongs to the coordinator: ``start()`` starts
it, ``stop()`` / ``stop_coordinator(name)`` stop and join it with its source.
"""

from .coordinator import init_reader
from .feeders.chunks import Batch, EpochEnd
from .feeders.reading import BatchReader, Inlet, SourceInfo
from .shared_regions import REGIONS, SharedRegion

__all__ = ["REGIONS", "Batch", "BatchReader", "EpochEnd", "Inlet", "SharedRegion", "SourceInfo", "init_reader"]
