"""``get_worker_info()``: who am I, for code running inside a fetcher.

Like PyTorch's ``torch.utils.data.get_worker_info``: a fetcher that shards
its data asks for its ``index`` within its own ``init_data_input_workers``
call rather than relying on the global worker id, which keeps growing across
calls (a second epoch, a second net).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from dataclasses import dataclass, field

import numpy as np

__all__ = ["WorkerInfo", "for_epoch", "get_worker_info", "is_last_epoch", "shuffle_rng", "worker_seeds"]

logger = logging.getLogger("blobfeed.worker_info")


@dataclass(frozen=True)
class WorkerInfo:
    """What a fetcher may know about itself.  Frozen.

    Attributes:
        worker_id: the id ``fetch_fun`` receives (global, from the
            coordinator's sequence 0, 1, 2, ...).
        index: this worker's position, 0 ... ``num_workers`` - 1, within its
            own ``init_data_input_workers`` call: use it to pick a shard.
        num_workers: how many workers that call made.
        source: the ``input_source_name``.
        seed: this worker's seed: one child of
            ``numpy.random.SeedSequence(base seed)`` per worker id.
        rng: a ``numpy.random.Generator`` seeded from ``seed``; it belongs to
            this worker alone.
        epoch: the pass over the data this worker is in (0, 1, ...; see
            ``epochs`` of ``init_data_input_workers``).  ``seed`` and ``rng``
            are those of the epoch: epoch 0's are the worker's own, each
            later epoch's a child of them, so a fetcher that draws from
            ``rng`` shuffles differently in every epoch, and the same way on
            every run.
    """

    worker_id: int
    index: int
    num_workers: int
    source: str
    seed: int
    rng: np.random.Generator = field(compare=False, repr=False)
    epoch: int = 0


_current = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of the worker calling this, inside ``fetch_fun``
    (and ``worker_init_fun``); ``None`` anywhere else."""
    return getattr(_current, "info", None)


def set_worker_info(info: WorkerInfo | None) -> None:
    """Bind ``info`` to the calling thread (the worker's own)."""
    _current.info = info


def draw_base_seed(source: str) -> int:
    """A fresh base seed, logged so that a run can be repeated with ``seed=``."""
    seed = secrets.randbits(63)
    logger.info("source %r: seed=None, drew seed=%d (pass seed=%d to repeat this run)", source, seed, seed)
    return seed


def worker_seeds(base: int, worker_id: int) -> tuple[int, np.random.Generator]:
    """The seed and generator of worker ``worker_id``: child ``worker_id`` of
    ``SeedSequence(base)`` (the same child ``spawn`` would give it)."""
    child = np.random.SeedSequence(base, spawn_key=(worker_id,))
    seed = int(child.generate_state(1, np.uint64)[0])
    # from the int, so that default_rng(info.seed) in user code is the same stream
    return seed, np.random.default_rng(seed)


def shuffle_rng(base: int) -> np.random.Generator:
    """The generator of a source's shuffle buffer: a child of
    ``SeedSequence(base)`` that no worker id can share (its key has two parts)."""
    return np.random.default_rng(np.random.SeedSequence(base, spawn_key=(0xB10BFEED, 0)))


def for_epoch(first: WorkerInfo, epoch: int) -> WorkerInfo:
    """The worker's info in ``epoch``, from its info in epoch 0.

    Epoch 0 keeps the worker's seed; epoch *e* > 0 has the child *e* of it,
    so each epoch's draws are fresh yet a resumed run, which starts a worker
    directly in its epoch, draws exactly what an uninterrupted one did.
    """
    if epoch == 0:
        return dataclasses.replace(first, rng=np.random.default_rng(first.seed))
    child = np.random.SeedSequence(first.seed, spawn_key=(epoch,))
    seed = int(child.generate_state(1, np.uint64)[0])
    return dataclasses.replace(first, seed=seed, rng=np.random.default_rng(seed), epoch=epoch)


def is_last_epoch(epochs: int | None, epoch: int) -> bool:
    """Whether a worker whose data ended in ``epoch`` is done (``epochs``
    passes in all; None: endless)."""
    return epochs is not None and epoch + 1 >= epochs
