"""``blobfeed serve MODULE:FUNCTION``: run a feeding service until stopped.

FUNCTION (called with no arguments) wires the sources with
``blobfeed.serve_source(...)``; the service then serves them until SIGTERM,
SIGINT or SIGHUP (at any moment, the start-up included: a stop, never a
kill halfway), or until every source ended, when it stops fetching, saves its
state (``--state-file``), tells every consumer and exits 0 (1 when a source
failed meanwhile, or a thread did not end; each failure is named on stderr).  Exit status 2
for a usage problem: a bad option or target, or a ``--metrics-port`` that is
taken (bound first, before the target is imported, so that it fails at once).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import signal
import sys
from typing import Any

import blobfeed
from blobfeed.service import FeedServer, StopRequested

from .argtypes import port, positive_float

logger = logging.getLogger("blobfeed.apps.serve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blobfeed serve",
        description="Serve input sources to trainer processes that attach with blobfeed.attach_source().",
    )
    p.add_argument("target", metavar="MODULE:FUNCTION",
                   help="FUNCTION of MODULE (importable, or a path/to/file.py) calls blobfeed.serve_source(...)")
    p.add_argument("--listen", metavar="ADDRESS", default=None,
                   help="a Unix socket's path (default: feed.sock in a new private directory, mode 0600), or "
                        "tcp://HOST:PORT to listen on TCP (tcp://:PORT is loopback; port 0 picks one). The "
                        "real address is printed at start. TCP has no authentication: a non-loopback HOST "
                        "lets anyone who can reach the port read the data (a warning is logged)")
    p.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                   help="serve /metrics, /healthz and /readyz on 127.0.0.1:PORT (0: any free port)")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="the address for --metrics-port (default loopback)")
    p.add_argument("--state-file", default=None, metavar="PATH",
                   help="save the position here at every stop (SIGTERM, SIGINT, SIGHUP, or every source ended) "
                        "and every --save-every seconds")
    p.add_argument("--save-every", type=positive_float, default=60.0, metavar="S", help="seconds between saves (60)")
    p.add_argument("--resume", action="store_true", help="continue from --state-file")
    p.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    return p


def load_target(target: str) -> Any:
    """The function ``MODULE:FUNCTION`` names (MODULE may be a ``.py`` path).

    Raises:
        ValueError: the target is malformed, or names nothing callable.
    """
    module_name, sep, func_name = target.rpartition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"expected MODULE:FUNCTION, got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.exists(path):
            raise ValueError(f"no file {module_name!r}")
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # under its own name, so that process workers can import what it defines
        sys.modules[name] = module
        sys.path.insert(0, os.path.dirname(path))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{module_name} has no function {func_name!r}")
    return func


def _error_text(err: BaseException) -> str:
    """An error in one line: an OSError's message without its "[Errno N]"."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f": {err.filename!r}" if err.filename else "")
    return str(err)


#: the signals that stop the service: a supervisor's, Ctrl-C's, a closed terminal's
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _StopRequests:
    """The stop signals, from the first moment of ``main``: before the
    server exists they are kept, and handed to it once it does.  A second
    signal while the start-up still runs (a wiring function that hangs,
    say) is the signal's default action: the process ends at once."""

    def __init__(self) -> None:
        #: the first signal's name, None while none came
        self.first: str | None = None
        #: the start-up runs (until the service serves, or gives up)
        self.starting = True
        self._server: FeedServer | None = None

    def handler(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.first is not None and self.starting:
            _tell(f"blobfeed serve: a second {name} during start-up: ending at once")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.first is None:
            self.first = name
            if self.starting:
                _tell(f"blobfeed serve: {name}: stopping once the start-up ends (another signal ends it at once)")
        if self._server is not None:
            self._server.request_stop(self.first)

    def attach(self, server: FeedServer) -> None:
        self._server = server
        if self.first is not None:
            server.request_stop(self.first)


def _tell(line: str) -> None:
    """A line to stderr from a signal handler: one write(2), never print()
    or logging (the interrupted code may be inside either, holding its lock)."""
    with contextlib.suppress(OSError):
        os.write(2, line.encode(errors="replace") + b"\n")


def _say(line: str, stream: Any = None) -> None:
    """A status line.  The reader may be gone (a launcher that read the
    address and closed the pipe, a closed terminal): the service goes on
    and stops as it would, silent from then on."""
    stream = sys.stdout if stream is None else stream
    try:
        print(line, file=stream, flush=True)
    except OSError:  # BrokenPipeError, or EIO from a closed terminal
        with contextlib.suppress(OSError, ValueError):
            # (as Python's docs advise: nothing more goes to the dead pipe, not even at exit)
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, stream.fileno())
            finally:
                os.close(null)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The handlers come first: a signal at any moment of the start-up (the
    # target's import, its wiring, the workers' start) is a stop request,
    # never the default action (a process killed halfway, its socket file
    # left) nor a KeyboardInterrupt through the user's wiring.  They stay
    # until main returns: a second signal while the first stop runs must
    # not find the default handler back.
    stops = _StopRequests()
    # A stop signal ignored at our start stays ignored, as Python does for
    # SIGINT: SIGHUP under nohup (the service outlives its terminal), SIGINT
    # in a background job of a shell (a Ctrl-C meant for the foreground)
    caught = [s for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN]
    old = {s: signal.signal(s, stops.handler) for s in caught}
    try:
        return _run(args, stops)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run(args: argparse.Namespace, stops: _StopRequests) -> int:
    try:
        server = FeedServer(
            args.listen, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
            state_file=args.state_file, resume=args.resume, save_every=args.save_every,
        )
    except (ValueError, TypeError, OSError, blobfeed.BlobfeedError) as err:
        _say(f"blobfeed serve: {_error_text(err)}", sys.stderr)
        return 2
    stops.attach(server)
    try:
        started = _start(args, server, stops)
    finally:
        stops.starting = False
    if started is not None:
        return started
    try:
        server.wait()
    finally:
        failed = [f"source {n!r} failed: {s.failure}" for n, s in server.sources.items() if s.failure is not None]
        clean = server.stop()
    _say(f"blobfeed serve: stopped ({server.stop_reason})")
    for line in failed:
        _say(f"blobfeed serve: {line}", sys.stderr)
    return 0 if clean and not failed else 1


def _start(args: argparse.Namespace, server: FeedServer, stops: _StopRequests) -> int | None:
    """The start-up: the metrics port, the target, its wiring, the workers.
    None once the service serves (or a stop came meanwhile: it then stops
    as after serving); else the exit status, the server stopped."""
    try:
        # the metrics port first: a taken port fails before the target is
        # imported, its sources wired or a worker started
        metrics_url = server.serve_metrics()
    except OSError as err:
        hint = "; choose another --metrics-port, or 0 for any free port" if args.metrics_port else ""
        _say(f"blobfeed serve: {_error_text(err)}{hint}", sys.stderr)
        return 2
    try:
        # (a stop asked for meanwhile imports and wires nothing)
        if stops.first is None:
            func = load_target(args.target)
        if stops.first is None:
            server.setup(func)
    except (ValueError, TypeError, ImportError, OSError, blobfeed.BlobfeedError) as err:
        server.stop()
        _say(f"blobfeed serve: {_error_text(err)}", sys.stderr)
        return 2
    except Exception as err:
        # the wiring function's own failure: named, with its traceback, as a failed start
        server.stop()
        logger.error("blobfeed serve: %s failed during start-up", args.target, exc_info=True)
        _say(f"blobfeed serve: {args.target} failed during start-up: {err!r}; not serving", sys.stderr)
        return 2
    except SystemExit as exc:
        # the target's own sys.exit(): its start-up failed, whatever the code
        server.stop()
        _say(f"blobfeed serve: {args.target} exited during start-up (sys.exit({exc.code!r})); not serving",
             sys.stderr)
        return 2
    except BaseException:
        server.stop()
        raise
    try:
        if stops.first is None:
            server.start()
    except StopRequested:
        return None  # a stop came while the start waited for its path: it stops as asked
    except (ValueError, TypeError, OSError, blobfeed.BlobfeedError) as err:
        server.stop()
        _say(f"blobfeed serve: {_error_text(err)}", sys.stderr)
        return 2
    except BaseException:
        server.stop()
        raise
    if stops.first is None:
        # one line a consumer's launcher can read for the address
        _say(f"blobfeed serve: listening on {server.address}")
        if metrics_url is not None:
            _say(f"blobfeed serve: metrics on {metrics_url}")
    return None
