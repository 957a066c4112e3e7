"""`jaxspec demo`: generate from a few built-in prompts with `generate` and tree
`speculative_generate`, show the text, tau and the measured speedup."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxspec.cli.common import (
    add_mesh_arguments,
    add_model_arguments,
    add_weights_args,
    load_model,
    mesh_from_args,
    positive,
)

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
        help="generate from a few built-in prompts and report tokens/s",
        description="Generate from a few built-in prompts with a checkpoint (or a randomly initialised "
        "preset) and report warm decode throughput and compile time.",
    )
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per prompt (default 64)")
    p.add_argument("--seed", type=int, default=0, help="init / prompt / sampling seed (default 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--spec", default="s3_k2_d6", help="tree speculation to compare against (default s3_k2_d6); "
                   "'auto' takes the checkpoint's tune.json choice for this batch; 'none' skips speculation")
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="a text file whose text is every row's prompt (token ids separated by spaces without a "
                   "tokenizer); long prompts go through the chunked prefill")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill chunk, a power of two (default: jaxspec.model.prefill.prefill_chunk of the config)")
    add_weights_args(p, checkpoint=True)
    add_mesh_arguments(p)
    p.set_defaults(func=run)


def _file_prompts(cfg, tokenizer, path: str, batch: int) -> tuple[list[list[int]], list[str] | None]:
    """Every row's prompt from a text file (encoded by the tokenizer, else whitespace-separated ids)."""
    if not os.path.isfile(path):
        raise ValueError(f"--prompt-file {path!r} is not a file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if tokenizer is None:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise ValueError(f"--prompt-file {path!r}: without a tokenizer it must hold token ids") from None
    else:
        ids = list(tokenizer.encode(text).ids)
        if cfg.bos_id is not None and (not ids or ids[0] != cfg.bos_id):
            ids = [cfg.bos_id, *ids]
    if not ids:
        raise ValueError(f"--prompt-file {path!r} holds no tokens")
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

    import jax
    import numpy as np

    from jaxspec.model.runner import sharded_compile_count
    from jaxspec.ops.quant import is_quantized, stored_nbytes
    from jaxspec.speculation.generate import compile_count, generate

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

    if args.prefill_chunk is not None:
        from jaxspec.model.prefill import check_chunk

        cfg = cfg.replace(prefill_chunk=check_chunk(args.prefill_chunk))
    if args.prompt_file is not None:
        prompts, texts = _file_prompts(cfg, tokenizer, args.prompt_file, args.batch)
        console.print(f"prompt: {len(prompts[0])} tokens from {args.prompt_file}")
    else:
        prompts, texts = _demo_prompts(cfg, tokenizer, args.batch, args.seed)
    kwargs = dict(
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=cfg.eos_id,
        rng=jax.random.key(args.seed),
        mesh=mesh,
    )

    compiles_before = compile_count() + sharded_compile_count()
    t0 = time.perf_counter()
    out = generate(params, cfg, prompts, **kwargs)  # cold: compile + run
    cold_s = time.perf_counter() - t0
    compiled = compile_count() + sharded_compile_count() - compiles_before
    t0 = time.perf_counter()
    out = generate(params, cfg, prompts, **kwargs)  # warm: same shapes, no compile
    warm_s = time.perf_counter() - t0

    table = Table(title=f"{args.batch} prompt(s), up to {args.new_tokens} new tokens", show_lines=True)
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

    generated = int(np.sum(out.lengths))
    console.print(
        f"warm run: {generated} tokens in {warm_s:.3f} s = [bold]{generated / warm_s:.1f} tokens/s[/] "
        f"(batch {args.batch}, {out.stats['decode_steps']} decode steps, "
        f"{1e3 * warm_s / max(out.stats['decode_steps'], 1):.2f} ms/step; prefill included, compile excluded)"
    )
    if compiled:
        console.print(
            f"compile: {max(cold_s - warm_s, 0.0):.2f} s "
            f"(first run {cold_s:.2f} s minus warm run; {compiled} program(s) compiled)"
        )
    else:
        console.print(f"compile: 0 s (program already compiled; first run {cold_s:.2f} s)")
    if args.spec.lower() != "none" and model.draft is not None:
        _demo_speculative(args, console, cfg, params, prompts, dict(kwargs, draft=model.draft), out,
                          generated / warm_s)
    if jax.default_backend() == "cpu":
        console.print("[dim]these are CPU numbers[/]")
    return 0


def _demo_speculative(args, console, cfg, params, prompts, kwargs, reference, ar_tokens_per_s) -> None:
    """Same prompts with tree speculation: tau, per-depth acceptance and the measured speedup."""
    import numpy as np

    from jaxspec.core.spec import SpecConfig
    from jaxspec.speculation.auto import auto_spec
    from jaxspec.speculation.generate import speculative_generate

    if args.spec.lower() == "auto":
        if args.checkpoint is None:
            raise ValueError("--spec auto reads the checkpoint's tune.json: pass --checkpoint")
        spec = auto_spec(kwargs["draft"].tuning or os.path.expanduser(args.checkpoint), len(prompts))
        if spec is None:
            console.print(f"tune.json chose no speculation for batch {len(prompts)}: autoregressive is fastest")
            return
        console.print(f"tune.json chose {spec.name} for batch {len(prompts)}")
    else:
        spec = SpecConfig.parse(args.spec)
    speculative_generate(params, cfg, prompts, spec, **kwargs)  # compile
    t0 = time.perf_counter()
    out = speculative_generate(params, cfg, prompts, spec, **kwargs)
    warm_s = time.perf_counter() - t0
    generated = int(np.sum(out.lengths))
    stats = out.stats
    same = np.array_equal(out.tokens, reference.tokens) and np.array_equal(out.lengths, reference.lengths)
    check = "identical to generate" if same else "differs from generate"
    if args.temperature > 0:
        check = "sampled (lossless: same distribution as generate, different draws)"
    console.print(
        f"tree speculation {spec.name}: {generated / warm_s:.1f} tokens/s = "
        f"[bold]{generated / warm_s / ar_tokens_per_s:.2f}x[/] autoregressive; "
        f"tau (mean accepted length) [bold]{stats['mean_accepted_length']:.2f}[/] over {stats['cycles']} cycles; "
        f"per-depth acceptance {', '.join(f'{x:.2f}' for x in stats['per_depth_acceptance'])}; output {check}"
    )
