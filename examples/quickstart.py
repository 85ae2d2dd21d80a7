"""The user's day with blobfeed, end to end.

1. a small ONNX model (an MLP classifier),
2. fetchers returning variable-size chunks,
3. ``init_data_input_workers`` + ``start()``,
4. a ``net.run()`` loop until the data ends,
5. the metrics scraped from ``/metrics``,
6. ``stop()``.

Run:  python examples/quickstart.py
"""

from __future__ import annotations

import logging
import threading
import urllib.request

import numpy as np

import blobfeed
from blobfeed.metrics import start_http_server
from blobfeed.apps.models import mlp_onnx, mlp_reference

N_SAMPLES = 20_000
FEATURES = 32
BATCH = 256


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model, weights = mlp_onnx([FEATURES, 64, 10], seed=0)

    # A "dataset" the fetchers read in random-size chunks, each sample once.
    rng = np.random.default_rng(0)
    features = rng.standard_normal((N_SAMPLES, FEATURES)).astype(np.float32)
    ids = np.arange(N_SAMPLES, dtype=np.int64)
    cursor = {"pos": 0}
    lock = threading.Lock()

    def fetch_fun(worker_id: int, batch_size: int) -> list[np.ndarray]:
        n = int(np.random.default_rng().integers(1, batch_size))
        with lock:
            start = cursor["pos"]
            if start >= N_SAMPLES:
                raise StopIteration  # this worker is done
            cursor["pos"] = start + n
        return [features[start : start + n], ids[start : start + n]]

    net = blobfeed.Net(model, name="classifier")
    coordinator = blobfeed.init_data_input_workers(
        net, ["data", "sample_id"], fetch_fun, batch_size=BATCH, num_worker_threads=2
    )
    server = start_http_server(0)  # 127.0.0.1, a free port
    print(f"metrics at {server.url}")

    coordinator.start()
    predictions = np.empty(N_SAMPLES, np.int64)
    batches = 0
    while True:
        try:
            out = net.run(timeout=10)
        except blobfeed.EndOfInput:
            break
        sample_ids = net.workspace.fetch_blob("sample_id")
        predictions[sample_ids] = out["logits"].argmax(axis=1)
        batches += 1

    with urllib.request.urlopen(server.url, timeout=5) as resp:
        scraped = [
            line for line in resp.read().decode().splitlines()
            if line.startswith(("blobfeed_batches_total", "blobfeed_fetched_samples_total"))
        ]
    print("\n".join(scraped))

    ok = coordinator.stop()
    server.close()

    expected = mlp_reference(features, weights).argmax(axis=1)
    agree = float((predictions == expected).mean())
    print(f"{batches} batches, {N_SAMPLES} samples, predictions agree with numpy: {agree:.2%}, clean stop: {ok}")
    if agree < 0.999 or not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
