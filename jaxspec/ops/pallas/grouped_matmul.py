"""Grouped matmul for the routed experts: rows sorted by expert, one weight per group, each selected
expert's weights read once per tile of its rows, in their stored format.

Layout: one program per (expert, output column block). A program walks its group's rows
[offsets[e], offsets[e+1]) in tiles of `block_m` and contracts each tile over `block_k`-row tiles
of its expert's weight; an expert no row selected costs one empty program. Rows of a tile past
the group's end are computed but not stored (masked store), so groups need no padding. Rows past
the last group (assignments of experts on another device) are never written: the caller masks
them (`layers.moe.kernel_experts` does).

Block-scaled weights (`ops.quant.BlockScaled`) are dequantized tile by tile inside the kernel:
FP8 e4m3 values times one float32 scale per 128 x 128 block, FP4 e2m1 codes (two per byte
along `in`) times a UE8M0 scale per 32 input rows. The FP4 kernel contracts the even and the odd
input rows of a tile separately (low and high nibbles), against x's columns permuted to match,
so no lane shuffle is needed. Dequantized values are exact in float32 and cast to x's dtype, as
`quant.dequantize` does, so fp32 results match a dequantize-then-matmul reference to rounding.

Its reference is `jax.lax.ragged_dot` (and `layers.moe.dense_experts` one level up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.core.checks import next_power_of_two
from jaxspec.ops import quant
from jaxspec.ops.pallas._common import (
    SQUEEZED,
    by_platform,
    exact_dot_precision,
    pad_axis,
    triton_params,
)

GPU_NUM_WARPS, GPU_NUM_STAGES = 4, 2
MAX_BLOCK_M, MAX_BLOCK_N, MAX_BLOCK_K = 64, 128, 64


def _store(ref, value, mask):
    """Masked store under the name this jax exports (the Triton module's since jax 0.7)."""
    from jax.experimental.pallas import triton as plgpu

    plgpu.store(ref, value, mask=mask)


def _e8m0(u):
    """UE8M0 bits (uint8) -> float32 2^(u - 127); u = 0 is the subnormal 2^-127."""
    bits = lax.shift_left(u.astype(jnp.int32), jnp.int32(23))
    return jnp.where(u == 0, jnp.float32(2.0**-127), lax.bitcast_convert_type(bits, jnp.float32))


def _gmm_kernel(off_ref, x_ref, w_ref, *refs, fmt: str, bm: int, bk: int, bn: int, num_k: int, precision,
                scale_block: tuple[int, int]):
    s_ref, o_ref = (refs[0], refs[1]) if fmt != "plain" else (None, refs[0])
    e, j = pl.program_id(0), pl.program_id(1)
    start, end = off_ref[e], off_ref[e + 1]
    dt = x_ref.dtype

    def dot(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    def k_step(row0, kk, acc):
        k0 = kk * bk
        if fmt == "plain":
            return acc + dot(x_ref[pl.ds(row0, bm), pl.ds(k0, bk)], w_ref[pl.ds(k0, bk), :].astype(dt))
        if fmt == "fp8":
            scale = s_ref[k0 // scale_block[0], (j * bn) // scale_block[1]]  # one scale per tile
            w = (w_ref[pl.ds(k0, bk), :].astype(jnp.float32) * scale).astype(dt)
            return acc + dot(x_ref[pl.ds(row0, bm), pl.ds(k0, bk)], w)
        half = bk // 2  # fp4: bk == the 32-row scale block; x's columns come [evens, odds] per tile
        codes = w_ref[pl.ds(kk * half, half), :]  # [bk/2, bn] uint8
        scale = s_ref[pl.ds(kk, 1), :]  # [1, bn]
        scale = _e8m0(scale) if scale.dtype == jnp.uint8 else scale
        even = (quant.decode_fp4(codes & 0xF) * scale).astype(dt)
        odd = (quant.decode_fp4(codes >> 4) * scale).astype(dt)
        acc = acc + dot(x_ref[pl.ds(row0, bm), pl.ds(k0, half)], even)
        return acc + dot(x_ref[pl.ds(row0, bm), pl.ds(k0 + half, half)], odd)

    def row_tile(r, carry):
        row0 = start + r * bm
        acc = lax.fori_loop(0, num_k, functools.partial(k_step, row0), jnp.zeros((bm, bn), jnp.float32))
        rows = row0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)
        _store(o_ref.at[pl.ds(row0, bm), :], acc, jnp.broadcast_to((rows < end)[:, None], (bm, bn)))
        return carry

    lax.fori_loop(0, lax.div(end - start + (bm - 1), jnp.int32(bm)), row_tile, 0)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _tiles(w, rows: int, groups: int, block_m, block_n, block_k, gpu: bool) -> tuple[int, int, int]:
    _, d_in, d_out = w.shape
    # Decode sends a few rows per expert; a 16-row tile (the Triton dot minimum) wastes least.
    bm = int(block_m or min(MAX_BLOCK_M, max(16, next_power_of_two(-(-rows // max(groups, 1))))))
    bn = int(block_n or _largest_pow2_divisor(d_out, MAX_BLOCK_N))
    if quant.is_quantized(w) and w.fmt == "fp4":
        bk = quant.FP4_BLOCK[0]  # one scale row per tile
    else:
        cap = MAX_BLOCK_K if not quant.is_quantized(w) else min(MAX_BLOCK_K, w.block[1])
        bk = int(block_k or _largest_pow2_divisor(d_in, cap))
    if d_in % bk or d_out % bn:
        raise ValueError(f"grouped_matmul: weight {w.shape} must be tiled by block_k={bk}, block_n={bn}")
    if gpu and min(bm, bn, bk if not (quant.is_quantized(w) and w.fmt == "fp4") else bk // 2) < 16:
        raise ValueError(f"grouped_matmul: the Triton lowering needs tiles >= 16 (weight {w.shape}, rows {rows})")
    return bm, bn, bk


def grouped_matmul(
    x: jax.Array,  # [R, in] rows sorted by group
    w: quant.Weight,  # [G, in, out] plain or BlockScaled
    offsets: jax.Array,  # [G + 1] int32 group starts, offsets[0] = 0, non-decreasing, offsets[G] <= R
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """rows [offsets[g], offsets[g+1]) @ w[g] for every g -> [R, out] fp32; rows >= offsets[G] are
    left unwritten (undefined). `interpret=None`: Triton where lowered for CUDA, else the interpreter."""
    if x.ndim != 2 or len(w.shape) != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: x must be [R, in] and w [G, in, out] with the same in, got {x.shape}, "
                         f"{w.shape}")
    if offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"grouped_matmul: offsets must be [G + 1] = [{w.shape[0] + 1}], got {offsets.shape}")
    if quant.is_quantized(w) and w.block[0] != 1:
        raise ValueError(f"grouped_matmul: the group axis of a BlockScaled must be unblocked, got {w.block}")
    return by_platform(
        lambda interp: _grouped_matmul(x, w, offsets, block_m, block_n, block_k, interpret=interp), interpret
    )


def _grouped_matmul(x, w, offsets, block_m, block_n, block_k, *, interpret: bool):
    rows, d_in = x.shape
    groups, _, d_out = w.shape
    gpu = not interpret
    bm, bn, bk = _tiles(w, rows, groups, block_m, block_n, block_k, gpu)
    fmt = w.fmt if quant.is_quantized(w) else "plain"
    xp = pad_axis(x, 0, rows + bm)  # a tile starting at the last row reads bm - 1 rows past it
    if fmt == "fp4":  # [evens, odds] within each bk-column tile, the order the kernel contracts
        xp = xp.reshape(rows + bm, d_in // bk, bk // 2, 2).swapaxes(2, 3).reshape(rows + bm, d_in)
    off = pad_axis(offsets.astype(jnp.int32), 0, next_power_of_two(groups + 1), value=rows)
    sq = SQUEEZED
    in_specs = [
        pl.BlockSpec((off.shape[0],), lambda e, j: (0,)),
        pl.BlockSpec((rows + bm, d_in), lambda e, j: (0, 0)),
    ]
    operands = [off, xp]
    scale_block = (1, 1)
    if fmt == "plain":
        in_specs.append(pl.BlockSpec((sq, d_in, bn), lambda e, j: (e, 0, j)))
        operands.append(w)
    else:
        data_rows = w.data.shape[1]
        in_specs.append(pl.BlockSpec((sq, data_rows, bn), lambda e, j: (e, 0, j)))
        operands.append(w.data)
        if fmt == "fp8":  # a few scalars per expert: float32 up front costs nothing
            scale = w.scale.astype(jnp.float32)
            scale_block = (w.block[1], w.block[2])
            in_specs.append(pl.BlockSpec((sq, *scale.shape[1:]), lambda e, j: (e, 0, 0)))
        else:  # one scale per 32 x 1: kept as its 8 bits, decoded in the kernel
            scale = w.scale
            if jnp.dtype(scale.dtype) not in (jnp.float32, jnp.uint8):
                scale = lax.bitcast_convert_type(scale.astype(jnp.float8_e8m0fnu), jnp.uint8)
            in_specs.append(pl.BlockSpec((sq, scale.shape[1], bn), lambda e, j: (e, 0, j)))
        operands.append(scale)
    kernel = functools.partial(
        _gmm_kernel, fmt=fmt, bm=bm, bk=bk, bn=bn, num_k=d_in // bk, precision=exact_dot_precision(x.dtype),
        scale_block=scale_block,
    )
    extra = {"compiler_params": triton_params(GPU_NUM_WARPS, GPU_NUM_STAGES)} if gpu else {}
    out = pl.pallas_call(
        kernel,
        grid=(groups, d_out // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((rows + bm, bn), lambda e, j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows + bm, d_out), jnp.float32),
        interpret=interpret,
        name=f"grouped_matmul_{fmt}",
        **extra,
    )(*operands)
    return out[:rows]
