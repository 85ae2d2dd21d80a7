"""The peers blobfeed is measured against, one module each (docs/BENCHMARKS.md,
"Baselines" and "Peers"): each has ``RUNNERS`` (its runners by name) and
``NEEDS`` (the optional package a runner needs, if any)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..workloads import Workload
from . import caffe2, copy_bound, grain_dataset, model_alone, mp_pool, ray_data, torch_dataloader, work_bound

PEERS = (caffe2, copy_bound, model_alone, grain_dataset, torch_dataloader, mp_pool, ray_data, work_bound)
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    name: run for peer in PEERS for name, run in peer.RUNNERS.items()
}
NEEDS: dict[str, str] = {name: need for peer in PEERS for name, need in peer.NEEDS.items()}
