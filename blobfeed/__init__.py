"""blobfeed: Caffe2's data_workers rebuilt -- fetcher threads, exact re-batching,
device queues and an ONNX ``Net``, with Prometheus metrics.

The work lives in modules named for what they do; this file only re-exports.
"""

import logging as _logging

from .coordinator import (
    DataInputCoordinator,
    GlobalCoordinator,
    WorkerCoordinator,
    global_coordinator,
    init_data_input_workers,
    init_workers,
)
from .autotune import AutoWorkers
from .errors import BlobfeedError, BlobfeedWarning, ChunkError, DequeueTimeout, EndOfEpoch, EndOfInput, FetcherError, ServiceError
from .feeders import FetcherBackend, ProcessBackend, ThreadBackend
from .feeders.indexed import IndexedReadError, RandomAccessSource
from .feeders.sharded import ShardedSource
from .net import Net, Workspace
from .queues import BlobsQueue
from .service import Attachment, FeedServer, attach_source, serve_source
from .worker_info import WorkerInfo, get_worker_info
from . import data_workers  # Caffe2's module name: from blobfeed import data_workers

# A library never configures logging; without this, Python's last-resort
# handler would print blobfeed's warnings to stderr of an application that
# chose not to log.
_logging.getLogger("blobfeed").addHandler(_logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "Attachment",
    "AutoWorkers",
    "BlobfeedError",
    "BlobfeedWarning",
    "BlobsQueue",
    "ChunkError",
    "DataInputCoordinator",
    "DequeueTimeout",
    "EndOfEpoch",
    "EndOfInput",
    "FetcherBackend",
    "FeedServer",
    "FetcherError",
    "IndexedReadError",
    "GlobalCoordinator",
    "Net",
    "ProcessBackend",
    "RandomAccessSource",
    "ServiceError",
    "ShardedSource",
    "ThreadBackend",
    "WorkerCoordinator",
    "WorkerInfo",
    "attach_source",
    "Workspace",
    "get_worker_info",
    "global_coordinator",
    "init_data_input_workers",
    "init_workers",
    "serve_source",
]
