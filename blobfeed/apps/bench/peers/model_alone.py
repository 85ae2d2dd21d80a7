"""``model``: W5's model alone, ``InferenceSession.run`` on pre-made batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter
from ..workloads import Workload, mlp_bytes, session_options


def run_model(wl: Workload, seconds: float) -> dict[str, Any]:
    import onnxruntime as ort

    sess = ort.InferenceSession(mlp_bytes(), sess_options=session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((wl.batch, 784)).astype(np.float32) for _ in range(8)]
    m = Meter(seconds)
    m.begin()
    i = 0
    while True:
        x = batches[i % len(batches)]
        sess.run(None, {"data": x})
        i += 1
        if not m.tick([x]):
            break
    return m.result()  # no feeding, nothing to lose: no samples_lost ("-" in the table)


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "model": run_model,
}
#: they need no optional package
NEEDS: dict[str, str] = {}
