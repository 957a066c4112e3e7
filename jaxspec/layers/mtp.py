"""The MTP block's own parameters (docs/architecture.md §6): e_proj / h_proj with their norms,
a full transformer block with sliding-window-only attention, and its own hc_head and norm. The
embedding and the output head are the main model's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.ops import quant
from jaxspec.ops.norms import rms_norm
from jaxspec.ops.quant import Weight
from jaxspec.sharding.rules import axes


@struct.dataclass
class MTPInputParams:
    e_proj: Weight = axes("embed", "embed_out", quant="fp8")  # [d, d]
    h_proj: Weight = axes("embed", "embed_out", quant="fp8")  # [d, d]
    enorm: jax.Array = axes("embed")  # [d] fp32
    hnorm: jax.Array = axes("embed")  # [d] fp32


def init_mtp_input(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> MTPInputParams:
    k1, k2 = jax.random.split(key)
    d, dtype = cfg.hidden_size, jnp.dtype(cfg.dtype)
    return MTPInputParams(
        e_proj=(std * jax.random.normal(k1, (d, d))).astype(dtype),
        h_proj=(std * jax.random.normal(k2, (d, d))).astype(dtype),
        enorm=jnp.ones((d,), jnp.float32),
        hnorm=jnp.ones((d,), jnp.float32),
    )


def mtp_inputs(
    p: MTPInputParams,
    cfg: ModelConfig,
    hidden: jax.Array,  # [B, T, hc, d] target streams before hc_head at position i
    next_embed: jax.Array,  # [B, T, d] embedding of token i+1
) -> jax.Array:
    """u_j = h_proj(hnorm(H_i,j)) + e_proj(enorm(e)) for every stream j -> [B, T, hc, d]."""
    h = quant.matmul(rms_norm(hidden, p.hnorm, cfg.rms_norm_eps), p.h_proj)
    e = quant.matmul(rms_norm(next_embed, p.enorm, cfg.rms_norm_eps), p.e_proj)
    return h + e[:, :, None, :]
