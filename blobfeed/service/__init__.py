"""The feeding service: a source served to nets in other processes.

* :class:`FeedServer` (and :func:`serve_source`, for ``blobfeed serve``)
  runs a source's workers once and deals its batches to consumers;
* :func:`attach_source` feeds a net in another process from it.

The wire format is JSON records and shared memory (:mod:`.wire`,
:mod:`.slots`): nothing a peer sends is ever unpickled.
"""

from .consumer import Attachment, attach_source
from .server import FeedServer, current_server, serve_source, serving
from .socket_path import StopRequested

__all__ = ["Attachment", "FeedServer", "StopRequested", "attach_source", "current_server", "serve_source", "serving"]
