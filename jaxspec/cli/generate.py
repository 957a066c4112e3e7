"""`jaxspec generate`: your own prompts (command line, a text file or JSON lines with prompts or
chats), batched, generated with tree speculation (`--spec auto`: the checkpoint's tune.json choice
per batch size), tokens streamed to the terminal as each cycle commits them, one JSON line per
prompt to `--out` (tokens, text, tau, the spec that ran, timings with compile time apart)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rich.console import Console

from jaxspec.cli.common import (
    add_draft_argument,
    add_mesh_arguments,
    add_model_arguments,
    add_weights_args,
    compile_cache_note,
    load_model,
    mesh_from_args,
    positive,
)
from jaxspec.cli.speed import UNTUNED_SPEC, CompileClock, check_spec_arg, choose_spec

# How a {"messages": [...]} line becomes a prompt without a chat template: the format the shipped
# checkpoint was trained on (jaxspec.training.data.sharegpt_prompt), one line per turn.
ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate from your own prompts (text, file or JSON lines), streaming tokens as cycles commit them",
        description="Generate from prompts given with --prompt (repeatable), --prompt-file (one prompt per line) "
        "or --jsonl (one JSON object per line: {\"prompt\": TEXT} or {\"messages\": [{\"role\": ..., \"content\": "
        "...}, ...]}), in batches, with tree speculation (--spec auto: the spec the checkpoint's tune.json chose for "
        "each batch size). Tokens stream to the terminal as each decode step / speculative cycle commits them; "
        "--out writes one JSON line per prompt with its tokens, text, tau, the spec that ran and the timings "
        "(compile time apart from generation time). Chats are rendered with the chat_template of the checkpoint's "
        "tokenizer_config.json when it has one (and jinja2 is installed), else as 'System: ...', 'User: ...', "
        "'Assistant: ...' lines ending in 'Assistant:', the format the shipped checkpoint was trained on.",
    )
    add_model_arguments(p)
    add_draft_argument(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for several; token ids separated by spaces without a tokenizer)")
    p.add_argument("--prompt-file", default=None, metavar="TXT", help="a text file, one prompt per non-empty line")
    p.add_argument("--jsonl", default=None, metavar="JSONL",
                   help='a file of JSON lines, each {"prompt": TEXT} or {"messages": [{"role", "content"}, ...]}')
    p.add_argument("--spec", default="auto",
                   help="'auto' (the checkpoint's tune.json choice per batch size; the untuned "
                   f"{UNTUNED_SPEC} without one), a spec name like s3_k1_d4, or 'none' (autoregressive)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: no cut)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (batch i uses fold_in(seed, i))")
    p.add_argument("--out", default=None, metavar="JSONL",
                   help="write one JSON line per prompt: tokens, text, tau, spec, timings (default: none)")
    p.add_argument("--no-stream", action="store_true", help="print each batch's texts when it ends instead")
    add_weights_args(p, checkpoint=True)
    add_mesh_arguments(p)
    p.set_defaults(func=run)


# ---- prompts ------------------------------------------------------------------------------------


def read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every prompt of --prompt, --prompt-file and --jsonl, in that order: [{"prompt": str} or
    {"messages": [...]}, with "source" naming where it came from]; one-line ValueErrors."""
    items: list[dict[str, Any]] = [{"prompt": t, "source": f"--prompt {i + 1}"} for i, t in enumerate(args.prompt)]
    if args.prompt_file is not None:
        lines = _read_lines(args.prompt_file, "--prompt-file")
        found = [{"prompt": line, "source": f"{args.prompt_file}:{n}"} for n, line in lines if line.strip()]
        if not found:
            raise ValueError(f"--prompt-file {args.prompt_file!r} holds no prompt (one per non-empty line)")
        items += found
    if args.jsonl is not None:
        found = []
        for n, line in _read_lines(args.jsonl, "--jsonl"):
            if line.strip():
                found.append(_jsonl_item(line, f"{args.jsonl}:{n}"))
        if not found:
            raise ValueError(f"--jsonl {args.jsonl!r} holds no prompt (one JSON object per line)")
        items += found
    if not items:
        raise ValueError("no prompts: give --prompt TEXT, --prompt-file TXT or --jsonl JSONL")
    for item in items:
        if "prompt" in item and not item["prompt"].strip():
            raise ValueError(f"{item['source']}: empty prompt")
    return items


def _read_lines(path: str, flag: str) -> list[tuple[int, str]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path!r} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            return [(n, line.rstrip("\r\n")) for n, line in enumerate(f, 1)]
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _jsonl_item(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise ValueError(f'{where}: want an object with "prompt" (text) or "messages" (a chat), not both')
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ValueError(f'{where}: "prompt" must be text, got {type(record["prompt"]).__name__}')
        return {"prompt": record["prompt"], "source": where}
    messages = record["messages"]
    if (not isinstance(messages, list) or not messages
            or any(not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLE_NAMES
                   for m in messages)):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role": one of '
                         f'{", ".join(ROLE_NAMES)}, "content": text}}')
    return {"messages": messages, "source": where}


def chat_renderer(checkpoint: str | None) -> tuple[Any, str]:
    """(messages -> prompt text, a line saying how): the chat_template of the checkpoint's
    tokenizer_config.json rendered by jinja2 when both exist, else `plain_chat`."""
    config = os.path.join(os.path.expanduser(checkpoint), "tokenizer_config.json") if checkpoint else None
    template = None
    if config and os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{config}: unreadable ({e})") from None
        template, bos = data.get("chat_template"), data.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
    if template:
        try:
            import jinja2
        except ImportError:
            return plain_chat, (f"chats rendered as 'User: ... / Assistant:' lines ({config} has a chat_template, "
                                "but jinja2 is not installed: pip install jinja2 to use it)")
        compiled = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
        return (lambda messages: compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos or "")), \
            f"chats rendered with the chat_template of {config}"
    return plain_chat, "chats rendered as 'System: / User: / Assistant:' lines ending in 'Assistant:'"


def plain_chat(messages: list[dict[str, str]]) -> str:
    """'User: hi\\nAssistant:' for [{"role": "user", "content": "hi"}]: one line per turn, ending with
    the assistant's cue (sharegpt_prompt's format for one turn)."""
    turns = [f"{ROLE_NAMES[m['role']]}: {m['content'].strip()}" for m in messages]
    return "\n".join(turns) + "\nAssistant:"


def encode_items(items: list[dict[str, Any]], cfg: Any, tokenizer: Any, render: Any) -> list[dict[str, Any]]:
    """Each item with "text" (what the model sees) and "ids" (BOS first when the config has one)."""
    for item in items:
        text = item["prompt"] if "prompt" in item else render(item["messages"])
        if tokenizer is None:
            try:
                ids = [int(t) for t in text.split()]
            except ValueError:
                raise ValueError(f"{item['source']}: without a tokenizer a prompt is token ids separated by "
                                 "spaces") from None
            bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
            if bad:
                raise ValueError(f"{item['source']}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        else:
            ids = text_ids(text, cfg, tokenizer)
        if not ids:
            raise ValueError(f"{item['source']}: the prompt encodes to no tokens")
        item["text"], item["ids"] = text, ids
    return items


def text_ids(text: str, cfg: Any, tokenizer: Any) -> list[int]:
    """Token ids of a prompt text: BOS first when the config has one (as the models were trained)."""
    ids = list(tokenizer.encode(text).ids)
    if cfg.bos_id is not None and (not ids or ids[0] != cfg.bos_id):
        ids = [cfg.bos_id, *ids]
    return ids


# ---- streaming ----------------------------------------------------------------------------------


class Streamer:
    """The `stream=` function of one batch: keeps each row's tokens and writes the new text as cycles
    commit it (one row: the text itself; several: `[i] text` lines; decoded incrementally, a
    character split across tokens held back until it is whole)."""

    def __init__(self, tokenizer: Any, first_index: int, rows: int, out: Any = None, show: bool = True):
        self.tokenizer, self.first, self.out, self.show = tokenizer, first_index, out or sys.stdout, show
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.shown = [""] * rows
        self.calls = 0

    def text(self, row: int) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, self.ids[row]))
        return self.tokenizer.decode(self.ids[row])

    def __call__(self, tokens: Any, counts: Any) -> None:
        self.calls += 1
        for row, count in enumerate(counts.tolist()):
            if count > 0:
                self.ids[row] += tokens[row, :count].tolist()
                self._show(row, final=False)

    def _show(self, row: int, final: bool) -> None:
        text = self.text(row)
        if text.endswith("\ufffd") and not final:  # half a UTF-8 character: wait for the rest
            return
        new, self.shown[row] = text[len(self.shown[row]):], text
        if self.show and new:
            if len(self.ids) == 1:
                self.out.write(new)
            else:
                self.out.write(f"[{self.first + row}] {new!r}\n")
            self.out.flush()

    def finish(self) -> None:
        """Whatever was held back (a character still incomplete when the row ended)."""
        for row in range(len(self.ids)):
            self._show(row, final=True)
        if self.show and len(self.ids) == 1:
            self.out.write("\n")
            self.out.flush()


# ---- the command --------------------------------------------------------------------------------


def run(args: argparse.Namespace, console: Console) -> int:
    positive("max-new-tokens", args.max_new_tokens)
    positive("batch-size", args.batch_size)
    spec_arg = check_spec_arg(args.spec)
    items = read_prompts(args)  # bad prompt files fail before the model loads
    if args.out is not None and os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a folder; give a file name (JSON lines)")

    import jax
    import numpy as np

    mesh = mesh_from_args(args)
    stream = not args.no_stream
    if stream and mesh is not None:
        console.print("note: streaming is for single-device runs; with --mesh each batch prints when it ends")
        stream = False
    model = load_model(args, console, seed=args.seed, mesh=mesh)
    cfg, tokenizer = model.cfg, model.tokenizer
    console.print(f"[bold]jaxspec generate[/]: {model.description}", highlight=False)
    console.print(compile_cache_note(args), highlight=False)
    render, how = chat_renderer(args.checkpoint)
    if any("messages" in item for item in items):
        console.print(how, highlight=False)
    encode_items(items, cfg, tokenizer, render)
    sink = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115 (closed below)
    try:
        for b, start in enumerate(range(0, len(items), args.batch_size)):
            batch = items[start : start + args.batch_size]
            choice = choose_spec(spec_arg, model.draft, len(batch))
            console.print(f"batch {b + 1}: prompts {start}..{start + len(batch) - 1}; {choice.how}", highlight=False)
            rng = jax.random.fold_in(jax.random.key(args.seed), b)
            records = _generate_batch(args, model, mesh, batch, start, choice, rng, stream, np)
            for record in records:
                if not stream:
                    console.print(f"[{record['index']}] {record['text']!r}", highlight=False)
                if sink is not None:
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    sink.flush()
            t = records[0]["timings"]
            console.print(
                f"batch {b + 1}: {t['batch_tokens']} tokens in {t['generate_seconds']:.2f} s = "
                f"{t['batch_tokens_per_s']:.1f} tokens/s ({records[0]['spec']}, tau {t['batch_tau']:.2f}); compile "
                f"{t['compile_seconds']:.1f} s apart ({t['programs']} programs, {t['cache_hits']} from the cache)",
                highlight=False)
    finally:
        if sink is not None:
            sink.close()
    if args.out:
        console.print(f"{len(items)} results written to {args.out}", highlight=False)
    return 0


def _generate_batch(args, model, mesh, batch, start, choice, rng, show, np) -> list[dict[str, Any]]:
    """One call of `speculative_generate` (or `generate` for no spec) on `batch`; -> its JSON records."""
    from jaxspec.speculation.generate import generate, speculative_generate

    streamer = Streamer(model.tokenizer, start, len(batch), show=show)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, eos_id=model.cfg.eos_id, rng=rng, mesh=mesh,
                  stream=None if mesh is not None else streamer)
    prompts = [item["ids"] for item in batch]
    with CompileClock() as clock:
        t0 = time.perf_counter()
        if choice.spec is None:
            out = generate(model.params, model.cfg, prompts, **kwargs)
        else:
            draft = choice.draft if choice.draft is not None else model.draft
            out = speculative_generate(model.params, model.cfg, prompts, choice.spec, **kwargs, draft=draft)
        wall = time.perf_counter() - t0
    streamer.finish()
    per_seq = out.stats["per_sequence"]
    generated = int(np.sum(out.lengths))
    gen_s = max(wall - clock.seconds, 1e-9)
    timings = {"wall_seconds": wall, "compile_seconds": clock.seconds, "generate_seconds": gen_s,
               "programs": clock.programs, "cache_hits": clock.cache_hits, "batch_tokens": generated,
               "batch_tokens_per_s": generated / gen_s, "batch_tau": out.stats["mean_accepted_length"],
               "streamed": kwargs["stream"] is not None}
    records = []
    for i, item in enumerate(batch):
        n = int(out.lengths[i])
        ids = out.tokens[i, :n].tolist()
        eos = model.cfg.eos_id
        text = model.tokenizer.decode(ids) if model.tokenizer is not None else " ".join(map(str, ids))
        records.append({
            "index": start + i, "source": item["source"],
            **({"prompt": item["prompt"]} if "prompt" in item else {"messages": item["messages"]}),
            "prompt_text": item["text"], "prompt_tokens": len(item["ids"]),
            "tokens": ids, "text": text, "num_tokens": n,
            "finish": "eos" if eos is not None and n and ids[-1] == eos else "length",
            "spec": out.stats["spec"], "spec_choice": choice.how,
            "tau": float(per_seq["mean_accepted_length"][i]), "cycles": int(per_seq["cycles"][i]),
            "temperature": args.temperature, "seed": args.seed,
            "timings": timings,
        })
    return records
