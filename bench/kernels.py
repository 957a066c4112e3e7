"""Pallas kernels against their XLA references: time, bytes each must read, implied bandwidth.

    python bench/kernels.py                 # GPU: V4-Flash shapes, history 4K/32K/128K, D 6/8/16, batch 1/8/64
    python bench/kernels.py --smoke         # any backend, tiny `test` shapes (interpret mode on CPU; CI)
    python bench/kernels.py --histories 32768 --tree-sizes 8 --batches 64 --block-k 32 --num-warps 4

Cases: `tree_attention` on a sliding (window only), HCA (dense over committed entries) and CSA
(per-node top-k index lists) layer, each over a random tree of D nodes at committed length L;
`chain_compress` for the CSA main compressor, the CSA indexer compressor and HCA. The reference of
each kernel is the model's jitted jnp path: `layers.attention.attend` for `tree_attention`, and
`ops.pooling.pool_rows` for `chain_compress` (which pools every node as if it closed a block: it is
zeroed on the nodes that close none, as the kernel returns).

Reported per case: median time of the kernel and of the reference (compile excluded), the bytes
the kernel must move at least (inputs it reads once + output written; the CSA count is per node,
as each node reads its own top-k), the implied bandwidth bytes / time and its share of the copy
bandwidth measured at start (an H200 copies at ~4.3 TB/s). The reference is credited with the same
byte count, so the two bandwidth columns compare like for like. Every case checks numerics
(relative max error: fp32 <= 1e-5, bf16 <= 2e-2); the exit status is 1 on any mismatch or error.
Cases are skipped, and said so, once `--budget` seconds are spent (default keeps a run under 5 min).
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by path (tests)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import check_positive, parser, write_json  # noqa: E402

import jaxspec as js  # noqa: E402
from jaxspec.layers.attention import attend, ring_positions  # noqa: E402
from jaxspec.ops.pallas.chain_compress import chain_compress  # noqa: E402
from jaxspec.ops.pallas.tree_attention import tree_attention  # noqa: E402
from jaxspec.ops.pooling import pool_rows  # noqa: E402
from jaxspec.ops.rope import inv_freq  # noqa: E402
from jaxspec.speculation.plan import build_plan  # noqa: E402

TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def device_info() -> dict:
    dev = jax.devices()[0]
    try:
        from jax.experimental.pallas import triton as _  # noqa: F401

        triton = True
    except ImportError:
        triton = False
    return {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "num_sms": getattr(dev, "core_count", None),
        "pallas_triton": triton,
        "interpret": jax.default_backend() != "gpu",
    }


def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s of a device read + write of an `nbytes` fp32 buffer (best of 5)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def timeit(fn, args, reps: int, trials: int) -> float:
    """Seconds per call: best over `trials` of the mean of `reps` back-to-back calls."""
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def random_tree(rng: np.random.Generator, nodes: int) -> np.ndarray:
    """Parent vector (parent[i] < i, root its own parent) of a bushy random tree."""
    parent = [0]
    for i in range(1, nodes):
        parent.append(int(rng.integers(0, i)) if i > 1 else 0)
    return np.asarray(parent, np.int32)


def tree_plan(rng, batch: int, nodes: int, committed: int):
    parent = jnp.asarray(np.stack([random_tree(rng, nodes) for _ in range(batch)]))
    return build_plan(parent, jnp.full((batch,), committed, jnp.int32), nodes - 1)


# ---------------------------------------------------------------------------------------------
# references


def pool_rows_emitting(ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, norm, freqs,
                       *, ratio: int, overlap: bool, eps: float) -> jax.Array:
    """`pool_rows` zeroed on the nodes that close no block ((pos + 1) % ratio != 0): what
    `chain_compress` returns."""
    pooled = pool_rows(ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, norm, freqs,
                       ratio=ratio, overlap=overlap, eps=eps)
    return jnp.where(((positions + 1) % ratio == 0)[..., None], pooled, 0.0)


# ---------------------------------------------------------------------------------------------
# cases


def attention_case(kind: str, cfg, history: int, nodes: int, batch: int, seed: int):
    """-> ((args, array kwargs), static kwargs, bytes) for one tree_attention case."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 6)
    dt = jnp.dtype(cfg.dtype)
    h, c, w = cfg.num_heads, cfg.head_dim, cfg.sliding_window
    isz = dt.itemsize
    plan = tree_plan(rng, batch, nodes, history)
    committed = jnp.full((batch,), history, jnp.int32)

    def normal(k, shape):
        return jax.random.normal(k, shape, jnp.float32).astype(dt)

    q = normal(keys[0], (batch, nodes, h, c))
    ring = normal(keys[1], (batch, w, c))
    ring_pos = ring_positions(committed, w)
    new = normal(keys[2], (batch, nodes, c))
    new_mask = plan.ancestor_mask & (plan.positions[:, None, :] > plan.positions[:, :, None] - w)
    kw = {}
    nbytes = batch * (nodes * h * c * (isz + 4) + w * (c * isz + 4) + nodes * c * isz + nodes * nodes)
    if kind != "sliding":
        ratio = cfg.csa_ratio if kind == "csa" else cfg.hca_ratio
        n = history // ratio
        cache = normal(keys[3], (batch, max(n, 1), c))
        emits = (plan.positions + 1) % ratio == 0
        kw.update(comp_kv=cache, tree_entries=normal(keys[4], (batch, nodes, c)),
                  tree_entry_mask=plan.ancestor_mask & emits[:, None, :])
        nbytes += batch * (nodes * c * isz + nodes * nodes)
        if kind == "hca":
            kw["comp_len"] = committed // ratio
            nbytes += batch * n * c * isz
        else:
            k = min(cfg.index_topk, n)
            # distinct ids spread over the whole history, a random offset per node
            stride = max(n // max(k, 1), 1)
            offset = jax.random.randint(keys[5], (batch, nodes, 1), 0, stride)
            ids = (jnp.arange(k, dtype=jnp.int32) * stride + offset) % max(n, 1)
            kw["comp_index"] = jnp.where(jnp.arange(k) < n, ids, -1).astype(jnp.int32)
            nbytes += batch * nodes * k * (c * isz + 4)
    args = (q, ring, ring_pos, new, new_mask, plan.positions, jnp.zeros((h,), jnp.float32))
    return (args, kw), dict(window=w, scale=c**-0.5), nbytes


def compress_case(kind: str, cfg, nodes: int, batch: int, seed: int):
    """-> ((args, {}), static kwargs, bytes) for one chain_compress case: CSA main / indexer / HCA."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 5)
    ratio = cfg.hca_ratio if kind == "hca" else cfg.csa_ratio
    overlap = kind != "hca"
    width = cfg.index_head_dim if kind == "csa-indexer" else cfg.head_dim
    coff = 2 if overlap else 1
    rows = coff * ratio
    # The root closes a block (committed = a multiple of ratio, minus one) so deeper nodes
    # read ring rows and ancestor rows both.
    committed = 4096 - 1
    plan = tree_plan(rng, batch, nodes, committed)

    def normal(k, shape):
        return jax.random.normal(k, shape, jnp.float32)

    args = (
        normal(keys[0], (batch, rows, coff * width)), normal(keys[1], (batch, rows, coff * width)),
        normal(keys[2], (batch, nodes, coff * width)), normal(keys[3], (batch, nodes, coff * width)),
        plan.positions, jnp.full((batch,), committed, jnp.int32), plan.ancestor_at_depth,
        1.0 + 0.1 * normal(keys[4], (width,)), jnp.asarray(inv_freq(cfg, True)),
    )
    emitting = int(jnp.sum((plan.positions + 1) % ratio == 0))
    # each emitting node reads the used half of `rows` kv and gate rows; every node writes D floats
    nbytes = emitting * rows * width * 4 * 2 + batch * nodes * (width * 4 + rows * 4)
    return (args, {}), dict(ratio=ratio, overlap=overlap, eps=cfg.rms_norm_eps), nbytes


# ---------------------------------------------------------------------------------------------


def run_case(name, kernel, reference, inputs, static, nbytes, dtype, copy_bw, reps, trials, tuning):
    # arrays travel as arguments (never closed over: they would become constants of the program)
    kernel_fn = jax.jit(lambda a, k: kernel(*a, **k, **static, **tuning))
    ref_fn = jax.jit(lambda a, k: reference(*a, **k, **static))
    args = inputs
    t0 = time.perf_counter()
    got = np.asarray(kernel_fn(*args), np.float32)
    compile_s = time.perf_counter() - t0
    want = np.asarray(ref_fn(*args), np.float32)
    err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    ok = bool(np.isfinite(got).all()) and err <= TOL[dtype]
    t_kernel = timeit(kernel_fn, args, reps, trials)
    t_ref = timeit(ref_fn, args, reps, trials)
    row = {
        "case": name, "kernel_us": t_kernel * 1e6, "xla_us": t_ref * 1e6, "speedup": t_ref / t_kernel,
        "mbytes": nbytes / 1e6, "kernel_gbps": nbytes / t_kernel / 1e9, "xla_gbps": nbytes / t_ref / 1e9,
        "kernel_pct_copy": 100 * nbytes / t_kernel / copy_bw, "max_rel_err": err, "ok": ok,
        "compile_s": compile_s,
    }
    print(
        f"{name:<34} {row['kernel_us']:>10.1f} {row['xla_us']:>10.1f} {row['speedup']:>6.2f}x "
        f"{row['mbytes']:>9.2f} {row['kernel_gbps']:>9.1f} {row['xla_gbps']:>9.1f} "
        f"{row['kernel_pct_copy']:>6.1f}% {err:>9.2e} {'ok' if ok else 'MISMATCH'}",
        flush=True,
    )
    return row


def build_cases(kernels, histories, sizes, batches) -> list[tuple]:
    """(what, kind, history, nodes, batch) in run order: one middle-size case of every kernel
    first (a spent budget never leaves a kernel untimed), then the attention grid, then the
    sliding and compression grids (those two do not depend on the history)."""
    grid = [(nodes, b) for nodes in sizes for b in batches]
    cases = [("attention", kind, h, n, b) for h in histories for kind in ("hca", "csa") if kind in kernels
             for n, b in grid]
    if "sliding" in kernels:
        cases += [("attention", "sliding", histories[0], n, b) for n, b in grid]
    if "compress" in kernels:
        cases += [("compress", kind, histories[0], n, b) for kind in ("csa", "csa-indexer", "hca") for n, b in grid]
    mid_history, mid = histories[len(histories) // 2], (sizes[len(sizes) // 2], batches[len(batches) // 2])
    first, seen = [], set()
    for case in cases:
        history = mid_history if case[:2] in (("attention", "hca"), ("attention", "csa")) else histories[0]
        if case[:2] not in seen and case[2:] == (history, *mid):
            seen.add(case[:2])
            first.append(case)
    return first + [case for case in cases if case not in first]


def main(argv=None) -> int:
    ap = parser(__doc__, preset=None, preset_help="model shapes (default v4-flash; test with --smoke)",
                seed_help="input seed, offset by the case number")
    ap.add_argument("--smoke", action="store_true", help="tiny `test` shapes; interpret mode off GPU (CI)")
    ap.add_argument("--dtype", default=None, choices=sorted(TOL), help="default bfloat16 (float32 with --smoke)")
    ap.add_argument("--histories", type=int, nargs="+", default=None, help="committed tokens L")
    ap.add_argument("--tree-sizes", type=int, nargs="+", default=None, help="tree nodes D (root included)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--kernels", nargs="+", default=["compress", "sliding", "hca", "csa"],
                    choices=["compress", "sliding", "hca", "csa"])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; later cases are skipped")
    ap.add_argument("--block-h", type=int, default=None)
    ap.add_argument("--block-k", type=int, default=None)
    ap.add_argument("--num-splits", type=int, default=None)
    ap.add_argument("--num-warps", type=int, default=None)
    args = ap.parse_args(argv)
    check_positive(ap, args, [n for n in ("histories", "tree_sizes", "batches", "reps") if getattr(args, n)])

    start = time.perf_counter()
    info = device_info()
    gpu = info["backend"] == "gpu"
    if args.smoke:
        preset, dtype = args.preset or "test", args.dtype or "float32"
        histories, sizes, batches = args.histories or [37], args.tree_sizes or [4], args.batches or [2]
        copy_bytes, reps, trials = 1 << 22, args.reps or 1, 1
    else:
        if not gpu:
            print("note: no GPU; the full grid in interpret mode is slow (use --smoke)", flush=True)
        preset, dtype = args.preset or "v4-flash", args.dtype or "bfloat16"
        histories = args.histories or [4096, 32768, 131072]
        sizes, batches = args.tree_sizes or [6, 8, 16], args.batches or [1, 8, 64]
        copy_bytes, reps, trials = (1 << 30 if gpu else 1 << 24), args.reps or 10, 3
    cfg = js.ModelConfig.preset(preset, dtype=dtype)
    copy_bw = copy_bandwidth(copy_bytes)
    info.update(preset=preset, dtype=dtype, copy_gbps=copy_bw / 1e9)
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    tuning_attn = {k: v for k, v in dict(block_h=args.block_h, block_k=args.block_k, num_splits=args.num_splits,
                                          num_warps=args.num_warps).items() if v is not None}
    tuning_cc = {"num_warps": args.num_warps} if args.num_warps else {}

    cases = build_cases(args.kernels, histories, sizes, batches)

    print(f"{'case':<34} {'kernel us':>10} {'xla us':>10} {'speed':>7} {'MB':>9} {'kern GB/s':>9} "
          f"{'xla GB/s':>9} {'%copy':>7} {'rel err':>9}", flush=True)
    rows, failures, skipped = [], 0, 0
    for i, (what, kind, history, nodes, b) in enumerate(cases):
        if time.perf_counter() - start > args.budget:
            skipped = len(cases) - i
            print(f"budget of {args.budget:.0f}s spent: {skipped} cases skipped", flush=True)
            break
        name = f"attn/{kind} L={history} D={nodes} B={b}" if what == "attention" else \
            f"comp/{kind} D={nodes} B={b}"
        try:
            if what == "attention":
                inputs, static, nbytes = attention_case(kind, cfg, history, nodes, b, seed=args.seed + i)
                row = run_case(name, tree_attention, attend, inputs, static, nbytes,
                               dtype, copy_bw, reps, trials, tuning_attn)
            else:
                inputs, static, nbytes = compress_case(kind, cfg, nodes, b, seed=args.seed + i)
                # compressor rows are fp32 whatever the model dtype
                row = run_case(name, chain_compress, pool_rows_emitting, inputs, static, nbytes,
                               "float32", copy_bw, reps, trials, tuning_cc)
        except Exception as e:  # report and go on: one failing lowering must not hide the rest
            failures += 1
            print(f"{name:<34} ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)
            rows.append({"case": name, "error": f"{type(e).__name__}: {e}"[:2000], "ok": False})
            continue
        failures += not row["ok"]
        rows.append(row)
    total = time.perf_counter() - start
    print(f"{len(rows)} cases, {failures} failed, {skipped} skipped, {total:.1f}s", flush=True)
    write_json(args.json, {"info": info, "rows": rows, "seconds": total})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
