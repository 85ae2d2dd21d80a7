"""A feeding service and torchrun-style trainers: one source, one process per rank.

Run it as it is (it plays both parts)::

    python examples/service_torchrun.py

or split the parts as on a real machine::

    blobfeed serve examples/service_torchrun.py:wire --listen /tmp/feed.sock &
    BLOBFEED_SERVICE=/tmp/feed.sock torchrun --nproc-per-node 4 examples/service_torchrun.py --rank-only

Each rank reads its rank and world size from the environment torchrun sets
(``RANK``, ``WORLD_SIZE``), attaches to the service and trains as with a
local source.  The service deals batch i to rank i % WORLD_SIZE, the same on
every run (deterministic=True), with equal shares per epoch (equal=True), so
no DDP step waits for a rank that ran out first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import blobfeed

SOURCE, BLOBS, BATCH, WORLD = "train", ["data", "label"], 32, 4


def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
    """A worker's shard: 20 chunks of 50 samples, then StopIteration (one epoch)."""
    info = blobfeed.get_worker_info()
    if fetch.calls.get(info.index, 0) == 20:  # type: ignore[attr-defined]
        fetch.calls[info.index] = 0  # type: ignore[attr-defined]
        raise StopIteration
    c = fetch.calls[info.index] = fetch.calls.get(info.index, 0) + 1  # type: ignore[attr-defined]
    ids = (info.index * 1000 + c) * 100 + np.arange(50)
    return [np.random.default_rng(int(ids[0])).random((50, 16), np.float32), ids]


fetch.calls = {}  # type: ignore[attr-defined]


def wire() -> None:
    """What ``blobfeed serve examples/service_torchrun.py:wire`` calls."""
    blobfeed.serve_source(
        SOURCE, BLOBS, fetch, BATCH, 2, deterministic=True, num_consumers=int(os.environ.get("WORLD_SIZE", WORLD)),
        equal=True, epochs=2,
    )


def rank_main() -> int:
    """One trainer rank: attach, run every epoch, report what it saw."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    net = blobfeed.Net(None, name=f"rank{rank}")  # your model: blobfeed.Net("model.onnx")
    seen = 0
    with blobfeed.attach_source(net, BLOBS, BATCH, SOURCE, consumer_index=rank, num_consumers=world, timeout=60):
        for epoch in range(2):
            for outputs in net:  # one epoch; EndOfEpoch ends the loop
                seen += len(outputs["label"])  # a real rank: loss, backward, optimizer step
    print(f"rank {rank}: {seen} samples", flush=True)
    return 0


def main() -> int:
    if "--rank-only" in sys.argv:
        return rank_main()
    server = blobfeed.FeedServer()
    with server:
        os.environ["WORLD_SIZE"] = str(WORLD)
        server.setup(wire)  # what `blobfeed serve service_torchrun.py:wire` does
        server.start()
        env = {**os.environ, "BLOBFEED_SERVICE": str(server.address), "WORLD_SIZE": str(WORLD)}
        ranks = [
            subprocess.Popen([sys.executable, __file__, "--rank-only"], env={**env, "RANK": str(r)})
            for r in range(WORLD)
        ]
        codes = [p.wait(timeout=120) for p in ranks]
    print(f"ranks exited {codes}")
    return 0 if codes == [0] * WORLD else 1


if __name__ == "__main__":
    sys.exit(main())
