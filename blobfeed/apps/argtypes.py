"""The option types of the command lines (``blobfeed demo``, ``bench``,
``serve``).  argparse names a type function in its message ("invalid
_positive value: 'abc'"): each of these raises ``ArgumentTypeError`` with
words instead, e.g. ``invalid positive integer: 'abc'``."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid positive integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid positive number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number more than 0, got {text}")
    return value


def seconds_or_more(text: str) -> float:
    """A number of seconds, 0 or more (``inf`` allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value
