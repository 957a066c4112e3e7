"""One-line errors for damaged checkpoints (used by `jaxspec.checkpoint`).

A truncated orbax array file makes TensorStore raise a many-line exception; worse, orbax runs the
restore's reads on an event loop it closes as soon as one read fails, so the reads still in flight
are finalized later, some at interpreter exit, each printing an "Exception ignored in: <coroutine
_read_array_index_and_device_put ...>" traceback ("Event loop is closed", "sys.meta_path is None").
`quiet_orphaned_reads`, installed before the restore, drops exactly those; everything else is unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

_MAX_DETAIL = 300  # characters of the underlying error kept in the one-line message


def one_line(error: BaseException) -> str:
    """The innermost cause's first line (TensorStore's own words), without the spec dump."""
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."


def read_json(filename: str) -> Any:
    """json.load, with a one-line ValueError naming the file when it is unreadable or malformed."""
    try:
        with open(filename) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{filename} is damaged or not JSON: {one_line(e)}") from None


def check_orbax_metadata(params_dir: str) -> None:
    """The JSON files orbax reads before any array, each parsed here so a damaged one is named."""
    names = ["_CHECKPOINT_METADATA", "_METADATA", "_sharding"]
    arrays = os.path.join(params_dir, "array_metadatas")
    if os.path.isdir(arrays):
        names += [os.path.join("array_metadatas", f) for f in sorted(os.listdir(arrays))]
    for name in names:
        if os.path.isfile(os.path.join(params_dir, name)):
            read_json(os.path.join(params_dir, name))


def damaged(params_dir: str, error: BaseException) -> ValueError:
    """A failed orbax restore -> one line naming the checkpoint's data file where TensorStore says
    which (a byte range beyond "value of size N": the file of that size), else its folder."""
    detail = one_line(error)
    where = params_dir
    size = re.search(r"not valid for value of size (\d+)", detail)
    if size:
        found = [os.path.join(root, f) for root, _, files in os.walk(params_dir) for f in files
                 if os.path.getsize(os.path.join(root, f)) == int(size.group(1))]
        if len(found) == 1:
            where = found[0]
    return ValueError(f"checkpoint data {where} is damaged or truncated: {detail}")


def mismatch(expected: Mapping[str, tuple[int, ...]], stored: Mapping[str, tuple[int, ...]]) -> str | None:
    """How the arrays config.json implies differ from those stored (dotted names -> shapes), or None."""
    problems = [f"{n} is stored but config.json has no such array" for n in sorted(set(stored) - set(expected))]
    problems += [f"{n} is missing from the stored arrays" for n in sorted(set(expected) - set(stored))]
    problems += [f"{n} is stored with shape {stored[n]}, config.json implies {expected[n]}"
                 for n in sorted(set(expected) & set(stored)) if tuple(stored[n]) != tuple(expected[n])]
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


def dotted(path: tuple[Any, ...]) -> str:
    """A pytree path as orbax names the array: layers.0.attn.wq_a."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


@contextlib.contextmanager
def quiet_absl_warnings() -> Iterator[None]:
    """orbax logs (absl) a warning where it cannot read a damaged checkpoint's metadata; the error
    that follows says it in one line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _from_orbax(unraisable: Any) -> bool:
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    return _closed_loop(unraisable.exc_value)


def _closed_loop(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)


# What an orphaned read leaves behind once orbax closed its loop: the reads' own exceptions (never
# retrieved: the restore already failed on the first one) and their completion callbacks hitting
# the closed loop.
_ORPHAN_LOGS = ("Task was destroyed but it is pending", "exception was never retrieved")
_ORPHAN_SOURCES = ["orbax", "TensorStore", "Encountered error while reading array"]  # + each folder restored


class _OrphanedTaskFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message += f" {record.exc_info[1]!r}"
        return not (any(m in message for m in _ORPHAN_LOGS) and any(s in message for s in _ORPHAN_SOURCES))


_INSTALLED: list[Any] = []


def quiet_orphaned_reads(params_dir: str) -> None:
    """Before an orbax restore: drop the noise its orphaned reads make should one read fail (the
    restore stops at the first failure, closes its event loop, and the reads still in flight end
    later, on TensorStore's threads, at any time up to interpreter exit). Installed once per
    process, before the first read, so no timing can slip past it; other unraisable errors, thread
    errors and log records still reach the old hooks. After a failure, call `settle_orphaned_reads`.

    A read's own error names the file it read (TensorStore: 'local file "<params_dir>/"'), so the
    asyncio records dropped are those that name `params_dir` or orbax / TensorStore."""
    folder = os.path.join(os.path.abspath(params_dir), "")
    if folder not in _ORPHAN_SOURCES:
        _ORPHAN_SOURCES.append(folder)
    if _INSTALLED:
        return
    previous_unraisable, previous_excepthook = sys.unraisablehook, sys.excepthook

    def unraisable_hook(unraisable):
        if not _from_orbax(unraisable):
            previous_unraisable(unraisable)

    def excepthook(kind, value, tb):
        # TensorStore's callback threads print a failed call_soon_threadsafe through sys.excepthook.
        if not _closed_loop(value):
            previous_excepthook(kind, value, tb)

    sys.unraisablehook, sys.excepthook = unraisable_hook, excepthook
    logging.getLogger("asyncio").addFilter(_OrphanedTaskFilter())
    _INSTALLED.append((unraisable_hook, excepthook))


def settle_orphaned_reads() -> None:
    """After a failed restore: finalize the orphaned reads' frames now rather than at exit."""
    gc.collect()
