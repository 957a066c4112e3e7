"""The chooser's result, `tune.json`: the spec (or no speculation) per batch bucket and every
measurement behind it. Written by `jaxspec tune` (`jaxspec.harness.tune.tune`), read here by
`speculative_generate(spec="auto", ...)` from the draft's tuning; this module needs nothing but the configs.
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

    def spec_for(self, batch_size: int) -> SpecConfig | None:
        """The choice for `batch_size` (the nearest calibrated bucket in log scale); None = no speculation."""
        positive_int("batch_size", batch_size)
        bucket = min(self.choices, key=lambda b: (abs(math.log2(b) - math.log2(batch_size)), b))
        name = self.choices[bucket]
        return None if name == NO_SPECULATION else SpecConfig.parse(name)

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
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a jaxspec tuning file (missing or malformed field: {e})") from e
        if not choices:
            raise ValueError("tuning has no choices")
        for name in choices.values():
            if name != NO_SPECULATION:
                SpecConfig.parse(name)
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
