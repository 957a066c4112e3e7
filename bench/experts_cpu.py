"""The CPU's routed-expert paths side by side: union (each selected expert once, on all N tokens,
read in place from its own leaf), blocked (each expert on the rows that selected it, a few rows at a
time, read in place), gathered (each assignment's weights copied, then contracted) and dense (every
expert on every token), at the token counts of a decode step, a tree verify and a prefill chunk, on
every MoE layer of a model at once.

    python bench/experts_cpu.py [--checkpoint PATH | --preset tiny] [--tokens 1 2 4 5 8 16 32 64 256]
                                [--blocks 4 8 16] [--rounds 15] [--json PATH]

One jitted function per (path, N) runs the routed experts of all layers in turn on N tokens (the
router of each layer picks the experts; all layers' weights are read, as in a forward pass, so they
do not sit in cache between calls). The functions are timed round-robin, `rounds` x 3 calls each,
so a change in machine load hits every path alike; the table gives the median ms per call and the
path `jaxspec.layers.moe.cpu_experts_path` picks (up to 64 experts: union while the assignments N*k
fit in the experts, blocked beyond; with more experts gathered while N*k is at most 1.5x the experts,
else dense): the measurement behind that rule. `--blocks` adds the blocked path at fixed rows per
block beside the engine's choice (`jaxspec.layers.moe.expert_block`): the measurement behind that one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import check_positive, console, machine_facts, machine_header, parser, write_json
from rich.table import Table

import jaxspec as js
from jaxspec.layers import moe
from jaxspec.layers.moe import CPU_PATHS, IN_PLACE_PATHS, cpu_experts_path, route, stack_experts, unstack_experts


def fixed_block(block: int):
    """The blocked path at `block` rows per block whatever the assignments (the engine's rule patched
    while it is traced)."""
    def path(experts, cfg, x, indices, weights):
        rule, moe.expert_block = moe.expert_block, lambda assignments, num_experts: block
        try:
            return moe.blocked_experts(experts, cfg, x, indices, weights)
        finally:
            moe.expert_block = rule
    return path


def load(args) -> tuple[js.ModelConfig, Any]:
    if args.checkpoint:
        cpu = jax.default_backend() == "cpu"
        ckpt = js.load_checkpoint(os.path.expanduser(args.checkpoint), dtype="float32" if cpu else None,
                                  cpu_experts=cpu)
        return ckpt.cfg, ckpt.params
    cfg = js.ModelConfig.preset(args.preset).replace(dtype="float32")
    return cfg, js.init_params(cfg, jax.random.key(args.seed))


def all_layers(cfg: js.ModelConfig, params, path, in_place: bool):
    """x [N, d], ids [N] -> the routed experts of every layer applied in turn (residual-style)."""
    layers = [layer.ffn for layer in params.layers]
    # the weights as the engine holds them on a CPU: per-expert leaves for the paths that read them in
    # place (model.network.cpu_layout), stacked for the others
    layout = unstack_experts if in_place else stack_experts
    layers = [ffn.replace(experts=layout(ffn.experts)) for ffn in layers]

    def run(layers, x, ids):
        for ffn in layers:
            indices, weights = route(ffn, cfg, x, ids)
            x = x + 0.01 * path(ffn.experts, cfg, x, indices, weights).astype(x.dtype)
        return x

    return jax.jit(run), layers


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--checkpoint", metavar="PATH", help="a trained checkpoint instead of --preset")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32, 64, 256])
    p.add_argument("--blocks", type=int, nargs="*", default=[], metavar="B",
                   help="also time the blocked path at B rows per block (the engine picks B by expert_block)")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    check_positive(p, args, ["tokens", "blocks", "rounds"])
    con, facts = console(), machine_facts()
    con.print(machine_header(facts, "a GPU, which runs the grouped-matmul kernel at every size"))
    cfg, params = load(args)
    paths = {name: (path, name in IN_PLACE_PATHS) for name, path in CPU_PATHS.items()}
    paths.update({f"blocked B={b}": (fixed_block(b), True) for b in args.blocks})
    calls = {}
    for name, (path, in_place) in paths.items():
        fn, layers = all_layers(cfg, params, path, in_place)
        for n in args.tokens:
            x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size), jnp.float32)
            ids = jax.random.randint(jax.random.key(n + 1), (n,), 0, cfg.vocab_size)
            compiled = fn.lower(layers, x, ids).compile()
            jax.block_until_ready(compiled(layers, x, ids))
            calls[(name, n)] = (compiled, (layers, x, ids))
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, (compiled, call_args) in calls.items():
            for _ in range(3):
                start = time.perf_counter()
                jax.block_until_ready(compiled(*call_args))
                times[key].append(time.perf_counter() - start)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    table = Table(title=f"routed experts of {len(params.layers)} layers, {e} experts, k = {k} (ms per call)")
    for col in ("tokens N", "N*k / E", *paths, "engine's CPU path", "engine's B"):
        table.add_column(col, justify="right")
    rows = []
    for n in args.tokens:
        ms = {name: 1e3 * float(np.median(times[(name, n)])) for name in paths}
        chosen, block = cpu_experts_path(n * k, e, k), moe.expert_block(n * k, e)
        rows.append({"tokens": n, **{f"{name}_ms": v for name, v in ms.items()}, "engine_path": chosen,
                     "engine_block": block})
        table.add_row(str(n), f"{n * k / e:.2f}", *(f"{v:.3f}" for v in ms.values()), chosen, str(block))
    con.print(table)
    result = {"facts": facts, "checkpoint": args.checkpoint, "preset": None if args.checkpoint else args.preset,
              "rounds": args.rounds, "rows": rows}
    write_json(args.json, result, con)
    return result


if __name__ == "__main__":
    main()
