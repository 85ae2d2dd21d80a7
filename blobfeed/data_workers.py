"""Caffe2's module name, for a port of code written for
``caffe2.python.data_workers``::

    from blobfeed import data_workers            # was: from caffe2.python import data_workers

    coordinator = data_workers.init_data_input_workers(
        net, ["data", "label"], my_fetch_fun, batch_size=32, input_source_name="train")
    coordinator.start()

The same objects as ``blobfeed``'s own, under the names Caffe2's module had
(those blobfeed has); the arguments are Caffe2's, in Caffe2's order, with
blobfeed's additions as keywords after them.  What differs from Caffe2 is in
docs/MIGRATING.md: ``net`` is a :class:`blobfeed.Net`, ``start()`` and
``stop()`` are the returned coordinator's, and the blobs reach ``Net.run()``.
"""

from __future__ import annotations

from .coordinator import (
    DataInputCoordinator,
    GlobalCoordinator,
    WorkerCoordinator,
    global_coordinator,
    init_data_input_workers,
)

__all__ = [
    "DataInputCoordinator",
    "GlobalCoordinator",
    "WorkerCoordinator",
    "get_worker_ids",
    "global_coordinator",
    "init_data_input_workers",
]


def get_worker_ids(num_workers: int) -> list[int]:
    """``[0, 1, ..., num_workers - 1]``, as Caffe2's ``data_workers.get_worker_ids``.

    (A coordinator's own ids, which its sources' workers really have, are
    ``GlobalCoordinator.get_worker_ids()``.)
    """
    return list(range(0, num_workers))
