"""Decode throughput of `jaxspec.speculation.generate` (plain autoregressive decoding, random init).

    python bench/decode.py [--preset tiny] [--batch 1 8] [--prompt-len 32] [--new-tokens 128]
                           [--repeats 3] [--seed 0] [--json PATH]

Per batch size: one warm-up call (compile excluded from every number), then `repeats` timed calls.
Reported:
  * decode tok/s   = batch * new_tokens / median end-to-end time of a `max_new_tokens=new_tokens` call
                     (prefill included, as a user sees it);
  * ms / step      = that time / stats["decode_steps"] (steps count the prefill-sampled token too);
  * prefill ms     = median time of a separate `max_new_tokens=1` call (prompt forward + 1 sample;
                     its cache is bucketed smaller, so it is a close, not exact, share of the above);
  * loop ms / step = (time - prefill) / (decode_steps - 1): the while-loop decode step alone.
Greedy sampling, no eos, so every call runs exactly `new_tokens` steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
from _common import check_positive, console, machine_facts, machine_header, parser, write_json
from rich.table import Table

import jaxspec as js
from jaxspec.speculation.generate import compile_count


def _timed(params, cfg, prompts, new_tokens: int) -> tuple[float, js.GenerateOutput]:
    t0 = time.perf_counter()
    out = js.generate(params, cfg, prompts, max_new_tokens=new_tokens)
    jax.block_until_ready(out.tokens)  # already numpy; kept so the timing boundary is explicit
    np.asarray(out.tokens)
    return time.perf_counter() - t0, out


def bench_batch(params, cfg, batch: int, prompt_len: int, new_tokens: int, repeats: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed + batch)
    prompts = rng.integers(0, cfg.vocab_size, size=(batch, prompt_len), dtype=np.int32)

    c0 = compile_count()
    t_compile = time.perf_counter()
    _timed(params, cfg, prompts, new_tokens)  # warm-up: compiles the full-length program
    _timed(params, cfg, prompts, 1)  # warm-up: compiles the prefill-only program
    compile_s = time.perf_counter() - t_compile
    compiles = compile_count() - c0

    full, prefill, steps = [], [], []
    for _ in range(repeats):
        dt, out = _timed(params, cfg, prompts, new_tokens)
        full.append(dt)
        steps.append(out.stats["decode_steps"])
        dt1, _ = _timed(params, cfg, prompts, 1)
        prefill.append(dt1)
    if compile_count() != c0 + compiles:
        print(f"warning: batch {batch} recompiled during the timed runs", file=sys.stderr)

    t = statistics.median(full)
    t_pre = statistics.median(prefill)
    n_steps = int(statistics.median(steps))
    loop_steps = max(n_steps - 1, 1)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "decode_steps": n_steps,
        "time_s": t,
        "time_s_all": full,
        "tokens_per_s": batch * new_tokens / t,
        "ms_per_step": 1e3 * t / n_steps,
        "prefill_ms": 1e3 * t_pre,
        "prefill_ms_all": [1e3 * x for x in prefill],
        "loop_ms_per_step": 1e3 * max(t - t_pre, 0.0) / loop_steps,
        "warmup_s": compile_s,
        "new_compiles": compiles,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, seed_help="prompt seed")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    check_positive(p, args, ("prompt_len", "new_tokens", "repeats", "batch"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    con = console()
    try:
        cfg = js.ModelConfig.preset(args.preset)
    except ValueError as e:
        sys.exit(f"decode.py: error: {e}")

    facts = machine_facts()
    header = machine_header(facts, "accelerator throughput")
    con.print(f"[bold]jaxspec decode benchmark[/]  preset={args.preset} dtype={cfg.dtype} "
              f"prompt_len={args.prompt_len} new_tokens={args.new_tokens} repeats={args.repeats}")
    con.print(header)

    t0 = time.perf_counter()
    params = js.init_params(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0

    rows = []
    for b in args.batch:
        with con.status(f"batch {b}: compiling + timing..."):
            rows.append(bench_batch(params, cfg, b, args.prompt_len, args.new_tokens, args.repeats, args.seed))

    table = Table(title=f"generate() decode throughput: {args.preset} ({facts['backend'].upper()})")
    table.add_column("batch", justify="right", no_wrap=True)
    for name in ("decode tok/s", "ms/step", "prefill ms", "loop ms/step", "steps", "run s", "warm-up s"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["batch"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['ms_per_step']:.2f}",
            f"{r['prefill_ms']:.1f}",
            f"{r['loop_ms_per_step']:.2f}",
            str(r["decode_steps"]),
            f"{r['time_s']:.3f}",
            f"{r['warmup_s']:.1f}",
        )
    con.print(table)
    con.print(
        "decode tok/s = batch*new_tokens / end-to-end run time (prefill included, compile excluded); "
        "ms/step = run time / decode_steps; prefill ms = a max_new_tokens=1 run; "
        "loop ms/step = (run - prefill) / (steps - 1); run s = median of repeats; "
        "warm-up s = compile + first runs."
    )

    result = {
        "preset": args.preset,
        "dtype": cfg.dtype,
        **facts,
        "init_s": init_s,
        "results": rows,
    }
    write_json(args.json, result, con)
    return result


if __name__ == "__main__":
    main()
