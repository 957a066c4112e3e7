"""Speculative (`speculative_generate`) vs autoregressive (`generate`) decoding.

    python bench/spec_vs_ar.py [--preset tiny | --checkpoint PATH] [--specs s3_k1_d4 s7_k1_d8 s3_k2_d6 s4_k2_d8]
                               [--variants random agreeing] [--batch 1] [--prompt-len 32]
                               [--new-tokens 64] [--repeats 2] [--stage-iters 10] [--no-stages] [--fused-cycle]
                               [--seed 0] [--json PATH]

Model variants of a --preset (both from `init_params(cfg, jax.random.key(0))`):
  * random   : plain random init; the MTP draft almost never agrees with the target (tau ~ 1),
               so speculation shows its pure overhead;
  * agreeing : `jaxspec.testing.high_acceptance` of it (damped sub-layers, MTP made to compute
               the target's token -> next-token function), so drafts are accepted often and the
               table shows what high acceptance buys.
With --checkpoint the one variant is "checkpoint": the trained model (`load_checkpoint(dtype="float32")`
on a CPU) with its own draft (`Checkpoint.draft`: calibration included), its config replacing --preset;
--variants does not apply. On a CPU every variant's routed experts are in the CPU's per-expert layout
(`model.network.cpu_layout`), as `load_checkpoint(cpu_experts=True)` gives them. Its
prompts are GSM8K held-out (test) questions when the data is available: each encoded with the
checkpoint's tokenizer, questions shorter than --prompt-len tokens skipped, the others cut to their
last --prompt-len tokens. Otherwise (and always with --preset) prompts are random tokens (--seed).

Part 1, end-to-end (per variant, batch, spec): one warm-up call each (compile excluded; its output
feeds the check and tau/cycles, which are deterministic), then `repeats` rounds timing AR and every
spec round-robin (so load changes on a shared machine hit all alike); median per method.
  tok/s = batch * new_tokens / median time (prefill included); x AR = spec tok/s / AR tok/s of
  the same variant and batch; tau = mean accepted length (accepted drafts + bonus per cycle);
  cycles = verify cycles summed over the batch; check = greedy spec tokens == generate's tokens.

Part 2, one cycle split into the separately jitted stage programs of `jaxspec.speculation.stages` (the
cycle's own, the ones `jaxspec tune` times), on a state prefilled with the prompt (`stages.prefill`:
the target's chunked prefill with the drafter following it, as `_speculative_loop` does), cache sized
as the end-to-end run:
  (a) draft   = the drafter's beam + prune_to_budget (b) plan   = build_plan
  (c) verify  = target forward with verify_context   (d) commit = acceptance + commit of the path
each timed by `jaxspec.harness.stages.time_stages` (block_until_ready, median over `stage-iters` calls),
plus a 1-token decode step (`stages.ar_step`, T=1, on generate's cache size) for reference. break-even
tau = sum of stages / decode step: the mean accepted length a spec needs to match AR per cycle;
tau for 1.2x = 1.2 x that; max tau = S + 1 (the deepest path plus the bonus token), so a spec whose
tau for 1.2x exceeds it cannot reach 1.2x at this cycle cost whatever its acceptance.
e2e ms/cycle = that spec's end-to-end run time / its loop cycles (prefill included; the whole cycle
fused in the while_loop). `--fused-cycle` also times `stages.cycle` (the whole cycle in one jit, one
more compile per spec). The AR step and the fused cycle advance the state they are timed on, so
they run at most as many times as the cache has room for. Stage cost does not depend on parameter
values, so it is measured once, on the first variant.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import check_positive, console, cycle_of, machine_facts, machine_header, parser, write_json
from rich.table import Table

import jaxspec as js
from jaxspec.core import measure
from jaxspec.harness.stages import STAGES, median_seconds, time_stages
from jaxspec.model.network import cpu_layout
from jaxspec.model.sampling import Sampling
from jaxspec.speculation import stages as st
from jaxspec.speculation.generate import compile_count, length_bucket, speculative_compile_count
from jaxspec.testing import high_acceptance

DEFAULT_PRESET = "tiny"
DEFAULT_SPECS = ["s3_k1_d4", "s7_k1_d8", "s3_k2_d6", "s4_k2_d8"]
VARIANTS = ("random", "agreeing")
CHECKPOINT = "checkpoint"  # the one variant of a --checkpoint run
TARGET_SPEEDUP = 1.2  # the batch-1 bar of the calibrated-trees and sampling issues


# ---------------------------------------------------------------------------------------------
# Model and prompts
# ---------------------------------------------------------------------------------------------


def make_variant(name: str, base, cfg):
    """The variant's params, routed experts in the CPU's per-expert layout on a CPU (a checkpoint's
    already are: `load_model`)."""
    if name in ("random", CHECKPOINT):
        return cpu_layout(base, cfg)
    if name == "agreeing":
        return cpu_layout(high_acceptance(base), cfg)
    raise ValueError(name)


def load_model(path: str, draft: str | None = None) -> tuple[js.ModelConfig, Any, Any, str, js.Draft | None]:
    """-> (cfg, params, tokenizer or None, note, draft) of a checkpoint, float32 on a CPU, its routed
    experts in the CPU's layout, and its own draft or drafts/`draft`/ (calibration included)."""
    cpu = jax.default_backend() == "cpu"
    ckpt = js.load_checkpoint(os.path.expanduser(path), dtype="float32" if cpu else None, cpu_experts=True,
                              draft=draft)
    note = " (cast to float32 for the CPU)" if cpu else ""
    return ckpt.cfg, ckpt.params, ckpt.tokenizer, note, ckpt.draft


def gsm8k_prompts(tok, count: int, prompt_len: int) -> np.ndarray | None:
    """[count, prompt_len] int32: the first GSM8K test questions of at least `prompt_len` tokens,
    each cut to its last `prompt_len` tokens (repeated in turn if too few qualify); None when the
    data is missing or no question is long enough."""
    from jaxspec.training.data import data_available, load_dataset
    from jaxspec.training.tokenizer import encode

    if tok is None or not data_available():
        return None
    rows = []
    for ex in load_dataset("gsm8k", "test"):
        ids = encode(tok, ex.prompt)
        if len(ids) >= prompt_len:
            rows.append(ids[-prompt_len:])
            if len(rows) == count:
                break
    if not rows:
        return None
    return np.asarray([rows[i % len(rows)] for i in range(count)], np.int32)


# ---------------------------------------------------------------------------------------------
# Part 1: end-to-end
# ---------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], js.GenerateOutput]) -> tuple[float, js.GenerateOutput]:
    t0 = time.perf_counter()
    out = fn()
    np.asarray(out.tokens)  # already host numpy: the call is synchronous
    return time.perf_counter() - t0, out


def bench_end_to_end(params, cfg, prompts, specs, new_tokens: int, repeats: int, draft=None) -> list[dict[str, Any]]:
    """Warm up AR and every spec (compile + reference output), then time them round-robin, `repeats` rounds,
    inside a `measure.Watch` (its verdict goes into the AR row). `draft`: the checkpoint's (None: the MTP
    block of `params`, uncalibrated)."""
    batch = prompts.shape[0]
    runs: dict[str, Callable[[], js.GenerateOutput]] = {
        "AR": lambda: js.generate(params, cfg, prompts, max_new_tokens=new_tokens)
    }
    for spec in specs:
        runs[spec] = functools.partial(js.speculative_generate, params, cfg, prompts, spec, max_new_tokens=new_tokens,
                                       draft=draft)
    c0, s0 = compile_count(), speculative_compile_count()
    warm, outs = {}, {}
    for name, fn in runs.items():
        warm[name], outs[name] = _timed(fn)
    c1, s1 = compile_count(), speculative_compile_count()
    with measure.Watch() as watch:
        timings = measure.round_robin(runs, repeats)
    times = {name: list(t.seconds) for name, t in timings.items()}
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
    rows[0]["measurement"] = watch.verdict(timings["AR"])
    for r in rows:
        r["spread"] = timings["AR" if r["spec"] is None else r["spec"]].spread
    return rows


# ---------------------------------------------------------------------------------------------
# Part 2: per-stage split of one cycle (jaxspec.speculation.stages)
# ---------------------------------------------------------------------------------------------

SAMPLING = Sampling.create()  # greedy


def _prefill(sp, models, prompt_tokens, max_len):
    """Prompt prefill exactly as `_speculative_loop` (full-length prompts): -> SpecState."""
    lengths = jnp.full((prompt_tokens.shape[0],), prompt_tokens.shape[1], jnp.int32)
    return st.prefill(sp, models, prompt_tokens, lengths, max_len, SAMPLING)


def _bench_one_spec(params, cfg, name: str, prompt_tokens, new_tokens: int, iters: int, fused: bool,
                    draft=None) -> dict:
    # Ranked as the loop ranks: the draft's calibration when it has one, else raw draft log-probs.
    sp, models = cycle_of(params, cfg, name, draft)
    spec = sp.spec
    prompt_len = prompt_tokens.shape[1]
    max_len = length_bucket(prompt_len + new_tokens + spec.num_steps + 1, cfg.max_position_embeddings, minimum=64)
    state = _prefill(sp, models, prompt_tokens, max_len)
    timed = time_stages(sp, models, state, iters)
    # A cycle emits at most its deepest path plus the bonus token, whatever the draft: where even that
    # is below the tau a target speed-up needs, no calibration or acceptance rule reaches it.
    row: dict[str, Any] = {"spec": name, "scores": spec.scores, "max_len": max_len, **timed, "fused_cycle_ms": None,
                           "max_tau": spec.num_steps + 1}
    if fused:
        # Each call commits up to num_steps + 1 tokens of the carried state: as many calls as the cache holds.
        cycle_iters = max(1, min(iters, (max_len - prompt_len) // (spec.num_steps + 1) - 1))
        first, seconds, _ = median_seconds(lambda s: st.cycle(sp, models, s, SAMPLING)[0], state, cycle_iters)
        row["first_call_s"]["cycle"] = first
        row["fused_cycle_ms"] = 1e3 * seconds
        row["fused_cycle_iters"] = cycle_iters
    return row


def bench_stages(params, cfg, prompts, specs, new_tokens: int, iters: int, fused: bool, draft=None) -> dict[str, Any]:
    """`params` as the loops read them (a variant's: the CPU's expert layout on a CPU)."""
    prompt_tokens = jnp.asarray(prompts, jnp.int32)
    prompt_len = prompts.shape[1]
    result: dict[str, Any] = {}
    # the 1-token decode step, on the cache size `generate` uses for this run; each call commits one
    # token of the carried state, so at most as many calls as the cache holds
    ar_len = length_bucket(prompt_len + new_tokens, cfg.max_position_embeddings, minimum=64)
    sp, models = cycle_of(params, cfg, specs[0], draft)
    state = _prefill(sp, models, prompt_tokens, ar_len)
    ar_iters = max(1, min(iters, ar_len - prompt_len - 1))
    first, seconds, _ = median_seconds(lambda c: st.ar_step(models.target, cfg, *c), (state.target, state.root),
                                       ar_iters)
    ms = 1e3 * seconds
    result["decode_step_ms"] = ms
    result["decode_step_first_call_s"] = first
    result["decode_step_iters"] = ar_iters
    result["specs"] = []
    for name in specs:
        row = _bench_one_spec(params, cfg, name, prompt_tokens, new_tokens, iters, fused, draft)
        row["break_even_tau"] = row["sum_of_stages_ms"] / ms
        row["tau_for_target"] = TARGET_SPEEDUP * row["break_even_tau"]
        result["specs"].append(row)
    return result


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, preset=None, preset_help=f"model config preset (default {DEFAULT_PRESET}; "
                                                 "ignored with --checkpoint)",
               seed_help="random prompt seed")
    p.add_argument("--checkpoint", metavar="PATH", help="a trained checkpoint folder instead of a random-init preset")
    p.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help="spec names sS_kK_dD")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="random-init variants (default: both; ignored with --checkpoint)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stage-iters", type=int, default=10, help="timed calls per stage (median)")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage split")
    p.add_argument("--fused-cycle", action="store_true", help="also time the whole cycle in one jit")
    p.add_argument("--core", type=int, default=None, help="pin to this core (default: the last allowed)")
    p.add_argument("--no-pin", action="store_true", help="do not pin (the verdict will say so)")
    args = p.parse_args(argv)
    check_positive(p, args, ("prompt_len", "new_tokens", "repeats", "stage_iters", "batch"))
    for s in args.specs:
        try:
            js.SpecConfig.parse(s)
        except ValueError as e:
            p.error(str(e))
    if args.checkpoint is not None and not os.path.isdir(os.path.expanduser(args.checkpoint)):
        p.error(f"--checkpoint {args.checkpoint!r} is not a folder")
    return args


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _print_end_to_end(con, e2e, model, args, facts) -> None:
    table = Table(title=f"end-to-end decode: {model}, {args.new_tokens} new tokens ({facts['backend'].upper()})")
    for name in ("variant", "batch", "method", "tok/s", "x AR", "spread", "tau", "cycles", "check", "run s",
                 "warm-up s"):
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
            f"{r['tokens_per_s']:.1f}", f"{r['ratio_vs_ar']:.2f}", f"{100 * r['spread']:.0f}%", f"{r['tau']:.2f}",
            _fmt(r["cycles"], "d") if r["cycles"] is not None else str(r["decode_steps"]) + " steps",
            check_str, f"{r['time_s']:.3f}", f"{r['warmup_s']:.1f}",
        )
    con.print(table)
    for r in e2e:
        if r.get("measurement"):
            con.print(f"{r['variant']}, batch {r['batch']}: " + measure.verdict_line(r["measurement"]))
    con.print(
        "tok/s = batch*new_tokens / median run time (prefill included, compile excluded); x AR = spec tok/s / AR "
        "tok/s (same variant, batch); spread = (max - min) / median over the rounds; tau = mean accepted length "
        "(accepted drafts + bonus per cycle); cycles summed "
        "over the batch (AR: decode steps); check = greedy spec tokens == generate's; warm-up s = first call "
        "(compile, when the shape is new, + one run)."
    )


def _print_stages(con, stages, args, variants, facts) -> None:
    for b, res in stages.items():
        table = Table(title=f"one cycle, per stage, ms (% of sum): batch {b}, prompt {args.prompt_len}, "
                            f"'{variants[0]}' params ({facts['backend'].upper()})")
        table.add_column("spec", no_wrap=True)
        names = ["draft+prune", "plan", "verify fwd", "accept+commit", "sum", "break-even tau",
                 f"tau for {TARGET_SPEEDUP}x", "max tau", "e2e ms/cycle"]
        if args.fused_cycle:
            names.append("fused cycle")
        for name in names:
            table.add_column(name, justify="right", no_wrap=True)
        for r in res["specs"]:
            cells = [f"{r['stage_ms'][s]:.2f} ({r['stage_pct'][s]:.0f}%)" for s in STAGES]
            reach = "" if r["tau_for_target"] <= r["max_tau"] else " [red](>max)[/]"
            cells += [f"{r['sum_of_stages_ms']:.2f}", f"{r['break_even_tau']:.2f}",
                      f"{r['tau_for_target']:.2f}{reach}", str(r["max_tau"]), _fmt(r["e2e_ms_per_cycle"])]
            if args.fused_cycle:
                cells.append(_fmt(r["fused_cycle_ms"]))
            table.add_row(r["spec"], *cells)
        table.add_section()
        table.add_row("AR step", "", "", f"{res['decode_step_ms']:.2f}", "", f"{res['decode_step_ms']:.2f}",
                      "1.00", "", "", "", *([""] if args.fused_cycle else []))
        con.print(table)
    con.print(
        f"Stages of jaxspec.speculation.stages jitted separately, median of {args.stage_iters} calls each "
        "(block_until_ready; one dispatch each); AR step = 1-token decode (stages.ar_step, T=1) on generate's "
        f"cache size; break-even tau = sum / AR step; tau for {TARGET_SPEEDUP}x = {TARGET_SPEEDUP} x break-even "
        "(prefill aside); max tau = S + 1, the deepest path plus the bonus token (>max: no acceptance reaches that "
        "speed-up at this cycle cost); e2e ms/cycle = end-to-end run time / loop cycles (prefill included)"
        + ("; fused cycle = stages.cycle" if args.fused_cycle else "") + ". The AR step"
        + (" and the fused cycle carry their state forward, so they run" if args.fused_cycle
           else " carries its state forward, so it runs") + " at most as many calls as the cache holds."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.no_pin:
        measure.pin(args.core)  # before the first computation: XLA reads its flags then
    con = console()
    tok, load_note, draft = None, "", None
    t0 = time.perf_counter()
    try:
        if args.checkpoint is not None:
            for flag, given in (("--preset", args.preset is not None), ("--variants", args.variants is not None)):
                if given:
                    con.print(f"[yellow]note:[/] {flag} ignored: the model comes from --checkpoint")
            cfg, base, tok, load_note, draft = load_model(args.checkpoint)
            model = f"checkpoint {os.path.basename(os.path.normpath(args.checkpoint))}"
            preset, variants = None, [CHECKPOINT]
        else:
            preset = args.preset or DEFAULT_PRESET
            cfg = js.ModelConfig.preset(preset)
            model, variants = preset, args.variants or list(VARIANTS)
        for s in args.specs:
            spec = js.SpecConfig.parse(s)
            spec.validate_for(cfg)
            if draft is not None:
                draft.drafter.check(cfg, spec)
    except ValueError as e:
        sys.exit(f"spec_vs_ar.py: error: {e}")

    facts = machine_facts()
    header = machine_header(facts, "accelerator throughput or of the spec/AR trade-off there")
    source = f"preset={preset}" if preset is not None else f"checkpoint={args.checkpoint}"
    con.print(f"[bold]jaxspec speculative vs autoregressive benchmark[/]  {source} dtype={cfg.dtype}{load_note} "
              f"prompt_len={args.prompt_len} new_tokens={args.new_tokens} repeats={args.repeats} "
              f"batch={args.batch} greedy, no eos")
    con.print(header)

    if args.checkpoint is None:
        base = js.init_params(cfg, jax.random.key(0))
    jax.block_until_ready(base)
    init_s = time.perf_counter() - t0

    prompt_source = "random"
    data = gsm8k_prompts(tok, max(args.batch), args.prompt_len) if args.checkpoint is not None else None
    if data is not None:
        prompt_source = "gsm8k test"
        prompts = {b: data[:b] for b in args.batch}
    else:
        if args.checkpoint is not None:
            con.print(f"[yellow]note:[/] random prompts: no GSM8K data, tokenizer or question of {args.prompt_len}+ "
                      "tokens")
        rng = np.random.default_rng(args.seed)
        prompts = {b: rng.integers(0, cfg.vocab_size, size=(b, args.prompt_len), dtype=np.int32) for b in args.batch}
    con.print(f"prompts: {prompt_source}")

    # Part 1
    e2e = []
    for variant in variants:
        params = make_variant(variant, base, cfg)
        for b in args.batch:
            with con.status(f"{variant}, batch {b}: compiling + timing..."):
                rows = bench_end_to_end(params, cfg, prompts[b], args.specs, args.new_tokens, args.repeats, draft)
            for r in rows:
                r.update(variant=variant, batch=b)
            e2e.extend(rows)

    _print_end_to_end(con, e2e, model, args, facts)

    # Part 2
    stages = {}
    if not args.no_stages:
        params = make_variant(variants[0], base, cfg)
        for b in args.batch:
            with con.status(f"per-stage split, batch {b}: compiling + timing..."):
                stages[b] = bench_stages(params, cfg, prompts[b], args.specs, args.new_tokens, args.stage_iters,
                                         args.fused_cycle, draft)
            for r in stages[b]["specs"]:  # the same spec's end-to-end loop, for comparison
                e = next((x for x in e2e if x["variant"] == variants[0] and x["batch"] == b
                          and x["spec"] == r["spec"]), None)
                r["e2e_ms_per_cycle"] = None if e is None else 1e3 * e["time_s"] / max(e["loop_cycles"], 1)
        _print_stages(con, stages, args, variants, facts)

    result = {
        "preset": preset,
        "checkpoint": args.checkpoint,
        "prompts": prompt_source,
        "dtype": cfg.dtype,
        **facts,
        "init_s": init_s,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "specs": args.specs,
        "variants": variants,
        "end_to_end": e2e,
        "stages": {str(b): v for b, v in stages.items()},
        "stage_iters": args.stage_iters,
    }
    write_json(args.json, result, con)
    return result


if __name__ == "__main__":
    main()
