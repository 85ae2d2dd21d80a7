"""The feeding service's state file: what ``FeedServer.save_state`` writes
and ``--resume`` reads back.  The file is untrusted input: it is read only
if it is a regular file of bounded size, and its shape is checked at every
level before anything of it is used (each source's inner state is then
checked by ``load_state_dict``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from typing import Any

__all__ = [
    "MAX_ACKED_AFTER", "MAX_STATE_FILE_BYTES", "MAX_STATE_VALUES", "STATE_VERSION", "field_name", "read_state",
    "savable",
]

logger = logging.getLogger("blobfeed.service")

#: the version of a service state (``FeedServer.state_dict``)
STATE_VERSION = 1
#: the largest state file a resume reads (256 MiB; a bigger one is refused
#: before it is read).  The largest state blobfeed allows of one source fits
#: in well under half of it: a random-access source's ``skip`` and
#: ``returned`` lists of at most 2**20 ranges together
#: (checkpoint.MAX_SKIP_ENTRIES; at most 47 bytes a range as saved: about
#: 50 MB), its nets (at most 2**16, about 3 MB) and ``acked_after`` (at most
#: MAX_ACKED_AFTER, 15 bytes each: 16 MB)
MAX_STATE_FILE_BYTES = 256 << 20
#: the most JSON values a state file may hold, counted before it is parsed
#: (its commas, brackets and braces: at least its values less one).  Parsed,
#: a value costs up to about 70 bytes (an empty object), so this bounds a
#: resume's memory where the file's size alone does not (a list of ``{}``
#: costs 25 times its bytes).  The largest state blobfeed writes holds about
#: 5.5 million (2**20 ranges of 4 values, 2**16 nets of 4, 2**20 in
#: ``acked_after``), with room for twice the ranges; a fetcher's own states
#: come on top (keep them small).
MAX_STATE_VALUES = 12 << 20
#: the most batches a source's ``acked_after`` lists (acknowledged past its
#: saved position), as checkpoint.MAX_SKIP_ENTRIES bounds a source's ranges
MAX_ACKED_AFTER = 1 << 20


def savable(state: dict[str, Any], path: str) -> str | None:
    """``state`` as the text :meth:`FeedServer.save_state` writes to
    ``path``; None (a warning says why) when a resume would refuse it, so
    that it is not written over the last good one."""
    for name, s in state["sources"].items():
        after = s.get("acked_after", [])
        if len(after) > MAX_ACKED_AFTER:
            logger.warning(
                "service: state not saved to %s (the last one saved stays): "
                "state['sources'][%r]['acked_after'] lists %d batches, more than a resume reads "
                "(MAX_ACKED_AFTER, %d)", path, name, len(after), MAX_ACKED_AFTER,
            )
            return None
    text = json.dumps(state)
    if len(text) > MAX_STATE_FILE_BYTES:  # ASCII (json.dumps escapes the rest): as many bytes
        logger.warning(
            "service: state not saved to %s (the last one saved stays): it is %d bytes, more than "
            "a resume reads (MAX_STATE_FILE_BYTES, %d)", path, len(text), MAX_STATE_FILE_BYTES,
        )
        return None
    values = _values(text)
    if values > MAX_STATE_VALUES:
        logger.warning(
            "service: state not saved to %s (the last one saved stays): it holds about %d JSON values, more "
            "than a resume reads (MAX_STATE_VALUES, %d)", path, values, MAX_STATE_VALUES,
        )
        return None
    return text


def _values(text: str) -> int:
    """About how many JSON values ``text`` holds (no fewer, less one): its
    commas, brackets and braces, counted without parsing it."""
    return text.count(",") + text.count("[") + text.count("{")


def read_state(path: str) -> dict[str, Any]:
    """The state in ``path``, its shape checked at every level down to
    each source's inner state (which ``load_state_dict`` checks).

    Raises:
        ValueError: no such file, not a regular file, over
            :data:`MAX_STATE_FILE_BYTES`, not JSON, or a field of the
            wrong kind, value or name (the message names it).
    """
    text = _read_state_file(path)
    values = _values(text)
    if values > MAX_STATE_VALUES:
        raise ValueError(f"resume: {path!r} holds about {values} JSON values, more than a state may hold "
                         f"(MAX_STATE_VALUES, {MAX_STATE_VALUES}): refused before it is parsed")
    try:
        state = json.loads(text)
    except RecursionError:
        raise ValueError(f"resume: {path!r} is not a service state: nested too deeply") from None
    except MemoryError:
        raise ValueError(f"resume: {path!r}: out of memory reading the state "
                         f"({len(text)} characters)") from None
    except ValueError as err:
        raise ValueError(f"resume: {path!r} is not a service state: {err}") from None
    del text
    where = f"resume: {path!r}"

    def bad(field: str, message: str) -> ValueError:
        return ValueError(f"{where}: {field}: {message}")

    def fields(obj: dict[str, Any], field: str, known: tuple[str, ...], required: tuple[str, ...]) -> None:
        for key in obj:
            if key not in known:
                raise bad(field, f"unknown field {key!r} (expected {', '.join(map(repr, known))})")
        for key in required:
            if key not in obj:
                raise bad(f"{field_name(field, key)}", "missing (the state is damaged, or not from state_dict())")

    if not isinstance(state, dict):
        raise bad("the state", f"expected an object {{'version': {STATE_VERSION}, 'sources': {{...}}}}, "
                  f"got {_kind(state)}")
    fields(state, "the state", ("version", "sources"), ("version", "sources"))
    if type(state["version"]) is not int or state["version"] != STATE_VERSION:
        raise bad("state['version']", f"this service reads version {STATE_VERSION}, got {_kind(state['version'])}")
    sources = state["sources"]
    if not isinstance(sources, dict):
        raise bad("state['sources']", f"expected an object (source name: its state), got {_kind(sources)}")
    for name, s in sources.items():
        field = field_name("state['sources']", name)
        if not isinstance(s, dict):
            raise bad(field, "expected an object {'service_version': 1, 'source': NAME, 'inner': {...}}, "
                      f"got {_kind(s)}")
        fields(s, field, ("service_version", "source", "inner", "acked_after"), ("inner",))
        if "service_version" in s and (type(s["service_version"]) is not int or s["service_version"] != 1):
            raise bad(field_name(field, "service_version"), f"expected 1, got {_kind(s['service_version'])}")
        if "source" in s and s["source"] != name:
            raise bad(field_name(field, "source"), f"expected {name!r} (the name it is saved under), "
                      f"got {_kind(s['source'])}")
        if not isinstance(s["inner"], dict):
            raise bad(field_name(field, "inner"), "expected an object (the source's position, from its "
                      f"state_dict()), got {_kind(s['inner'])}")
        # serve_source wires the source with it before load_state_dict
        # checks the rest of the inner state: checked here
        if "seed" in s["inner"]:
            seed = s["inner"]["seed"]
            if not (_seed(seed) or isinstance(seed, list) and seed and all(map(_seed, seed))):
                raise bad(field_name(field_name(field, "inner"), "seed"), "expected an int >= 0 or a non-empty list "
                          f"of them (the seed the source was wired with), got {_kind(seed)}")
        after = s.get("acked_after", [])
        # 0: the batch at the position was acknowledged in a run before
        # (a resumed run saves what it is still to skip)
        if isinstance(after, list) and len(after) > MAX_ACKED_AFTER:
            raise bad(field_name(field, "acked_after"), f"expected a list of at most {MAX_ACKED_AFTER} "
                      f"batches acknowledged past the position (MAX_ACKED_AFTER), got {len(after)}")
        if not isinstance(after, list) or not all(type(x) is int and 0 <= x < 1 << 40 for x in after):
            raise bad(field_name(field, "acked_after"), "expected a list of ints >= 0 (batches acknowledged "
                      f"past the position), got {_kind(after)}")
    return state


def _file_kind(mode: int) -> str:
    """What a file of ``mode`` is, as a message says it."""
    for test, kind in (
        (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"a file of mode {stat.filemode(mode)}"


def _read_state_file(path: str) -> str:
    """The text of the state file ``path``: a regular file of at most
    :data:`MAX_STATE_FILE_BYTES` (read as untrusted input: a FIFO does not
    block, a device is not read, at most the cap and one byte are read
    whatever its size said, running out of memory is an error naming it).

    Raises:
        ValueError: naming the file and what was wrong with it.
    """
    cap = MAX_STATE_FILE_BYTES
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once (it is
        # refused below); a regular file's reads ignore the flag
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValueError(f"resume: no state file {path!r}") from None
    except OSError as err:
        # a socket file cannot be opened (ENXIO): say what it is
        with contextlib.suppress(OSError):
            mode = os.stat(path).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError(f"resume: {path!r} is {_file_kind(mode)}, not a regular file "
                                 "(a state file is one, from save_state)") from None
        raise ValueError(f"resume: {path!r} is not a service state: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"resume: {path!r} is {_file_kind(st.st_mode)}, not a regular file "
                             "(a state file is one, from save_state)")
        if st.st_size > cap:
            raise ValueError(f"resume: {path!r} is {st.st_size} bytes, more than a state file may have "
                             f"({cap} bytes, MAX_STATE_FILE_BYTES)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(cap + 1)
        if len(data) > cap:
            raise ValueError(f"resume: {path!r} holds more than {cap} bytes (MAX_STATE_FILE_BYTES), "
                             f"though it was {st.st_size} bytes when opened (it grew while read)")
        return data.decode("utf-8")
    except MemoryError:
        raise ValueError(f"resume: {path!r}: out of memory reading the state file "
                         f"(at most {cap} bytes, MAX_STATE_FILE_BYTES)") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"resume: {path!r} is not a service state: {err}") from None
    except OSError as err:
        raise ValueError(f"resume: {path!r} is not a service state: {err.strerror or err}") from None
    finally:
        os.close(fd)


def _seed(value: object) -> bool:
    """Is ``value`` a seed a state may hold (an int >= 0, never a bool)?"""
    return type(value) is int and value >= 0


def field_name(field: str, key: object) -> str:
    """``field[key]``, as a message names a field of a state."""
    return f"{field}[{key!r}]"


def _kind(value: object) -> str:
    """What a message says a state held: its JSON kind, and the value if short."""
    kinds = {dict: "an object", list: "a list", str: "a str", bool: "a bool", int: "an int", float: "a number"}
    kind = kinds.get(type(value), "null" if value is None else type(value).__name__)
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return kind if value is None or len(text) > 60 else f"{kind} {text}"
