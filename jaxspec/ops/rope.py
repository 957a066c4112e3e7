"""Interleaved (GPT-J pair) rotary embedding on the trailing `rope_head_dim` channels.

Sliding-window layers (and the MTP block) use base `rope_theta`; CSA/HCA layers use
`compress_rope_theta` with YaRN for everything in the layer (queries, window keys, compressed
entries, indexer). V4 applies no YaRN attention temperature.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import ModelConfig


@functools.lru_cache(maxsize=64)
def _inv_freq(dim: int, base: float, yarn: tuple | None) -> np.ndarray:
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    if yarn is None:
        return inv_freq
    factor, original_max, beta_fast, beta_slow = yarn

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1.0 - ramp).astype(np.float32)
    interpolation = (1.0 / (factor * pos_freqs)).astype(np.float32)
    return (interpolation * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def inv_freq(cfg: ModelConfig, compressed: bool) -> np.ndarray:
    """[rope_head_dim // 2] inverse frequencies for a sliding (False) or compressed (True) layer."""
    if not compressed:
        return _inv_freq(cfg.rope_head_dim, float(cfg.rope_theta), None)
    yarn = None
    if cfg.yarn_factor is not None:
        yarn = (
            float(cfg.yarn_factor), int(cfg.yarn_original_max_position),
            float(cfg.yarn_beta_fast), float(cfg.yarn_beta_slow),
        )
    return _inv_freq(cfg.rope_head_dim, float(cfg.compress_rope_theta), yarn)


def rope_angles(positions: jax.Array, freqs: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions: [...] int -> (cos, sin): [..., r/2] fp32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotate the trailing 2*cos.shape[-1] channels of x in interleaved pairs.

    x: [..., D]; cos, sin: broadcastable to x[..., :r/2] (e.g. [B, T, 1, r/2] for [B, T, H, D]).
    `inverse` rotates by -angle: V4 de-rotates the attention output because V = K carries RoPE.
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    rot = rot.astype(jnp.float32).reshape(*rot.shape[:-1], half, 2)
    even, odd = rot[..., 0], rot[..., 1]
    if inverse:
        sin = -sin
    out_even = even * cos - odd * sin
    out_odd = odd * cos + even * sin
    rotated = jnp.stack([out_even, out_odd], axis=-1).reshape(*x.shape[:-1], rope_dim)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
