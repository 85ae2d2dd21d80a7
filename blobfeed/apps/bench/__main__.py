"""``python -m blobfeed.apps.bench``: how the runner starts each measurement
(``--child``), and ``blobfeed bench`` by another name.

The fetchers, grain's map function and the Pool's initializer live in the
package's modules, not in ``__main__``: worker processes (blobfeed's,
grain's, the Pool's) find them there by reference."""

import sys

from blobfeed.apps.bench.cli import main

sys.exit(main())
