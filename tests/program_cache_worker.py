"""Runs in its own process (see tests/test_programs.py): compiles many distinct speculative loops
one after the other, as a long notebook or sweep does, and reports the process's memory maps.

    python tests/program_cache_worker.py OUT.json [--loops 60] [--cache-size N] [--batch-sizes 1,2]

A 1-layer `test`-style model (cheap compiles) whose draft mostly agrees with it (trees are
accepted deep), batch 1 and 2, greedy: every loop's tokens are compared with `generate`'s. Without
the bounded program cache each loop would keep ~1,000 maps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxspec as js  # noqa: E402
from jaxspec.core import programs  # noqa: E402
from jaxspec.speculation.generate import compile_count, speculative_compile_count  # noqa: E402
from jaxspec.testing import high_acceptance, randomize  # noqa: E402

CFG = js.ModelConfig.preset("test", num_layers=1, layer_types=("sliding",))
PROMPTS = {1: [[5, 17, 3, 9]], 2: [[5, 17, 3, 9], [7, 8]]}
NEW_TOKENS = 6


def specs() -> list[str]:
    """Every valid spec with S <= 2 (27), then deeper chains and trees: the cheapest loops first."""
    out = []
    for s in (1, 2, 3, 4):
        for k in (1, 2, 4):
            for d in range(2, 17):
                try:
                    out.append(js.SpecConfig(s, k, d).name)
                except ValueError:
                    pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--loops", type=int, default=60)
    parser.add_argument("--cache-size", type=int, default=None)
    parser.add_argument("--batch-sizes", default="1,2", help="of 1,2: the loops alternate over them")
    args = parser.parse_args()
    if args.cache_size is not None:
        programs.set_cache_size(args.cache_size)
    # One jitted init (eager init would compile every op on its own: ~10 s of a CPU).
    params = jax.jit(lambda k: high_acceptance(randomize(js.init_params(CFG, k), jax.random.fold_in(k, 1))))(
        jax.random.key(0))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    reference = {b: js.generate(params, CFG, PROMPTS[b], max_new_tokens=NEW_TOKENS) for b in batch_sizes}
    start_maps, start = programs.process_map_count(), time.perf_counter()
    loops, max_maps, mismatches, maps_after, taus = 0, start_maps, [], [], []
    spec_loops_before = speculative_compile_count()
    runs = [(spec, b) for spec in specs() for b in batch_sizes]
    for spec, b in runs[: args.loops]:
        out = js.speculative_generate(params, CFG, PROMPTS[b], spec, max_new_tokens=NEW_TOKENS)
        ref = reference[b]
        if not (np.array_equal(out.tokens, ref.tokens) and np.array_equal(out.lengths, ref.lengths)):
            mismatches.append(f"{spec} batch {b}")
        taus.append(out.stats["mean_accepted_length"])
        loops += 1
        maps = programs.process_map_count()
        maps_after.append(maps)
        max_maps = max(max_maps, maps)
        print(f"{loops:3d} {spec} b={b} maps {maps} live {programs.live_programs()} "
              f"{time.perf_counter() - start:.0f}s", flush=True)
    report = {
        "loops": loops,
        "spec_loops_compiled": speculative_compile_count() - spec_loops_before,
        "generate_programs": compile_count(),
        "cache_size": programs.cache_size(),
        "live_programs": programs.live_programs(),
        "start_maps": start_maps,
        "max_maps": max_maps,
        "maps_after": maps_after,
        "mismatches": mismatches,
        "mean_tau": float(np.mean(taus)) if taus else 0.0,
        "max_map_count": open(programs.MAP_COUNT_FILE).read().strip() if os.path.exists(programs.MAP_COUNT_FILE)
        else None,
        "seconds": time.perf_counter() - start,
    }
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
