"""Accepted length (tau) of speculative sampling: the block rule (block verification / its traversal form)
and the residual rule (token rule / recursive rejection) on sampled drafts beside the target-only rule on
top-K drafts, held-out prompts (docs/sampling.md).

    python bench/rsd_tau.py --checkpoint checkpoints/tiny-v4 --specs s7_k1_d8,s4_k2_d8 \\
        --temperatures 0.6,1.0 --top-ps 1.0,0.9 --rules block,residual,target [--prompts 32] [--new-tokens 96]
        [--batch 64] [--out results/rsd/tau.jsonl]
    python bench/rsd_tau.py --checkpoint ... --speed s7_k1_d8 --temperatures 0.6 --batch 1 --prompts 8
    python bench/rsd_tau.py --plot results/rsd/tau.jsonl        # tau vs D figure beside the file

tau = (accepted drafts + cycles) / cycles over every real row (batch padding rows cut). Every
(spec, rule) compiles once; sampling settings are traced. Records are appended to --out as JSON
lines; a (spec, rule, T, top-p) already there is skipped, so a stopped run resumes. --speed times
batch-1 generation (one warm-up call, then every prompt) against `generate` at the same settings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

DATASETS = ("gsm8k", "mbpp", "sharegpt")


def load(checkpoint: str, num_prompts: int, draft: str | None = None):
    """-> (cfg, params, held-out prompts, the checkpoint's draft (or its drafts/`draft`/) with its calibration);
    float32 and the CPU's expert layout on a CPU."""
    import jax

    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.harness.eval import encode_prompts
    from jaxspec.training.data import HELDOUT_SPLITS, load_dataset

    cpu = jax.default_backend() == "cpu"
    ckpt = load_checkpoint(checkpoint, draft=draft, dtype="float32" if cpu else None, cpu_experts=True)
    prompts = []
    for name in DATASETS:
        examples = load_dataset(name, HELDOUT_SPLITS[name])[:num_prompts]
        prompts += encode_prompts(ckpt.tokenizer, examples, 192)
    return ckpt.cfg, ckpt.params, prompts, ckpt.draft


def as_array(prompts: list[list[int]], rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts padded to [rows, width] (missing rows repeat the first prompt; they are cut later)."""
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.full((rows,), len(prompts[0]), np.int32)
    tokens[:, : len(prompts[0])] = prompts[0]
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        lengths[i] = len(p)
    return tokens, lengths


def tau_and_error(accepted: np.ndarray, cycles: np.ndarray) -> tuple[float, float]:
    """-> (tau, its standard error over prompts): the ratio estimator's linearised variance."""
    tau = float((accepted.sum() + cycles.sum()) / max(cycles.sum(), 1))
    resid = accepted + cycles - tau * cycles
    n = len(cycles)
    return tau, float(np.sqrt(n / max(n - 1, 1) * np.sum(resid**2)) / max(cycles.sum(), 1))


def measure_tau(params, cfg, prompts, spec, rule, temperature, top_p, new_tokens, batch, seed=0,
                calibration=None, draft=None) -> dict:
    """`draft`: the checkpoint's (its calibration ranks the tree unless `calibration` overrides it); None =
    the MTP block of `params`, uncalibrated."""
    import jax

    import jaxspec as js

    width = max(len(p) for p in prompts)
    accepted = cycles = 0
    hits, ranks, start = None, None, time.perf_counter()
    per_acc, per_cyc = [], []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        tokens, lengths = as_array(chunk, batch, width)
        out = js.speculative_generate(
            params, cfg, tokens, spec, max_new_tokens=new_tokens, temperature=temperature,
            top_p=None if top_p >= 1.0 else top_p, rng=jax.random.key(seed + i), prompt_lengths=lengths, accept=rule,
            calibration=calibration, draft=draft,
        )
        per = {k: np.asarray(v)[: len(chunk)] for k, v in out.stats["per_sequence"].items()}
        accepted += int(per["accepted"].sum())
        cycles += int(per["cycles"].sum())
        per_acc.append(per["accepted"])
        per_cyc.append(per["cycles"])
        h, r = per["depth_hits"].sum(0), per["rank_hist"].sum(0)
        hits = h if hits is None else hits + h
        ranks = r if ranks is None else ranks + r
    per_acc, per_cyc = np.concatenate(per_acc), np.concatenate(per_cyc)
    tau, se = tau_and_error(per_acc, per_cyc)
    third = len(prompts) // len(DATASETS)  # `load` takes the same count from each dataset, in order
    by_dataset = {name: tau_and_error(per_acc[j * third:(j + 1) * third], per_cyc[j * third:(j + 1) * third])[0]
                  for j, name in enumerate(DATASETS)}
    return {
        "tau_se": se, "tau_by_dataset": by_dataset, "seed": seed,
        "per_sequence": {"accepted": per_acc.tolist(), "cycles": per_cyc.tolist()},
        "spec": spec, "rule": rule, "temperature": temperature, "top_p": top_p, "prompts": len(prompts),
        "new_tokens": new_tokens, "batch": batch, "tau": (accepted + cycles) / max(cycles, 1),
        "per_depth_acceptance": (hits / max(cycles, 1)).tolist(), "rank_histogram": ranks.tolist(),
        "seconds": time.perf_counter() - start,
    }


def measure_speed(params, cfg, prompts, spec, rule, temperature, top_p, new_tokens, seed=0, draft=None) -> dict:
    """Batch 1, one prompt at a time, one width: tokens/s of speculative sampling and of `generate`."""
    import jax

    import jaxspec as js

    width = max(len(p) for p in prompts)
    top = None if top_p >= 1.0 else top_p
    result = {"spec": spec, "rule": rule, "temperature": temperature, "top_p": top_p, "batch": 1,
              "prompts": len(prompts), "new_tokens": new_tokens}
    for name, run in (("ar", lambda t, n, k: js.generate(params, cfg, t, new_tokens, temperature, None, top, None, k,
                                                           prompt_lengths=n)),
                      ("spec", lambda t, n, k: js.speculative_generate(
                          params, cfg, t, spec, new_tokens, temperature, None, top, None, k, prompt_lengths=n,
                          accept=rule, draft=draft))):
        tokens, lengths = as_array(prompts[:1], 1, width)
        run(tokens, lengths, jax.random.key(seed))  # compile
        generated, seconds = 0, 0.0
        for i, p in enumerate(prompts):
            tokens, lengths = as_array([p], 1, width)
            t0 = time.perf_counter()
            out = run(tokens, lengths, jax.random.key(seed + i))
            seconds += time.perf_counter() - t0
            generated += int(out.lengths.sum())
        result[f"{name}_tokens_per_s"] = generated / seconds
    result["speedup_vs_ar"] = result["spec_tokens_per_s"] / result["ar_tokens_per_s"]
    return result


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if "tau" in r]
    settings = sorted({(r["temperature"], r["top_p"]) for r in records})
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.6), squeeze=False, sharey=True)
    for ax, (t, p) in zip(axes[0], settings, strict=True):
        styles = {"block": "-", "residual": ":", "target": "--"}
        for rule, style in ((r, styles.get(r, "-.")) for r in sorted({r["rule"] for r in records})):
            for kind, marker in (("chain", "o"), ("tree", "s")):
                pts = {}
                for r in records:
                    k = int(r["spec"].split("_k")[1].split("_")[0])
                    if (r["temperature"], r["top_p"], r["rule"]) == (t, p, rule) and (k == 1) == (kind == "chain"):
                        d = int(r["spec"].split("_d")[1])
                        pts[d] = max(pts.get(d, 0.0), r["tau"])
                if pts:
                    ds = sorted(pts)
                    ax.plot(ds, [pts[d] for d in ds], style, marker=marker, label=f"{rule} {kind} (best)")
        ax.set_title(f"T={t}, top-p={p}")
        ax.set_xlabel("D (nodes verified)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tau (tokens per cycle)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    p.add_argument("--specs", default="s7_k1_d8,s4_k2_d8,s3_k4_d8")
    p.add_argument("--rules", default="block,residual,target")
    p.add_argument("--temperatures", default="0.6,1.0")
    p.add_argument("--top-ps", default="1.0,0.9")
    p.add_argument("--prompts", type=int, default=32, help="per dataset")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default="results/rsd/tau.jsonl")
    p.add_argument("--speed", action="store_true", help="batch-1 tokens/s vs generate instead of tau")
    p.add_argument("--plot", default=None, metavar="JSONL", help="only draw the figure of a finished file")
    p.add_argument("--calibration", default=None, metavar="JSON",
                   help="node values file (e.g. results/rsd/residual_values.json); default: the checkpoint's")
    p.add_argument("--draft", default=None, metavar="NAME",
                   help="the checkpoint's drafts/NAME/ (e.g. dspark) instead of its own draft")
    p.add_argument("--seeds", default="0", help="comma-separated rng seeds; tau of each is a record")
    args = p.parse_args()
    if args.plot:
        print(plot(Path(args.plot)))
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["spec"], r["rule"], r["temperature"], r["top_p"], "tau" in r, r.get("calibration"),
                      r.get("seed", 0)))
    cfg, params, prompts, draft = load(args.checkpoint, args.prompts, args.draft)
    calibration = None
    if args.calibration:
        from jaxspec.speculation.values import load_calibration

        calibration = load_calibration(args.calibration, draft.params, cfg)
    for spec, seed in ((s, int(x)) for s in args.specs.split(",") for x in args.seeds.split(",")):
        for rule in args.rules.split(","):
            for t in map(float, args.temperatures.split(",")):
                for top_p in map(float, args.top_ps.split(",")):
                    if (spec, rule, t, top_p, not args.speed, args.calibration, seed) in done:
                        continue
                    if args.speed:
                        r = measure_speed(params, cfg, prompts, spec, rule, t, top_p, args.new_tokens, seed, draft)
                    else:
                        r = measure_tau(params, cfg, prompts, spec, rule, t, top_p, args.new_tokens, args.batch, seed,
                                        calibration, draft)
                    r["calibration"] = args.calibration
                    if args.draft:
                        r["draft"] = args.draft
                    print(json.dumps({k: v for k, v in r.items() if k not in ("rank_histogram", "per_sequence")}),
                          flush=True)
                    with open(out, "a") as f:
                        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
