"""Worker lifecycle, the global coordinator and shared input sources.

One ``init_*`` call makes one group of workers (a coordinator: threads with
a name); the :class:`GlobalCoordinator` starts and stops them all.  The
parts, each in a module named for its job (imports run down this list):

* ``groups``: one group of workers each (:class:`WorkerCoordinator`,
  :class:`DataInputCoordinator`, the generic workers, external loggers);
* ``registry``: the groups, the sources by name, worker id allocation;
* ``checkpoint``: ``state_dict`` / ``load_state_dict``: layout, validation;
* ``lifecycle``: :class:`GlobalCoordinator` start/stop/join, the stopper and
  monitor threads, atexit and fork hooks;
* ``monitor``: the monitor thread's body (rates, the verdict, the tuner, the loggers);
* ``wiring``: ``init_workers``, ``init_data_input_workers``, argument checks.
"""

from .groups import DataInputCoordinator, WorkerCoordinator, _GenericCoordinator, _LogRunner
from .lifecycle import (
    ATEXIT_JOIN_TIMEOUT,
    DEFAULT_JOIN_TIMEOUT,
    GlobalCoordinator,
    _inside_blobfeed,
    _is_core,
    _Stopper,
    global_coordinator,
)
from .monitor import RATE_TICK_S
from .wiring import InitFun, init_data_input_workers, init_reader, init_workers, resolve_backend

__all__ = [
    "DataInputCoordinator",
    "GlobalCoordinator",
    "WorkerCoordinator",
    "global_coordinator",
    "init_data_input_workers",
    "init_reader",
    "init_workers",
]
