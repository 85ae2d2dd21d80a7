"""blobfeed: Caffe2's data_workers rebuilt -- fetcher threads, exact re-batching,
device queues and an ONNX ``Net``, with Prometheus metrics.

The work lives in modules named for what they do; this file only re-exports.
"""

from .coordinator import (
    DataInputCoordinator,
    GlobalCoordinator,
    WorkerCoordinator,
    global_coordinator,
    init_data_input_workers,
    init_workers,
)
from .errors import BlobfeedError, ChunkError, DequeueTimeout, EndOfInput, FetcherError
from .net import Net, Workspace
from .queues import BlobsQueue

__version__ = "0.1.0"

__all__ = [
    "BlobfeedError",
    "BlobsQueue",
    "ChunkError",
    "DataInputCoordinator",
    "DequeueTimeout",
    "EndOfInput",
    "FetcherError",
    "GlobalCoordinator",
    "Net",
    "WorkerCoordinator",
    "Workspace",
    "global_coordinator",
    "init_data_input_workers",
    "init_workers",
]
