"""The docs' tree-vs-chain table from tau.jsonl: per D the chain, the calibrated trees the engine
runs today (per-context values where S >= 8) and the raw-ranked tree, with the gain over the chain.

    python experiments/calibration/tau_table.py [results/calibration/tau.jsonl] [--plot docs/calibration_tau_vs_d.png]
"""
import json
import sys

from jaxspec.core.spec import SpecConfig
from jaxspec.speculation.values import CONTEXT_CAP

DATASETS = ("gsm8k", "mbpp", "sharegpt", "tau_all")
args = [a for a in sys.argv[1:] if not a.startswith("--")]
plot = sys.argv[sys.argv.index("--plot") + 1] if "--plot" in sys.argv else None
args = [a for a in args if a != plot]
path = args[0] if args else "results/calibration/tau.jsonl"
runs = {}
for line in open(path):
    if line.strip():
        r = json.loads(line)
        s = SpecConfig.parse(r["spec"])
        if r["scores"] == "calibrated" and (s.num_steps >= CONTEXT_CAP) != (r.get("values") == "per-context"):
            continue  # a deep tree measured before the per-context values: not what the engine runs now
        runs[(r["spec"], r["scores"])] = r  # the latest record of a (spec, scores) wins
print("| D | spec | ranking | GSM8K | MBPP | ShareGPT | all |\n|---:|---|---|---:|---:|---:|---:|")
for d in sorted({r["D"] for r in runs.values()}):
    rows = sorted((r for r in runs.values() if r["D"] == d),
                  key=lambda r: (SpecConfig.parse(r["spec"]).topk > 1, r["scores"] == "draft", r["spec"]))
    chain = next((r for r in rows if SpecConfig.parse(r["spec"]).topk == 1), None)
    for r in rows:
        is_chain = r is chain
        cells = [f"{r[k]:.3f}" + ("" if is_chain or chain is None else f" ({100 * (r[k] / chain[k] - 1):+.1f}%)")
                 for k in DATASETS]
        ranking = "-" if is_chain else ("raw draft" if r["scores"] == "draft" else r.get("values", "pooled"))
        print(f"| {d} | {r['spec']}{' (chain)' if is_chain else ''} | {ranking} | " + " | ".join(cells) + " |")

if plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ds, color in zip(DATASETS, ("tab:blue", "tab:orange", "tab:green", "black"), strict=True):
        for ranking, style in (("calibrated", "s-"), ("draft", "x:")):
            gains, taus = {}, {}
            for r in runs.values():
                s = SpecConfig.parse(r["spec"])
                chain = next((c for c in runs.values() if c["D"] == r["D"] and SpecConfig.parse(c["spec"]).topk == 1),
                             None)
                if s.topk > 1 and r["scores"] == ranking and chain:
                    gains[r["D"]] = max(gains.get(r["D"], -1e9), 100 * (r[ds] / chain[ds] - 1))
                    taus[r["D"]] = max(taus.get(r["D"], 0), r[ds])
            label = f"{'all' if ds == 'tau_all' else ds}, {'calibrated' if ranking == 'calibrated' else 'raw'}"
            if gains:
                axes[1].plot(*zip(*sorted(gains.items()), strict=True), style, color=color, label=label)
            if taus and ranking == "calibrated":
                axes[0].plot(*zip(*sorted(taus.items()), strict=True), style, color=color, label=label)
        chain = sorted((r["D"], r[ds]) for r in runs.values() if SpecConfig.parse(r["spec"]).topk == 1)
        axes[0].plot(*zip(*chain, strict=True), "o--", color=color, alpha=0.5, label=f"{ds.replace('tau_', '')}, chain")
    axes[0].set(xscale="log", xlabel="D (verified nodes)", ylabel="tau", title="held-out greedy tau vs D")
    axes[1].axhline(0, color="gray", lw=0.8)
    axes[1].set(xscale="log", xlabel="D (verified nodes)", ylabel="% over the chain",
                title="best tree's gain over the chain (K = 2 or 4)", ylim=(-40, 40))
    for ax in axes:
        ds_ticks = sorted({r["D"] for r in runs.values()})
        ax.set_xticks(ds_ticks, [str(d) for d in ds_ticks])
        ax.minorticks_off()
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
