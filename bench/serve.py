"""Serving under load: continuous batching (the engine behind `jaxspec serve`) against static batches of the
same requests and against autoregressive serving, then open-loop arrivals at several rates.

Requests: the first held-out prompts of GSM8K, MBPP and ShareGPT (as every benchmark reads them), greedy,
each with its own max_tokens drawn uniformly from [--min-tokens, --max-tokens] (seeded): the spread of
lengths is what continuous batching exploits and what a static batch wastes (every row waits for the
longest). Methods, timed round-robin on one pinned core (`jaxspec.core.measure`), every request queued at
time zero (a load that keeps the slots busy):
- continuous: the slot engine with --spec over --slots rows (`jaxspec.serve.engine.Engine`);
- static: `speculative_generate` with the same spec on batches of --slots requests in arrival order, each
  batch running to its longest request; only each request's own tokens count;
- continuous-ar: the slot engine decoding autoregressively.
Then, for each --rates (a fraction of the continuous method's measured request rate), Poisson arrivals into
a running engine: time to first token and time per output token at p50 / p99, tokens/s, tau.

    python bench/serve.py --checkpoint checkpoints/tiny-v4 --json results/serve/tiny-v4.json
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from jaxspec.core import measure  # noqa: E402


def main() -> int:
    p = _common.parser(__doc__, preset=None)
    p.add_argument("--checkpoint", default="checkpoints/tiny-v4", help="a jaxspec checkpoint with a tokenizer")
    p.add_argument("--spec", default="s3_k1_d4", help="the speculative spec of the continuous and static methods")
    p.add_argument("--slots", type=int, default=8, help="rows decoded together (the static batch size too)")
    p.add_argument("--per-dataset", type=int, default=16, help="held-out prompts per dataset")
    p.add_argument("--min-tokens", type=int, default=16, help="smallest max_tokens of a request")
    p.add_argument("--max-tokens", type=int, default=128, help="largest max_tokens of a request")
    p.add_argument("--max-prompt-tokens", type=int, default=192, help="longer prompts keep their last tokens")
    p.add_argument("--cycles-per-call", type=int, default=4, help="the engine's cycles per device call")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of the saturated comparison")
    p.add_argument("--rates", default="0.25,0.5,0.9", help="open-loop arrival rates, fractions of the saturated one")
    p.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last one allowed)")
    args = p.parse_args()
    _common.check_positive(p, args, ["slots", "per_dataset", "min_tokens", "max_tokens", "repeats",
                                     "cycles_per_call", "max_prompt_tokens"])
    if args.min_tokens > args.max_tokens:
        p.error("--min-tokens must be <= --max-tokens")
    rates = [float(r) for r in args.rates.split(",") if r]
    pinned = measure.pin(args.core)

    import numpy as np

    import jaxspec as js
    from jaxspec.cli.generate import text_ids
    from jaxspec.serve.engine import Engine, generate_all
    from jaxspec.training.data import DATASETS, HELDOUT_SPLITS, load_dataset

    console = _common.console()
    ckpt = js.load_checkpoint(args.checkpoint, dtype="float32", cpu_experts=True)
    cfg = ckpt.cfg
    rng = np.random.default_rng(args.seed)
    prompts = []
    for name in DATASETS:
        for ex in load_dataset(name, HELDOUT_SPLITS[name])[: args.per_dataset]:
            prompts.append(text_ids(ex.prompt, cfg, ckpt.tokenizer)[-args.max_prompt_tokens:])
    limits = [int(x) for x in rng.integers(args.min_tokens, args.max_tokens + 1, size=len(prompts))]
    params = [js.SamplingParams(max_tokens=m, stop_token_ids=(cfg.eos_id,)) for m in limits]
    max_len = 1 << (args.max_prompt_tokens + args.max_tokens + 64).bit_length()
    console.print(f"{len(prompts)} requests, max_tokens {args.min_tokens}..{args.max_tokens}, {args.slots} slots, "
                  f"spec {args.spec}; pinned {pinned}")

    def engine(spec: str) -> Engine:
        return Engine(ckpt.params, cfg, draft=ckpt.draft, spec=spec, num_slots=args.slots, max_len=max_len,
                      cycles_per_call=args.cycles_per_call, max_queue=len(prompts) + 1)

    outputs: dict[str, list[list[int]]] = {}

    def continuous(spec: str, name: str):
        def run():
            requests = generate_all(engine(spec), prompts, params)
            outputs[name] = [r.tokens for r in requests]
            return np.zeros(())
        return run

    def static():
        tokens = []
        for start in range(0, len(prompts), args.slots):
            batch, lim = prompts[start: start + args.slots], limits[start: start + args.slots]
            out = js.speculative_generate(ckpt.params, cfg, batch, args.spec, max_new_tokens=max(lim),
                                          eos_id=cfg.eos_id, draft=ckpt.draft)
            tokens += [out.tokens[i, : min(int(out.lengths[i]), m)].tolist() for i, m in enumerate(lim)]
        outputs["static"] = tokens
        return np.zeros(())

    methods = {"continuous": continuous(args.spec, "continuous"), "static": static,
               "continuous-ar": continuous("none", "continuous-ar")}
    longest = max(len(x) for x in prompts)
    for spec in (args.spec, "none"):  # the engines' programs for every group size and prompt width
        t0 = time.perf_counter()
        n = engine(spec).warm_up(longest)
        console.print(f"warm-up (compiles): {spec} engine, {n} programs, {time.perf_counter() - t0:.1f} s")
    for name, call in methods.items():  # compile every other program once
        t0 = time.perf_counter()
        call()
        console.print(f"warm-up (compiles): {name} {time.perf_counter() - t0:.1f} s")
    same = outputs["continuous"] == outputs["static"] == outputs["continuous-ar"]
    generated = sum(len(t) for t in outputs["continuous"])
    with measure.Watch() as watch:
        timings = measure.round_robin(methods, args.repeats, progress=lambda s: console.print(s))
    verdict = watch.verdict(timings["continuous-ar"], "continuous-ar")
    console.print(measure.verdict_line(verdict))
    saturated = {name: {"seconds": t.median, "spread": t.spread, "tokens_per_s": generated / t.median}
                 for name, t in timings.items()}
    for name, row in saturated.items():
        console.print(f"{name:>14}: {row['tokens_per_s']:8.1f} tokens/s ({row['seconds']:.2f} s, spread "
                      f"{100 * row['spread']:.0f}%)")
    gain = saturated["continuous"]["tokens_per_s"] / saturated["static"]["tokens_per_s"]
    console.print(f"continuous / static: {gain:.3f}; outputs identical across methods: {same}")

    request_rate = len(prompts) / saturated["continuous"]["seconds"]
    open_loop = []
    for fraction in rates:
        rate = fraction * request_rate
        eng = engine(args.spec)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(prompts)))
        eng.start()
        start = time.perf_counter()
        requests = []
        for prompt, sp, at in zip(prompts, params, arrivals, strict=True):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            requests.append(eng.submit(prompt, sp))
        for r in requests:
            r.done.wait()
        wall = max(r.finished for r in requests) - start
        eng.shutdown(0)
        ttft = np.asarray([r.first_token - r.submitted for r in requests])
        tpot = np.asarray([(r.finished - r.first_token) / (len(r.tokens) - 1) for r in requests if len(r.tokens) > 1])
        tokens = sum(len(r.tokens) for r in requests)
        row = {"fraction": fraction, "requests_per_s": rate, "tokens_per_s": tokens / wall,
               "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
               "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": float(np.percentile(tpot, 99)),
               "tau": eng.metrics()["tau"]}
        open_loop.append(row)
        console.print(f"arrivals {rate:.2f}/s ({fraction:g} of saturated): {row['tokens_per_s']:.1f} tokens/s, TTFT "
                      f"p50 {1e3 * row['ttft_p50']:.0f} ms p99 {1e3 * row['ttft_p99']:.0f} ms, TPOT p50 "
                      f"{1e3 * row['tpot_p50']:.1f} ms p99 {1e3 * row['tpot_p99']:.1f} ms, tau {row['tau']:.2f}")
    _common.write_json(args.json, {
        "machine": _common.machine_facts(), "pinned": pinned, "verdict": verdict, "args": vars(args),
        "requests": len(prompts), "generated_tokens": generated, "outputs_identical": same,
        "saturated": saturated, "open_loop": open_loop,
    }, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
