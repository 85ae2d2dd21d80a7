"""The service's Unix socket file: taking a path, binding there, letting go.

Two services started at once on the path of a third that died would both
find its socket stale, and the second would unlink the first's new socket:
the first then listens where nobody can reach it.  So a path is taken
under a lock of its own, ``PATH.lock`` (``flock``, held from the start to
the end of the service's stop, released by the kernel if it dies): only
its holder may judge the file at the path stale and replace it, and a
service restarted on the path while the last one still stops (saving the
state the new one resumes from) waits for it.

The socket file is made mode 0600 without touching the process's umask
(which every thread shares: a file another thread made meanwhile would
get the service's mode): it is bound in a private directory, given its
mode there, and linked into place (a link never replaces a file that
appeared meanwhile).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import tempfile
import time
from typing import Callable

__all__ = ["SocketPath", "StopRequested", "bind_in_own_directory", "bind_private"]

#: backlog of the listening socket
BACKLOG = 64
#: tries to take a lock file that its holder removes as we take it
LOCK_TRIES = 5
#: seconds to wait for a service that holds the path and stops (no longer listens)
LOCK_WAIT_S = 30.0
#: how often that wait looks again (flock has no timeout)
LOCK_POLL_S = 0.05
#: seconds a held lock with no socket file beside it is given (the holder
#: removes its file just before it lets go) before the start is refused
NO_FILE_S = 1.0
#: the longest path a Unix socket may have (sun_path, with its terminating NUL)
MAX_PATH_BYTES = 107
#: what a lock file this code made says (one without it, another program's, is never removed)
LOCK_MARK = b"blobfeed service lock\n"


class StopRequested(ValueError):
    """A stop was requested while the start waited for the path: not a
    refusal of the path, and not the caller's mistake."""


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    # (an inode number is reused at once: the change time tells two files apart)
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _file(st: os.stat_result) -> tuple[int, int]:
    """A lock file's identity: its inode is not reused while our descriptor
    keeps it (and writing the mark changes its change time)."""
    return st.st_dev, st.st_ino


class SocketPath:
    """A Unix socket path this service holds (its lock) and listens at."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock_path = path + ".lock"
        self._lock_fd = -1
        self._lock_file: tuple[int, int] | None = None
        #: the socket file this service made (removed at release if still there)
        self._socket_file: tuple[int, int, int] | None = None

    def take(self, stop: Callable[[], bool] | None = None) -> socket.socket:
        """Take the path and listen there; a wait for a service that stops
        on it ends early once ``stop()`` is true (a stop was requested).

        Raises:
            ValueError: a path no socket can have (empty, a directory, too
                long to connect to), another service holds the path, or a
                file that is no socket or a live socket of another program
                is there.
            OSError: the path cannot be locked or bound (a missing
                directory, say); the message names the path.
        """
        _check_path(self.path)
        self._lock(stop)
        try:
            if os.path.lexists(self.path):
                if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    raise ValueError(f"listen={self.path!r} exists and is not a socket")
                live = _alive(self.path)
                if live is not None:
                    raise ValueError(
                        f"listen={self.path!r}: another program has a socket there ({live}, another service "
                        "or not): stop it, or listen elsewhere"
                    )
                os.unlink(self.path)  # a stale socket of a program that died
            sock = bind_private(os.path.dirname(self.path) or ".", self.path)
            try:
                self._socket_file = _identity(os.stat(self.path))
            except BaseException:
                sock.close()
                raise
            return sock
        except BaseException:
            self._unlock()
            raise

    def release(self) -> None:
        """Remove the socket file if it is still the one this service made
        (a service started on the path after this one closed its socket
        made another), then the lock.  Idempotent."""
        if self._socket_file is not None:
            with contextlib.suppress(OSError):
                if _identity(os.stat(self.path)) == self._socket_file:
                    os.unlink(self.path)
            self._socket_file = None
        self._unlock()

    def _lock(self, stop: Callable[[], bool] | None) -> None:
        for _ in range(LOCK_TRIES):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as err:
                raise OSError(err.errno, f"cannot listen on {self.path!r}: its lock {self.lock_path!r}: "
                                         f"{err.strerror or err}") from err
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError(f"listen={self.path!r}: {self.lock_path!r} is not a regular file")
                if not self._wait_for_lock(fd, st, stop):
                    os.close(fd)
                    continue  # the file waited on was replaced: lock the one there now
                try:
                    now = os.stat(self.lock_path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                if now is not None and _file(now) == _file(st):
                    _mark(fd)
                    self._lock_fd, self._lock_file = fd, _file(st)
                    return
                # its holder removed it as it let go: ours is a file nobody else will lock
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise ValueError(f"listen={self.path!r}: its lock {self.lock_path!r} kept changing under us: another "
                         "program is starting and stopping services there")

    def _wait_for_lock(self, fd: int, st: os.stat_result, stop: Callable[[], bool] | None) -> bool:
        """Lock ``fd`` (the lock file as ``st`` found it).  Another service
        holds it: one that listens is refused at once; one that no longer
        does is stopping (saving its state, say: a restart with ``--resume``
        must read what it saves), so its end is waited for, at most
        :data:`LOCK_WAIT_S`, or until ``stop()`` says a stop was requested
        (:class:`StopRequested`).  False when the lock
        file was replaced meanwhile (its holder let go and removed it)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        no_file_since: float | None = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            try:
                if _file(os.stat(self.lock_path, follow_symlinks=False)) != _file(st):
                    return False
            except FileNotFoundError:
                return False
            now = time.monotonic()
            there = os.path.lexists(self.path)
            # (only a connect says it listens: the kernel lists a stopping
            # service's accepted connections under its path as bound)
            live = _alive(self.path, bound_too=False) if there else None
            if live is not None:
                raise ValueError(f"listen={self.path!r}: another blobfeed service holds this path (its lock "
                                 f"{self.lock_path!r}) and listens there: stop it, or listen elsewhere")
            if not there:
                no_file_since = now if no_file_since is None else no_file_since
                if now - no_file_since >= NO_FILE_S:
                    raise ValueError(
                        f"listen={self.path!r}: another blobfeed service holds this path (its lock "
                        f"{self.lock_path!r}), and its socket file is gone (removed under it by another "
                        "program?): stop that service, or listen elsewhere"
                    )
            else:
                no_file_since = None
            if now >= deadline:
                raise ValueError(f"listen={self.path!r}: another blobfeed service holds this path (its lock "
                                 f"{self.lock_path!r}), stopping for more than {LOCK_WAIT_S:g} s: stop it, or "
                                 "listen elsewhere")
            if stop is not None and stop():
                raise StopRequested(f"listen={self.path!r}: a stop was requested while waiting for the service "
                                    "that holds this path to let go")
            time.sleep(LOCK_POLL_S)

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd < 0:
            return
        # removed while still held: whoever opened it meanwhile sees it gone
        # once it gets the lock, and retries; never another program's file
        with contextlib.suppress(OSError):
            if _file(os.stat(self.lock_path, follow_symlinks=False)) == self._lock_file and _marked(fd):
                os.unlink(self.lock_path)
        # the lock is the open file's, which a process this one forked may
        # share: let go of it here, not when the last copy closes
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _check_path(path: str) -> None:
    """A path a Unix socket may be bound at and connected to."""
    if not path or path.endswith("/") or os.path.isdir(path):
        raise ValueError(f"listen={path!r}: a Unix socket needs a file's path (not empty, not a directory)")
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ValueError(f"listen={path!r}: {len(os.fsencode(path))} bytes, longer than a Unix socket's path may "
                         f"be ({MAX_PATH_BYTES}): choose a shorter one")


def _mark(fd: int) -> None:
    """Say in the lock file that this code made it (an empty file is ours: a
    crashed service's, or one we just made)."""
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_size == 0:
            os.pwrite(fd, LOCK_MARK, 0)


def _marked(fd: int) -> bool:
    try:
        return os.pread(fd, len(LOCK_MARK) + 1, 0) == LOCK_MARK
    except OSError:
        return False


def bind_in_own_directory(path: str) -> socket.socket:
    """A listening socket at ``path``, in a directory only this process's
    user may enter (mode 0700, made by the service): bound in place, mode
    0600.

    Raises:
        ValueError: ``path`` is too long for a Unix socket.
        OSError: it cannot be made (the message names ``path``).
    """
    _check_path(path)
    return _listen_at(path, path)


def bind_private(directory: str, path: str) -> socket.socket:
    """A listening ``SOCK_SEQPACKET`` socket at ``path`` (in ``directory``),
    mode 0600: bound in a private directory made there, given its mode, then
    linked to ``path``.

    Raises:
        OSError: it cannot be made (the message names ``path``); EEXIST
            when a file appeared at ``path`` meanwhile.
    """
    try:
        private = tempfile.mkdtemp(prefix=".bf", dir=directory)  # mode 0700
    except OSError as err:
        raise OSError(err.errno, f"cannot listen on {path!r}: {err.strerror or err}") from err
    made = os.path.join(private, "s")
    try:
        if len(os.fsencode(made)) > MAX_PATH_BYTES:
            # the path fits, its private twin does not: bound in place, and
            # its mode set at once (connecting takes write permission,
            # which the usual umask gives nobody else meanwhile)
            return _listen_at(path, path)
        sock = _listen_at(made, path)
        try:
            os.link(made, path)
        except OSError as err:
            sock.close()
            raise OSError(err.errno, f"cannot listen on {path!r}: {err.strerror or err}") from err
        return sock
    finally:
        with contextlib.suppress(OSError):
            os.unlink(made)
        with contextlib.suppress(OSError):
            os.rmdir(private)


def _listen_at(at: str, path: str) -> socket.socket:
    """A ``SOCK_SEQPACKET`` socket bound at ``at``, mode 0600, listening;
    an error names ``path`` (the address the caller asked for)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(at)
        os.chmod(at, 0o600)
        sock.listen(BACKLOG)
        return sock
    except OSError as err:
        sock.close()
        # the socket's own error names no path ("No such file or directory")
        raise OSError(err.errno, f"cannot listen on {path!r}: {err.strerror or err}") from err
    except BaseException:
        sock.close()
        raise


def _alive(path: str, bound_too: bool = True) -> str | None:
    """What is live at the socket file ``path`` (a program has it bound,
    and listening for a connected type; with ``bound_too``, or only bound),
    None if it is stale.  Every type is tried: connecting with another type
    than the socket's fails (EPROTOTYPE) even when it is live."""
    for kind in ("SOCK_SEQPACKET", "SOCK_STREAM", "SOCK_DGRAM"):
        s = socket.socket(socket.AF_UNIX, getattr(socket, kind))
        try:
            s.settimeout(1.0)
            s.connect(path)
            return f"a live {kind} socket"
        except (TimeoutError, BlockingIOError):
            return f"a live {kind} socket, its backlog full"
        except OSError as err:
            if err.errno in (errno.ECONNREFUSED, errno.EPROTOTYPE):
                continue  # nobody there, or a socket of another type
            # cannot tell (no permission, say): never take it over
            return f"a socket that a {kind} probe could not reach: {err.strerror or err}"
        finally:
            s.close()
    # Refused on every type: nobody listens, but a program may still have it
    # bound (between bind() and listen(), or bound only to name it): the
    # kernel lists every bound path.
    if bound_too and _bound(path):
        return "a socket a program has bound (not listening)"
    return None


def _bound(path: str) -> bool:
    """Whether the kernel lists ``path`` among the bound Unix sockets
    (/proc/net/unix; a path bound relative to another directory is matched
    by its tail).  False where that list cannot be read."""
    absolute = os.path.abspath(path)
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                fields = line.split(None, 7)
                if len(fields) < 8:
                    continue
                bound = fields[7].rstrip("\n")
                if bound == absolute or (not bound.startswith("/") and absolute.endswith("/" + bound)):
                    return True
    except OSError:
        return False
    return False
