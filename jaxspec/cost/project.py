"""Projection rows from the stage table and the calibrated latency terms: per batch size the AR
step, the best chain and the best tree at their measured tau (from a `jaxspec sweep`), their
projected speedup over AR and the break-even tau (cycle / AR step)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.cost import latency
from jaxspec.cost.terms import Costs, Setup, stage_table


@dataclasses.dataclass(frozen=True)
class Row:
    spec: str  # "ar" for the autoregressive step
    batch: int
    stages: dict[str, Costs]
    seconds: dict[str, float]  # per stage
    step_seconds: float  # AR: one step; spec: one cycle


def row(s: Setup, spec: SpecConfig | None, hw: latency.Hardware, lat: latency.Latency,
        draft: DSparkConfig | None = None) -> Row:
    """One AR step (spec None) or one cycle of `spec` with the model's MTP draft, or a DSpark `draft`."""
    table = stage_table(s, spec, draft)
    secs = {name: latency.seconds(c, hw, lat) for name, c in table.items()}
    return Row("ar" if spec is None else spec.name, s.batch, table, secs, sum(secs.values()))


def nearest_tau(taus: Mapping[tuple[str, int], float], spec: str, batch: int) -> float | None:
    """tau of `spec` measured at the batch size nearest `batch` (None if never measured)."""
    known = [b for (name, b) in taus if name == spec]
    if not known:
        return None
    return taus[(spec, min(known, key=lambda b: (abs(b - batch), b)))]


def best(rows: Sequence[Row], ar: Row, taus: Mapping[tuple[str, int], float] | None, tau: float | None,
         chain: bool) -> dict[str, Any] | None:
    """The chain (topk 1) or tree spec of `rows` with the highest projected speedup over `ar`."""
    picks = []
    for r in rows:
        if r.spec == "ar" or (SpecConfig.parse(r.spec).topk == 1) != chain:
            continue
        t = tau if tau is not None else nearest_tau(taus or {}, r.spec, r.batch)
        if t is None:
            continue
        picks.append({"spec": r.spec, "tau": t, "cycle_ms": 1e3 * r.step_seconds,
                      "speedup": t * ar.step_seconds / r.step_seconds,
                      "break_even_tau": r.step_seconds / ar.step_seconds})
    return max(picks, key=lambda p: p["speedup"]) if picks else None


@functools.lru_cache(maxsize=64)
def projected_seconds(cfg: ModelConfig, spec: SpecConfig | None, batch: int, context: int, accelerator: str,
                      mesh: tuple[int, int, int] = (1, 1, 1)) -> float:
    """Projected seconds of one AR step (spec None) or one cycle on `mesh` of `accelerator`, with the
    shipped latency terms (`latency.H200`) and the calibration's `even` layout."""
    hw = latency.hardware(accelerator)
    return row(Setup(cfg, mesh, batch, context, layout="even"), spec, hw, latency.H200).step_seconds
