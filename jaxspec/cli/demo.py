"""`jaxspec demo`: generate from a few built-in prompts with `generate` and tree
`speculative_generate` (the checkpoint's tuned spec by default), show the text, tau and the speed-up
measured as `jaxspec.core.measure` says (pinned, round-robin, spread, verdict), compile time apart."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxspec.cli.common import (
    NO_PIN_ENV,
    add_draft_argument,
    add_mesh_arguments,
    add_model_arguments,
    add_weights_args,
    compile_cache_note,
    load_model,
    mesh_from_args,
    pin_from_args,
    positive,
)
from jaxspec.cli.speed import UNTUNED_SPEC, CompileClock, check_spec_arg, choose_spec, cpu_note

DEMO_TEXT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Speculative decoding speeds up generation by",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics are",
    "JAX is a library for",
    "1, 1, 2, 3, 5, 8,",
    "Translate to German: good morning ->",
)



def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="generate from a few built-in prompts, AR and tree speculation, and report the measured speed-up",
        description="Generate from a few built-in prompts (or --prompt-file) with a checkpoint (or a randomly "
        "initialised preset), plainly and with tree speculation (by default the spec the checkpoint's tune.json "
        "chose for this batch size); time both round-robin over --repeats rounds on one pinned core "
        "(jaxspec.core.measure) and print the speed-up, its spread, the measurement verdict and, separately, "
        "the compile time. For your own prompts, many at a time, see `jaxspec generate`.",
    )
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=4, help="number of prompts")
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per prompt")
    p.add_argument("--seed", type=int, default=0, help="init / prompt / sampling seed")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: no cut)")
    p.add_argument("--spec", default="auto",
                   help="tree speculation to compare with AR: 'auto' takes the checkpoint's tune.json choice for this "
                   f"batch size (the untuned {UNTUNED_SPEC} without one), a name like s3_k1_d4, or 'none' (AR only)")
    add_draft_argument(p)
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="a text file whose text is every row's prompt (token ids separated by spaces without a "
                   "tokenizer); long prompts go through the chunked prefill (default: the built-in prompts)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill chunk, a power of two (default: jaxspec.model.prefill.prefill_chunk of the config)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, AR and speculation round-robin")
    p.add_argument("--core", type=int, default=None,
                   help="the core to pin to, single-threaded XLA (default: the last allowed; not on a GPU machine)")
    p.add_argument("--no-pin", action="store_true",
                   help=f"run on every allowed core (also: {NO_PIN_ENV}=1); the verdict will say so")
    add_weights_args(p, checkpoint=True)
    add_mesh_arguments(p)
    p.set_defaults(func=run)


def _check_prompt_file(path: str) -> str:
    """The text of --prompt-file; ValueError when it is missing, not text or empty."""
    if not os.path.isfile(path):
        raise ValueError(f"--prompt-file {path!r} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ValueError(f"--prompt-file {path!r} is empty: it holds the prompt every row generates from")
    return text


def _file_prompts(cfg, tokenizer, path: str, batch: int) -> tuple[list[list[int]], list[str] | None]:
    """Every row's prompt from a text file (encoded by the tokenizer, else whitespace-separated ids)."""
    text = _check_prompt_file(path)
    if tokenizer is None:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise ValueError(f"--prompt-file {path!r}: without a tokenizer it must hold token ids") from None
    else:
        ids = list(tokenizer.encode(text).ids)
        if not ids:
            raise ValueError(f"--prompt-file {path!r} holds no tokens")
        if cfg.bos_id is not None and ids[0] != cfg.bos_id:
            ids = [cfg.bos_id, *ids]
    return [ids] * batch, None if tokenizer is None else [text] * batch


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"... ({len(text) - limit} chars) " + text[-limit:]


def _demo_prompts(cfg, tokenizer, batch: int, seed: int) -> tuple[list[list[int]], list[str] | None]:
    import numpy as np

    if tokenizer is None:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(4, 17, size=batch)
        return [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in lengths], None
    from jaxspec.training.data import gsm8k_prompt, mbpp_prompt, sharegpt_prompt

    kinds = [
        gsm8k_prompt("Tom has 3 boxes with 12 apples each. He gives away 10 apples. How many apples are left?"),
        mbpp_prompt("Write a function to find the maximum of two numbers.", ["assert max_of_two(3, 5) == 5"]),
        sharegpt_prompt("What are three tips for writing clear documentation?"),
        *DEMO_TEXT_PROMPTS,
    ]
    texts = [kinds[i % len(kinds)] for i in range(batch)]
    prompts = []
    for text in texts:
        ids = list(tokenizer.encode(text).ids)
        if cfg.bos_id is not None and (not ids or ids[0] != cfg.bos_id):
            ids = [cfg.bos_id, *ids]
        if not ids:
            raise ValueError(f"the tokenizer encoded the demo prompt {text!r} to no tokens")
        prompts.append(ids)
    return prompts, texts


def run(args: argparse.Namespace, console: Console) -> int:
    positive("batch", args.batch)
    positive("new-tokens", args.new_tokens)
    positive("repeats", args.repeats)
    spec_arg = check_spec_arg(args.spec)  # a typo fails before the model loads
    if args.prompt_file is not None:
        _check_prompt_file(args.prompt_file)  # so does a missing or empty prompt file
    pin_from_args(args, console)  # before the first computation

    import jax
    import numpy as np

    from jaxspec.ops.quant import is_quantized, stored_nbytes

    mesh = mesh_from_args(args)
    model = load_model(args, console, seed=args.seed, mesh=mesh)
    cfg, params, tokenizer, source = model.cfg, model.params, model.tokenizer, model.description
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)  # a BlockScaled counts its weight's elements
    n_params = sum(int(np.prod(x.shape)) for x in leaves)
    resident = sum(stored_nbytes(x) for x in leaves)
    console.print(f"[bold]jaxspec demo[/]: {source}")
    console.print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"{n_params / 1e6:.2f}M params ({resident / 2**20:.1f} MiB resident), {cfg.dtype}; "
        f"backend {jax.default_backend()} "
        f"({', '.join(str(d) for d in jax.devices())})"
    )
    console.print(compile_cache_note(args))

    if args.prefill_chunk is not None:
        from jaxspec.model.prefill import check_chunk

        cfg = cfg.replace(prefill_chunk=check_chunk(args.prefill_chunk))
    if args.prompt_file is not None:
        prompts, texts = _file_prompts(cfg, tokenizer, args.prompt_file, args.batch)
        console.print(f"prompt: {len(prompts[0])} tokens from {args.prompt_file}, on each of the {args.batch} rows")
    else:
        prompts, texts = _demo_prompts(cfg, tokenizer, args.batch, args.seed)
        what = "random token ids (no tokenizer)" if tokenizer is None else "the built-in demo prompts"
        console.print(f"prompts: {len(prompts)} of {what} (--prompt-file for your own; `jaxspec generate` for many)")
    choice = choose_spec(spec_arg, model.draft, len(prompts))
    console.print(choice.how)
    kwargs = dict(max_new_tokens=args.new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  eos_id=cfg.eos_id, rng=jax.random.key(args.seed), mesh=mesh)
    draft = choice.draft if choice.draft is not None else model.draft
    runs = _timed_runs(args, console, cfg, params, prompts, kwargs, choice, draft)
    _show_outputs(console, args, prompts, texts, tokenizer, runs[choice.spec.name if choice.spec else "AR"]["out"])
    _report(args, console, choice, runs)
    return 0


def _timed_runs(args, console, cfg, params, prompts, kwargs, choice, draft) -> dict[str, dict[str, Any]]:
    """AR and the chosen spec: a first call each (compile, timed apart), then `--repeats` rounds
    round-robin inside a `measure.Watch`. -> name -> {"out", "compile": CompileClock, "timing"}."""
    import functools

    from jaxspec.core import measure
    from jaxspec.speculation.generate import generate, speculative_generate

    calls = {"AR": functools.partial(generate, params, cfg, prompts, **kwargs)}
    if choice.spec is not None:
        calls[choice.spec.name] = functools.partial(speculative_generate, params, cfg, prompts, choice.spec,
                                                    **kwargs, draft=draft)
    runs: dict[str, dict[str, Any]] = {}
    for name, call in calls.items():
        with console.status(f"first {name} run (compiles its programs, or loads them from the compile cache)"), \
                CompileClock() as clock:
            runs[name] = {"out": call(), "compile": clock}
    with console.status(f"timing {' and '.join(calls)}: {args.repeats} rounds, round-robin") as status, \
            measure.Watch(probe=jax_backend() == "cpu") as watch:
        timings = measure.round_robin({name: (lambda c=call: c().tokens) for name, call in calls.items()},
                                      args.repeats, progress=status.update)
    for name in calls:
        runs[name]["timing"] = timings[name]
    runs["verdict"] = watch.verdict(timings["AR"])
    return runs


def jax_backend() -> str:
    import jax

    return jax.default_backend()


def _show_outputs(console, args, prompts, texts, tokenizer, out) -> None:
    table = Table(title=f"{len(prompts)} prompt(s), up to {args.new_tokens} new tokens", show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("prompt")
    table.add_column("output")
    table.add_column("new", justify="right")
    for i, prompt in enumerate(prompts):
        n = int(out.lengths[i])
        ids = out.tokens[i, :n].tolist()
        if tokenizer is not None:
            shown_prompt, shown_out = _short(texts[i]), tokenizer.decode(ids)
        else:
            shown_prompt, shown_out = _short(" ".join(map(str, prompt))), " ".join(map(str, ids))
        table.add_row(str(i), shown_prompt, shown_out, str(n))
    console.print(table)


def _report(args, console, choice, runs) -> None:
    """Tokens/s with their spread, the speed-up, tau, the verdict, compile time apart, and why a CPU
    gain is small (always beside a ratio below 1.0x)."""
    import numpy as np

    from jaxspec.core import measure

    console.print(measure.verdict_line(runs["verdict"]))
    ar = runs["AR"]
    generated = int(np.sum(ar["out"].lengths))
    ar_rate = generated / ar["timing"].median
    console.print(f"AR: {ar_rate:.1f} tokens/s ({generated} tokens, median of {args.repeats} rounds, spread "
                  f"{100 * ar['timing'].spread:.0f}%; prefill included, compile excluded)")
    ratio = None
    if choice.spec is not None:
        run = runs[choice.spec.name]
        out, stats = run["out"], run["out"].stats
        spec_generated = int(np.sum(out.lengths))
        rate = spec_generated / run["timing"].median
        ratio = rate / ar_rate
        same = np.array_equal(out.tokens, ar["out"].tokens) and np.array_equal(out.lengths, ar["out"].lengths)
        check = "identical to AR" if same else "differs from AR"
        if args.temperature > 0:
            check = "sampled (lossless: same distribution as AR, different draws)"
        console.print(
            f"{choice.spec.name}: {rate:.1f} tokens/s (spread {100 * run['timing'].spread:.0f}%) = "
            f"[bold]{ratio:.2f}x AR[/]; tau (mean accepted length) [bold]{stats['mean_accepted_length']:.2f}[/] over "
            f"{stats['cycles']} cycles; per-depth acceptance "
            f"{', '.join(f'{x:.2f}' for x in stats['per_depth_acceptance'])}; output {check}"
        )
    console.print("compile, not in any tokens/s above: " + "; ".join(
        f"{name} {run['compile'].describe()}" for name, run in runs.items() if name != "verdict"))
    if jax_backend() == "cpu" or (ratio is not None and ratio < 1.0):
        console.print(cpu_note(choice, ratio))
