"""The one-shot GPU measurements of `scripts/gpu_check.sh`: grouped-experts bandwidth, and the stage split
and spec-vs-AR step ratio of a random-weight model, Pallas vs XLA attention, at batch 1 / 8 / 32.

    python bench/gpu_check.py --out DIR            # on a GPU: V4-Flash layer shapes sized to one H200
    python bench/gpu_check.py --out DIR --dry-run  # any backend, tiny sizes (CI: the same code path)

Grouped experts (`layers.moe.kernel_experts`, bf16 and FP4 experts on the GPU, fp32 in the dry run):
for N tokens routed to k of E experts, the bytes it must read at least are the stored bytes of
the distinct selected experts (w1, w3, w2) plus the tokens; bandwidth = bytes / median time,
against the H200's 4.8 TB/s. The dense reference (`dense_experts`) is timed beside it.

Model: V4-Flash layer shapes (hidden 4096, 64 heads x 512, 256 experts of 2048, window 128, CSA 4 /
HCA 128) with 2 layers (csa, hca) in bf16 (~13 GB of experts per layer) plus the MTP block (4
layers fit one H200 too, but their 30 stage compiles would not fit the 8 minutes); the dry run
uses 2 layers of the `test` preset at batch 1. Per attention impl and batch: `stages.time_stages` of a
s3_k2_d6 cycle of the MTP draft on a prefilled state (draft, plan, verify, commit = accept + commit),
and one AR step (`speculation.stages.ar_step`); break-even tau = sum of stages / AR step (the accepted
length a spec needs to match AR).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxspec as js  # noqa: E402
from jaxspec import testing  # noqa: E402
from jaxspec.harness import stages  # noqa: E402
from jaxspec.layers import moe  # noqa: E402
from jaxspec.model.sampling import Sampling  # noqa: E402
from jaxspec.ops import quant  # noqa: E402
from jaxspec.speculation import stages as programs  # noqa: E402

H200_TBPS = 4.8


def _experts(cfg, fmt, key):
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"w1": (e, d, i), "w3": (e, d, i), "w2": (e, i, d)}
    keys = dict(zip(shapes, jax.random.split(key, 3), strict=True))
    if fmt == "plain":
        return moe.MLPParams(**{n: 0.02 * jax.random.normal(keys[n], s, cfg.dtype) for n, s in shapes.items()})

    def fp4(k, s):
        data = jax.random.randint(k, (s[0], s[1] // 2, s[2]), 0, 256, jnp.int32).astype(jnp.uint8)
        scale = jnp.full((s[0], s[1] // 32, s[2]), 2.0**-6, jnp.float32).astype(jnp.float8_e8m0fnu)
        return quant.BlockScaled(data=data, scale=scale, block=(1, 32, 1), dtype=cfg.dtype)

    return moe.MLPParams(**{n: fp4(keys[n], s) for n, s in shapes.items()})


def grouped_experts_bandwidth(cfg, tokens, iters) -> list[dict]:
    rows = []
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    for fmt in ("plain", "fp4"):
        experts = _experts(cfg, fmt, jax.random.key(1))
        per_expert = sum(quant.stored_nbytes(w) for w in (experts.w1, experts.w3, experts.w2)) // e
        kernel = jax.jit(lambda ex, x, idx, w: moe.kernel_experts(ex, cfg, x, idx, w))
        dense = jax.jit(lambda ex, x, idx, w: moe.dense_experts(ex, cfg, x, idx, w))
        for n in tokens:
            rng = np.random.default_rng(n)
            idx = jnp.asarray(np.argsort(rng.random((n, e)), axis=-1)[:, :k], jnp.int32)
            x = jnp.asarray(rng.standard_normal((n, cfg.hidden_size)), cfg.dtype)
            w = jnp.asarray(rng.random((n, k)), jnp.float32)
            distinct = len(np.unique(np.asarray(idx)))
            nbytes = distinct * per_expert + 2 * x.nbytes
            args = (experts, x, idx, w)
            _, t_kernel, outs = stages.median_seconds(lambda _, f=kernel, a=args: f(*a), None, iters)
            _, t_dense, refs = stages.median_seconds(lambda _, f=dense, a=args: f(*a), None, iters)
            err = float(jnp.max(jnp.abs(outs[-1] - refs[-1])) / (jnp.max(jnp.abs(refs[-1])) + 1e-30))
            tbps = nbytes / t_kernel / 1e12
            rows.append({"fmt": fmt, "tokens": n, "distinct_experts": distinct, "bytes": nbytes,
                         "kernel_ms": 1e3 * t_kernel, "dense_ms": 1e3 * t_dense, "kernel_TBps": tbps,
                         "pct_of_h200": 100 * tbps / H200_TBPS, "rel_err_vs_dense": err})
    return rows


def stage_split(cfg, batches, spec_name, prompt_len, iters, budget_s) -> list[dict]:
    """Cases past `budget_s` seconds are skipped and listed as such (compiles dominate on a GPU)."""
    params = js.init_params(cfg, jax.random.key(0))
    models, sampling = testing.mtp_models(params), Sampling.create()
    out, start = [], time.perf_counter()
    for b in batches:
        for impl in ("pallas", "xla"):
            c = cfg.replace(kernels=impl)
            if time.perf_counter() - start > budget_s:
                out.append({"attention": impl, "batch": b, "spec": spec_name, "skipped": f"budget {budget_s:.0f} s"})
                continue
            tokens = jax.random.randint(jax.random.key(b), (b, prompt_len), 0, c.vocab_size, jnp.int32)
            lengths = jnp.full((b,), prompt_len, jnp.int32)
            sp = testing.mtp_speculator(c, spec_name)
            state = programs.prefill(sp, models, tokens, lengths, prompt_len + 64, sampling)
            st = stages.time_stages(sp, models, state, iters=iters)
            _, ar_s, _ = stages.median_seconds(lambda carry, c=c: programs.ar_step(models.target, c, *carry),
                                               (state.target, state.root), iters)
            ar_ms = 1e3 * ar_s
            out.append({"attention": impl, "batch": b, "spec": spec_name, **st, "ar_step_ms": ar_ms,
                        "cycle_over_ar": st["sum_of_stages_ms"] / ar_ms,
                        "break_even_tau": st["sum_of_stages_ms"] / ar_ms})
    return out


def flash_sized(num_layers: int = 2) -> js.ModelConfig:
    types = ("csa", "hca") * (num_layers // 2)
    return js.ModelConfig.preset("v4-flash").replace(num_layers=num_layers, layer_types=types, num_hash_layers=1)


def markdown(result: dict) -> str:
    lines = [f"# GPU check ({result['backend']}, {result['device']}, jax {result['jax']})", "",
             "## Grouped experts (kernel vs dense reference)", "",
             "| fmt | tokens | experts read | MB | kernel ms | dense ms | TB/s | % of 4.8 TB/s | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["grouped_experts"]:
        lines.append(f"| {r['fmt']} | {r['tokens']} | {r['distinct_experts']} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['kernel_ms']:.3f} | {r['dense_ms']:.3f} | {r['kernel_TBps']:.3f} | "
                     f"{r['pct_of_h200']:.1f} | {r['rel_err_vs_dense']:.1e} |")
    lines += ["", f"## Stage split ({result['model']})", "",
              "| attention | batch | draft ms | plan ms | verify ms | accept + commit ms | cycle ms | AR step ms | "
              "break-even tau |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["stages"]:
        if "skipped" in r:
            lines.append(f"| {r['attention']} | {r['batch']} | skipped ({r['skipped']}) |||||||")
            continue
        s = r["stage_ms"]
        lines.append(f"| {r['attention']} | {r['batch']} | {s['draft']:.2f} | {s['plan']:.2f} | {s['verify']:.2f} | "
                     f"{s['commit']:.2f} | {r['sum_of_stages_ms']:.2f} | {r['ar_step_ms']:.2f} | "
                     f"{r['break_even_tau']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="grouped-experts bandwidth and stage split on one GPU")
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on any backend (CI)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the stage split; later cases skip")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.dry_run:
        cfg = js.ModelConfig.preset("test").replace(num_layers=2, layer_types=("csa", "hca"))
        model, batches, iters, prompt = "test preset, 2 layers", (1,), 1, 8
        moe_cfg = cfg.replace(hidden_size=64, moe_intermediate_size=64, n_routed_experts=8)
        tokens = (8,)
    else:
        cfg = flash_sized()
        model, batches, iters, prompt = "V4-Flash layers x2, bf16", (1, 8, 32), 10, 64
        moe_cfg, tokens = cfg, (6, 48, 192)
    result = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "dry_run": args.dry_run, "model": model}
    result["grouped_experts"] = grouped_experts_bandwidth(moe_cfg, tokens, iters)
    print(f"grouped experts done, {time.perf_counter() - start:.0f} s", flush=True)
    budget = float("inf") if args.dry_run else args.budget  # the dry run must cover every case
    result["stages"] = stage_split(cfg, batches, "s3_k2_d6", prompt, iters, budget)
    result["seconds"] = time.perf_counter() - start
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    tol = 1e-5 if moe_cfg.dtype == "float32" else 2e-2
    bad = [r for r in result["grouped_experts"] if r["rel_err_vs_dense"] > tol]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
