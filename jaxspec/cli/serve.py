"""`jaxspec serve`: an OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`, `/metrics`) over continuous batching of exact speculative cycles (`jaxspec.serve`).
Needs the serve extra: pip install 'jaxspec[serve]'."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.console import Console

from jaxspec.cli.common import add_draft_argument, add_model_arguments, compile_cache_note, load_model, positive
from jaxspec.cli.generate import chat_renderer, text_ids
from jaxspec.cli.speed import UNTUNED_SPEC


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with continuous batching of speculative cycles",
        description="Serve --checkpoint over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
        "/v1/models; server-sent events with stream=true), /health and /metrics (Prometheus text). Requests enter "
        "and leave --slots rows of one live speculative state between device calls of --cycles-per-call cycles; "
        "each request has its own max_tokens, stop, temperature / top_p / top_k and seed, and greedy output is "
        "token-identical to `jaxspec generate` of the prompt alone (float32). Needs pip install 'jaxspec[serve]'.",
    )
    add_model_arguments(p, text=True)
    add_draft_argument(p, every=True)
    p.add_argument("--spec", default="auto",
                   help="'auto' (the checkpoint's tune.json choice for --slots rows; the untuned "
                   f"{UNTUNED_SPEC} without one), a spec name like s3_k1_d4, or 'none' (autoregressive)")
    p.add_argument("--slots", type=int, default=8, help="requests decoded together (rows of the live state)")
    p.add_argument("--max-len", type=int, default=2048, help="tokens a request may hold: prompt + max_tokens")
    p.add_argument("--cycles-per-call", type=int, default=4,
                   help="cycles per device call: fewer host round trips against later joins and exits")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get HTTP 429")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: the folder's name)")
    p.add_argument("--warm-up", action="store_true",
                   help="compile every program (each group size and prompt width) before listening, so no request "
                   "waits on a compile")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on shutdown, how long live requests may finish before they are cancelled")


def build_app(args: argparse.Namespace, console: Console) -> Any:
    """Load the model, build the engine and its app (the server's parts, for tests and `run`)."""
    from jaxspec.serve.app import create_app
    from jaxspec.serve.engine import Engine
    from jaxspec.training.tokenizer import decode

    for name in ("slots", "max_len", "cycles_per_call", "max_queue"):
        positive(name.replace("_", "-"), getattr(args, name))
    model = load_model(args, console, need_tokenizer="jaxspec serve")
    cfg, tokenizer = model.cfg, model.tokenizer
    spec = args.spec
    if spec == "auto" and (model.draft is None or getattr(model.draft, "tuning", None) is None) and args.draft != "all":
        spec = UNTUNED_SPEC
    engine = Engine(model.params, cfg, draft=model.draft, spec=spec, num_slots=args.slots, max_len=args.max_len,
                    cycles_per_call=args.cycles_per_call, max_queue=args.max_queue)
    if args.warm_up:
        with console.status("compiling the engine's programs (--warm-up)"):
            count = engine.warm_up()
        console.print(f"warm-up: {count} programs compiled", highlight=False)
    render, how = chat_renderer(args.checkpoint)
    name = args.model_name or os.path.basename(os.path.normpath(os.path.expanduser(args.checkpoint)))
    console.print(f"[bold]jaxspec serve[/]: {model.description}; spec {engine.spec_name}, {args.slots} slots, "
                  f"max_len {args.max_len}; model id {name!r}; {how}", highlight=False)
    return create_app(engine, model_name=name, encode=lambda text: text_ids(text, cfg, tokenizer),
                      decode=lambda ids: decode(tokenizer, ids), render_chat=render,
                      drain_seconds=args.drain_seconds)


def run(args: argparse.Namespace, console: Console) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ValueError("jaxspec serve needs the serve extra: pip install 'jaxspec[serve]'") from None
    app = build_app(args, console)
    console.print(compile_cache_note(args), highlight=False)
    console.print(f"listening on http://{args.host}:{args.port} (Ctrl-C stops; live requests get "
                  f"{args.drain_seconds:g} s to finish)", highlight=False)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
