"""Speculative (`speculative_generate`) vs autoregressive (`generate`) decoding, random init.

    python bench/spec_vs_ar.py [--preset tiny] [--specs s3_k1_d4 s7_k1_d8 s3_k2_d6 s4_k2_d8]
                               [--variants random agreeing] [--batch 1] [--prompt-len 32]
                               [--new-tokens 64] [--repeats 2] [--stage-iters 10] [--no-stages] [--fused-cycle]
                               [--json PATH]

Model variants (both from `init_params(cfg, jax.random.key(0))`):
  * random   : plain random init; the MTP draft almost never agrees with the target (tau ~ 1),
               so speculation shows its pure overhead;
  * agreeing : the same transformation as jaxspec.testing `high_acceptance` (damped sub-layers,
               MTP made to compute the target's token -> next-token function), so drafts are
               accepted often and the table shows what high acceptance buys.

Part 1, end-to-end (per variant, batch, spec): one warm-up call each (compile excluded; its output
feeds the check and tau/cycles, which are deterministic), then `repeats` rounds timing AR and every
spec round-robin (so load changes on a shared machine hit all alike); median per method.
  tok/s = batch * new_tokens / median time (prefill included); x AR = spec tok/s / AR tok/s of
  the same variant and batch; tau = mean accepted length (accepted drafts + bonus per cycle);
  cycles = verify cycles summed over the batch; check = greedy spec tokens == generate's tokens.

Part 2, one cycle split into separately jitted stages, on a state prefilled with the prompt
(target extend + MTP ring prefill, as `_speculative_loop` does), cache sized as the end-to-end run:
  (a) draft   = draft_tree + prune_to_budget     (b) plan   = build_plan
  (c) verify  = target forward with verify_context (d) accept = argmax + greedy_accept + commit_accepted_path
each timed with block_until_ready, median over `stage-iters` calls, plus a 1-token decode step
(`extend`, T=1) for reference. break-even tau = sum of stages / decode step: the mean accepted length
a spec needs to match AR per cycle. e2e ms/cycle = that spec's end-to-end run time / its loop
cycles (prefill included; the whole cycle fused in the while_loop). `--fused-cycle` also times
`speculative_cycle` in one jit (one more compile per spec). Stage cost does not depend on
parameter values, so it is measured once, on the first variant.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _machine import machine_facts, machine_header
from rich.console import Console
from rich.table import Table

import jaxspec as js
from jaxspec.generate import (
    compile_count,
    length_bucket,
    prefill_for_speculation,
    speculative_compile_count,
    speculative_cycle,
)
from jaxspec.model import extend, forward
from jaxspec.testing import high_acceptance
from jaxspec.tree.commit import commit_accepted_path
from jaxspec.tree.draft import draft_tree, prune_to_budget
from jaxspec.tree.plan import build_plan, verify_context
from jaxspec.tree.verify import greedy_accept

DEFAULT_SPECS = ["s3_k1_d4", "s7_k1_d8", "s3_k2_d6", "s4_k2_d8"]
VARIANTS = ("random", "agreeing")
STAGES = ("draft", "plan", "verify", "accept")


# ---------------------------------------------------------------------------------------------
# Model variants
# ---------------------------------------------------------------------------------------------




def make_variant(name: str, base):
    if name == "random":
        return base
    if name == "agreeing":
        return high_acceptance(base)
    raise ValueError(name)


# ---------------------------------------------------------------------------------------------
# Part 1: end-to-end
# ---------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], js.GenerateOutput]) -> tuple[float, js.GenerateOutput]:
    t0 = time.perf_counter()
    out = fn()
    np.asarray(out.tokens)  # already host numpy: the call is synchronous
    return time.perf_counter() - t0, out


def bench_end_to_end(params, cfg, prompts, specs, new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Warm up AR and every spec (compile + reference output), then time them round-robin, `repeats` rounds."""
    batch = prompts.shape[0]
    runs: dict[str, Callable[[], js.GenerateOutput]] = {
        "AR": lambda: js.generate(params, cfg, prompts, max_new_tokens=new_tokens)
    }
    for spec in specs:
        runs[spec] = functools.partial(js.speculative_generate, params, cfg, prompts, spec, max_new_tokens=new_tokens)
    c0, s0 = compile_count(), speculative_compile_count()
    warm, outs = {}, {}
    for name, fn in runs.items():
        warm[name], outs[name] = _timed(fn)
    c1, s1 = compile_count(), speculative_compile_count()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(_timed(fn)[0])
    if (compile_count(), speculative_compile_count()) != (c1, s1):
        print("warning: recompiled during the timed runs", file=sys.stderr)
    ar = outs["AR"]
    ar_tps = batch * new_tokens / statistics.median(times["AR"])
    rows = [{
        "method": "AR", "spec": None, "time_s": statistics.median(times["AR"]), "time_s_all": times["AR"],
        "warmup_s": warm["AR"], "tokens_per_s": ar_tps, "ratio_vs_ar": 1.0, "decode_steps": ar.stats["decode_steps"],
        "tau": 1.0, "cycles": None, "check": None, "per_depth_acceptance": None,
    }]
    for spec in specs:
        out, t = outs[spec], statistics.median(times[spec])
        same = bool(np.array_equal(out.tokens, ar.tokens) and np.array_equal(out.lengths, ar.lengths))
        tps = batch * new_tokens / t
        rows.append({
            "method": "spec", "spec": spec, "time_s": t, "time_s_all": times[spec], "warmup_s": warm[spec],
            "tokens_per_s": tps, "ratio_vs_ar": tps / ar_tps, "decode_steps": None,
            "tau": out.stats["mean_accepted_length"], "cycles": out.stats["cycles"],
            "loop_cycles": max(out.stats["per_sequence"]["cycles"]),
            "check": "OK" if same else "MISMATCH",
            "first_mismatch": None if same else int(np.argmax(np.any(out.tokens != ar.tokens, axis=0))),
            "per_depth_acceptance": out.stats["per_depth_acceptance"],
            "rank_histogram": out.stats["rank_histogram"],
        })
    rows[0]["new_compiles"] = {"generate": c1 - c0, "speculative": s1 - s0}
    return rows


# ---------------------------------------------------------------------------------------------
# Part 2: per-stage split of one cycle
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 3))
def _prefill(params, cfg, prompt_tokens, max_len):
    """Prompt prefill exactly as `_speculative_loop` (full-length prompts): -> state, root, last_hidden."""
    lengths = jnp.full((prompt_tokens.shape[0],), prompt_tokens.shape[1], jnp.int32)
    return prefill_for_speculation(params, cfg, prompt_tokens, lengths, max_len)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _verify(params, state, tokens, plan, cfg):
    """Shared across specs: same tree size D and cache size -> one compile."""
    return forward(params, cfg, state, tokens, verify_context(plan, state.length))


def _stage_fns(cfg, spec: js.SpecConfig) -> dict[str, Callable]:
    def draft(params, state, root, last_hidden):
        pool = draft_tree(params, cfg, spec, state, root, last_hidden)
        return prune_to_budget(pool, root, spec.num_draft_tokens)

    def plan(parent, length):
        return build_plan(parent, length, spec.num_steps)

    def accept(params, state, tree, verify_out, plan, last_hidden, active):
        choice = jnp.argmax(verify_out.logits, axis=-1).astype(jnp.int32)
        acc = greedy_accept(tree.tokens, tree.parent, choice, spec.num_steps)
        return commit_accepted_path(params, cfg, state, tree.tokens, verify_out, plan, acc, last_hidden, active)

    def cycle(params, state, root, last_hidden, active):
        return speculative_cycle(params, cfg, spec, state, root, last_hidden, active)

    fns = {name: jax.jit(fn) for name, fn in (("draft", draft), ("plan", plan), ("accept", accept), ("cycle", cycle))}
    fns["verify"] = functools.partial(_verify, cfg=cfg)
    return fns


def _time_call(fn: Callable, iters: int) -> tuple[float, float]:
    """-> (compile + first call seconds, median ms of `iters` further calls)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, 1e3 * statistics.median(times)


def _bench_one_spec(params, cfg, name: str, prompt_tokens, new_tokens: int, iters: int, fused: bool) -> dict:
    spec = js.SpecConfig.parse(name)
    b, prompt_len = prompt_tokens.shape
    active = jnp.ones((b,), bool)
    max_len = length_bucket(prompt_len + new_tokens + spec.num_steps + 1, cfg.max_position_embeddings, minimum=64)
    state, root, last_hidden = _prefill(params, cfg, prompt_tokens, max_len)
    fns = _stage_fns(cfg, spec)
    row: dict[str, Any] = {"spec": name, "max_len": max_len, "stage_ms": {}, "first_call_s": {}}
    # one real pass (compiles each stage) produces every stage's inputs
    t0 = time.perf_counter()
    tree = jax.block_until_ready(fns["draft"](params, state, root, last_hidden))
    t1 = time.perf_counter()
    plan = jax.block_until_ready(fns["plan"](tree.parent, state.length))
    t2 = time.perf_counter()
    vout = jax.block_until_ready(fns["verify"](params, state, tree.tokens, plan))
    t3 = time.perf_counter()
    row["first_call_s"].update(draft=t1 - t0, plan=t2 - t1, verify=t3 - t2)
    calls = {
        "draft": lambda: fns["draft"](params, state, root, last_hidden),
        "plan": lambda: fns["plan"](tree.parent, state.length),
        "verify": lambda: fns["verify"](params, state, tree.tokens, plan),
        "accept": lambda: fns["accept"](params, state, tree, vout, plan, last_hidden, active),
    }
    if fused:
        calls["cycle"] = lambda: fns["cycle"](params, state, root, last_hidden, active)
    for stage, call in calls.items():
        first, ms = _time_call(call, iters)
        row["stage_ms"][stage] = ms
        row["first_call_s"].setdefault(stage, first)
    total = sum(row["stage_ms"][s] for s in STAGES)
    row["sum_of_stages_ms"] = total
    row["stage_pct"] = {s: 100.0 * row["stage_ms"][s] / total for s in STAGES}
    row["fused_cycle_ms"] = row["stage_ms"].pop("cycle", None)
    return row


def bench_stages(params, cfg, prompts, specs, new_tokens: int, iters: int, fused: bool) -> dict[str, Any]:
    prompt_tokens = jnp.asarray(prompts, jnp.int32)
    result: dict[str, Any] = {}
    # the 1-token decode step, on the cache size `generate` uses for this run
    ar_len = length_bucket(prompts.shape[1] + new_tokens, cfg.max_position_embeddings, minimum=64)
    state, root, _ = _prefill(params, cfg, prompt_tokens, ar_len)
    step = jax.jit(lambda p, s, t: extend(p, cfg, s, t, jnp.ones(t.shape, bool)))
    first, ms = _time_call(lambda: step(params, state, root[:, None]), iters)
    result["decode_step_ms"] = ms
    result["decode_step_first_call_s"] = first
    result["specs"] = []
    for name in specs:
        row = _bench_one_spec(params, cfg, name, prompt_tokens, new_tokens, iters, fused)
        row["break_even_tau"] = row["sum_of_stages_ms"] / ms
        result["specs"].append(row)
    return result


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help="spec names sS_kK_dD")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stage-iters", type=int, default=10, help="timed calls per stage (median)")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage split")
    p.add_argument("--fused-cycle", action="store_true", help="also time speculative_cycle in one jit")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "repeats", "stage_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.batch):
        p.error("--batch values must be >= 1")
    for s in args.specs:
        try:
            js.SpecConfig.parse(s)
        except ValueError as e:
            p.error(str(e))
    return args


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:  # piped / logged: don't squeeze the tables into 80 columns
        console = Console(width=160)
    try:
        cfg = js.ModelConfig.preset(args.preset)
        for s in args.specs:
            js.SpecConfig.parse(s).validate_for(cfg)
    except ValueError as e:
        sys.exit(f"spec_vs_ar.py: error: {e}")

    facts = machine_facts()
    header = machine_header(facts, "accelerator throughput or of the spec/AR trade-off there")
    console.print(f"[bold]jaxspec speculative vs autoregressive benchmark[/]  preset={args.preset} dtype={cfg.dtype} "
                  f"prompt_len={args.prompt_len} new_tokens={args.new_tokens} repeats={args.repeats} "
                  f"batch={args.batch} greedy, no eos")
    console.print(header)

    t0 = time.perf_counter()
    base = js.init_params(cfg, jax.random.key(0))
    jax.block_until_ready(base)
    init_s = time.perf_counter() - t0

    rng = np.random.default_rng(args.seed)
    prompts = {b: rng.integers(0, cfg.vocab_size, size=(b, args.prompt_len), dtype=np.int32) for b in args.batch}

    # Part 1
    e2e = []
    for variant in args.variants:
        params = make_variant(variant, base)
        for b in args.batch:
            with console.status(f"{variant}, batch {b}: compiling + timing..."):
                rows = bench_end_to_end(params, cfg, prompts[b], args.specs, args.new_tokens, args.repeats)
            for r in rows:
                r.update(variant=variant, batch=b)
            e2e.extend(rows)

    table = Table(title=f"end-to-end decode: {args.preset}, {args.new_tokens} new tokens ({facts['backend'].upper()})")
    for name in ("variant", "batch", "method", "tok/s", "x AR", "tau", "cycles", "check", "run s", "warm-up s"):
        table.add_column(name, justify="left" if name in ("variant", "method", "check") else "right", no_wrap=True)
    last_group = None
    for r in e2e:
        group = (r["variant"], r["batch"])
        if last_group is not None and group != last_group:
            table.add_section()
        last_group = group
        check = r["check"]
        check_str = "-" if check is None else ("[green]OK[/]" if check == "OK" else "[red]MISMATCH[/]")
        table.add_row(
            r["variant"], str(r["batch"]), "AR" if r["spec"] is None else r["spec"],
            f"{r['tokens_per_s']:.1f}", f"{r['ratio_vs_ar']:.2f}", f"{r['tau']:.2f}",
            _fmt(r["cycles"], "d") if r["cycles"] is not None else str(r["decode_steps"]) + " steps",
            check_str, f"{r['time_s']:.3f}", f"{r['warmup_s']:.1f}",
        )
    console.print(table)
    console.print(
        "tok/s = batch*new_tokens / median run time (prefill included, compile excluded); x AR = spec tok/s / AR "
        "tok/s (same variant, batch); tau = mean accepted length (accepted drafts + bonus per cycle); cycles summed "
        "over the batch (AR: decode steps); check = greedy spec tokens == generate's; warm-up s = first call "
        "(compile, when the shape is new, + one run)."
    )

    # Part 2
    stages = {}
    if not args.no_stages:
        params = make_variant(args.variants[0], base)
        for b in args.batch:
            with console.status(f"per-stage split, batch {b}: compiling + timing..."):
                stages[b] = bench_stages(params, cfg, prompts[b], args.specs, args.new_tokens, args.stage_iters,
                                         args.fused_cycle)
            for r in stages[b]["specs"]:  # the same spec's end-to-end loop, for comparison
                e = next((x for x in e2e if x["variant"] == args.variants[0] and x["batch"] == b
                          and x["spec"] == r["spec"]), None)
                r["e2e_ms_per_cycle"] = None if e is None else 1e3 * e["time_s"] / max(e["loop_cycles"], 1)
        for b, res in stages.items():
            table = Table(title=f"one cycle, per stage, ms (% of sum): batch {b}, prompt {args.prompt_len}, "
                                f"'{args.variants[0]}' params ({facts['backend'].upper()})")
            table.add_column("spec", no_wrap=True)
            names = ["draft+prune", "plan", "verify fwd", "accept+commit", "sum", "break-even tau", "e2e ms/cycle"]
            if args.fused_cycle:
                names.append("fused cycle")
            for name in names:
                table.add_column(name, justify="right", no_wrap=True)
            for r in res["specs"]:
                cells = [f"{r['stage_ms'][s]:.2f} ({r['stage_pct'][s]:.0f}%)" for s in STAGES]
                cells += [f"{r['sum_of_stages_ms']:.2f}", f"{r['break_even_tau']:.2f}",
                          _fmt(r["e2e_ms_per_cycle"])]
                if args.fused_cycle:
                    cells.append(_fmt(r["fused_cycle_ms"]))
                table.add_row(r["spec"], *cells)
            table.add_section()
            table.add_row("AR step", "", "", f"{res['decode_step_ms']:.2f}", "", f"{res['decode_step_ms']:.2f}",
                          "1.00", "", *([""] if args.fused_cycle else []))
            console.print(table)
        console.print(
            f"Stages jitted separately, median of {args.stage_iters} calls each (block_until_ready; one dispatch "
            "each); AR step = 1-token decode (extend, T=1) on generate's cache size; break-even tau = sum / AR step; "
            "e2e ms/cycle = end-to-end run time / loop cycles (prefill included)."
        )

    result = {
        "preset": args.preset,
        "dtype": cfg.dtype,
        **facts,
        "init_s": init_s,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "specs": args.specs,
        "variants": args.variants,
        "end_to_end": e2e,
        "stages": {str(b): v for b, v in stages.items()},
        "stage_iters": args.stage_iters,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
