"""``state_dict`` / ``load_state_dict`` of a deterministic source: the
layout a state records, and the checks a state must pass before it is
loaded (a state is user input: a file on disk)."""

from __future__ import annotations

import logging
import reprlib
from typing import Any, NoReturn, Sequence

from ..feeders import READABLE_VERSIONS, InputSource
from ..feeders.dealing import INDEXED_STATE_VERSION


def resumable_source(name: str, source: InputSource | None) -> InputSource:
    """``source`` (the one named ``name``) if it can save and load a state."""
    if source is None:
        raise ValueError(f"no input source named {name!r}")
    if not source.dealer.resumable:
        raise ValueError(
            f"source {name!r} is not deterministic: state_dict/load_state_dict need "
            "init_data_input_workers(..., deterministic=True)"
        )
    return source


def layout(source: InputSource, seeds: Sequence[int]) -> dict[str, Any]:
    """What a state records of how ``source`` is wired: everything that
    changes its stream; ``seeds``: the base seed of each
    ``init_data_input_workers`` call for it, in wiring order."""
    dealer = source.dealer
    return {
        "num_workers": len(dealer.worker_ids),
        "batch_size": dealer.batch_size,
        "blobs": [list(f.blob_names) for f in source.feeds],
        "axes": list(source.axes),
        # per init_data_input_workers call, in wiring order
        "seed": list(seeds),
        "shuffle_buffer": source.dealing.shuffle_buffer,
        # per net, in wiring order
        "drop_last": [bool(f.drop_last) for f in source.feeds],
        # equal shares drop rounds: another stream
        "equal": source.dealing.equal,
    }


def state_dict(source: InputSource, seeds: Sequence[int]) -> dict[str, Any]:
    """The position of ``source`` after the last batch each net's ``run()`` returned."""
    if is_random_access(source):
        return source.dealer.state(random_access_layout(source), [f.net_name for f in source.feeds])
    return source.dealer.state(layout(source, seeds), [f.net_name for f in source.feeds])


# -- random-access sources ---------------------------------------------------------------
def is_random_access(source: InputSource) -> bool:
    return source.dealing.random_access


def random_access_layout(source: InputSource) -> dict[str, Any]:
    """What a random-access source's state records of its wiring: what its
    stream is a function of (checked on load), and the rest for the record
    (workers, nets, read size: a resume may change them)."""
    assert source.random_access is not None
    n, seed, shuffle, read_size = source.random_access
    sharded = source.sharded
    # a sharded source: kind "sharded", its shard count, sizes and shuffle_block
    extra: dict[str, Any] = {"kind": "random_access"} if sharded is None else {
        "kind": "sharded", "shards": sharded[0], "shard_sizes": sharded[1], "shuffle_block": sharded[2],
    }
    return {
        **extra,
        "length": n,
        "batch_size": source.dealer.batch_size,
        "seed": seed,
        "shuffle": shuffle,
        "equal": source.dealing.equal,
        "axes": list(source.axes),
        # for the record only
        "num_workers": len(source.dealer.worker_ids),
        "read_size": source.dealer.units.read_size if read_size is None else read_size,  # type: ignore[attr-defined]
        "drop_last": [bool(f.drop_last) for f in source.feeds],
    }


logger = logging.getLogger("blobfeed.coordinator")


#: how much of a value a refused state said its message quotes
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxtuple = 3, 6, 6, 6
_QUOTE.maxstring, _QUOTE.maxlong, _QUOTE.maxother = 60, 40, 60
#: lists nested deeper than this are no layout a state records (compared no further)
_MAX_DEPTH = 16


def _shown(value: Any) -> str:
    """``value`` (from an untrusted state) for a message: cut short, however
    long or deeply nested it is."""
    try:
        return _QUOTE.repr(value)
    except Exception:  # (a RecursionError in a user object's __repr__)
        return f"<a {type(value).__name__}>"


def _source_name(check: Any, name: str, state: dict[str, Any]) -> None:
    """The state's ``source``, when it has one: a str; another name than the
    source's is only logged (a renamed source resumes; its layout fields
    are what say whether it is the same stream)."""
    if "source" not in state:
        return
    saved = state["source"]
    if not isinstance(saved, str):
        check.fail(["source"], f"expected the source's name (a str), got {_shown(saved)}")
    if saved != name:
        logger.warning("source %r: loading a state saved by source %r", name, saved)


#: the fields of a random-access source's state that its stream depends on
_RA_LAYOUT = ("length", "batch_size", "seed", "shuffle", "equal", "axes")
#: and those of a sharded source (checked first: another shard count says more than another length)
_SHARDED_LAYOUT = ("shards", "shard_sizes", "shuffle_block")
#: at most this many ranges of samples left out (a state is a file: bounded)
MAX_SKIP_ENTRIES = 1 << 20
#: a net's told epoch (the epoch ends run() reported to it) is at most this
#: far from the position's epoch (a net is behind the position by at most
#: about one epoch per net: each is a piece it is handed on load, so an
#: untrusted state may not ask for more)
MAX_UNTOLD_EPOCHS = 1 << 16
#: a net is at most this many of its own batches ahead of the slowest net's
#: next batch (a faster net is ahead by what the slower nets' queues hold:
#: a few batches each; a state that says more is damaged, and would have the
#: net drop that many batches read again, or its state_dict walk them)
MAX_LEAD = 1 << 16
#: global positions of a random-access source stay below this (2**62: a
#: read unit's record says them as signed 64-bit ints, with room to spare)
MAX_POSITION = 1 << 62


def _net_entry(check: Any, j: int, entry: Any, k: int, sizes: tuple[int, ...]) -> int:
    """Net ``j``'s entry of ``k``: [name, next batch(, epoch)] of one of
    ``sizes``; its next batch, one of net ``j``'s (dealt in turn)."""
    if not isinstance(entry, list) or len(entry) not in sizes:
        check.fail(["nets", j], f"expected [net name, next batch, epoch], got {_shown(entry)}")
    if not isinstance(entry[0], str):
        check.fail(["nets", j, 0], f"expected the net's name (a str), got {_shown(entry[0])}")
    nxt: int = check.integer(entry[1], ["nets", j, 1], j)
    if (nxt - j) % k:
        check.fail(["nets", j, 1], f"expected a batch of net {j} (one of {j}, {j + k}, {j + 2 * k}, ...: "
                   f"batches are dealt to the {k} nets in turn), got {nxt}")
    return nxt


def _leads(check: Any, next_batches: Sequence[int], batches: int) -> list[int]:
    """How many of its own batches each net is past the position's next
    batch ``batches`` (the nets are dealt in turn); a lead over
    :data:`MAX_LEAD` is refused naming the net's entry."""
    k = len(next_batches)
    leads = []
    for j, nxt in enumerate(next_batches):
        first = batches + ((j - batches) % k)  # net j's first batch at or past the position
        lead = max(0, (nxt - first + k - 1) // k)
        if lead > MAX_LEAD:
            check.fail(["nets", j, 1], f"expected at most {MAX_LEAD} of net {j}'s batches ahead of the "
                       f"slowest net (its next batch is {min(next_batches)}), got {nxt}: {lead} ahead")
        leads.append(lead)
    return leads


def _told_near(check: Any, j: int, told: int, epoch: int) -> None:
    """Net ``j`` was told of the end of epochs up to ``told``: at most
    MAX_UNTOLD_EPOCHS before the position's ``epoch`` (each epoch end between
    them is a piece the net is handed on load; one told of ends past the
    position costs nothing)."""
    if told + MAX_UNTOLD_EPOCHS < epoch:
        check.fail(["nets", j, 2], f"expected an epoch within {MAX_UNTOLD_EPOCHS} before the position's "
                   f"epoch {epoch} (the epoch ends this net was told of), got {told}")


def check_random_access_state(name: str, state: dict[str, Any], source: InputSource) -> None:
    """:func:`check_state` for a random-access source: the stream's fields
    must match (``ValueError`` naming the field, saved vs now); the worker
    count, backend and number of nets may differ."""
    check = _Checker(name)
    version = check.get(state, ["version"])
    if version != INDEXED_STATE_VERSION or type(version) is not int:
        if type(version) is int and version not in READABLE_VERSIONS:
            cause = "an unknown version: from a newer blobfeed, or damaged"
        else:
            cause = "a state of a fetch_fun source cannot resume a random-access one"
        raise ValueError(
            f"source {name!r}: state has version {_shown(version)}; a random-access source reads version "
            f"{INDEXED_STATE_VERSION} ({cause})"
        )
    _source_name(check, name, state)
    wired = random_access_layout(source)
    kind = wired["kind"]
    if state.get("kind") != kind:
        check.fail(["kind"], f"expected {kind!r} (this pipeline reads a "
                   f"{'sharded' if kind == 'sharded' else 'random-access'} source), got {_shown(state.get('kind'))}")
    for key in (_SHARDED_LAYOUT if kind == "sharded" else ()) + _RA_LAYOUT:
        saved = check.get(state, [key])
        if not _same(saved, wired[key]):
            hint = " (pass the saved seed to RandomAccessSource(seed=...) or seed=)" if key == "seed" else ""
            if key == "shard_sizes":
                hint = " (the same number of shards and samples, other sizes)"
            check.fail([key], f"saved {_shown(saved)}, this pipeline has {wired[key]!r}: another stream{hint}")
    n = wired["length"]
    epochs = source.epochs
    position = check.get(state, ["position"])
    if not isinstance(position, dict):
        check.fail(["position"], f"expected a dict, got {_shown(position)}")
    batches = check.integer(check.get(position, ["position", "batches"]), ["position", "batches"], 0)
    # a global position (epoch * length + offset) travels to a worker
    # process as a signed 64-bit int: an endless source's epochs are bounded
    epoch = check.integer(check.get(position, ["position", "epoch"]), ["position", "epoch"], 0,
                          None if epochs is None else epochs)
    if (epoch + 1) * n >= MAX_POSITION:
        check.fail(["position", "epoch"], f"epoch {epoch} of {n} samples ends past sample 2**62, "
                   "further than blobfeed counts")
    check.integer(check.get(position, ["position", "offset"]), ["position", "offset"], 0, n + 1)
    counts = {}
    for key in ("skip", "returned"):
        entries = check.get(state, [key])
        if not isinstance(entries, list) or len(entries) > MAX_SKIP_ENTRIES:
            check.fail([key], f"expected a list of at most {MAX_SKIP_ENTRIES} [epoch, offset, count], "
                       f"got {type(entries).__name__}{f' of {len(entries)}' if isinstance(entries, list) else ''}")
        counts[key] = 0
        for i, entry in enumerate(entries):
            if not isinstance(entry, list) or len(entry) != 3:
                check.fail([key, i], f"expected [epoch, offset, count], got {_shown(entry)}")
            e = check.integer(entry[0], [key, i, 0], epoch, None if epochs is None else epochs)
            if (e + 1) * n >= MAX_POSITION:
                check.fail([key, i, 0], f"epoch {e} of {n} samples ends past sample 2**62, "
                           "further than blobfeed counts")
            off = check.integer(entry[1], [key, i, 1], 0, n)
            counts[key] += check.integer(entry[2], [key, i, 2], 1, n - off + 1)
    # a resume with another number of nets leaves both out of its stream, and
    # its own state says them all as "skip": together under the bound, so that
    # blobfeed reads back what it writes
    if len(state["skip"]) + len(state["returned"]) > MAX_SKIP_ENTRIES:
        raise ValueError(f"source {name!r}: state['skip'] and state['returned']: at most {MAX_SKIP_ENTRIES} "
                         f"entries together, got {len(state['skip']) + len(state['returned'])}")
    nets = check.get(state, ["nets"])
    if not isinstance(nets, list) or not nets or len(nets) > 1 << 16:
        check.fail(["nets"], f"expected a list of [net name, next batch, epoch], got {_shown(nets)}")
    k = len(nets)
    next_batches = []
    for j, entry in enumerate(nets):
        nxt = _net_entry(check, j, entry, k, (3,))
        told = check.integer(entry[2], ["nets", j, 2], 0, None if epochs is None else epochs)
        _told_near(check, j, told, epoch)
        next_batches.append(nxt)
    low = min(next_batches)
    if not low - k < batches <= low:
        check.fail(["position", "batches"], f"expected {low} (the next batch of the slowest net, "
                   f"in {next_batches}), got {batches}")
    # every batch a faster net returned past the position is in "returned",
    # and holds a sample at least: a net said further ahead would drop
    # batches nobody read (the same nets), or be dealt them again (others)
    ahead = sum(_leads(check, next_batches, batches))
    if ahead > counts["returned"]:
        check.fail(["returned"], f"the nets are {ahead} batches ahead of the position in all (their next "
                   f"batches {next_batches}, the position's {batches}), but it holds {counts['returned']} "
                   "samples: each batch a net returned past the position is there")


#: what a state must hold (``seed``, ``shuffle_buffer``, ``drop_last``, ``equal`` came later: see _LAYOUT)
_REQUIRED = ("version", "num_workers", "batch_size", "blobs", "axes", "position", "nets")
#: layout key -> what a message calls it
_LAYOUT: tuple[tuple[str, str], ...] = (
    ("num_workers", "worker count"),
    ("batch_size", "batch size"),
    ("blobs", "blob layout"),
    ("axes", "blob layout (batch axes)"),
    ("seed", "seed"),
    ("shuffle_buffer", "shuffle_buffer"),
    ("drop_last", "drop_last (per net)"),
    ("equal", "equal"),
)
_POSITION = ("batches", "rr", "offset", "calls", "states")


def _path(keys: Sequence[str | int]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in keys)


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Equal, and of the same types throughout: ``True == 1`` and
    ``2.0 == 2`` in Python, but a state that says ``True`` workers is damaged.
    Lists nested past :data:`_MAX_DEPTH` are no layout's: not the same."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if depth >= _MAX_DEPTH:
            return False
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class _Checker:
    """The checks of one state; each failure names its field."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, keys: Sequence[str | int], message: str) -> NoReturn:
        raise ValueError(f"source {self.name!r}: {_path(keys)}: {message}")

    def get(self, where: dict[str, Any], keys: Sequence[str | int]) -> Any:
        if keys[-1] not in where:
            self.fail(keys, "missing (the state is damaged, or not from state_dict())")
        return where[keys[-1]]

    def integer(self, value: Any, keys: Sequence[str | int], lo: int, hi: int | None = None) -> int:
        """An int (never a bool or a float) in [lo, hi)."""
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or value < lo or (hi is not None and value >= hi):
            span = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
            self.fail(keys, f"expected an int {span}, got {_shown(value)}")
        return int(value)

    def sequence(self, value: Any, keys: Sequence[str | int], length: int, what: str) -> list[Any]:
        if not isinstance(value, list) or len(value) != length:
            got = f"a list of {len(value)}" if isinstance(value, list) else _shown(value)
            self.fail(keys, f"expected a list of {length} ({what}), got {got}")
        return list(value)


def check_state(name: str, state: Any, source: InputSource, seeds: Sequence[int]) -> None:
    """Refuse a ``state`` that ``source`` (named ``name``) cannot continue
    from, before anything is loaded: every field, its type (an int is never
    a bool), its range, the lengths of its lists, and that its parts agree.

    What cannot be known before the run (an ``offset`` past the end of the
    regenerated head chunk) is the stream's to refuse.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: naming the field that is wrong or missing.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    if is_random_access(source):
        check_random_access_state(name, state, source)
        return
    if state.get("kind") in ("random_access", "sharded"):
        raise ValueError(
            f"source {name!r}: the state is a {str(state.get('kind')).replace('_', '-')} source's (version {_shown(state.get('version'))}); "
            "this source is read through a fetch_fun"
        )
    check = _Checker(name)
    for key in _REQUIRED:
        check.get(state, [key])
    version = state["version"]
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ValueError(
            f"source {name!r}: state has version {_shown(version)}; this blobfeed reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    _source_name(check, name, state)
    feeds = source.feeds
    k = len(feeds)
    nets = state["nets"]
    if not isinstance(nets, list) or len(nets) != k:
        raise ValueError(
            f"source {name!r}: the state was saved for {len(nets) if isinstance(nets, list) else '?'} "
            f"nets {_shown(nets)}; this pipeline feeds {k}: {[f.net_name for f in feeds]}"
        )
    wired = layout(source, seeds)
    for key, what in _LAYOUT:
        if key not in state:
            # saved before the key was recorded: seed could be anything;
            # shuffle_buffer, drop_last and equal had their defaults
            implied = {"shuffle_buffer": 0, "drop_last": [False] * k, "equal": False}.get(key)
            if implied is None or _same(implied, wired[key]):
                continue
            raise ValueError(
                f"source {name!r}: the state predates {key} being saved (such a state implies "
                f"{key}={implied!r}); this pipeline has {key}={wired[key]!r}: its stream differs"
            )
        if not _same(state[key], wired[key]):
            hint = " (pass seed= with the saved value)" if key == "seed" else ""
            raise ValueError(
                f"source {name!r}: the state was saved with {what} {_shown(state[key])}; "
                f"this pipeline has {wired[key]!r}{hint}"
            )
    epochs = source.epochs
    n = wired["num_workers"]
    position = state["position"]
    if not isinstance(position, dict):
        check.fail(["position"], f"expected a dict, got {_shown(position)}")
    for key in _POSITION + (("epoch",) if version >= 2 else ()):
        check.get(position, ["position", key])
    batches = check.integer(position["batches"], ["position", "batches"], 0)
    epoch = check.integer(position.get("epoch", 0), ["position", "epoch"], 0)
    if epochs is not None and epoch >= epochs:
        check.fail(["position", "epoch"], f"the state was saved in epoch {epoch}; this pipeline runs "
                   f"epochs={epochs} (epochs 0 to {epochs - 1})")
    rr = check.integer(position["rr"], ["position", "rr"], 0, n)
    offset = check.integer(position["offset"], ["position", "offset"], 0)
    calls = check.sequence(position["calls"], ["position", "calls"], n, "calls per worker")
    for i, c in enumerate(calls):
        check.integer(c, ["position", "calls", i], 0)
    states = check.sequence(position["states"], ["position", "states"], n, "a fetcher state per worker")
    # per net: [name, next batch, epochs it was told ended] (version 1: no epochs)
    next_batches = []
    for j, entry in enumerate(nets):
        nxt = _net_entry(check, j, entry, k, (2, 3) if version == 1 else (3,))
        if len(entry) == 3:
            # The ends it was told of (the last epoch's is EndOfInput, not
            # told).  One net: one per epoch the position passed.  Several:
            # a net may be epochs ahead of the position (the slowest net's),
            # and a shuffled source's position stays at its start.
            if k == 1 and not source.dealing.shuffle_buffer:
                told = check.integer(entry[2], ["nets", j, 2], 0, epoch + 1)
            else:
                told = check.integer(entry[2], ["nets", j, 2], 0, epochs)
                if nxt == batches and told > epoch:
                    # its next batch is the position's: it passed no epoch
                    # end the position has not (it would never be told of those)
                    check.fail(["nets", j, 2], f"expected at most {epoch} (net {j}'s next batch is the "
                               f"position's, in epoch {epoch}: it cannot have been told of a later epoch's "
                               f"end), got {told}")
            # several nets (or a shuffled source's, whose position stays at
            # its start) may be told of many more ends than the position passed
            _told_near(check, j, told, epoch)
        next_batches.append(nxt)
    low = min(next_batches)
    _leads(check, next_batches, low)
    if source.dealing.shuffle_buffer:
        # a shuffled source resumes from its start, dropping what each net had
        start = {"batches": 0, "epoch": 0, "rr": 0, "offset": 0}
        for key, want in start.items():
            if {"batches": batches, "epoch": epoch, "rr": rr, "offset": offset}[key] != want:
                check.fail(["position", key], f"expected {want} (a shuffled source's state is at its start)")
        if any(calls) or any(s is not None for s in states):
            check.fail(["position", "calls"], "expected every worker at its start (a shuffled source's state is)")
    elif not low - k < batches <= low:
        # the position is the one after the slowest net's last batch (or the
        # end of the stream, when every net is past it): further on, that
        # net would never get the batches in between; further back, the
        # stream would be dealt to the wrong nets
        check.fail(["position", "batches"], f"expected {low} (the next batch of the slowest net, "
                   f"in {[e[1] for e in nets]}), got {batches}")


def load_state(source: InputSource, state: dict[str, Any]) -> None:
    """Set ``source`` to continue from a checked ``state``."""
    dealer = source.dealer
    starts = dealer.load(state)
    source.resume_at = dict(zip(dealer.worker_ids, starts))
