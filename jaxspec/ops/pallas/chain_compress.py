"""Chain compression: the compressed entry a node emits when it closes a CSA / HCA block, pooled
from committed compressor rows (the state ring) and the rows of the node's own ancestors
(docs/architecture.md §3, docs/tree_verification.md §4).

For each node the kernel gathers the coff*ratio source rows (ring slot or ancestor row), runs the
per-channel softmax pooling as an online softmax over blocks of rows, then RMSNorm and RoPE at
the block start. Nodes that close no block skip all reads and yield zeros (callers mask them).
One call serves the main compressor and the indexer's (they differ only in width and ratio).

RoPE without lane shuffles: the rotation needs each channel's pair partner, so the kernel also
pools the partner-permuted columns of the same rows (the second read hits the cache) and
combines normed * cos + normed_partner * signed_sin, with cos = 1, sin = 0 off the rope channels.

Its jnp counterpart, and the reference the tests hold it to, is `ops.pooling.pool_rows` (what
`layers.compressor.pool_entries` runs without the kernel) on the nodes that close a block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.core.config import pooling_coff
from jaxspec.ops.pallas._common import SQUEEZED, by_platform, triton_params
from jaxspec.ops.pooling import source_indices
from jaxspec.ops.rope import rope_angles

GPU_NUM_WARPS, GPU_NUM_STAGES = 4, 1
MAX_BLOCK_ROWS = 16


def _source_rows(
    positions: jax.Array,  # [B, T] int32
    committed: jax.Array,  # [B] int32 committed length P
    ancestor_at_depth: jax.Array,  # [B, T, T] int32: node index of the chain element at P + depth
    num_sources: int,
    ring_size: int,
) -> jax.Array:
    """Where the rows of positions pos-num_sources+1 .. pos live -> [B, T, S] int32:
    ring slot (pos mod R) for positions < P, R + ancestor node for positions >= P, -1 before 0."""
    index, valid = source_indices(
        positions.astype(jnp.int32), committed, ancestor_at_depth.astype(jnp.int32), num_sources, ring_size
    )
    return jnp.where(valid, index, -1)


def _check(ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, norm, ratio, overlap):
    if ring_kv.ndim != 3 or new_kv.ndim != 3:
        raise ValueError(
            f"ring_kv must be [B, R, coff*D] and new_kv [B, T, coff*D], got {ring_kv.shape}, {new_kv.shape}"
        )
    b, t, width2 = new_kv.shape
    coff = pooling_coff(overlap)
    width = norm.shape[0]
    if width2 != coff * width or ring_kv.shape[2] != width2:
        raise ValueError(f"rows must be coff*D = {coff}*{width} wide, got ring {ring_kv.shape} and new {new_kv.shape}")
    if ring_gate.shape != ring_kv.shape or new_gate.shape != new_kv.shape:
        raise ValueError("gate rows must match kv rows in shape")
    if ring_kv.shape[0] != b or positions.shape != (b, t) or committed.shape != (b,):
        raise ValueError(f"batch/length mismatch: positions {positions.shape}, committed {committed.shape}")
    if ancestor_at_depth.shape != (b, t, t):
        raise ValueError(f"ancestor_at_depth must be [B, T, T] = {(b, t, t)}, got {ancestor_at_depth.shape}")
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    if ring_kv.shape[1] < coff * ratio - 1:
        raise ValueError(f"ring holds {ring_kv.shape[1]} rows, a block needs {coff * ratio - 1} committed ones")


def _chain_compress_kernel(
    meta_ref,  # [2] int32: emits, unused
    src_ref,  # [S] int32 encoded source rows
    ring_kv_ref,  # [R, coff*D]
    ring_gate_ref,
    new_kv_ref,  # [T, coff*D]
    new_gate_ref,
    norm_ref,  # [D] fp32
    norm_partner_ref,  # [D] fp32: weight of each channel's rope partner
    cos_ref,  # [D] fp32
    sin_ref,  # [D] fp32 signed
    o_ref,  # [D] fp32
    *,
    ratio: int,
    overlap: bool,
    width: int,
    rope_dim: int,
    block_rows: int,
    eps: float,
):
    ring_size = ring_kv_ref.shape[0]
    num_sources = src_ref.shape[0]
    ch = lax.broadcasted_iota(jnp.int32, (width,), 0)
    # Interleaved pairs (2i, 2i+1) of the trailing rope_dim channels; width - rope_dim is even.
    partner = jnp.where(ch >= width - rope_dim, ch + 1 - 2 * lax.rem(ch, 2), ch)

    def pool():
        states = [
            (jnp.full((width,), -jnp.inf, jnp.float32), jnp.zeros((width,), jnp.float32),
             jnp.zeros((width,), jnp.float32))
            for _ in range(2)
        ]
        for blk in range(num_sources // block_rows):
            start = blk * block_rows
            # CSA: the first `ratio` sources read the previous block through the A half.
            col0 = width if overlap and start >= ratio else 0
            rows = src_ref[pl.ds(start, block_rows)]
            valid = rows >= 0
            is_new = rows >= ring_size
            ring_rows = jnp.where(valid & ~is_new, rows, 0)[:, None]
            new_rows = jnp.where(is_new, rows - ring_size, 0)[:, None]
            for k, cols in enumerate((col0 + ch, col0 + partner)):
                cols = cols[None, :]
                sel = is_new[:, None]
                kv = jnp.where(sel, new_kv_ref[new_rows, cols], ring_kv_ref[ring_rows, cols])
                gate = jnp.where(sel, new_gate_ref[new_rows, cols], ring_gate_ref[ring_rows, cols])
                gate = jnp.where(valid[:, None], gate, -jnp.inf)
                kv = jnp.where(valid[:, None], kv, 0.0)
                m, l, acc = states[k]
                m_new = jnp.maximum(m, jnp.max(gate, axis=0))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m - m_safe)
                p = jnp.exp(gate - m_safe[None, :])
                states[k] = (m_new, l * alpha + jnp.sum(p, axis=0), acc * alpha + jnp.sum(p * kv, axis=0))
        (_, l, acc), (_, lp, accp) = states
        pooled = acc / jnp.where(l > 0, l, 1.0)
        pooled_partner = accp / jnp.where(lp > 0, lp, 1.0)
        inv = lax.rsqrt(jnp.sum(pooled * pooled) / width + eps)
        normed = pooled * inv * norm_ref[...]
        normed_partner = pooled_partner * inv * norm_partner_ref[...]
        return normed * cos_ref[...] + normed_partner * sin_ref[...]

    o_ref[...] = lax.cond(meta_ref[0] != 0, pool, lambda: jnp.zeros((width,), jnp.float32))


def _rope_tables(positions, ratio, freqs, width):
    """cos / signed sin per channel at the block start: [B, T, D] (1 / 0 off the rope channels)."""
    cos, sin = rope_angles((positions // ratio) * ratio, freqs)  # [B, T, r/2]
    half = cos.shape[-1]
    b, t = positions.shape
    cos_full = jnp.repeat(cos, 2, axis=-1)
    sin_full = jnp.stack([-sin, sin], axis=-1).reshape(b, t, 2 * half)
    nope = width - 2 * half
    cos_full = jnp.concatenate([jnp.ones((b, t, nope), jnp.float32), cos_full], axis=-1)
    sin_full = jnp.concatenate([jnp.zeros((b, t, nope), jnp.float32), sin_full], axis=-1)
    return cos_full, sin_full


def _block_rows(ratio: int, num_sources: int) -> int:
    """Largest power of two <= MAX_BLOCK_ROWS dividing ratio (a block never straddles CSA halves)."""
    rows = 1
    while rows * 2 <= MAX_BLOCK_ROWS and ratio % (rows * 2) == 0 and num_sources % (rows * 2) == 0:
        rows *= 2
    return rows


def chain_compress(
    ring_kv: jax.Array,  # [B, R, coff*D] fp32
    ring_gate: jax.Array,  # [B, R, coff*D] fp32
    new_kv: jax.Array,  # [B, T, coff*D] fp32
    new_gate: jax.Array,  # [B, T, coff*D] fp32
    positions: jax.Array,  # [B, T] int32
    committed: jax.Array,  # [B] int32
    ancestor_at_depth: jax.Array,  # [B, T, T] int32
    norm: jax.Array,  # [D] fp32
    freqs,  # [r/2]
    *,
    ratio: int,
    overlap: bool,
    eps: float,
    block_rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Pallas version of `ops.pooling.pool_rows` -> [B, T, D] fp32 (zeros where no block closes).

    `interpret=None`: the Triton lowering where the program is lowered for CUDA, else the interpreter."""
    _check(ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, norm, ratio, overlap)
    arrays = (ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, norm, freqs)
    kw = dict(ratio=ratio, overlap=overlap, eps=eps, block_rows=block_rows, num_warps=num_warps, num_stages=num_stages)
    return by_platform(lambda interp: _chain_compress(*arrays, interpret=interp, **kw), interpret)


def _chain_compress(ring_kv, ring_gate, new_kv, new_gate, positions, committed, ancestor_at_depth, norm, freqs, *,
                    ratio, overlap, eps, block_rows, num_warps, num_stages, interpret: bool):
    b, t, width2 = new_kv.shape
    coff = pooling_coff(overlap)
    width = norm.shape[0]
    rope_dim = 2 * int(jnp.shape(freqs)[-1])
    num_sources = coff * ratio
    if rope_dim > width or (width - rope_dim) % 2:
        raise ValueError(f"rope dims ({rope_dim}) must fit the width ({width}) with an even remainder")
    if not interpret and width & (width - 1):
        raise ValueError(f"the Triton lowering needs a power-of-two compressor width, got {width}")
    rows = int(block_rows or _block_rows(ratio, num_sources))
    if ratio % rows or num_sources % rows:
        raise ValueError(f"block_rows={rows} must divide ratio={ratio}")
    src = _source_rows(positions, committed, ancestor_at_depth, num_sources, ring_kv.shape[1])
    emits = ((positions + 1) % ratio == 0).astype(jnp.int32)
    meta = jnp.stack([emits, jnp.zeros_like(emits)], axis=-1)
    cos_full, sin_full = _rope_tables(positions, ratio, freqs, width)
    ch = np.arange(width)
    partner = np.where(ch >= width - rope_dim, ch + 1 - 2 * (ch % 2), ch)
    norm32 = norm.astype(jnp.float32)
    sq = SQUEEZED
    r = ring_kv.shape[1]
    in_specs = [
        pl.BlockSpec((sq, sq, 2), lambda i, j: (i, j, 0)),
        pl.BlockSpec((sq, sq, num_sources), lambda i, j: (i, j, 0)),
        pl.BlockSpec((sq, r, width2), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((sq, r, width2), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((sq, t, width2), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((sq, t, width2), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((width,), lambda i, j: (0,)),
        pl.BlockSpec((width,), lambda i, j: (0,)),
        pl.BlockSpec((sq, sq, width), lambda i, j: (i, j, 0)),
        pl.BlockSpec((sq, sq, width), lambda i, j: (i, j, 0)),
    ]
    kernel = functools.partial(
        _chain_compress_kernel, ratio=ratio, overlap=overlap, width=width, rope_dim=rope_dim,
        block_rows=rows, eps=float(eps),
    )
    extra = {}
    if not interpret:
        extra["compiler_params"] = triton_params(num_warps or GPU_NUM_WARPS, num_stages or GPU_NUM_STAGES)
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid=(b, t),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((sq, sq, width), lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t, width), f32),
        interpret=interpret,
        name="chain_compress",
        **extra,
    )(meta, src, ring_kv.astype(f32), ring_gate.astype(f32), new_kv.astype(f32), new_gate.astype(f32),
      norm32, norm32[partner], cos_full, sin_full)
