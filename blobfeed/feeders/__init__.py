"""Workers, chunk validation, re-batching and enqueuers: everything between a
user's ``fetch_fun`` and a net's device queue.

Data path for one input source (see docs/ARCHITECTURE.md)::

    backend (threads / processes / Ray) -- WorkerIntake --> InputSource.dealer
        --Feed (one per net: re-batching)--> device queue --> Net.run

Modules, each using only those above it: ``chunks`` (what a worker hands
over, and its checks), ``rebatch``, ``source`` (the internal queue, worker
lifecycle, intakes), ``dealing`` (how chunks reach the nets: arrival
order, or lanes in round robin with an optional shuffle stage),
``replay`` (a worker brought back to a saved position), ``enqueuer`` (``Feed``), ``backends`` (the seam and the
thread backend), ``processes`` (process workers).
"""

from .backends import (
    FetcherBackend,
    FetchFun,
    LaunchPlan,
    ThreadBackend,
    WorkerGroup,
    WorkerPlan,
    thread_main,
)
from .chunks import Batch, Chunk, ChunkValidator, EpochEnd, ModelInput, Pin
from .enqueuer import Feed, FeedGroup
from .processes import ProcessBackend
from .dealing import READABLE_VERSIONS, STATE_VERSION, Dealer, DealerStats, DealingOptions, LaneDealer, make_dealer
from .rebatch import Rebatcher
from .replay import Replayed, is_stateful
from .shuffle import ShuffleBuffer
from .source import InputSource, OnError, WorkerIntake

__all__ = [
    "Batch", "Chunk", "ChunkValidator", "EpochEnd", "Feed", "FeedGroup", "FetchFun", "FetcherBackend",
    "InputSource", "LaunchPlan", "ModelInput", "OnError", "Dealer", "DealerStats", "DealingOptions", "LaneDealer", "make_dealer", "Pin", "ProcessBackend", "READABLE_VERSIONS",
    "Rebatcher", "Replayed", "STATE_VERSION", "ShuffleBuffer", "ThreadBackend", "is_stateful",
    "WorkerGroup", "WorkerIntake", "WorkerPlan", "thread_main",
]
