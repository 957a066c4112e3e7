"""DSpark on V4-Flash by the analytic cost model (docs/cost_model.md, "DSpark"): first SGLang's published
DSpark chain on 8 x B200 at concurrency 1 (TPOT and speedup, the residuals and where they come from), then
DSpark trees against the chain on 8 x H200.

    python experiments/dspark/cost_projection.py [--rates RATES.json] [--sibling 0.25] [--context 4096] \
        [--batches 1,4,16,64] [--out results/dspark]

Acceptance: the chain's per-position acceptance is the published one for V4-Flash-0731, greedy, 5 drafts
(vLLM: 0.579 / 0.447 / 0.316 / 0.237 / 0.158, accept length 2.74), read as P(the first k drafts all
accepted); a node at depth k accepts its rank-0 child with c_k = a_k / a_(k-1). Siblings: given the rank-0
child is rejected, the rank-1 child is the target's token with probability `--sibling` (one table each
of 0.10 / 0.25 / 0.50 by default: DDTree on vLLM found DSpark siblings rarely right; the project's MTP
drafts on the tiny target measure 0.24-0.38 (one-step) and 0.56-0.74 (distilled) by depth,
results/report_regime/acceptance.json), the same at every depth, and a node's children accept as a chain
node's do (the Markov head conditions them on their own parent). `--rates FILE` replaces all of this
with measured rates: {"rate": [[P(rank 0 | parent accepted), P(rank 1 | parent accepted), ...] per depth]}
(the layout of `results/report_regime/acceptance.json`'s per-dataset "rate").

Trees are grown as jaxspec grows them and valued by their path acceptance (`jaxspec.cost.acceptance`).

`--heldout FILE --draft NAME` adds the regime projection (docs/dspark.md, "In DeepSeek's regime"): tau of
the chain and of the best tree at each D as `heldout_acceptance.py` measured them for that draft (mean of
GSM8K / MBPP / ShareGPT; trees ranked per cycle, which the static rates above cannot express), scaled by
2.74 / tau(the block's full chain) so the chain accepts what the release's does, over the model's cycle
time of each spec on 8 x H200 at --regime-batches: TPOT = cycle / tau, beside SGLang's published chain.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.cost import fit as cost_fit
from jaxspec.cost import latency
from jaxspec.cost.acceptance import beam_tau, rates_from_chain
from jaxspec.cost.project import row
from jaxspec.cost.terms import Setup, default_dspark

PER_POSITION = (0.579, 0.447, 0.316, 0.237, 0.158)  # vLLM, V4-Flash-0731, greedy, k = 5
RELEASE_TAU = 1.0 + sum(PER_POSITION)  # 2.74: the release chain's accepted length, bonus included
MEAN_OVER = ("gsm8k", "mbpp", "sharegpt")
SIBLING_RANGE = (0.10, 0.25, 0.50)


# ---- SGLang check ------------------------------------------------------------------------------


def sglang_check() -> dict:
    points = [p for p in cost_fit.load_points() if p.get("draft") and p["accelerator"] == "b200"]
    ar_points = {p["name"]: p for p in cost_fit.load_points() if "8xb200-ar" in p["name"]}
    rows = []
    for p in points:
        tag = p["name"].rsplit("8xb200-", 1)[1]
        r = {x["name"]: x for x in cost_fit.residuals([p, ar_points[f"v4-flash-sglang-8xb200-ar-{tag}"]],
                                                      latency.H200)}
        dspark, ar = r[p["name"]], r[f"v4-flash-sglang-8xb200-ar-{tag}"]
        setup = cost_fit._setup(p)
        hw = latency.hardware("b200")
        spec, dcfg = SpecConfig.parse(p["spec"]), cost_fit.point_draft(p)
        cyc = row(setup, spec, hw, latency.H200, dcfg)
        ar_row = row(setup, None, hw, latency.H200)
        terms = {stage: {k: 1e3 * v for k, v in latency.split(c, hw, latency.H200).items()}
                 for stage, c in cyc.stages.items() if stage != "plan"}
        terms["ar"] = {k: 1e3 * v for k, v in latency.split(ar_row.stages["ar"], hw, latency.H200).items()}
        tpot = {f"{m:.2f}": cyc.step_seconds * 1e3 / m for m in (p["accept_range"][0], p["accept_length"],
                                                                 p["accept_range"][1])}
        rows.append({"name": p["name"], "workload": p["source"].split("), ")[1].split(": TPOT")[0],
                     "context": p["context"], "published_tpot_ms": p["ms_per_token"],
                     "published_speedup": p["speedup"], "accept_length": p["accept_length"],
                     "model_tpot_ms": cyc.step_seconds * 1e3 / p["accept_length"], "tpot_residual": dspark["residual"],
                     "model_tpot_by_accept_length": tpot, "model_speedup": dspark["model_speedup"],
                     "speedup_residual": dspark["speedup_residual"], "implied_accept_length":
                     dspark["implied_accept_length"], "model_cycle_ms": cyc.step_seconds * 1e3,
                     "model_ar_ms": ar_row.step_seconds * 1e3, "implied_ar_ms": ar_points[ar["name"]]["ms_per_token"],
                     "ar_residual": ar["residual"], "ms_terms": terms,
                     "launches_ar": ar_row.stages["ar"].layer_passes})
    return {"rows": rows, "diagnostic": _b200_diagnostic(points, ar_points)}


def _b200_diagnostic(points, ar_points) -> dict:
    """Not shipped: what the B200 stack's fixed costs would have to be for the model's AR step to equal the
    no-speculation steps SGLang's numbers imply, and the DSpark TPOT under them."""
    hw = latency.hardware("b200")
    out = {}
    # the per-kernel launch that makes each AR step match, the collective latency held at the H200 fit
    need = {}
    for name, p in ar_points.items():
        rest, launches, colls = latency.linear_parts(cost_fit.cycle_costs(p, None), hw, latency.H200)
        need[name] = (p["ms_per_token"] * 1e-3 - rest - colls * latency.H200.collective_us * 1e-6) / launches * 1e6
    out["launch_us_matching_each_ar_step"] = need
    # both terms refit (the fit's own procedure and prior) on the three derived AR steps
    pseudo = [dict(p, role="fit", spec=None, accept_length=1.0) for p in ar_points.values()]
    rows, rhs = [], []
    for p in pseudo:
        rest, launches, colls = latency.linear_parts(cost_fit.cycle_costs(p, None), hw, latency.PRIOR)
        target = p["ms_per_token"] * 1e-3
        rows.append([launches * 1e-6 / target, colls * 1e-6 / target])
        rhs.append(1.0 - rest / target)
    w = math.sqrt(cost_fit.PRIOR_WEIGHT)
    rows += [[w / latency.PRIOR.launch_us, 0.0], [0.0, w / latency.PRIOR.collective_us]]
    rhs += [w, w]
    launch, coll = (max(float(v), 0.0) for v in np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0])
    lat = latency.Latency(launch_us=round(launch, 2), collective_us=round(coll, 1))
    out["refit_on_derived_ar_steps"] = {"launch_us": lat.launch_us, "collective_us": lat.collective_us,
                                        "residuals": {r["name"]: r["residual"] for r in cost_fit.residuals(
                                            [*points, *ar_points.values()], lat)}}
    return out


def chain_at(d: int, dcfg) -> SpecConfig:
    """The chain a budget of D verified tokens allows: as deep as D, at most the block."""
    return SpecConfig(min(d, dcfg.block_size + 1) - 1, 1, min(d, dcfg.block_size + 1))


# ---- the tree projection -----------------------------------------------------------------------


def projection(rates_by_sibling: dict[str, list[list[float]]], batches, context: int, budgets) -> list[dict]:
    cfg = ModelConfig.preset("v4-flash")
    dcfg = default_dspark(cfg)
    hw, lat, mesh = latency.hardware("h200"), latency.H200, (1, 8, 1)
    out = []
    for b in batches:
        s = Setup(cfg, mesh, b, context, "fp8", "fp4", 0.0, "even")
        ar = row(s, None, hw, lat).step_seconds
        cycles = {}
        for d in budgets:
            chain = chain_at(d, dcfg)
            trees = [SpecConfig(steps, 2, d) for steps in (4, 5) if steps < d]  # K = 2, S = 4..5
            for spec in [chain, *trees]:
                if spec.name not in cycles:
                    r = row(s, spec, hw, lat, dcfg)
                    cycles[spec.name] = (r.step_seconds, {k: 1e3 * v for k, v in r.seconds.items()})
            for label, rates in rates_by_sibling.items():
                tau_c = beam_tau(rates, chain)[0]
                best = None
                for t in trees:
                    tau_t, kept = beam_tau(rates, t)
                    sp = tau_t * ar / cycles[t.name][0]
                    if best is None or sp > best["speedup"]:
                        best = {"spec": t.name, "tau": tau_t, "cycle_ms": 1e3 * cycles[t.name][0], "speedup": sp,
                                "kept": ["".join(map(str, p)) for p in kept]}
                sc = tau_c * ar / cycles[chain.name][0]
                out.append({"batch": b, "D": d, "sibling": label, "ar_ms": 1e3 * ar,
                            "chain": {"spec": chain.name, "tau": tau_c, "cycle_ms": 1e3 * cycles[chain.name][0],
                                      "speedup": sc, "stage_ms": cycles[chain.name][1]},
                            "tree": {**best, "stage_ms": cycles[best["spec"]][1]},
                            "tree_over_chain": best["speedup"] / sc - 1.0,
                            "tokens_per_s": {"ar": b / ar, "chain": b * tau_c / cycles[chain.name][0],
                                             "tree": b * best["tau"] / cycles[best["spec"]][0]}})
    return out


def measured_taus(path: str, draft: str) -> dict[str, float]:
    """Mean tau over MEAN_OVER of every spec `draft` ran on all three datasets."""
    by: dict[str, dict[str, float]] = {}
    for r in json.loads(Path(path).read_text()):
        if r["draft"] == draft and r["dataset"] in MEAN_OVER:
            by.setdefault(r["spec"], {})[r["dataset"]] = r["tau"]
    return {spec: sum(v.values()) / len(v) for spec, v in by.items() if len(v) == len(MEAN_OVER)}


def regime_projection(taus: dict[str, float], batches, context: int, budgets) -> dict:
    """Chain vs best measured tree at each D, tau scaled to the release's chain, TPOT from the cycle model."""
    cfg = ModelConfig.preset("v4-flash")
    dcfg = default_dspark(cfg)
    hw, lat, mesh = latency.hardware("h200"), latency.H200, (1, 8, 1)
    block_chain = SpecConfig(dcfg.block_size, 1, dcfg.block_size + 1).name
    if block_chain not in taus:
        raise SystemExit(f"the records lack the block's full chain {block_chain}, which sets the scale")
    scale = RELEASE_TAU / taus[block_chain]
    rows = []
    for b in batches:
        s = Setup(cfg, mesh, b, context, "fp8", "fp4", 0.0, "even")
        ar = row(s, None, hw, lat).step_seconds
        for d in budgets:
            chain = chain_at(d, dcfg).name
            parsed = {n: SpecConfig.parse(n) for n in taus}
            trees = [n for n, sp in parsed.items() if sp.topk > 1 and sp.num_draft_tokens == d and not sp.widths]
            if chain not in taus or not trees:
                continue
            best = max(trees, key=taus.__getitem__)
            cells = {}
            for label, name in (("chain", chain), ("tree", best)):
                spec = SpecConfig.parse(name)
                cyc = row(s, SpecConfig(spec.num_steps, spec.topk, spec.num_draft_tokens), hw, lat, dcfg).step_seconds
                tau = taus[name] * scale
                cells[label] = {"spec": name, "tau_measured": taus[name], "tau": tau, "cycle_ms": 1e3 * cyc,
                                "tpot_ms": 1e3 * cyc / tau, "speedup": tau * ar / cyc}
            rows.append({"batch": b, "D": d, "ar_ms": 1e3 * ar, **cells,
                         "tree_over_chain_tpot": cells["chain"]["tpot_ms"] / cells["tree"]["tpot_ms"] - 1.0})
    return {"scale": scale, "block_chain": block_chain, "rows": rows}


def regime_markdown(proj: dict, context: int, source: str) -> list[str]:
    lines = [f"In the regime: V4-Flash-0731 with DSpark (block 5, 3 stages) on 8 x H200 (TP8 EP8, FP8 / FP4 as "
             f"released, context {context}); tau measured on tiny-v4 with {source}, scaled by "
             f"{proj['scale']:.3f} so that the full chain {proj['block_chain']} accepts {RELEASE_TAU:.2f} "
             "(the release's); SGLang publishes 1.70-1.88 ms for its chain at concurrency 1 (8 x B200)", "",
             "| concurrency | D | AR ms | chain (tau) | cycle ms | TPOT ms | best tree (tau) | cycle ms | TPOT ms "
             "| tree over chain (tokens/s) |", "|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in proj["rows"]:
        c, t = r["chain"], r["tree"]
        lines.append(f"| {r['batch']} | {r['D']} | {r['ar_ms']:.2f} | {c['spec']} ({c['tau']:.2f}) | "
                     f"{c['cycle_ms']:.2f} | {c['tpot_ms']:.2f} | {t['spec']} ({t['tau']:.2f}) | "
                     f"{t['cycle_ms']:.2f} | {t['tpot_ms']:.2f} | {100 * (c['tpot_ms'] / t['tpot_ms'] - 1):+.1f}% |")
    return lines


# ---- output ------------------------------------------------------------------------------------


def check_markdown(check: dict) -> list[str]:
    lines = ["SGLang DSpark chain, DeepSeek-V4-Flash-DSpark on 8 x B200 (TP8 EP8, greedy, 5 drafts, verify 6), "
             "concurrency 1; model: analytic terms, H200-fitted latency terms on B200's roofline; accept length "
             "2.74 assumed", "",
             "| workload | context | TPOT published | TPOT model (2.48 / 2.74 / 3.51) | residual | speedup published "
             "| speedup model | residual | accept length implied | AR ms implied | AR ms model | AR residual |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in check["rows"]:
        t = " / ".join(f"{v:.2f}" for v in r["model_tpot_by_accept_length"].values())
        lines.append(f"| {r['workload']} | {r['context']} | {r['published_tpot_ms']:.2f} | {t} | "
                     f"{100 * r['tpot_residual']:+.0f}% | {r['published_speedup']:.2f}x | {r['model_speedup']:.2f}x | "
                     f"{100 * r['speedup_residual']:+.0f}% | {r['implied_accept_length']:.2f} | "
                     f"{r['implied_ar_ms']:.2f} | {r['model_ar_ms']:.2f} | {100 * r['ar_residual']:+.0f}% |")
    r = check["rows"][0]
    lines += ["", f"Model cycle at context {r['context']} ({r['model_cycle_ms']:.2f} ms), ms per term:", "",
              "| stage | roofline | launch | collective latency | collective bytes | dispatch | total |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for stage, t in r["ms_terms"].items():
        lines.append(f"| {stage} | " + " | ".join(f"{t[k]:.3f}" for k in ("roofline", "launch", "collective_latency",
                                                                           "collective_bytes", "dispatch"))
                     + f" | {sum(t.values()):.3f} |")
    d = check["diagnostic"]
    need = ", ".join(f"{v:.2f}" for v in d["launch_us_matching_each_ar_step"].values())
    refit = d["refit_on_derived_ar_steps"]
    res = ", ".join(f"{k.split('8xb200-')[1]} {100 * v:+.0f}%" for k, v in refit["residuals"].items())
    lines += ["", f"Diagnostic, not shipped: launch_us that makes the model's AR step equal each implied one "
              f"(collective held at {latency.H200.collective_us} us): {need}; both terms refit on the three implied "
              f"AR steps: launch {refit['launch_us']} us, collective {refit['collective_us']} us -> residuals {res}."]
    return lines


def projection_markdown(rows: list[dict], context: int, source: str) -> list[str]:
    lines = [f"DSpark trees against the DSpark chain, V4-Flash on 8 x H200 (TP8 EP8 mesh (1, 8, 1), FP8 / FP4 experts "
             f"as released, context {context}, H200-fitted latency terms); acceptance: {source}", ""]
    for label in dict.fromkeys(r["sibling"] for r in rows):
        lines += [f"sibling acceptance {label}:", "",
                  "| concurrency | D | AR ms | chain (tau) | cycle ms | x AR | best tree (tau) | cycle ms | x AR "
                  "| tree over chain |", "|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
        for r in rows:
            if r["sibling"] != label:
                continue
            c, t = r["chain"], r["tree"]
            lines.append(f"| {r['batch']} | {r['D']} | {r['ar_ms']:.2f} | {c['spec']} ({c['tau']:.2f}) | "
                         f"{c['cycle_ms']:.2f} | {c['speedup']:.2f}x | {t['spec']} ({t['tau']:.2f}) | "
                         f"{t['cycle_ms']:.2f} | {t['speedup']:.2f}x | {100 * r['tree_over_chain']:+.1f}% |")
        lines.append("")
    return lines


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    labels = list(dict.fromkeys(r["sibling"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 3.2), sharey=True)
    for ax, b in zip(np.atleast_1d(axes), batches, strict=True):
        sub = [r for r in rows if r["batch"] == b]
        ds = sorted({r["D"] for r in sub})
        chain = [next(r for r in sub if r["D"] == d)["chain"]["speedup"] for d in ds]
        ax.plot(ds, chain, "k-o", label="chain")
        for label, style in zip(labels, ("C0:^", "C1-s", "C2--v"), strict=False):
            ax.plot(ds, [next(r for r in sub if r["D"] == d and r["sibling"] == label)["tree"]["speedup"] for d in ds],
                    style, label=f"tree, sibling {label}")
        ax.set_title(f"concurrency {b}")
        ax.set_xlabel("verify budget D")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("tokens/s over AR (model)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.suptitle("DSpark on V4-Flash, 8 x H200 (analytic cost model)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default=None, metavar="JSON", help='measured {"rate": [[rank 0, rank 1], ...]}')
    p.add_argument("--sibling", default=",".join(map(str, SIBLING_RANGE)),
                   help="rank-1 acceptance given rank 0 rejected (comma-separated: one table each)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--budgets", default="5,6,7,8")
    p.add_argument("--out", default="results/dspark")
    p.add_argument("--heldout", default=None, metavar="JSON", help="heldout_acceptance.py records (regime projection)")
    p.add_argument("--draft", default="dspark-regime", help="the draft of --heldout's records to project")
    p.add_argument("--regime-batches", default="1,32")
    p.add_argument("--regime-budgets", default="5,6,7,8,12,16")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = sglang_check()
    (out / "cost_sglang_check.json").write_text(json.dumps(check, indent=1) + "\n")
    lines = check_markdown(check)
    if args.rates:
        data = json.loads(Path(args.rates).read_text())
        rates = {"measured": [list(map(float, r)) for r in data["rate"]]}
        source = f"measured rates from {args.rates}"
    else:
        rates = {f"{q:.2f}": rates_from_chain(PER_POSITION, q) for q in map(float, args.sibling.split(","))}
        source = ("the published V4-Flash-0731 chain per-position acceptance (vLLM, greedy, k = 5) and a rank-1 "
                  "sibling accepted with the given probability when rank 0 is rejected")
    rows = projection(rates, [int(b) for b in args.batches.split(",")], args.context,
                      [int(d) for d in args.budgets.split(",")])
    (out / "cost_projection.json").write_text(json.dumps({"context": args.context, "rates": rates, "rows": rows},
                                                         indent=1) + "\n")
    lines += ["", *projection_markdown(rows, args.context, source)]
    if args.heldout:
        batches = [int(b) for b in args.regime_batches.split(",")]
        budgets = [int(d) for d in args.regime_budgets.split(",")]
        proj = regime_projection(measured_taus(args.heldout, args.draft), batches, args.context, budgets)
        (out / "cost_regime.json").write_text(json.dumps({"context": args.context, "heldout": args.heldout,
                                                          "draft": args.draft, **proj}, indent=1) + "\n")
        lines += ["", *regime_markdown(proj, args.context, f"{args.draft} ({args.heldout})")]
    (out / "cost_projection.md").write_text("\n".join(lines) + "\n")
    figure(rows, out / "cost_projection.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
