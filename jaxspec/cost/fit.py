"""Fit the latency terms to published decode points (calibration_points.json beside this file).

A "fit" point is one speculative cycle at batch 1: its published ms per output token times the
accept length is the cycle time. The model's cycle is linear in (launch_us, collective_us); the
fit minimizes the squared relative residuals plus a weak prior toward `latency.PRIOR` (weight
`PRIOR_WEIGHT`), because points that differ mostly in their layer count cannot tell a kernel's
launch from a collective's latency. "shape" points check the slope of step time vs draft tokens;
"check" points print a residual; "unexpressed" points say why they cannot be costed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from typing import Any

import numpy as np

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.cost import latency
from jaxspec.cost.terms import Costs, Setup, stage_table

PRIOR_WEIGHT = 0.05
ROLES = ("fit", "shape", "check", "unexpressed")
_REQUIRED = {"fit": ("preset", "accelerator", "mesh", "weights", "experts", "batch", "context", "spec",
                     "ms_per_token", "accept_length"),
             "shape": ("preset", "accelerator", "mesh", "weights", "experts", "batch", "context", "drafts", "step_ms"),
             "check": ("preset", "accelerator", "mesh", "weights", "experts", "batch", "context", "ms_per_token"),
             "unexpressed": ("why",)}


def r1_like() -> ModelConfig:
    """V4 layers at DeepSeek-R1's sizes (61 layers, d 7168, 128 heads, 256 experts top-8 of width
    2048): V4-Pro with R1's expert shape. An approximation: R1's attention is MLA over the full
    context, and its first 3 layers are dense FFNs, here V4's hash-routed ones."""
    return ModelConfig.preset("v4-pro", n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048)


def r1_structure() -> ModelConfig:
    """`r1_like` with R1's layer structure as far as V4's layer kinds reach: every layer attends over
    the whole context without compressor or indexer (MLA ~ a sliding layer whose window covers a
    2048-token context), and no hash-routed layers. R1's 3 dense FFN layers stay MoE."""
    return dataclasses.replace(r1_like(), layer_types=("sliding",) * 61, sliding_window=2048, num_hash_layers=0)


def model_config(preset: str) -> ModelConfig:
    if preset in ("r1-like", "r1-structure"):
        return r1_like() if preset == "r1-like" else r1_structure()
    return ModelConfig.preset(preset)


def default_path() -> str:
    return str(resources.files("jaxspec.cost").joinpath("calibration_points.json"))


def load_points(path: str | None = None) -> list[dict[str, Any]]:
    """The points of a calibration file; ValueError (one line) if missing or malformed."""
    path = default_path() if path is None else path
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"calibration file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path} is not JSON: {e.msg} at line {e.lineno}") from None
    points = data.get("points") if isinstance(data, dict) else None
    if not isinstance(points, list) or not points:
        raise ValueError(f"calibration file {path} needs a non-empty list 'points'")
    for i, p in enumerate(points):
        role = p.get("role") if isinstance(p, dict) else None
        if role not in ROLES:
            raise ValueError(f"calibration point {i} of {path}: role must be one of {ROLES}, got {role!r}")
        missing = [k for k in _REQUIRED[role] if k not in p]
        if missing:
            raise ValueError(f"calibration point {i} ({p.get('name', '?')}) of {path} lacks {missing}")
    if not any(p["role"] == "fit" for p in points):
        raise ValueError(f"calibration file {path} has no point with role 'fit'")
    return points


def _setup(p: dict[str, Any], batch: int | None = None) -> Setup:
    return Setup(model_config(p["preset"]), tuple(p["mesh"]), batch or p["batch"], p["context"], p["weights"],
                 p["experts"], layout="even", mtp_weights=p.get("mtp_weights"), moe_groups=p.get("moe_groups"))


def point_draft(p: dict[str, Any]) -> DSparkConfig | None:
    """A point's DSpark drafter ("draft": {DSparkConfig fields}), or None for the model's MTP block."""
    d = p.get("draft")
    if d is None:
        return None
    try:
        return DSparkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    except (TypeError, AttributeError) as e:
        raise ValueError(f"calibration point {p.get('name', '?')}: draft must hold DSparkConfig fields ({e})") from None


def cycle_costs(p: dict[str, Any], spec: SpecConfig | None) -> Costs:
    """One AR step (spec None) or one cycle (draft + plan + verify + commit) of a point's setup."""
    table = stage_table(_setup(p), spec, point_draft(p) if spec is not None else None)
    total = None
    for c in table.values():
        total = c if total is None else total + c
    return total


def _spec(drafts: int) -> SpecConfig | None:
    return None if drafts == 0 else SpecConfig(drafts, 1, drafts + 1)


def fit(points: list[dict[str, Any]], prior: latency.Latency = latency.PRIOR) -> latency.Latency:
    """Least squares over the fit points' relative residuals, plus the prior (non-negative)."""
    rows, rhs = [], []
    for p in points:
        if p["role"] != "fit":
            continue
        c = cycle_costs(p, SpecConfig.parse(p["spec"]))
        rest, launches, colls = latency.linear_parts(c, latency.hardware(p["accelerator"]), prior)
        target = p["ms_per_token"] * p["accept_length"] * 1e-3
        rows.append([launches * 1e-6 / target, colls * 1e-6 / target])
        rhs.append(1.0 - rest / target)
    w = math.sqrt(PRIOR_WEIGHT)
    rows += [[w / prior.launch_us, 0.0], [0.0, w / prior.collective_us]]
    rhs += [w, w]
    sol = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
    launch, coll = (max(float(v), 0.0) for v in sol)
    return dataclasses.replace(prior, launch_us=round(launch, 2), collective_us=round(coll, 1))


def slope(xs: list[float], ys: list[float]) -> float:
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    return float(np.polyfit(x, y, 1)[0])


def residuals(points: list[dict[str, Any]], lat: latency.Latency) -> list[dict[str, Any]]:
    """Per point: the model's number beside the published one (relative residual), or why not."""
    out = []
    for p in points:
        row: dict[str, Any] = {"name": p.get("name", "?"), "role": p["role"], "source": p.get("source", "")}
        if p["role"] == "unexpressed":
            row["why"] = p["why"]
        elif p["role"] == "shape":
            hw = latency.hardware(p["accelerator"])
            model = [1e3 * latency.seconds(cycle_costs(p, _spec(d)), hw, lat) for d in p["drafts"]]
            published, predicted = slope(p["drafts"], p["step_ms"]), slope(p["drafts"], model)
            row.update(published=published, model=predicted, residual=predicted / published - 1.0,
                       what="ms of step per draft token (slope)", model_ms=model, published_ms=p["step_ms"])
        else:
            spec = SpecConfig.parse(p["spec"]) if p.get("spec") else None
            hw = latency.hardware(p["accelerator"])
            ms = 1e3 * latency.seconds(cycle_costs(p, spec), hw, lat)
            target = p["ms_per_token"] * p.get("accept_length", 1.0)
            row.update(published=target, model=ms, residual=ms / target - 1.0,
                       what="ms per cycle (ms per token x accept length)" if spec else "ms per AR step")
            if spec is not None and "speedup" in p:  # the ratio to the same session's AR step
                ar = 1e3 * latency.seconds(cycle_costs(p, None), hw, lat)
                model = p["accept_length"] * ar / ms
                row.update(speedup=p["speedup"], model_speedup=model, speedup_residual=model / p["speedup"] - 1.0,
                           model_ar_ms=ar, implied_accept_length=p["speedup"] * ms / ar)
        out.append(row)
    return out
