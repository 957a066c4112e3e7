"""Each stage of a speculative cycle against its roofline floor on this machine.

    python bench/roofline.py [--checkpoint PATH | --preset tiny] [--batch 1] [--prompt-len 32]
                             [--specs s3_k1_d4 s7_k1_d8] [--verify-tokens 1 2 4 8 16] [--calls 20]
                             [--rounds 5] [--overlap RHO | --measure-overlap] [--core N] [--json PATH]

Floor = max(bytes / bandwidth, FLOPs / matmul rate): the bytes a stage must read and write and
the FLOPs it must do, from the analytic stage table (`jaxspec.cost.terms`: every weight of
the units it runs once, the routed experts at the expected union of its tokens' selections under
routing overlap rho, the state rows it reads and writes), over this core's bandwidth and fp32
matmul rate measured by `jaxspec.core.measure` just before (a 64 MB read: the checkpoint's weights
also stream from the shared L3; the matmul rate at the stage's rows, interpolated between 8 and
512). docs/results.md ("Roofline") writes the AR step's bytes out by hand.

Measured = device time of the stage as the loop runs it: each stage is jitted inside a
`fori_loop` of `--calls` calls (the state carried where the stage advances it, an artificial
dependence otherwise, so XLA cannot hoist it), with the compiler options the engine's programs
use and the CPU layout of the params (`model.cpu_layout`), so no Python dispatch is counted.
The loops are timed round-robin, `--rounds` rounds, min and median per call; the `jaxspec.core.measure`
verdict says whether the machine was quiet. Stages:
  ar           one greedy decode step (extend, T = 1), state carried
  verify T     the target forward over a T-token chain (a tree's plan), against the prefilled state,
               a different window of the target's continuation each call (routing varies as in decoding)
  draft        the draft stage of a spec (`cycle.draft_stage`: S MTP steps of the beam + prune_to_budget)
               from a different root each call; "draft step" = draft / S
  accept       greedy acceptance + commit of the accepted path (`cycle.accept_stage` + `commit_stage`),
               the whole SpecState carried
  cycle        the whole speculative cycle (`cycle.speculative_cycle`, draft .. commit), state carried
A checkpoint runs with its own draft (`Checkpoint.draft`, its calibration ranking the tree as the loop does).
The floor of the cycle is the sum of its stages' floors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from _common import check_positive, console, cycle_of, parser, write_json

from jaxspec.core import measure

STAGE_NAMES = ("ar", "verify", "draft", "draft step", "accept", "cycle")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, preset="tiny")
    p.add_argument("--checkpoint", metavar="PATH", help="a trained checkpoint folder instead of a random-init preset")
    p.add_argument("--draft", metavar="NAME", help="time drafts/NAME/ of the checkpoint (e.g. dspark) instead of "
                   "its own MTP draft")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--specs", nargs="+", default=["s3_k1_d4", "s7_k1_d8"])
    p.add_argument("--verify-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--calls", type=int, default=20, help="calls per jitted loop")
    p.add_argument("--rounds", type=int, default=5, help="round-robin rounds")
    p.add_argument("--overlap", type=float, default=None, help="routing overlap rho for the floors (default: "
                   "measured on GSM8K test prompts with a checkpoint, else 0)")
    p.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last allowed)")
    args = p.parse_args(argv)
    check_positive(p, args, ("batch", "prompt_len", "calls", "rounds", "verify_tokens"))
    if args.overlap is not None and not 0 <= args.overlap < 1:
        p.error("--overlap must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    pinned = measure.pin(args.core)  # before the first computation: XLA reads its flags then
    import jax
    import jax.numpy as jnp
    import numpy as np
    from rich.table import Table
    from spec_vs_ar import gsm8k_prompts, load_model

    import jaxspec as js
    from jaxspec.core.programs import compiler_options
    from jaxspec.cost import terms
    from jaxspec.model.network import cpu_layout, extend, forward
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation import cycle as cycle_lib
    from jaxspec.speculation import stages as programs
    from jaxspec.speculation.cycle import SpecStats
    from jaxspec.speculation.dspark import DSparkDrafter
    from jaxspec.speculation.generate import length_bucket
    from jaxspec.speculation.plan import build_plan, verify_context

    con = console()
    specs = [js.SpecConfig.parse(s) for s in args.specs]
    if args.checkpoint:
        cfg, params, tok, note, draft = load_model(args.checkpoint, args.draft)  # the CPU's expert layout already
    else:
        cfg = js.ModelConfig.preset(args.preset).replace(dtype="float32")
        params, tok, note, draft = js.init_params(cfg, jax.random.key(0)), None, "", None
        params = cpu_layout(params, cfg)
    sampling = Sampling.create()  # greedy
    b, r = args.batch, args.calls
    data = gsm8k_prompts(tok, b, args.prompt_len)
    prompts = (jnp.asarray(data) if data is not None else
               jax.random.randint(jax.random.key(args.seed), (b, args.prompt_len), 0, cfg.vocab_size))
    overlap = args.overlap
    if overlap is None:
        overlap = 0.0
        if data is not None:
            from jaxspec.cost.overlap import measure as measure_overlap
            overlap = measure_overlap(params, cfg, [list(map(int, row)) for row in np.asarray(prompts)], 2)["overlap"]
    max_steps = max(s.num_steps for s in specs)
    max_len = length_bucket(args.prompt_len + r * (max_steps + 1) + max_steps + 1, cfg.max_position_embeddings,
                            minimum=64)
    lengths = jnp.full((b,), args.prompt_len, jnp.int32)
    speculators = {spec.name: cycle_of(params, cfg, spec, draft)[0] for spec in specs}
    sp0, models = cycle_of(params, cfg, specs[0], draft)
    prefilled = programs.prefill(sp0, models, prompts, lengths, max_len, sampling)  # the drafter follows it too
    state, root = prefilled.target, prefilled.root
    opts = compiler_options()

    def loop(body, carry):
        """jit of a fori_loop of `r` calls of body(models, carry) -> carry."""
        return jax.jit(lambda p, c: jax.lax.fori_loop(0, r, lambda i, c: body(p, c), c), compiler_options=opts)

    def bump(tokens, x):  # a dependence on the last call's output that never changes the tokens
        return tokens + (jnp.sum(x) > 3e38).astype(tokens.dtype)

    def bumped(tree, x):  # every leaf made to depend on x (adds 0), so XLA hoists nothing out of the loop
        zero = jnp.sum(x) > 3e38
        return jax.tree.map(lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.number) else a, tree)

    calls: dict[str, tuple[Any, Any]] = {}
    ones = jnp.ones((b, 1), bool)

    def ar_body(p, c):
        s, last = c
        out, s = extend(p.target, cfg, s, last[:, None], ones)
        return s, jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)

    calls["ar"] = (loop(ar_body, None), (state, root))
    # A verify reads the experts its tokens route to: verify windows of the target's own greedy
    # continuation (what a fully accepted chain verifies), a different window each call. One window
    # repeated keeps the same experts hot in the cache call after call and reads faster than decoding
    # does (measured: a fused s3_k1_d4 cycle from one repeated state 3.41 ms, carried 3.75 ms).
    span = max(max(args.verify_tokens), 8) * 10
    continuation = jnp.asarray(js.generate(params, cfg, np.asarray(prompts), max_new_tokens=span).tokens)

    def window(i, t):  # [B, t] the i-th call's tokens
        start = (i * t) % (span - t + 1)
        return jax.lax.dynamic_slice_in_dim(continuation, start, t, axis=1)

    for t in args.verify_tokens:
        parent = jnp.broadcast_to(jnp.arange(-1, t - 1, dtype=jnp.int32), (b, t))

        def verify_body(p, c, parent=parent, t=t):
            i, acc = c
            st = bumped(state, acc)
            ctx = verify_context(build_plan(bump(parent, acc), st.length, t), st.length)
            out = forward(p.target, cfg, st, bump(window(i, t), acc), ctx, capture=sp0.drafter.capture)
            return i + 1, out.logits[:, :, 0]

        calls[f"verify {t}"] = (loop(verify_body, None), (jnp.int32(0), jnp.zeros((b, t), jnp.float32)))
    resolved = {}
    active = jnp.ones((b,), bool)
    for sp in speculators.values():
        spec = sp.spec  # scores resolved as the loop resolves them
        resolved[spec.name] = (spec, sp.policy.values)
        start = prefilled.replace(stats=SpecStats.zeros(spec, b))  # the prefilled state, this spec's counters

        def draft_body(p, c, sp=sp, start=start):  # a different root token each call, as in decoding
            i, acc = c
            rt = bump(window(i, 1)[:, 0], acc)
            tree = cycle_lib.draft_stage(sp, p, bumped(start, acc).replace(root=rt), sampling)
            return i + 1, tree.tokens.astype(jnp.float32)

        calls[f"draft {spec.name}"] = (loop(draft_body, None), (jnp.int32(0), jnp.zeros((b, spec.num_draft_tokens))))
        tree = programs.draft(sp, models, start, sampling)
        verify_out = programs.verify(sp, models, state, tree, programs.plan(sp, state, tree))

        def accept_body(p, c, sp=sp, tree=tree, verify_out=verify_out):
            # The state is carried: every layer's commit and the drafter's follow are live (a loop that kept
            # one slice of the state let XLA drop the rest and timed 0.03 ms where the commit costs 0.11).
            logits = bumped(verify_out.logits, c.target.length)  # not hoisted out of the loop
            acceptance = cycle_lib.accept_stage(sp, tree, logits, sampling, c.stats.cycles)
            return cycle_lib.commit_stage(sp, p, c, tree, verify_out, acceptance, active)[0]

        calls[f"accept {spec.name}"] = (loop(accept_body, None), start)

        def cycle_body(p, c, sp=sp):
            return cycle_lib.speculative_cycle(sp, p, c, sampling, active)[0]

        calls[f"cycle {spec.name}"] = (loop(cycle_body, None), start)

    with con.status("compiling the stage loops..."):
        runs = {}
        for name, (fn, carry) in calls.items():
            jax.block_until_ready(fn(models, carry))
            runs[name] = (lambda fn=fn, carry=carry: fn(models, carry))
    with con.status("measuring this core..."):
        rates = measure.machine_rates()
    with measure.Watch() as watch, con.status("timing..."):
        timings = measure.round_robin(runs, args.rounds)
    verdict = watch.verdict(timings["ar"], "AR loop")

    def floor(costs: terms.Costs, rows: int) -> dict[str, float]:
        mem = costs.total_bytes / (rates.bandwidth_gbs * 1e9)
        flop = costs.total_flops / (rates.matmul_gflops(rows) * 1e9)
        return {"bytes": costs.total_bytes, "flops": costs.total_flops, "memory_s": mem, "compute_s": flop,
                "floor_s": max(mem, flop), "bound": "memory" if mem >= flop else "compute"}

    context = args.prompt_len + r // 2  # the AR loop's mean context; the others read the prefilled state
    setup = terms.Setup(cfg, (1, 1, 1), b, max(context, 2), overlap=overlap)
    rows: list[dict[str, Any]] = []

    def add(stage: str, name: str, measured_s: float, median_s: float, costs: terms.Costs, rows_: int, per=1.0):
        f = floor(costs, rows_)
        rows.append({"stage": stage, "name": name, "measured_ms": 1e3 * measured_s / per,
                     "median_ms": 1e3 * median_s / per, **{k: (v / per if k != "bound" else v) for k, v in f.items()},
                     "ratio": measured_s / f["floor_s"]})

    def per_call(name):
        t = timings[name]
        return min(t.seconds) / r, t.median / r

    add("ar", "AR step", *per_call("ar"), terms.stage_table(setup, None)["ar"], b)
    for t in args.verify_tokens:
        spec_t = js.SpecConfig(num_steps=max(t - 1, 1), topk=1, num_draft_tokens=t) if t > 1 else None
        costs = (terms.stage_table(setup, spec_t)["verify"] if spec_t else terms.main_pass(setup, 1, commit=0))
        add("verify", f"verify {t}", *per_call(f"verify {t}"), costs, b * t)
    block = draft.drafter.config if draft is not None and isinstance(draft.drafter, DSparkDrafter) else None
    for name, (spec, _) in resolved.items():
        table = terms.stage_table(setup, spec, block)
        add("draft", f"draft {name}", *per_call(f"draft {name}"), table["draft"], b * spec.topk)
        m, med = per_call(f"draft {name}")
        add("draft step", f"draft step {name}", m, med, table["draft"], b * spec.topk, per=spec.num_steps)
        add("accept", f"accept+commit {name}", *per_call(f"accept {name}"), table["commit"], b * (spec.num_steps + 1))
        cycle = table["draft"] + table["plan"] + table["verify"] + table["commit"]
        add("cycle", f"cycle {name}", *per_call(f"cycle {name}"), cycle, b * spec.num_draft_tokens)

    table = Table(title=f"roofline: {'checkpoint ' + args.checkpoint if args.checkpoint else args.preset}{note}, "
                        f"batch {b}, prompt {args.prompt_len}, rho {overlap:.2f}")
    for col in ("stage", "measured ms (min / median)", "MB", "MFLOP", "floor ms", "bound", "measured / floor"):
        table.add_column(col, justify="left" if col in ("stage", "bound") else "right", no_wrap=True)
    for row in rows:
        ratio = row["ratio"]
        colour = "green" if ratio <= (1.5 if row["stage"] == "ar" else 2.0) else "red"
        table.add_row(row["name"], f"{row['measured_ms']:.3f} / {row['median_ms']:.3f}", f"{row['bytes'] / 1e6:.2f}",
                      f"{row['flops'] / 1e6:.1f}", f"{1e3 * row['floor_s']:.3f}", row["bound"],
                      f"[{colour}]{ratio:.2f}[/]")
    con.print(table)
    con.print(f"this core: {rates.bandwidth_gbs:.1f} GB/s read ({measure.PROBE_MB} MB), matmul "
              f"{rates.matmul_gflops_8:.0f} / {rates.matmul_gflops_512:.0f} GFLOP/s at 8 / 512 rows; measured = min "
              f"over {args.rounds} rounds of a {r}-call jitted loop, per call; bars: AR <= 1.5x, every other stage "
              "<= 2x its floor")
    con.print(measure.verdict_line(verdict))
    result = {"checkpoint": args.checkpoint, "preset": None if args.checkpoint else args.preset, "batch": b,
              "prompt_len": args.prompt_len, "overlap": overlap, "calls": r, "rounds": args.rounds,
              "rates": rates.__dict__, "rows": rows, "verdict": verdict, "pinned": pinned,
              "jax_version": jax.__version__, "time": time.strftime("%Y-%m-%d %H:%M")}
    write_json(args.json, result, con)
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
