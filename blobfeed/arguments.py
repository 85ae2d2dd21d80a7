"""Checks of user arguments at the public boundary.

Every check raises ``TypeError`` for a value of the wrong kind and
``ValueError`` for one out of range, naming the argument and the value, in
the caller's thread.  Never ``assert``: ``python -O`` strips asserts.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np

__all__ = ["check_flag", "check_index", "check_timeout"]


def check_index(what: str, value: Any, minimum: int = 1) -> int:
    """An integer argument: any integral type (``operator.index``), so numpy
    integers work; ``bool`` is refused (``True`` is not a count)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None
    if n < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {n}")
    return n


def check_timeout(what: str, value: Any, *, allow_zero: bool = False) -> float:
    """A duration in seconds: any real number (numpy floats too), finite or
    ``inf``; negative, NaN (and zero unless ``allow_zero``) are refused, as
    ``queue.Queue.get`` refuses a negative timeout."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} {value!r}")
    t = float(value)
    if math.isnan(t) or t < 0 or (t == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a number of seconds {bound}, got {value!r}")
    return t


def check_flag(what: str, value: Any) -> bool:
    """A flag: ``bool`` (or ``numpy.bool_``) only.  A string such as
    ``"False"`` from a config file is truthy and would silently mean True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def wait_bound(timeout: float | None) -> float | None:
    """A timeout for ``Condition.wait``: ``inf`` means no bound (``wait``
    itself overflows on it)."""
    if timeout is None or math.isinf(timeout):
        return None
    return timeout
