"""The chooser's result, `tune.json`: the spec (or no speculation) per batch bucket and every
measurement behind it. Written by `jaxspec tune` (`jaxspec.harness.tune.tune`), read here by
`speculative_generate(spec="auto", ...)` from the draft's tuning; this module needs nothing but the configs.

A tuning of one draft names specs ("s5_k1_d6"); a tuning across every draft of a checkpoint
(`jaxspec tune --draft all`, `drafts/tune.json`) names draft and spec ("dspark/s5_k1_d6").
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxspec.core.checks import positive_int
from jaxspec.core.spec import SpecConfig

NO_SPECULATION = "ar"
TUNING_FILE = "tune.json"
DRAFT_SEP = "/"  # "draft/spec": a choice among several drafts


def qualified(draft: str, spec: str) -> str:
    """The method name of `spec` run with draft `draft` ("dspark/s5_k1_d6")."""
    return f"{draft}{DRAFT_SEP}{spec}"


def split_choice(name: str) -> tuple[str | None, SpecConfig | None]:
    """A tuning's method name -> (draft name or None for the tuned draft itself, spec or None for "ar");
    a ValueError for a name that is neither."""
    if name == NO_SPECULATION:
        return None, None
    draft, sep, spec = name.rpartition(DRAFT_SEP)
    if sep and not draft:
        raise ValueError(f"{name!r} names no draft before {DRAFT_SEP!r}")
    return (draft if sep else None), SpecConfig.parse(spec)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The chosen spec per batch bucket and every measurement behind it (`jaxspec.harness.tune.tune`)."""

    choices: dict[int, str]  # batch bucket -> spec name, or "ar" for no speculation
    measurements: tuple[dict[str, Any], ...]  # per (bucket, spec), pooled over datasets: tokens/s, tau, ratio
    max_new_tokens: int
    estimator: str = "end-to-end"  # "end-to-end" (the loops timed here) or "projected" (the cost model's times)
    projected: str | None = None  # the accelerator the times were projected onto, when not measured
    groups: tuple[dict[str, Any], ...] = ()  # per (bucket, dataset, spec): the timing each pooled row sums
    verdicts: tuple[dict[str, Any], ...] = ()  # per (bucket, dataset): the measurement verdict (jaxspec.core.measure)
    # the sampling it was measured at ({"temperature", "top_p", "accept", "seed"}, `harness.eval.Sampled`);
    # None = greedy
    sampling: dict[str, Any] | None = None

    def name_for(self, batch_size: int) -> str:
        """The method chosen for `batch_size` (the nearest calibrated bucket in log scale), as named."""
        positive_int("batch_size", batch_size)
        bucket = min(self.choices, key=lambda b: (abs(math.log2(b) - math.log2(batch_size)), b))
        return self.choices[bucket]

    def choice_for(self, batch_size: int) -> tuple[str | None, SpecConfig | None]:
        """-> (the draft the choice names, None in a one-draft tuning; the spec, None = no speculation)."""
        return split_choice(self.name_for(batch_size))

    def spec_for(self, batch_size: int) -> SpecConfig | None:
        """The spec chosen for `batch_size`; None = no speculation."""
        return self.choice_for(batch_size)[1]

    @property
    def drafts(self) -> tuple[str, ...]:
        """The drafts a tuning across drafts chose among (from its measurements); () for a one-draft tuning."""
        names = (split_choice(m["spec"])[0] for m in self.measurements if "spec" in m)
        return tuple(dict.fromkeys(n for n in names if n is not None))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["choices"] = {str(b): name for b, name in sorted(self.choices.items())}
        out["measurements"] = list(self.measurements)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tuning:
        try:
            choices = {int(b): str(name) for b, name in data["choices"].items()}
            tuning = cls(
                choices=choices,
                measurements=tuple(data["measurements"]),
                max_new_tokens=int(data["max_new_tokens"]),
                estimator=str(data.get("estimator", "end-to-end")),
                projected=data.get("projected"),
                groups=tuple(data.get("groups", ())),
                verdicts=tuple(data.get("verdicts", ())),
                sampling=None if data.get("sampling") is None else dict(data["sampling"]),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a jaxspec tuning file (missing or malformed field: {e})") from e
        if not choices:
            raise ValueError("tuning has no choices")
        for name in choices.values():
            split_choice(name)
        return tuning

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.is_dir():
            path = path / TUNING_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def load_tuning(path: str | Path) -> Tuning:
    """Read a tuning written by `jaxspec tune`: the JSON file, or the checkpoint folder holding it; a
    damaged file is a one-line ValueError naming it."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TUNING_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no tuning at {str(path)!r}; run `jaxspec tune --checkpoint FOLDER` first")
    try:
        return Tuning.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def as_tuning(tuning: Tuning | str | Path) -> Tuning:
    if isinstance(tuning, Tuning):
        return tuning
    if isinstance(tuning, (str, Path)):
        return load_tuning(tuning)
    raise ValueError(f"tuning must be a Tuning or the path of a tuning file / checkpoint folder, got {tuning!r}")


def auto_spec(tuning: Tuning | str | Path, batch_size: int) -> SpecConfig | None:
    """What spec="auto" means, in one place: the spec `jaxspec tune` chose for this batch size
    (None where no speculation is fastest). `tuning` is a `Tuning`, a tuning JSON file, or the
    checkpoint folder holding one."""
    return as_tuning(tuning).spec_for(batch_size)
