"""The drafting interface a cycle calls, and the draft a checkpoint carries.

A `Drafter` is static (hashable, part of the compiled program): what kind of draft model runs and its
fixed settings. Its parameters and its state are pytrees the cycle passes in. The contract:

- `init_state(cfg, batch, max_len)`: an empty draft state (its own, never the target's);
- `follow(models, cfg, state, rows)`: the state after the target committed `rows` (`Exposed`: the
  prompt's chunks during prefill, the accepted path of every cycle); only committed rows ever reach it;
- `draft(models, cfg, spec, state, root, expander)`: the cycle's tree of D nodes (`tree.Tree`: tokens,
  parents, depths, ranks, node values, draft probabilities when sampled), from the committed draft state
  and the root (the bonus token of the last cycle, not yet committed);
- `capture`: the target layers whose hyper-connection means `forward` must expose (`Exposed.captured`);
- `check(cfg, spec)`: one-line ValueErrors for a spec this draft cannot grow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import jax
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.model.network import Models
from jaxspec.speculation.auto import Tuning
from jaxspec.speculation.tree import Expander, Tree
from jaxspec.speculation.values import Calibration


@struct.dataclass
class Exposed:
    """What the target exposes of rows it just committed (docs/tree_verification.md §1): the drafter follows them."""

    tokens: jax.Array  # [B, T] int32 committed tokens
    positions: jax.Array  # [B, T] int32 their absolute positions
    take: jax.Array  # [B, T] bool: committed (a prefix of each row)
    hidden: jax.Array  # [B, T, hc, d] the target's final streams at those rows
    captured: jax.Array | None = None  # [B, T, n*d] means of the drafter's `capture` layers


class Drafter(Protocol):
    name: str
    capture: tuple[int, ...]

    def check(self, cfg: ModelConfig, spec: SpecConfig) -> None: ...

    def init_state(self, cfg: ModelConfig, batch: int, max_len: int) -> Any: ...

    def follow(self, models: Models, cfg: ModelConfig, state: Any, rows: Exposed) -> Any: ...

    def draft(self, models: Models, cfg: ModelConfig, spec: SpecConfig, state: Any, root: jax.Array,
              expander: Expander) -> Tree: ...


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A sidecar file of a draft (calibration.json, tune.json) that could not be read: loading goes on,
    and using it raises this one-line error."""

    path: str
    error: str

    def fail(self) -> None:
        raise ValueError(f"{self.path}: {self.error}")


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    """A checkpoint's draft, everything that belongs to it: the drafter, its parameters, the node values
    calibrated for it (`jaxspec calibrate`) and the spec per batch size tuned for it (`jaxspec tune`).
    `load_checkpoint(path, draft=NAME)` builds one; `speculative_generate(..., draft=...)` runs it."""

    name: str  # "default" (the checkpoint's own), or a drafts/<name>/ folder
    drafter: Drafter
    params: Any
    calibration: Calibration | Unreadable | None = None  # of the draft probability (calibration.json)
    tuning: Tuning | Unreadable | None = None
    # of the other value sources, by source ("confidence", "both"; calibration_<source>.json)
    value_calibrations: Mapping[str, Calibration | Unreadable] = dataclasses.field(default_factory=dict)

    def calibration_for(self, values: str) -> Calibration | Unreadable | None:
        """The calibration a spec ranking by value source `values` (`SpecConfig.values`) uses by default."""
        return self.calibration if values == "draft" else self.value_calibrations.get(values)

    def __repr__(self) -> str:
        return (f"Draft({self.name!r}, {type(self.drafter).__name__}, calibrated={self.calibration is not None}, "
                f"tuned={self.tuning is not None})")


@dataclasses.dataclass(frozen=True, eq=False)
class DraftSet:
    """Every draft of a checkpoint and the tuning that chose among them: `load_checkpoint(path, draft="all")`
    builds one (the tuning is `drafts/tune.json`, written by `jaxspec tune --draft all`). Passed as
    `speculative_generate(..., draft=...)`, spec="auto" runs the draft and spec chosen for the batch size;
    a spec names its draft ("dspark/s5_k1_d6"), or take one draft out by name (`drafts["dspark"]`)."""

    drafts: tuple[Draft, ...]
    tuning: Tuning | Unreadable | None = None

    def __post_init__(self):
        if not self.drafts or not all(isinstance(d, Draft) for d in self.drafts):
            raise ValueError("a DraftSet holds one or more Drafts")
        if len({d.name for d in self.drafts}) != len(self.drafts):
            raise ValueError(f"draft names repeat: {[d.name for d in self.drafts]}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.drafts)

    def __getitem__(self, name: str) -> Draft:
        for d in self.drafts:
            if d.name == name:
                return d
        raise ValueError(f"no draft {name!r} here; drafts: {', '.join(self.names)}")

    def __repr__(self) -> str:
        return f"DraftSet({', '.join(self.names)}, tuned={self.tuning is not None})"
