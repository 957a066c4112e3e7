"""The designs tried for the R1 step-vs-drafts slope (issue 23, docs/cost_model.md): each refits the
latency terms on the V4 points, then prints the R1 slope and the V4 residuals. The R1 points are the
check, never fitted. A model, not a measurement.

    python bench/r1_slope_designs.py            # every design (~1 minute on one core)
    python bench/r1_slope_designs.py D1 D3      # those whose name starts so
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

from jaxspec.cost import fit as cost_fit
from jaxspec.cost import latency, terms

_DRAFT_KINDS = ("mtp_in", "draft_sample", "draft_expand")
_NO_DRAFT_KERNELS = {k: 0 for k in _DRAFT_KINDS}  # the model before D1
_TRTLLM = {"mtp_weights": "plain", "moe_groups": 2}  # the min-latency recipe: bf16 MTP, MoE TP4 x EP2

DESIGNS: dict[str, dict[str, Any]] = {
    "D0 before: no draft-step input / selection kernels": dict(kernels=_NO_DRAFT_KERNELS),
    "D1 the draft step's own kernels (shipped)": dict(),
    "D2 D0 + MTP layer bf16": dict(kernels=_NO_DRAFT_KERNELS, r1={"mtp_weights": "plain"}),
    "D3 D0 + MoE TP4 x EP2": dict(kernels=_NO_DRAFT_KERNELS, r1={"moe_groups": 2}),
    "D4 D0 + R1 layer structure": dict(kernels=_NO_DRAFT_KERNELS, r1={"preset": "r1-structure"}),
    "D5 D0 + MTP pass at a main layer's kernels (30)": dict(kernels=_NO_DRAFT_KERNELS, mtp_kernels=30),
    "D6 D0 + B200 at nominal 8 TB/s": dict(kernels=_NO_DRAFT_KERNELS, bandwidth=8.0e12),
    "D7 D1 + D2": dict(r1={"mtp_weights": "plain"}),
    "D8 D1 + D2 + D4": dict(r1={"mtp_weights": "plain", "preset": "r1-structure"}),
    "D9 D1 + D2 + D3 + D4 (the published recipe)": dict(r1={**_TRTLLM, "preset": "r1-structure"}),
    "D10 D1 + D3": dict(r1={"moe_groups": 2}),
    "D11 D1 + embedding all-reduce per pass": dict(embed_collective=True),
    "D12 D9 + embedding all-reduce per pass": dict(r1={**_TRTLLM, "preset": "r1-structure"}, embed_collective=True),
}
_V4 = ("v4-flash-fp8-sglang-4xh200", "v4-flash-fp4-sglang-4xh200", "v4-pro-sglang-8xh200")


def _mtp_as_main_layer(kernels_per_pass: int):
    """A layer_pass whose MTP block launches `kernels_per_pass` kernels (kind "mtp_layer")."""
    plain = terms.layer_pass

    def layer_pass(s, name, tokens, prior=0, commit=0):
        c = plain(s, name, tokens, prior, commit)
        return dataclasses.replace(c, layer_passes={"mtp_layer": 1}) if name == "mtp" else c

    return plain, layer_pass


def _embed_with_collective():
    """An embed_rows whose vocab-split lookup is summed over "tensor" (one all-reduce of the rows)."""
    plain = terms.embed_rows

    def embed_rows(s, tokens):
        c = plain(s, tokens)
        t = s.mesh[1]
        if t == 1:
            return c
        sent = 2.0 * (t - 1) / t * s.rows * tokens * s.cfg.hidden_size * s.act_bytes
        return dataclasses.replace(c, collectives={"all_reduce": (1, sent)})

    return plain, embed_rows


def evaluate(design: dict[str, Any]) -> dict[str, Any]:
    points = copy.deepcopy(cost_fit.load_points())
    for p in points:
        if p.get("preset") == "r1-like" and p["role"] == "shape":
            p.update(design.get("r1", {}))
    kernels = {**latency.DEFAULT_KERNELS, **design.get("kernels", {})}
    b200 = latency.HARDWARE["b200"]
    plain = plain_embed = None
    try:
        if design.get("embed_collective"):
            plain_embed, terms.embed_rows = _embed_with_collective()
        if "bandwidth" in design:
            latency.HARDWARE["b200"] = dataclasses.replace(b200, bandwidth=design["bandwidth"])
        if "mtp_kernels" in design:
            plain, terms.layer_pass = _mtp_as_main_layer(design["mtp_kernels"])
            kernels["mtp_layer"] = design["mtp_kernels"]
        fitted = cost_fit.fit(points, dataclasses.replace(latency.PRIOR, kernels=tuple(kernels.items())))
        rows = {r["name"]: r for r in cost_fit.residuals(points, fitted)}
    finally:
        latency.HARDWARE["b200"] = b200
        if plain is not None:
            terms.layer_pass = plain
        if plain_embed is not None:
            terms.embed_rows = plain_embed
    r1 = rows["r1-fp4-trtllm-8xb200"]
    return {"launch_us": fitted.launch_us, "collective_us": fitted.collective_us, "slope": r1["model"],
            "slope_residual": r1["residual"], "steps_ms": r1["model_ms"],
            "v4_residuals": [rows[n]["residual"] for n in _V4]}


def main(prefixes: list[str]) -> None:
    print("| design | slope ms/draft (published 0.751) | residual | step ms at 0..5 drafts | V4 residuals "
          "(Flash FP8, Flash FP4, Pro) | fit launch / collective us |")
    print("|---|---:|---:|---|---|---|")
    for name, design in DESIGNS.items():
        if prefixes and not any(name.split()[0] == p for p in prefixes):
            continue
        r = evaluate(design)
        steps = " / ".join(f"{x:.2f}" for x in r["steps_ms"])
        v4 = ", ".join(f"{x:+.1%}" for x in r["v4_residuals"])
        print(f"| {name} | {r['slope']:.3f} | {r['slope_residual']:+.1%} | {steps} | {v4} | "
              f"{r['launch_us']:g} / {r['collective_us']:g} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
