"""The option types of the command lines (``blobfeed demo``, ``bench``,
``serve``).  argparse names a type function in its message ("invalid
_positive value: 'abc'"): each of these raises ``ArgumentTypeError`` with
words instead, e.g. ``invalid positive integer: 'abc'``."""

from __future__ import annotations

import argparse
import math
from typing import Callable, TypeVar

N = TypeVar("N", int, float)


def _number(convert: Callable[[str], N], what: str, fits: Callable[[N], bool], rule: str,
            doc: str) -> Callable[[str], N]:
    """An option type: ``convert`` the text, then check it ``fits``; the
    errors say ``invalid {what}: 'text'`` or ``must be {rule}, got text``."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what}: {text!r}") from None
        if not fits(value):  # a float's nan fits nothing
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__doc__ = doc
    return parse


positive_int = _number(int, "positive integer", lambda v: v >= 1, "at least 1", "An integer of at least 1.")
positive_float = _number(float, "positive number", lambda v: v > 0 and math.isfinite(v), "a number more than 0",
                         "A finite number more than 0.")
seconds_or_more = _number(float, "number of seconds", lambda v: v >= 0, "0 or more seconds",
                          "A number of seconds, 0 or more (``inf`` allowed).")
port = _number(int, "port number", lambda v: 0 <= v <= 65535, "0..65535", "A TCP port, 0..65535 (0: any free port).")
