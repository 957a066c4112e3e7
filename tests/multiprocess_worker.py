"""One process of the multi-process loading test (tests/test_multiprocess_load.py).

    python tests/multiprocess_worker.py CKPT OUT --process-id I --num-processes 2 --port P [--v41 FOLDER]
    python tests/multiprocess_worker.py CKPT OUT --single [--v41 FOLDER]

Multi-process: 4 CPU devices per process, `jax.distributed` on localhost, a (data 1, tensor 2,
expert 4) mesh over both processes' 8 devices; loads CKPT into it (each process reads its own
slices), gathers the parameters, runs greedy `speculative_generate` on the mesh. Single: one
process, one device, no mesh. Writes OUT/<name>.json (tokens, bytes read per tensor, the experts
this process's devices hold) and OUT/<name>.npz (the full parameters; process 0 and single only).
--v41: also a DeepSeek-V4.1 release folder loaded the same way (`load_release`), its gathered parameters
in OUT/<name>_v41.npz and its greedy `generate` tokens in the report.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("out")
parser.add_argument("--process-id", type=int, default=None)
parser.add_argument("--num-processes", type=int, default=2)
parser.add_argument("--port", type=int, default=None)
parser.add_argument("--single", action="store_true")
parser.add_argument("--v41", default=None, help="a V4.1 release folder to load too")
args = parser.parse_args()

jax.config.update("jax_num_cpu_devices", 1 if args.single else 4)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import jaxspec as js  # noqa: E402
from jaxspec.checkpoint import LoadStats  # noqa: E402
from jaxspec.model.placement import param_shardings  # noqa: E402
from jaxspec.sharding import initialize_distributed  # noqa: E402

PROMPTS = [[5, 17, 3, 9, 60], [7, 8, 9], [int(t) for t in np.random.default_rng(0).integers(0, 96, 19)]]
NEW_TOKENS = 10
SPEC = "s2_k2_d4"


def gathered(params, mesh) -> dict:
    """Every leaf of `params` whole on this process, by its keystr path."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if mesh is None:
        return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}
    from jax.experimental import multihost_utils

    return {jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True)) for p, x in flat}


def v41(folder, mesh, name) -> dict:
    """The V4.1 release over the mesh: its gathered target and drafter, greedy tokens, and whether every
    target leaf sits in its declared sharding."""
    ckpt = js.load_release(folder, dtype="float32", mesh=mesh)
    arrays = gathered((ckpt.params, ckpt.draft.params), mesh)  # a collective: every process takes part
    if args.single or args.process_id == 0:
        np.savez(os.path.join(args.out, f"{name}_v41.npz"), **arrays)
    report = {}
    if mesh is not None:
        want = jax.tree.leaves(param_shardings(ckpt.cfg, mesh, params=ckpt.params))
        report["v41_shardings_ok"] = all(x.sharding.is_equivalent_to(s, x.ndim)
                                         for x, s in zip(jax.tree.leaves(ckpt.params), want, strict=True))
    out = js.generate(ckpt.params, ckpt.cfg, PROMPTS, max_new_tokens=6, mesh=mesh)
    report["v41_tokens"] = out.tokens.tolist()
    return report


def main() -> None:
    t0 = time.perf_counter()
    mesh = None
    name = "single"
    if not args.single:
        initialize_distributed(f"localhost:{args.port}", args.num_processes, args.process_id)
        mesh = js.make_mesh(data=1, tensor=2, expert=4)
        name = f"process{args.process_id}"
    stats = LoadStats()
    cfg, params = js.load_hf_checkpoint(args.checkpoint, dtype="float32", mesh=mesh, stats=stats)
    load_s = time.perf_counter() - t0
    report = {"process_count": jax.process_count(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count(), "bytes_read": stats.bytes_read,
              "bytes_in_files": stats.bytes_in_files, "load_s": load_s}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if mesh is not None:
        want = jax.tree.leaves(param_shardings(cfg, mesh))
        report["shardings_ok"] = all(x.sharding == s for (_, x), s in zip(flat, want, strict=True))
        # the experts this process's devices hold (jax's own placement), per stacked leaf
        held = {}
        for path, x in flat:
            key = jax.tree_util.keystr(path)
            if ".ffn.experts." in key:
                held[key] = sorted({e for idx in x.sharding.addressable_devices_indices_map(x.shape).values()
                                    for e in range(*idx[0].indices(x.shape[0])[:2])})
        report["experts_held"] = held
    arrays = gathered(params, mesh)
    if args.single or args.process_id == 0:
        np.savez(os.path.join(args.out, f"{name}.npz"), **arrays)
    out = js.speculative_generate(params, cfg, PROMPTS, SPEC, max_new_tokens=NEW_TOKENS, mesh=mesh)
    report.update(tokens=out.tokens.tolist(), lengths=out.lengths.tolist(),
                  tau=float(out.stats["mean_accepted_length"]), total_s=time.perf_counter() - t0)
    report["experts_read"] = sorted({int(m.group(1)) for k in stats.bytes_read
                                     if (m := re.search(r"\.experts\.(\d+)\.", k))})
    if args.v41:
        report.update(v41(args.v41, mesh, name))
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
