"""``blobfeed bench``: workloads W1-W6, W1p-W6p, the ordered modes and the feeding service (docs/BENCHMARKS.md), blobfeed beside its baselines and peers.

Every (workload, runner) measurement runs in a fresh child process so that
peak RSS belongs to that runner alone; repetitions are interleaved (A B A B
...) so slow drift of a shared machine hits every runner alike; the median
of the repetitions is reported, and ratios are taken between runners of the
same invocation.

Workloads W1-W6 run blobfeed's fetchers as threads; W1p, W2p, W4p and W6p
are W1, W2, W4 and W6 with ``backend="processes"`` (2 worker processes).
W1d, W2d and W4pd are W1, W2 and W4p with ``deterministic=True``; W1s and
W2s are W1 and W2 with ``deterministic=True, shuffle_buffer=10000``.  They
run blobfeed alone, and the table's "vs base" column gives blobfeed's
batches/s on each over its batches/s on the default-mode workload in the
same run (the targets of W1d, W2d, W4pd, W1s and W2s are on that ratio).

R1 and R2 run blobfeed's fetchers as Ray actors (``blobfeed.ray.RayBackend``,
extra ``blobfeed[ray]``) on a local cluster of simulated nodes that each
measurement starts before it connects (a head with no CPUs, and nodes of 2
CPUs with 2 actors each), so that the first batch is timed from ``start()``
on a running cluster, not from Ray's start-up; they are skipped where Ray is
not installed.  R1's fetchers wait on I/O (50 ms per 256 KiB chunk): runners
``ray1``, ``ray2``, ``ray4`` (nodes), and ``ray2max`` (the same chunks with
no wait: the driver's ingest limit).  R2 is W2 through Ray (``ray``: one
node, 2 actors) beside W2 through threads (``blobfeed``) in the same run.

A4p, A6p, A2p and Aio (opt-in: ``--workloads auto``) set
``num_worker_threads="auto"`` against fixed counts 1, 2, 4, 8 (16 for Aio,
the I/O-bound one) on the same fetcher, before and after its cost doubles
(``autobench``).

S1, S2, S8 and attach measure the feeding service (``blobfeed.service``),
each consumer a process of its own.  S1 (W2's chunks and batch) and S2
(W1's): ``service`` is one ``FeedServer`` (2 workers: processes for S1, as
a user would run an image loader; threads for S2, W1's fetcher being
trivial) dealing to 4 consumer processes by index; ``pipes`` is 4 consumer
processes with a pipeline each (2 workers: processes for S1, threads for
S2); ``bare`` (S2) the service's transport alone, written plainly (a
sender and a receiver thread per consumer, one record of bytes made in
advance per batch, each acknowledged; no fetching, no guarantees);
``copy`` (S1) the copy bound; ``raysplit`` Ray Data's
``streaming_split(4)`` to 4 Ray actors, where ``ray[data]`` is installed.
S8 is S1's service with 8 consumer processes, set against S1's.  The window
is timed from outside the consumers and the PSS is the whole process
tree's; the CPU time and context switches of the service and of each
consumer are read from /proc at the window's two ends, and shown per batch.
attach: the time from ``attach_source(...)`` to the first batch on a
running service.  They are not in the default run (``--workloads
S1,S2,S8,attach``).

Runners:

* ``blobfeed``   -- the library, a ``Net`` with no model (W5: the MLP).
* ``caffe2``     -- Caffe2's original re-batching, written from its
  description: ``np.append`` growth, ``np.split``, leftover put back with
  ``put(block=False)`` and dropped when the queue is full.  It counts the
  samples it drops.
* ``copy``       -- the copy bound (W2): one ``np.copyto`` per batch into
  buffers rotated through more memory than the last-level cache.
* ``model``      -- the model alone (W5): ``InferenceSession.run`` on pre-made batches.
* in-process peers (W1, W2), where installed: ``grain0`` (grain, no worker
  process, chunks re-batched by grain), ``torch0`` (DataLoader, map-style
  per-sample dataset, ``num_workers=0``), ``torch0it`` (DataLoader over an
  iterable dataset of the chunks, re-batched in the loop).
* process peers (W1p, W2p, W4p, W6p): ``grain2`` (``mp_prefetch``, 2
  workers, chunks re-batched in the parent), ``grain2b`` (the same with the
  re-batching inside the workers: exact batches per worker), ``torch2``
  (DataLoader, map-style per-sample, ``num_workers=2``), ``torch2it``
  (iterable dataset of the chunks, ``num_workers=2``, re-batched in the
  parent) and ``pool`` (``multiprocessing.Pool(2).imap`` of the fetch
  function, re-batched in the parent: what one writes by hand).  grain and
  torch rows are skipped where the package is not installed, and the
  targets that need them say "not evaluated (peer missing)".
* ``raydata`` (W1, W2, W3), where ``ray[data]`` is installed: Ray Data on a
  local cluster of 2 CPUs started before the clock: ``map_batches`` makes
  blocks of the workload's chunks, ``iter_batches`` re-batches them to the
  exact batch (see ``peers.ray_data``); its PSS column is the whole cluster's.
  ``raysplit`` (S1, S2): the same through ``streaming_split(4)``.
* ``service``, ``pipes`` (S1, S2, S8, attach), ``bare`` (S2): see above.

Exit status: 0 when every evaluated target is met; 1 when any is missed,
including blobfeed losing a sample in any repetition (the missed targets are
listed), or when no target could be evaluated; 2 for a usage error, or when
any measurement failed (crashed, hung, or gave a physically impossible
figure, such as a ratio to an ideal past what the cores can do): its row
says so and the other measurements are still judged.

The modules, by job:

* ``workloads`` -- what each workload's fetcher returns, and the table of
  workloads (their runners, batch, backend, mode);
* ``measure`` -- inside one measurement: the tally the workers report to,
  the meter of the timed window, the PSS of a process tree, the CPU time
  and context switches of groups of processes over a window;
* ``library`` -- blobfeed's runners (threads, processes, Ray actors);
* ``autobench`` -- the auto workloads: their fetchers, runners (fixed
  counts, auto, the doubled cost) and their targets' reading of auto's series;
* ``service`` -- the feeding service's runners (S1, S2, S8, attach) and their
  consumer processes;
* ``peers`` -- one module per baseline or peer (``caffe2``, ``copy_bound``,
  ``model_alone``, ``torch_dataloader``, ``grain_dataset``, ``mp_pool``,
  ``ray_data``), each with its ``RUNNERS`` and the package they need;
* ``runner`` -- the run: the plan, its estimated length, each measurement
  in a child process (``python -m blobfeed.apps.bench --child``), the
  repetitions;
* ``report`` -- the targets, the table and the verdict;
* ``cli`` -- the command line (``blobfeed bench``).
"""
