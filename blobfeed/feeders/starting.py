"""How a worker process starts: what it imports first (the program's main
module, which must not start workers again) and the pickled ``fetch_fun``
it reads at start-up.  Used by :mod:`.processes`."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable

from .backends import FetchFun, WorkerInitFun

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["MAIN_REENTRY_EXIT", "describe_exit", "early_exit", "exit_fd", "preload_forkserver", "process_context", "serialize_polls"]

logger = logging.getLogger("blobfeed.feeders.processes")

#: the exit code of a worker process whose start-up, importing the program's
#: main module, ran a pipeline with process workers again (no __main__ guard)
MAIN_REENTRY_EXIT = 86


def _main_module() -> str | None:
    """What a worker process imports as the program's main module before
    blobfeed's code runs in it (``multiprocessing.spawn.prepare``): the
    script's path, or the module of ``python -m``; None when nothing."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else name
    return getattr(main, "__file__", None)


def _exit_if_importing_main() -> None:
    """End this process, in one line, when it is a new process of
    multiprocessing's ``spawn`` or ``forkserver`` still importing the main
    module and that module starts process workers again: a script without
    ``if __name__ == "__main__":``.

    multiprocessing would raise its RuntimeError a moment later anyway, with
    a traceback of some 75 lines per worker; the exit code tells the parent
    the cause, which it names in its FetcherError.
    """
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    logger.error(
        "blobfeed: process pid %d imports the main module %r to start a worker process, and the "
        "module starts blobfeed's process workers again: guard the pipeline with "
        "if __name__ == '__main__':", os.getpid(), _main_module(),
    )
    logging.shutdown()
    os._exit(MAIN_REENTRY_EXIT)


def _payload_fd(payload: bytes) -> int:
    """A memfd holding ``payload``, for the workers to read at start-up.

    The payload (``fetch_fun`` pickled, with whatever it refers to: often a
    module-level array of megabytes) does not travel in the process object
    multiprocessing writes to a new process's start-up pipe.  A process
    that ends while importing the main module (a script without the
    ``__main__`` guard, :func:`_exit_if_importing_main`) stops reading that
    pipe, and a write past the pipe's 64 KiB buffer then failed in
    ``start()`` with a bare BrokenPipeError, before the cause could be named.
    """
    fd = os.memfd_create("blobfeed-payload", os.MFD_CLOEXEC)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        return fd
    except BaseException:
        os.close(fd)
        raise


def _payload(fetch_fun: FetchFun, worker_init_fun: WorkerInitFun | None) -> bytes:
    """``(fetch_fun, worker_init_fun)`` pickled for the children.

    Raises:
        TypeError: naming what does not pickle, before anything starts.
    """
    try:
        import cloudpickle

        dumps: Callable[[Any], bytes] = cloudpickle.dumps
    except ImportError:  # pragma: no cover - a dependency
        dumps = pickle.dumps
    for what, obj in (("fetch_fun", fetch_fun), ("worker_init_fun", worker_init_fun)):
        try:
            dumps(obj)
        except Exception as exc:
            raise TypeError(
                f"{what} {obj!r} cannot be sent to a worker process: {exc!r}. With "
                "backend='processes' it must pickle (a module-level function, or anything "
                "cloudpickle handles) together with what it refers to"
            ) from exc
    return dumps((fetch_fun, worker_init_fun))


#: what the forkserver imports once, so that a worker starts as a plain fork
#: of it (milliseconds) rather than importing numpy and blobfeed (~0.2 s)
_PRELOAD = "blobfeed.feeders.child"


def process_context(start_method: str) -> ForkServerContext | SpawnContext:
    """The multiprocessing context of ``start_method``, ``"forkserver"`` or
    ``"spawn"``.  Each is asked for by name: ``get_context`` of a plain
    ``str`` is typed a ``BaseContext``, which has no ``Process``."""
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    if start_method == "forkserver":
        return multiprocessing.get_context("forkserver")
    raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")


def serialize_polls(process: Any, lock: Any) -> None:
    """Make every poll of started ``process`` take ``lock`` (a re-entrant
    lock its owner also polls it under).

    multiprocessing polls the children it knows by itself, in
    ``active_children()`` and in every ``Process.start()`` (another worker
    starting, in any thread).  A forkserver child's exit status is read
    once from the forkserver's pipe: of two polls at once, the loser reads
    EOF and multiprocessing makes it 255, so a worker that returned was
    reported dead with "code 255" (spawn children: the loser's waitpid
    fails and it says "running").
    """
    popen: Any = getattr(process, "_popen", None)
    poll = getattr(popen, "poll", None)
    if poll is None:  # another CPython: left as it is
        return

    def locked_poll(*args: Any) -> Any:
        with lock:
            return poll(*args)

    popen.poll = locked_poll


def preload_forkserver(ctx: Any) -> None:
    """Add blobfeed's child module to what the forkserver preloads, keeping
    what the program asked for; a no-op once the forkserver runs.  (The
    forkserver stays single-threaded: importing numpy starts no thread.)"""
    try:
        from multiprocessing import forkserver

        server: Any = forkserver._forkserver
        if server._forkserver_pid is not None:
            return  # running: its modules are set
        preload = list(server._preload_modules)
    except AttributeError:  # another CPython: leave it as it is
        return
    if _PRELOAD not in preload:
        ctx.set_forkserver_preload(preload + [_PRELOAD])


def exit_fd(process: Any) -> tuple[int, bool]:
    """A descriptor that becomes readable when ``process`` itself ends, and
    whether it is ours to close.

    A pidfd where the kernel has them: ready at the process's exit whatever
    its own children hold.  multiprocessing's sentinel is not that under
    ``spawn``: it is a pipe whose write end the child holds, and a helper
    the child forks inherits it, so it would never be ready while the
    helper lives.  (Under ``forkserver`` the forkserver writes the exit
    status to it, which is as good.)
    """
    try:
        return os.pidfd_open(process.pid), True
    except (AttributeError, OSError):  # not Linux >= 5.3
        return process.sentinel, False


def describe_exit(code: int | None) -> str:
    """How a worker process ended, for an error message (``code``: its exit code, None: running)."""
    if code is None:
        return "is still running but closed its pipe"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} ({-code})"
    if code == 0:
        return "exited (code 0) without finishing: os._exit() or sys.exit() inside fetch_fun?"
    return f"exited with code {code}"


def early_exit(pid: int, code: int, main: str | None) -> tuple[str, str]:
    """What a worker process that ended with ``code`` before blobfeed's code
    ran in it died of, and when: in multiprocessing's start-up, which
    imports the main module (``main``; None: it has none to import)."""
    if main is None:
        return (f"worker process pid {pid} {describe_exit(code)} before blobfeed's worker code ran "
                "(its traceback is on stderr)", " while starting")
    if code == MAIN_REENTRY_EXIT:
        detail = (
            "guard the pipeline with if __name__ == '__main__': (the module started blobfeed "
            f"workers again in worker process pid {pid}, which imports it as every "
            "spawn or forkserver process does)"
        )
    else:
        detail = (
            f"worker process pid {pid} {describe_exit(code)} before blobfeed's worker code "
            "ran (its traceback is on stderr); code the module runs at import runs in every "
            "worker process: guard the pipeline with if __name__ == '__main__':"
        )
    return detail, f" while importing the main module {main!r}"
