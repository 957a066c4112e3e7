"""A host channel for streaming tokens out of a jitted loop while it runs.

Traced code sends arrays with `send(channel, ...)` (an ordered `io_callback`); they reach the Python
function the caller opened the channel with, for the duration of one call. The channel is addressed
by an id passed into the program as a traced int32, so one compiled program serves every caller and
every function; a send to a channel that is not open is dropped.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

_OPEN: dict[int, Callable[..., Any]] = {}  # the channels open now: id -> the function they deliver to
_IDS = itertools.count(1)


@contextlib.contextmanager
def channel(fn: Callable[..., Any]) -> Iterator[np.int32]:
    """Open a channel delivering to `fn` until the block ends; -> its id (pass it into the program)."""
    if not callable(fn):
        raise ValueError(f"stream must be a callable taking (tokens, counts), got {fn!r}")
    cid = next(_IDS)
    _OPEN[cid] = fn
    try:
        yield np.int32(cid)
    finally:
        _OPEN.pop(cid, None)


def send(channel_id: jax.Array, *arrays: jax.Array) -> None:
    """From traced code: deliver `arrays` (as numpy) to the channel's function, in program order."""
    io_callback(_deliver, None, channel_id, *arrays, ordered=True)


def _deliver(channel_id: Any, *arrays: Any) -> None:
    fn = _OPEN.get(int(channel_id))
    if fn is not None:
        fn(*(np.asarray(a) for a in arrays))
