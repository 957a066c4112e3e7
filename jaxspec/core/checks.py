"""Checks and helpers on plain ints, one home for each (the floor below `config`).

A bool is not an int here: `True` as a batch size is a mistake, not 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def positive_int(name: str, value: Any) -> int:
    """`value` as an int; a one-line ValueError naming `name` unless it is an int >= 1."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def is_power_of_two(value: Any) -> bool:
    return is_int(value) and value >= 1 and not int(value) & (int(value) - 1)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()
