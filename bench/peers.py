"""jaxspec beside its peers on one checkpoint: HF transformers (`DeepseekV4ForCausalLM`, torch CPU) and
mlx-vlm (`mlx[cpu]`), same prompts, same greedy tokens, one pinned core, round-robin.

    python bench/peers.py [--checkpoint checkpoints/tiny-v4] [--prompts 4] [--prompt-len 32]
                          [--new-tokens 64] [--repeats 3] [--specs s3_k1_d4 s7_k1_d8] [--core N] [--json PATH]

The checkpoint is exported in the release's layout (`save_hf_checkpoint`: transformers' names for
transformers, DeepSeek's official names for mlx-vlm) and each engine decodes the same prompts greedily,
one prompt at a time (batch 1), `--new-tokens` tokens each, prefill included:
  * jaxspec AR (`generate`) and jaxspec speculation (`speculative_generate` with the checkpoint's
    own draft, each of `--specs`);
  * transformers AR (`generate(do_sample=False)`, its DynamicCache). transformers' own speculation
    (assisted decoding, prompt lookup) refuses DeepSeek-V4's cache, which cannot be cropped: the
    script tries it and prints the refusal;
  * mlx-vlm AR: its DeepSeek-V4 language model with its own cache, a greedy loop of one-token
    steps. mlx-vlm accepts only the release's compression ratios (CSA 4, HCA 128) and its HCA
    position table is sized by the ratio, so it cannot load a checkpoint with another HCA ratio
    (tiny-v4's is 16). It runs on the checkpoint's twin instead: the same shapes with HCA 128 and
    random weights (`jaxspec.testing.randomize`), timed against jaxspec AR on that same twin
    ("jaxspec AR (twin)"), tokens compared with it. Its cached one-token decode drops the overlapping
    half of each new CSA entry, so its tokens may part from ours after the first CSA boundary.
    mlx-vlm's MTP speculation needs the April MTP layout and its own draft loader; not run here.
Every engine warms up once (compiles, caches), then `--repeats` rounds time every engine in turn
inside `jaxspec.core.measure.Watch`: its verdict (pinned, quiet, the reference's spread) is printed
with the table. torch and mlx are told to use one thread; XLA is single-threaded by `pin`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from _common import check_positive, console, parser, write_json

from jaxspec.core import measure

# bench/kernels.py would shadow the `kernels` package that transformers imports: drop this folder from
# the path now that _common is imported.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

DEFAULT_SPECS = ["s3_k1_d4", "s7_k1_d8"]


def _args():
    p = parser(__doc__, preset=None)
    p.add_argument("--checkpoint", default="checkpoints/tiny-v4", help="a jaxspec checkpoint (default tiny-v4)")
    p.add_argument("--prompts", type=int, default=4, help="prompts, each decoded at batch 1 (default 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (GSM8K test questions, cut)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help="jaxspec speculation configs to time")
    p.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last usable one)")
    args = p.parse_args()
    check_positive(p, args, ("prompts", "prompt_len", "new_tokens", "repeats"))
    return args


def _prompts(tok, count: int, length: int, vocab: int, seed: int) -> tuple[list[list[int]], str]:
    import numpy as np

    from jaxspec.training.data import data_available, load_dataset

    if tok is not None and data_available():
        rows = [tok.encode(ex.prompt).ids for ex in load_dataset("gsm8k", "test")]
        rows = [r[-length:] for r in rows if len(r) >= length][:count]
        if len(rows) == count:
            return rows, f"GSM8K test questions, last {length} tokens"
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, length).tolist() for _ in range(count)], "random tokens (GSM8K data absent)"


def _jaxspec_runs(ckpt, prompts, new_tokens, specs):
    import numpy as np

    import jaxspec as js

    def ar():
        return [js.generate(ckpt.params, ckpt.cfg, [p], max_new_tokens=new_tokens).tokens[0] for p in prompts]

    runs: dict[str, Any] = {"jaxspec AR": ar}
    for spec in specs:
        def run(spec=spec):
            return [js.speculative_generate(ckpt.params, ckpt.cfg, [p], spec, max_new_tokens=new_tokens,
                                            draft=ckpt.draft).tokens[0] for p in prompts]
        runs[f"jaxspec {spec}"] = run
    taus = {}
    for spec in specs:
        out = [js.speculative_generate(ckpt.params, ckpt.cfg, [p], spec, max_new_tokens=new_tokens, draft=ckpt.draft)
               for p in prompts]
        taus[f"jaxspec {spec}"] = float(np.mean([o.stats["mean_accepted_length"] for o in out]))
    return runs, taus


def _transformers_runs(folder, prompts, new_tokens):
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    model = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every engine decodes all --new-tokens (jaxspec: eos_id=None)
    model.generation_config.pad_token_id = 0

    def ar():
        with torch.no_grad():
            return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]

    refusal = None
    try:
        with torch.no_grad():
            model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=4)
    except ValueError as e:
        refusal = str(e).splitlines()[0]
    return {"transformers AR": ar}, refusal


def _mlx_runs(folder, prompts, new_tokens):
    import glob

    import mlx.core as mx
    from mlx_vlm.models.deepseek_v4.config import ModelConfig as MLXConfig
    from mlx_vlm.models.deepseek_v4.language import LanguageModel

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    # index_block=0: no HISA (mlx-vlm's approximate top-k past 1024 compressed entries; these have fewer)
    model = LanguageModel(MLXConfig.from_dict({**config, "index_block": 0}))
    weights = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        weights.update(mx.load(file))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())

    def ar():
        outs = []
        for p in prompts:
            cache = model.make_cache()
            logits = model(mx.array([p]), cache=cache).logits[:, -1]
            tokens = []
            for _ in range(new_tokens):
                token = mx.argmax(logits, axis=-1)
                mx.eval(token)
                tokens.append(int(token.item()))
                logits = model(token[:, None], cache=cache).logits[:, -1]
            outs.append(tokens)
        return outs

    return {"mlx-vlm AR (twin)": ar}


def main() -> int:
    args = _args()
    pinned = measure.pin(args.core)  # before any jax, torch or mlx work
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import jax

    import jaxspec as js
    from jaxspec.checkpoint import save_hf_checkpoint
    from jaxspec.model.network import cpu_layout
    from jaxspec.testing import randomize

    out = console()
    plain = js.load_checkpoint(args.checkpoint, dtype="float32")
    ckpt = js.load_checkpoint(args.checkpoint, dtype="float32", cpu_experts=True)
    prompts, source = _prompts(ckpt.tokenizer, args.prompts, args.prompt_len, ckpt.cfg.vocab_size, args.seed)
    out.print(f"{args.checkpoint}: {len(prompts)} prompts ({source}), {args.new_tokens} greedy tokens each, "
              f"batch 1, core {pinned.get('core')}")
    runs, taus = _jaxspec_runs(ckpt, prompts, args.new_tokens, args.specs)
    notes = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, official_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "official")
        save_hf_checkpoint(hf_dir, plain.cfg, plain.params, spelling="hf")
        save_hf_checkpoint(official_dir, plain.cfg, plain.params, spelling="official")
        hf_runs, refusal = _transformers_runs(hf_dir, prompts, args.new_tokens)
        runs.update(hf_runs)
        notes["transformers speculation"] = refusal or "prompt-lookup decoding ran (not timed)"
        # mlx-vlm's twin: tiny-v4's shapes with the release's HCA ratio, random weights
        twin_cfg = plain.cfg.replace(hca_ratio=128)
        twin = randomize(js.init_params(twin_cfg, jax.random.key(args.seed)), jax.random.key(args.seed + 1), scale=0.1)
        save_hf_checkpoint(official_dir, twin_cfg, twin, spelling="official")
        twin_cpu = cpu_layout(twin, twin_cfg)
        runs["jaxspec AR (twin)"] = lambda: [
            js.generate(twin_cpu, twin_cfg, [p], max_new_tokens=args.new_tokens).tokens[0] for p in prompts]
        runs.update(_mlx_runs(official_dir, prompts, args.new_tokens))
        if plain.cfg.hca_ratio != 128:
            notes["mlx-vlm"] = (f"cannot load HCA ratio {plain.cfg.hca_ratio} (accepts 128 only): timed on the "
                                "checkpoint's twin with HCA 128 and random weights, against jaxspec AR on that twin")
        warm, outputs = {}, {}
        for name, run in runs.items():  # compile / warm caches, and the tokens compared below
            t0 = time.perf_counter()
            outputs[name] = [list(map(int, t)) for t in run()]
            warm[name] = time.perf_counter() - t0
        with measure.Watch() as watch:
            timings = measure.round_robin(runs, args.repeats)
    ar = timings["jaxspec AR"].median
    generated = len(prompts) * args.new_tokens
    rows = []
    for name, t in timings.items():
        reference = outputs["jaxspec AR (twin)" if "twin" in name else "jaxspec AR"]
        same = [a == b for a, b in zip(outputs[name], reference, strict=True)]
        first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                 for a, b in zip(outputs[name], reference, strict=True)]
        rows.append({"engine": name, "seconds": t.median, "rounds": list(t.seconds), "spread": t.spread,
                     "tokens_per_s": generated / t.median, "vs_jaxspec_ar": ar / t.median,
                     "tau": taus.get(name), "warmup_s": warm[name],
                     "prompts_identical": int(sum(same)), "first_difference": first})
    verdict = watch.verdict(timings["jaxspec AR"], "jaxspec AR")
    from rich.table import Table

    table = Table(title="greedy decoding, batch 1, one core")
    for col in ("engine", "tok/s", "x jaxspec AR", "spread", "tau", "tokens = its jaxspec AR"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for r in rows:
        table.add_row(r["engine"], f"{r['tokens_per_s']:.0f}", f"{r['vs_jaxspec_ar']:.2f}x",
                      f"{100 * r['spread']:.0f}%", "-" if r["tau"] is None else f"{r['tau']:.2f}",
                      f"{r['prompts_identical']}/{len(prompts)}")
    out.print(table)
    for name, note in notes.items():
        out.print(f"{name}: {note}")
    out.print(measure.verdict_line(verdict))
    write_json(args.json, {"checkpoint": args.checkpoint, "prompts": source, "new_tokens": args.new_tokens,
                           "repeats": args.repeats, "rows": rows, "notes": notes, "measurement": verdict,
                           "versions": _versions()}, out)
    return 0


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("jax", "torch", "transformers", "mlx", "mlx-vlm")}


if __name__ == "__main__":
    sys.exit(main())
