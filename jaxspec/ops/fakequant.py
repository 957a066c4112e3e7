"""DeepSeek-V4.1's quantization-aware rounding of activations (docs/v41.md, "QAT rounding").

V4.1 was trained seeing some activations rounded through FP8 or FP4 and written back; inference
must round them the same way. Every rounding works on blocks along the last axis:
* `fp8`: FP8 e4m3 with a power-of-two (UE8M0) scale per block of 32: the input of every FP8 / FP4
  linear (what the reference's GEMMs quantize), and the window KV (the whole vector, RoPE included).
* `fp4_ue8m0`: FP4 e2m1 with a power-of-two scale per block of 32: the indexer's queries and keys.
* `fp4_e4m3`: FP4 e2m1 with an E4M3 scale per block of 16: the compressed KV in the pools.
A UE8M0 scale is 2^ceil(log2(amax / max)) with amax floored, computed from the float32 bits
(exponent + (mantissa != 0)) so boundary cases round as the reference's kernels do. e2m1 rounds to
the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"the last axis ({x.shape[-1]}) must be a multiple of the block ({block})")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _amax(xb: jax.Array, floor: float) -> jax.Array:
    return jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), floor)


def _ue8m0(amax: jax.Array, max_value: float) -> jax.Array:
    """2^ceil(log2(amax * (1 / max))) from the float32 bits of the product."""
    bits = jax.lax.bitcast_convert_type(amax * jnp.float32(1.0 / max_value), jnp.uint32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def _e2m1(v: jax.Array) -> jax.Array:
    """|v| <= 6 to the nearest e2m1 value, ties to even, sign kept."""
    mag = jnp.abs(v)
    idx = sum((mag > t).astype(jnp.int32) for t in (0.25, 1.25, 2.5, 5.0))
    idx = idx + sum((mag >= t).astype(jnp.int32) for t in (0.75, 1.75, 3.5))
    return jnp.sign(v) * jnp.asarray(_E2M1, jnp.float32)[idx]


def fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """FP8 e4m3 round trip with a power-of-two scale per `block` -> x's shape and dtype."""
    xb = _blocks(x, block)
    s = _ue8m0(_amax(xb, 1e-4), FP8_MAX)
    q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s
    return q.reshape(x.shape).astype(x.dtype)


def fp4_ue8m0(x: jax.Array, block: int = 32) -> jax.Array:
    """FP4 e2m1 round trip with a power-of-two scale per `block` (the indexer's q and k)."""
    xb = _blocks(x, block)
    s = _ue8m0(_amax(xb, FP4_MAX * 2.0**-126), FP4_MAX)
    return (_e2m1(jnp.clip(xb / s, -FP4_MAX, FP4_MAX)) * s).reshape(x.shape).astype(x.dtype)


def fp4_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """FP4 e2m1 round trip with an E4M3 scale (amax / 6 rounded to e4m3) per `block` (the pools)."""
    xb = _blocks(x, block)
    # e4m3fn has no infinity: a scale past its range saturates at 448, as the reference's cast does.
    s = jnp.minimum(_amax(xb, FP4_MAX * 2.0**-9) / FP4_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (_e2m1(jnp.clip(xb / s, -FP4_MAX, FP4_MAX)) * s).reshape(x.shape).astype(x.dtype)


class Roundings(NamedTuple):
    """The three roundings as a model applies them (`roundings`)."""

    fp8: Callable[..., jax.Array]
    fp4_ue8m0: Callable[..., jax.Array]
    fp4_e4m3: Callable[..., jax.Array]


def _keep(x: jax.Array, block: int = 0) -> jax.Array:
    return x


def roundings(on: bool) -> Roundings:
    """The roundings (`on`, V4.1 as released), or identities: the continuous model, where a last-bit
    difference between two programs stays a last-bit difference instead of moving a value to the next
    FP8 / FP4 step (used to check the decode machinery to float32 precision, docs/v41.md)."""
    return Roundings(fp8, fp4_ue8m0, fp4_e4m3) if on else Roundings(_keep, _keep, _keep)
