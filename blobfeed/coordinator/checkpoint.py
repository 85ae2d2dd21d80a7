"""``state_dict`` / ``load_state_dict`` of a deterministic source: the
layout a state records, and the checks a state must pass before it is
loaded (a state is user input: a file on disk)."""

from __future__ import annotations

from typing import Any, Sequence

from ..feeders import READABLE_VERSIONS, InputSource


def ordered_source(name: str, source: InputSource | None) -> InputSource:
    """``source`` (the one named ``name``) if it can save and load a state."""
    if source is None:
        raise ValueError(f"no input source named {name!r}")
    if source.ordered is None or not source.ordered.strict:
        raise ValueError(
            f"source {name!r} is not deterministic: state_dict/load_state_dict need "
            "init_data_input_workers(..., deterministic=True)"
        )
    return source


def layout(source: InputSource, seeds: Sequence[int]) -> dict[str, Any]:
    """What a state records of how ``source`` is wired; ``seeds``: the base
    seed of each ``init_data_input_workers`` call for it, in wiring order."""
    ordered = source.ordered
    assert ordered is not None
    return {
        "num_workers": len(ordered.worker_ids),
        "batch_size": ordered.batch_size,
        "blobs": [list(f.blob_names) for f in source.feeds],
        "axes": list(source.axes),
        # per init_data_input_workers call, in wiring order
        "seed": list(seeds),
    }


def state_dict(source: InputSource, seeds: Sequence[int]) -> dict[str, Any]:
    """The position of ``source`` after the last batch each net's ``run()`` returned."""
    assert source.ordered is not None
    return source.ordered.state(layout(source, seeds), [f.net_name for f in source.feeds])


def check_state(name: str, state: Any, source: InputSource, seeds: Sequence[int]) -> None:
    """Refuse a ``state`` that ``source`` (named ``name``) cannot continue from.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: naming the field that is wrong.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    if state.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"source {name!r}: state has version {state.get('version')!r}; this blobfeed reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    nets = state.get("nets")
    if not isinstance(nets, list) or len(nets) != len(source.feeds):
        raise ValueError(
            f"source {name!r}: the state was saved for {len(nets) if isinstance(nets, list) else '?'} "
            f"nets {nets!r}; this pipeline feeds {len(source.feeds)}: "
            f"{[f.net_name for f in source.feeds]}"
        )
    wired = layout(source, seeds)
    for key, what in (("num_workers", "worker count"), ("batch_size", "batch size"),
                      ("blobs", "blob layout"), ("axes", "blob layout (batch axes)"), ("seed", "seed")):
        if key not in state and key == "seed":
            continue  # version 1 did not record it
        if state.get(key) != wired[key]:
            hint = " (pass seed= with the saved value)" if key == "seed" else ""
            raise ValueError(
                f"source {name!r}: the state was saved with {what} {state.get(key)!r}; "
                f"this pipeline has {wired[key]!r}{hint}"
            )
    epoch = state.get("position", {}).get("epoch", 0)
    if source.epochs is not None and epoch >= source.epochs:
        raise ValueError(
            f"source {name!r}: the state was saved in epoch {epoch}; this pipeline runs "
            f"epochs={source.epochs} (epochs 0 to {source.epochs - 1})"
        )


def load_state(source: InputSource, state: dict[str, Any]) -> None:
    """Set ``source`` to continue from a checked ``state``."""
    ordered = source.ordered
    assert ordered is not None
    starts = ordered.load(state)
    source.resume_at = dict(zip(ordered.worker_ids, starts))
