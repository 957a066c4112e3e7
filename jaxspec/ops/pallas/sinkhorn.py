"""Sinkhorn normalisation of the hyper-connections' hc x hc mixing matrices in one kernel.

`layers.mhc.hc_pre` runs `iters` Sinkhorn steps (rows, then columns, normalised to sum 1) on a
[hc, hc] matrix per token (hc = 4). As a `fori_loop` of reductions that is ~3 kernels per step on
a GPU, 19 steps, twice per layer: ~110 launches per layer for 16 numbers per token, more than the
rest of the layer together (docs/gpu.md, "Kernels per layer"). Here each program loads a block of
tokens' matrices once, runs every step in registers and stores the result: one launch.

Its jnp counterpart, and the reference the tests hold it to, is `sinkhorn_reference` (the loop
`hc_pre` runs off CUDA). `sinkhorn` picks by the platform the program is lowered for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.ops.pallas._common import triton_params

BLOCK_TOKENS = 64  # matrices per program: 64 x 16 fp32 = 4 KB of registers over 4 warps
GPU_NUM_WARPS, GPU_NUM_STAGES = 4, 1


def sinkhorn_reference(comb: jax.Array, iters: int, eps: float) -> jax.Array:  # comb: [..., hc, hc] fp32
    """`iters` steps: each row divided by its sum (+ eps), then each column by its sum (+ eps)."""

    def step(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters, step, comb)


def _sinkhorn_kernel(comb_ref, out_ref, *, iters: int, eps: float):
    out_ref[...] = sinkhorn_reference(comb_ref[...], iters, eps)  # [block, hc, hc] in registers


def sinkhorn_kernel(comb: jax.Array, iters: int, eps: float, interpret: bool = False,
                    block: int = BLOCK_TOKENS) -> jax.Array:  # comb: [..., hc, hc] fp32
    """The kernel over every matrix of `comb`, BLOCK_TOKENS per program (the token count padded to a
    whole block with identity-like ones, which normalise without NaNs, and cut off after)."""
    *lead, hc, hc2 = comb.shape
    if hc != hc2 or hc & (hc - 1):
        raise ValueError(f"sinkhorn needs square [..., hc, hc] matrices with hc a power of two, got {comb.shape}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    flat = comb.reshape(-1, hc, hc).astype(jnp.float32)
    n = flat.shape[0]
    padded = -(-max(n, 1) // block) * block
    flat = jnp.concatenate([flat, jnp.ones((padded - n, hc, hc), jnp.float32)], axis=0)
    spec = pl.BlockSpec((block, hc, hc), lambda i: (i, 0, 0))
    out = pl.pallas_call(
        functools.partial(_sinkhorn_kernel, iters=iters, eps=eps),
        out_shape=jax.ShapeDtypeStruct(flat.shape, jnp.float32),
        grid=(padded // block,),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
        name="sinkhorn",
        **({} if interpret else {"compiler_params": triton_params(GPU_NUM_WARPS, GPU_NUM_STAGES)}),
    )(flat)
    return out[:n].reshape(comb.shape)


def sinkhorn(comb: jax.Array, iters: int, eps: float) -> jax.Array:  # comb: [..., hc, hc] fp32
    """The one entry point: the kernel where the program is lowered for CUDA, the reference loop
    elsewhere (the CPU runs the loop as fast as anything, docs/results.md)."""
    args = (comb,)
    return jax.lax.platform_dependent(
        *args,
        cuda=lambda c: sinkhorn_kernel(c, iters, eps),
        default=lambda c: sinkhorn_reference(c, iters, eps),
    )
