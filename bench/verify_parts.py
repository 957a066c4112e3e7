"""Where a verify's time goes on a CPU, against a decode step's: each timed whole, then with one part
replaced by a stand-in that costs nothing (attribution only: those outputs are not the model's).

    python bench/verify_parts.py [--checkpoint checkpoints/tiny-v4] [--draft dspark] [--verify-tokens 4 8]
                                 [--prompt-len 32] [--calls 20] [--rounds 7] [--core 1] [--json PATH]

Each program is a jitted loop of --calls calls, as `bench/roofline.py` times them: the AR step with the
state carried, a verify of T tokens of the target's own greedy continuation (a different window each
call, capturing the drafter's features), against the prefilled prompt; the AR step is fed the same
continuation token by token, so no variant changes what the experts are routed on. Variants:

  whole           the model as decoding runs it
  no attention    each layer's attention output replaced by half its input (its rows still written)
  no routed       the routed experts replaced by half their input (the router goes with them)
  no MoE          the whole MoE (routed and shared experts) replaced the same way
  no head         the final norm and vocabulary projection replaced by a sum over the streams
  union experts   the routed experts by the union path at every size (each selected expert on all
                  rows; the engine's path before the blocked one): the same outputs, another cost

Round-robin over --rounds rounds on one pinned core, with a verdict (`jaxspec.core.measure`); the table
gives the median ms per call and, for each removed part, what it cost (whole less the variant).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any
from unittest import mock

from _common import check_positive, console, cycle_of, write_json

from jaxspec.core import measure


def variants() -> dict[str, Any]:
    """name -> a context manager that swaps the part out while the programs are traced."""
    import jax.numpy as jnp

    from jaxspec.layers import moe
    from jaxspec.model import network

    attention = network.attention
    return {
        "whole": contextlib.nullcontext,
        "no attention": lambda: mock.patch.object(
            network, "attention", lambda p, cfg, kind, x, ls, ctx: (x * 0.5, attention(p, cfg, kind, x, ls, ctx)[1])),
        "no routed": lambda: mock.patch.object(moe, "sparse_experts", lambda experts, cfg, x, i, w: x * 0.5),
        "no MoE": lambda: mock.patch.object(network, "moe", lambda p, cfg, x, ids: x * 0.5),
        "no head": lambda: mock.patch.object(
            network, "head_logits", lambda params, cfg, streams, final=None: jnp.sum(streams, axis=2)[..., :2]),
        "union experts": lambda: mock.patch.object(moe, "cpu_experts_path", lambda assignments, e, k: "union"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    p.add_argument("--draft", default="dspark", help="the drafter whose features the verify captures")
    p.add_argument("--verify-tokens", type=int, nargs="+", default=[4, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--core", type=int, default=None, help="pin to this core (default: the last allowed)")
    args = p.parse_args(argv)
    check_positive(p, args, ("verify_tokens", "prompt_len", "calls", "rounds"))
    pinned = measure.pin(args.core)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from rich.table import Table
    from spec_vs_ar import gsm8k_prompts, load_model

    import jaxspec as js
    from jaxspec.core.programs import compiler_options
    from jaxspec.model import network
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation import stages
    from jaxspec.speculation.generate import length_bucket
    from jaxspec.speculation.plan import build_plan, verify_context

    con = console()
    cfg, params, tok, _, draft = load_model(os.path.expanduser(args.checkpoint), args.draft)
    prompts = gsm8k_prompts(tok, 1, args.prompt_len)
    if prompts is None:
        raise SystemExit("needs the GSM8K data (JAXSPEC_DATA) and a checkpoint with a tokenizer")
    prompts = jnp.asarray(prompts)
    sp, models = cycle_of(params, cfg, js.SpecConfig.parse("s1_k1_d2"), draft)
    max_len = length_bucket(args.prompt_len + args.calls + 1, cfg.max_position_embeddings, minimum=64)
    pre = stages.prefill(sp, models, prompts, jnp.full((1,), args.prompt_len, jnp.int32), max_len, Sampling.create())
    span = max(args.verify_tokens) * 10
    continuation = jnp.asarray(js.generate(params, cfg, np.asarray(prompts), max_new_tokens=span).tokens)
    ones = jnp.ones((1, 1), bool)

    def ar_body(m, c):  # the continuation's tokens in turn, whatever a variant's logits say
        s, i, acc = c
        dep = (jnp.sum(acc) > 3e38).astype(jnp.int32)
        token = jax.lax.dynamic_slice_in_dim(continuation, i % span, 1, axis=1) + dep
        out, s = network.extend(m.target, cfg, s, token, ones)
        return s, i + 1, out.logits[:, 0, :1]

    def verify_body(t):
        parent = jnp.arange(-1, t - 1, dtype=jnp.int32)[None]

        def body(m, c):
            i, acc = c
            dep = (jnp.sum(acc) > 3e38).astype(jnp.int32)  # never true: keeps XLA from hoisting the call
            tokens = jax.lax.dynamic_slice_in_dim(continuation, (i * t) % (span - t + 1), t, axis=1) + dep
            ctx = verify_context(build_plan(parent + dep, pre.target.length, t), pre.target.length)
            out = network.forward(m.target, cfg, pre.target, tokens, ctx, capture=sp.drafter.capture)
            return i + 1, out.logits[:, :, 0]

        return body

    programs = [("AR step", ar_body, (pre.target, jnp.int32(0), jnp.zeros((1, 1))))]
    programs += [(f"verify {t}", verify_body(t), (jnp.int32(0), jnp.zeros((1, t)))) for t in args.verify_tokens]
    calls = {}
    with con.status("compiling..."):
        for name, swap in variants().items():
            for program, body, carry in programs:
                with swap():
                    fn = jax.jit(lambda m, c, body=body: jax.lax.fori_loop(0, args.calls, lambda i, c: body(m, c), c),
                                 compiler_options=compiler_options()).lower(models, carry).compile()
                jax.block_until_ready(fn(models, carry))
                calls[(name, program)] = (lambda fn=fn, carry=carry: fn(models, carry))
    with measure.Watch() as watch, con.status("timing..."):
        timings = measure.round_robin(calls, args.rounds)
    verdict = watch.verdict(timings[("whole", "AR step")])
    ms = {key: 1e3 * t.median / args.calls for key, t in timings.items()}
    table = Table(title=f"{args.checkpoint}, prompt {args.prompt_len}, batch 1: ms per call (what the part costs)")
    table.add_column("variant")
    for program, _, _ in programs:
        table.add_column(program, justify="right")
    rows = []
    for name in variants():
        cells = []
        for program, _, _ in programs:
            value, whole = ms[(name, program)], ms[("whole", program)]
            cells.append(f"{value:.3f}" + ("" if name == "whole" else f" ({whole - value:+.3f})"))
            rows.append({"variant": name, "program": program, "ms": value, "whole_less_variant_ms": whole - value})
        table.add_row(name, *cells)
    con.print(table)
    con.print(measure.verdict_line(verdict))
    result = {"checkpoint": args.checkpoint, "draft": args.draft, "prompt_len": args.prompt_len,
              "calls": args.calls, "rounds": args.rounds, "rows": rows,
              "verdict": verdict, "pinned": pinned, "jax_version": jax.__version__}
    write_json(args.json, result, con)
    return result


if __name__ == "__main__":
    main()
