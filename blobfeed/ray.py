"""blobfeed on Ray (extra ``blobfeed[ray]``): the public names.

* ``RayBackend``: fetchers as Ray actors (``backend=RayBackend(...)``); it
  lives beside the process backend, in :mod:`blobfeed.feeders.ray_backend`.
* ``serve_on_ray`` / ``RayService``: the feeding service as a named Ray
  actor, that consumers anywhere on the cluster attach to with
  ``attach_source(..., address="ray://NAME")``
  (:mod:`blobfeed.service.ray_service`, docs/SERVICE.md).

Importing this needs no Ray: it is imported when first used.
"""

from __future__ import annotations

from .feeders.ray_backend import RayBackend
from .service.ray_service import RayService, serve_on_ray

__all__ = ["RayBackend", "RayService", "serve_on_ray"]
