"""The run: which measurements, how long they take, each in a child
process, repeated and interleaved."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

from . import autobench, direct, library, peers, service
from .library import W5_SLICE_S
from .measure import Meter, sweep_tallies
from .peers.ray_data import RAYDATA_NEEDS
from .report import summarize
from .workloads import (PROCESS_PEERS, SERVICE_CONSUMERS, WORKLOADS, W4Fetch, Workload, ensure_w6_corpus,
                        ensure_w7_records)

#: every runner by name: blobfeed's, then the peers'
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    **library.RUNNERS, **service.RUNNERS, **direct.RUNNERS, **peers.RUNNERS, **autobench.RUNNERS,
}
#: the optional package each runner needs; the others need only the standard library
RUNNER_NEEDS: dict[str, str] = {**library.NEEDS, **service.NEEDS, **peers.NEEDS}


def installed(module: str) -> bool:
    """Can ``module`` be imported here (without importing it)?"""
    return importlib.util.find_spec(module) is not None


def available_packages() -> frozenset[str]:
    """The optional packages of this machine the bench can use; ``ray.data``
    stands for Ray with its extra ``ray[data]``."""
    have = {p for p in ("torch", "grain", "PIL", "ray") if installed(p)}
    if all(installed(p) for p in RAYDATA_NEEDS):
        have.add("ray.data")
    return frozenset(have)


#: Meter's warm-up before each measured window, seconds.
WARMUP_S = Meter.warmup
#: Per-measurement cost beyond warm-up and window, by runner: a child's
#: start-up (the interpreter, numpy, blobfeed), its set-up and its drain.
#: Measured with short runs (``--seconds 0.5 --repeats 1``, each measurement
#: timed from outside, the least of two) on this project's 2-core machine
#: while other suites ran on it (load 4-5): W1-W3/blobfeed 0.40-0.53 s beyond
#: the warm-up and the window, caffe2 0.47-0.58, W2/copy 0.46, W5/model 0.65,
#: W1p/blobfeed 0.94, W1p/pool 1.79; W4 0.68 and 0.77, W4p 2.09 (blobfeed)
#: and 2.48 (pool).  Until issue 24 the window also grew by the time of each
#: PSS reading (taken out of it, seconds a reading on a busy machine), which
#: no model of this kind could follow: 298 s were estimated and 361 s taken.
CHILD_OVERHEAD_S = 0.45
#: caffe2: its threads' joins (they poll their queues every 0.1 s).
CAFFE2_EXTRA_S = 0.1
#: W2/copy faults in 256 MiB of buffers first (most of it inside the warm-up).
COPY_SETUP_S = 0.05
#: W5: onnxruntime's import and session (the model alone's; the fed net has its
#: own, and the interleaved slices, counted apart).
MODEL_EXTRA_S = 0.2
W5_EXTRA_S = 0.85
#: W4, W4p, W4pd: the fetcher calibrates its loop (``calibrate_w4``, about
#: 0.13 s of CPU time, more on a busy machine) in every measurement.
CALIBRATION_S = 0.25
#: CPU-bound fetches in worker processes (W4p, W4pd, W6p): the workers finish
#: the fetches under way, 5 ms and more each, before the drain ends.
CPU_PROCESSES_DRAIN_S = 0.6
#: torch's import; its worker processes (``num_workers=2``, forked) on top.
TORCH_EXTRA_S = 1.3
TORCH_WORKERS_S = 0.1
#: grain's import; its worker processes (spawned, importing grain again) on top.
GRAIN_EXTRA_S = 0.2
GRAIN_WORKERS_S = 0.5
#: blobfeed's process workers: the forkserver, the children, the drain.
PROCESSES_EXTRA_S = 0.5
#: the auto workloads (A4p, A6p, A2p): each worker process beyond the first
#: two (its start, its drain); for auto, a guess at the processes it starts
AUTO_PROCESS_S = 0.1
#: ``multiprocessing.Pool(2)``: start and terminate.
POOL_EXTRA_S = 1.3
#: Pillow's import (in the workers too) and W6's first decodes.
W6_EXTRA_S = 0.2
#: The drain of a shuffled source after the clock: the buffer's 10 000
#: samples still leave as batches (W2s: 156 of 9.6 MB, about 0.4 s at its
#: rate; W1s: 312 small ones, 0.05 s).
SHUFFLE_DRAIN_S = {"W1s": 0.1, "W2s": 0.5}
#: W7 (blobfeed and its own sequential read, 2 worker processes): the
#: forkserver and the workers as any process workload, plus the dataset's
#: index (57 217 offsets) pickled to each worker and the first batches'
#: faults in the mapped file (its first batch took 0.5-1.1 s).
#: W7's peers: the package's import (TORCH_EXTRA_S, GRAIN_EXTRA_S), the
#: loader's start and its first shuffled batches, and each worker process
#: (torch's forked with the dataset; grain's spawned, importing grain again).
#: Timed from outside with --seconds 0.5 windows while the machine was at
#: load 10-12 (blobfeed 1.75 s beyond warm-up and window, sequential 2.5;
#: torchmap0/1/2/4 5.1, 3.6, 4.0, 4.4; grainmap0/1/2/4 1.2, 1.9, 3.0, 6.0),
#: and taken at about half, the load (4-5) of the other overheads here.
W7_EXTRA_S = 0.4
#: W7's work2 (and hand2): two spawned processes (an interpreter, numpy, the
#: bench's workloads module and the dataset's index each) and their first batches
WORK2_EXTRA_S = 0.8
TORCH_MAP_EXTRA_S = 0.6
TORCH_MAP_WORKER_S = 0.15
GRAIN_MAP_EXTRA_S = 0.4
GRAIN_MAP_WORKER_S = 0.6
#: The first run with W7 writes its 2 GB record file (not in the estimate:
#: once per machine; 19 s on this project's 2-core machine, shared, load 8).
W7_GENERATE_S = 20.0
#: A local Ray cluster: the head, then each simulated node (with its actors' start).
RAY_CLUSTER_S = 6.0
RAY_NODE_S = 1.5
#: raydata: ``import ray.data``, a local cluster, Ray Data's first batch
#: (its workers' start) and ``ray.shutdown()``.
RAYDATA_EXTRA_S = 9.0
#: S1, S2 (4 consumer processes): until every consumer has had a batch (their
#: start, the service's or the pipelines' workers: four pipelines of process
#: workers start 4 forkservers and 8 workers), then the drain and the
#: processes' exit; by runner and the backend of its workers.  From one run
#: of ``--workloads S1,S2,attach --seconds 1 --repeats 1`` (24.8 s) on this
#: project's 2-core machine while another suite ran (load 5).
#: The service with thread workers (S2 since issue 25): no forkserver, no
#: worker processes to start; an estimate, from the same run's figures.
SERVICE_EXTRA_S = {("service", "processes"): 2.1, ("service", "threads"): 1.6, ("pipes", "processes"): 5.0,
                   ("pipes", "threads"): 2.1}
#: S8: each consumer process beyond S1's four (its start on a busy machine,
#: its first batch, its drain)
SERVICE_CONSUMER_S = 0.5
#: attach: the service's start, the cycle that ends past the window (a
#: consumer process's start, about 0.5 s) and the drain of the rest
ATTACH_EXTRA_S = 2.9
#: bare, direct, ledger: 4 consumer processes (the bench's modules, no pipeline)
#: (their start, until each has had a batch), and their end
BARE_EXTRA_S = 1.2
#: raysplit: a local cluster, 4 actors, until each has had a block, and
#: ``ray.shutdown()`` (one measurement of 2 s took 11.3 s, of S1 and of S2)
RAYSPLIT_EXTRA_S = 8.5


def _packages(packages: Collection[str] | bool) -> frozenset[str]:
    """A set of installed optional packages; ``True``/``False`` stand for all/none."""
    if packages is True:
        return frozenset({"torch", "grain", "PIL", "ray", "ray.data"})
    if packages is False:
        return frozenset({"PIL"})
    return frozenset(packages)


def _plan(workloads: list[str], packages: Collection[str] | bool) -> list[tuple[str, str]]:
    """The (workload, runner) measurements of one repetition, in order:
    those whose packages are installed."""
    have = _packages(packages)
    return [
        (w, r)
        for w in workloads
        if all(n in have for n in WORKLOADS[w].needs)
        for r in WORKLOADS[w].runners
        if RUNNER_NEEDS.get(r, "numpy") in have | {"numpy"}
    ]


def _skipped_workloads(workloads: list[str], packages: Collection[str] | bool) -> dict[str, str]:
    have = _packages(packages)
    return {
        w: f"{', '.join(n for n in WORKLOADS[w].needs if n not in have)} not installed"
        for w in workloads
        if any(n not in have for n in WORKLOADS[w].needs)
    }


def measurement_seconds(w: str, r: str, seconds: float) -> float:
    """Approximate wall time of one measurement of runner ``r`` on workload
    ``w`` with a window of ``seconds``: the child's start-up, the warm-up,
    the window, and the runner's own set-up, calibration and drain."""
    wl = WORKLOADS[w]
    one = CHILD_OVERHEAD_S + WARMUP_S + seconds
    if r in autobench.RUNNERS:
        # its own warm-up (auto: its settling; autox2: twice), and on processes
        # the forkserver and a start for each worker (auto's too, as it adds them)
        one = CHILD_OVERHEAD_S + autobench.measurement_seconds(r, seconds)
        if wl.backend == "processes":
            one += PROCESSES_EXTRA_S + AUTO_PROCESS_S * autobench.workers_of(r)
    elif (w, r) == ("W5", "blobfeed"):
        one += 2 * W5_SLICE_S * max(4, int(seconds / W5_SLICE_S / 2)) + W5_EXTRA_S
    elif r == "caffe2":
        one += CAFFE2_EXTRA_S
    elif r in ("work2", "hand2"):
        one += WORK2_EXTRA_S
    elif r in ("copy", "copy2"):
        one += COPY_SETUP_S * (2 if r == "copy2" else 1)
    elif r == "model":
        one += MODEL_EXTRA_S
    elif r.startswith("torchmap"):
        one += TORCH_EXTRA_S + TORCH_MAP_EXTRA_S + TORCH_MAP_WORKER_S * int(r[len("torchmap"):])
    elif r.startswith("grainmap"):
        one += GRAIN_EXTRA_S + GRAIN_MAP_EXTRA_S + GRAIN_MAP_WORKER_S * int(r[len("grainmap"):])
    elif r.startswith("torch"):
        one += TORCH_EXTRA_S + (TORCH_WORKERS_S if r.startswith("torch2") else 0.0)
    elif r.startswith("grain"):
        one += GRAIN_EXTRA_S + (GRAIN_WORKERS_S if r.startswith("grain2") else 0.0)
    elif r == "pool":
        one += POOL_EXTRA_S
    elif r == "raydata":
        one += RAYDATA_EXTRA_S
    elif r == "raysplit":
        one += RAYSPLIT_EXTRA_S
    elif r == "service" and wl.consumers == 1:  # attach: no warm-up, cycles for the window
        one += ATTACH_EXTRA_S - WARMUP_S
    elif r in ("bare", "direct", "ledger"):
        one += BARE_EXTRA_S
    elif r in ("service", "pipes"):
        one += SERVICE_EXTRA_S[(r, wl.backend if r == "service" else wl.pipes_backend)]
        one += SERVICE_CONSUMER_S * max(0, wl.consumers - SERVICE_CONSUMERS)
    elif r.startswith("ray"):
        nodes = {"ray2": 2, "ray2max": 2, "ray4": 4}.get(r, 1)
        one += RAY_CLUSTER_S + RAY_NODE_S * nodes
    elif r in ("blobfeed", "sequential") and wl.backend == "processes":
        one += PROCESSES_EXTRA_S + (W7_EXTRA_S if wl.dataset is not None else 0.0)
    if r == "blobfeed":
        one += SHUFFLE_DRAIN_S.get(w, 0.0)
    if wl.fetcher is W4Fetch:
        one += CALIBRATION_S
    if wl.ideal_cores and wl.backend == "processes" and r in ("blobfeed", *PROCESS_PEERS):
        one += CPU_PROCESSES_DRAIN_S
    if "PIL" in wl.needs:
        one += W6_EXTRA_S
    return one


def estimate_seconds(workloads: list[str], seconds: float, repeats: int, packages: Collection[str] | bool) -> float:
    """Approximate wall time of a run: a model of it, not a measurement,
    made of the measurements it will run (those whose packages are
    installed: ``packages``, the optional packages installed (torch, grain,
    PIL, ray, ray.data), or True for all of them, False for none but
    Pillow), each with its runner's overheads (:func:`measurement_seconds`)."""
    return repeats * sum(measurement_seconds(w, r, seconds) for w, r in _plan(workloads, packages))


#: The child's ``__main__``: ``python -m blobfeed.apps.bench`` without the
#: current directory first on ``sys.path``.  ``-m`` (and ``-c``) put it
#: there, and run from the folder that holds the clone, its ``blobfeed/``
#: (the clone's root, no ``__init__.py``) is taken for the package: a
#: namespace package with no ``Net``, ahead of an editable install's finder.
#: ``-P`` does this from Python 3.11 on; this also works on 3.10.
CHILD_MAIN = (
    "import runpy, sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "runpy.run_module('blobfeed.apps.bench', run_name='__main__', alter_sys=True)\n"
)


def child_command(*args: str) -> list[str]:
    """The command line of a measurement's child: ``python -m
    blobfeed.apps.bench *args``, whatever the current directory holds."""
    return [sys.executable, "-c", CHILD_MAIN, *args]


class MeasurementFailed(Exception):
    """A measurement's child crashed, hung past its time limit, or printed no result."""


def child_timeout(seconds: float) -> float:
    """How long a measurement's child may take before it counts as hung."""
    return seconds * 10 + 120


SHM = "/dev/shm"


def _semaphores() -> set[str]:
    """The named semaphores of multiprocessing (``sem.mp-*``) in /dev/shm now."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("sem.mp-")}
    except OSError:
        return set()


def _unlink_orphan_semaphores(before: set[str], group: int) -> None:
    """Unlink the multiprocessing semaphores (and the tally) a killed measurement left.

    A measurement killed with its whole group (a peer's Pool, its resource
    tracker) cannot unlink the named semaphores it made: each would stay in
    /dev/shm for good.  Those that appeared since ``before`` and no live
    process maps any more are its own (the group is gone; the wait is
    bounded: a killed process lets its mappings go as it exits).
    """
    deadline = time.monotonic() + 5.0
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    sweep_tallies(SHM)  # its tally, whose owner is dead now
    new = _semaphores() - before
    if not new:
        return
    mapped = _mapped_shm_files()
    for name in new:
        path = os.path.join(SHM, name)
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) not in mapped:
                os.unlink(path)


def _mapped_shm_files() -> set[tuple[int, int]]:
    """(device, inode) of every file under /dev/shm some process maps.

    By inode, not by name: the process that makes a named semaphore maps it
    under the temporary name ``sem_open`` created it as
    (``/dev/shm/sem.XXXXXX (deleted)``) before linking it to its own, so by
    name a live semaphore of any other program looked unmapped."""
    mapped: set[tuple[int, int]] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                lines = [line for line in f if SHM + "/" in line]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # address, perms, offset, dev (major:minor, hex), inode, path
            with contextlib.suppress(ValueError, IndexError):  # one odd line: the others still count
                major, minor = fields[3].split(":")
                mapped.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    return mapped


def _group_alive(group: int) -> bool:
    """Whether a process of process group ``group`` still runs (not a zombie)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == group:
            return True
    return False


def _child(wl_id: str, runner: str, seconds: float, timeout: float | None = None) -> dict[str, Any]:
    """One measurement in a fresh child process (``python -m
    blobfeed.apps.bench --child``), so that its peak RSS is its own.

    The child leads a process group of its own: when it hangs past
    ``timeout`` (default :func:`child_timeout`), it is killed with every
    process it started (a Pool's workers, torch's, grain's), none left behind.

    Raises:
        MeasurementFailed: it crashed, timed out or printed no result; the
            message is one line that says which.
    """
    limit = child_timeout(seconds) if timeout is None else timeout
    semaphores = _semaphores()
    env = dict(os.environ)
    for name, value in WORKLOADS[wl_id].child_env:
        env.setdefault(name, value)
    proc = subprocess.Popen(
        child_command("--child", wl_id, runner, str(seconds)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except BaseException as exc:  # the time limit, or Ctrl-C: the whole group goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        _unlink_orphan_semaphores(semaphores, proc.pid)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise MeasurementFailed(f"timed out after {limit:g} s (killed)") from None
        raise
    finally:
        # what the child started and left running (it exited, its group may not have)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        last = next((line for line in reversed(err.splitlines()) if line.strip()), "no message")
        raise MeasurementFailed(f"exited with status {proc.returncode}: {last.strip()}")
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise MeasurementFailed(f"printed no result (stdout: {out.strip()[-200:]!r})") from None
    if not isinstance(result, dict):
        raise MeasurementFailed(f"printed {type(result).__name__}, not a result")
    return result


#: how run_all runs one measurement (tests put a stand-in here)
measure_one: Callable[[str, str, float], dict[str, Any]] = _child


def run_all(workloads: list[str], seconds: float, repeats: int, progress: Any = None) -> dict[str, Any]:
    """Every measurement of ``workloads`` whose packages are installed,
    ``repeats`` times, interleaved (A B A B ...: a shared machine's drift
    hits every runner alike); the report :func:`report.format_report` prints."""
    if progress is None:
        progress = sys.stderr  # looked up now: whatever stderr is at the call
    packages = available_packages()
    plan = _plan(workloads, packages)
    raw: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in plan}
    if any(w for w, _ in plan if "PIL" in WORKLOADS[w].needs):
        ensure_w6_corpus(progress=progress)
    if any(w == "W7" for w, _ in plan):
        ensure_w7_records(progress=progress)  # 2 GB, once
    total = len(plan) * repeats
    done = 0
    failures: dict[tuple[str, str], str] = {}
    t0 = time.monotonic()
    for rep in range(repeats):
        for w, r in plan:
            done += 1
            if (w, r) in failures:  # failed once: its row is failed, the rest of the run goes on
                continue
            progress.write(f"\r[{done}/{total}] {w:<3} {r:<9} rep {rep + 1}/{repeats}  {time.monotonic() - t0:5.0f} s elapsed ")
            progress.flush()
            try:
                raw[(w, r)].append(measure_one(w, r, seconds))
            except MeasurementFailed as exc:
                failures[(w, r)] = f"repetition {rep + 1}: {exc}"
                progress.write(f"\nblobfeed bench: {w}/{r} failed in repetition {rep + 1}: {exc}; "
                               f"its row is reported as failed, the other measurements go on\n")
    progress.write("\n")
    results = summarize(raw, failures, cpus=os.cpu_count() or 1)
    return {"seconds": seconds, "repeats": repeats, "torch": "torch" in packages, "grain": "grain" in packages,
            "pillow": "PIL" in packages, "raydata": "ray.data" in packages, "skipped": _skipped_workloads(workloads, packages),
            "results": results, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "elapsed_s": time.monotonic() - t0}
