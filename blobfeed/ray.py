"""Fetchers as Ray actors (extra ``blobfeed[ray]``): the public name.

``from blobfeed.ray import RayBackend``; the backend itself lives beside the
process backend, in :mod:`blobfeed.feeders.ray_backend`.  Importing either
needs no Ray: it is imported when a ``RayBackend`` is first used.
"""

from __future__ import annotations

from .feeders.ray_backend import RayBackend

__all__ = ["RayBackend"]
