"""Tokens/s of `generate` and `speculative_generate` on 1 device vs. sharded over 8 (simulated CPU
devices unless the machine has 8 accelerators).

    python bench/sharded.py [--preset tiny] [--meshes 8,1,1 1,8,1 2,2,2] [--batch 8] [--prompt-len 32]
                            [--new-tokens 64] [--spec s3_k2_d6] [--repeats 3] [--seed 0] [--json PATH]

On CPU the process asks for 8 host devices (`jax_num_cpu_devices`); they share the same cores, so
a mesh cannot be faster than one device there: the CPU numbers show the sharding overhead (more,
smaller kernels and the collectives), not a speedup. Per method and mesh: one warm-up call (compile
excluded), then `repeats` timed calls, round-robin over meshes; median. tok/s = batch * new_tokens
/ time (prefill included). check = tokens identical to the 1-device run. Parameters are placed on
each mesh once (`placement.shard_params`) before timing. Parameters are
`jaxspec.testing.high_acceptance` of a random init (the `agreeing` variant of spec_vs_ar.py): the
draft accepts often, so speculation does real tree work.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax

# Before any backend starts; only the CPU backend reads it (an 8-GPU machine uses its GPUs).
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from _common import check_positive, console, parser, usable_cores, write_json  # noqa: E402
from rich.table import Table  # noqa: E402

import jaxspec as js  # noqa: E402
from jaxspec.model.placement import shard_params  # noqa: E402
from jaxspec.sharding import make_mesh, parse_mesh  # noqa: E402
from jaxspec.testing import high_acceptance  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, seed_help="prompt seed")
    p.add_argument("--meshes", nargs="+", default=["8,1,1", "1,8,1", "2,2,2"], help="data,tensor,expert")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--spec", default="s3_k2_d6")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    check_positive(p, args, ("batch", "prompt_len", "new_tokens", "repeats"))
    try:
        args.meshes = [parse_mesh(m) for m in args.meshes]
        args.spec = js.SpecConfig.parse(args.spec)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    con = console()
    cfg = js.ModelConfig.preset(args.preset)
    backend, n_dev = jax.default_backend(), len(jax.devices())
    con.print(f"[bold]jaxspec sharded benchmark[/]  preset={args.preset} batch={args.batch} "
              f"prompt_len={args.prompt_len} new_tokens={args.new_tokens} spec={args.spec.name}")
    con.print(f"backend {backend}, {n_dev} devices ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    if backend == "cpu":
        con.print(f"[bold yellow]CPU numbers[/]: {n_dev} simulated devices share {usable_cores()} cores; "
                  "a mesh shows sharding overhead here, not a speedup")
    params = high_acceptance(js.init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len), dtype=np.int32)
    setups: list[tuple[str, Any, Any]] = [("1 device", None, params)]
    for shape in args.meshes:
        mesh = make_mesh(*shape)
        setups.append((f"mesh {','.join(map(str, shape))}", mesh, shard_params(params, cfg, mesh)))

    methods = {
        "generate": lambda p, mesh: js.generate(p, cfg, prompts, max_new_tokens=args.new_tokens, mesh=mesh),
        f"speculative {args.spec.name}": lambda p, mesh: js.speculative_generate(
            p, cfg, prompts, args.spec, max_new_tokens=args.new_tokens, mesh=mesh),
    }
    rows = []
    for method, run in methods.items():
        times: dict[str, list[float]] = {name: [] for name, _, _ in setups}
        outputs, warmup = {}, {}
        for name, mesh, p in setups:
            with con.status(f"{method} on {name}: compiling..."):
                t0 = time.perf_counter()
                outputs[name] = run(p, mesh)
                warmup[name] = time.perf_counter() - t0
        for _ in range(args.repeats):
            for name, mesh, p in setups:
                t0 = time.perf_counter()
                run(p, mesh)
                times[name].append(time.perf_counter() - t0)
        ref = outputs["1 device"]
        for name, _, _ in setups:
            t = statistics.median(times[name])
            out = outputs[name]
            rows.append({
                "method": method, "setup": name, "time_s": t, "tokens_per_s": args.batch * args.new_tokens / t,
                "warmup_s": warmup[name], "check": bool(np.array_equal(out.tokens, ref.tokens)),
                "tau": out.stats.get("mean_accepted_length"),
            })

    table = Table(title=f"tokens/s, {args.preset}, batch {args.batch} ({backend.upper()} numbers)")
    for col in ("method", "setup", "tok/s", "x 1 device", "run s", "warm-up s", "tau", "check"):
        table.add_column(col, justify="left" if col in ("method", "setup") else "right", no_wrap=True)
    base = {r["method"]: r["tokens_per_s"] for r in rows if r["setup"] == "1 device"}
    for r in rows:
        speedup = r["tokens_per_s"] / base[r["method"]]
        table.add_row(r["method"], r["setup"], f"{r['tokens_per_s']:.1f}", f"{speedup:.2f}", f"{r['time_s']:.3f}",
                      f"{r['warmup_s']:.1f}", "" if r["tau"] is None else f"{r['tau']:.2f}",
                      "ok" if r["check"] else "DIFFERS")
    con.print(table)
    result = {"preset": args.preset, "backend": backend, "devices": n_dev, "cpu_numbers": backend == "cpu",
              "cores": usable_cores(), "jax_version": jax.__version__, "rows": rows}
    write_json(args.json, result, con)
    return result


if __name__ == "__main__":
    main()
