"""Lightning indexer of CSA layers (docs/architecture.md §4): its own CSA compressor produces one
index key per compressed entry; queries come from the shared q latent; score(t, w) =
sum_h w_{t,h} * ReLU(q_{t,h} . K_w) / sqrt(c_I * H_I); each query keeps the top-k entries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.layers.compressor import CompressorParams, init_compressor
from jaxspec.ops import quant
from jaxspec.ops.quant import Weight
from jaxspec.ops.rope import apply_rope
from jaxspec.sharding.rules import axes


@struct.dataclass
class IndexerParams:
    wq_b: Weight = axes("q_lora", "index_heads", quant="fp8")  # [q_lora_rank, H_I * c_I]
    weights_proj: jax.Array = axes("embed", "index_heads")  # [d, H_I] fp32
    compressor: CompressorParams  # CSA scheme at width c_I


def init_indexer(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> IndexerParams:
    k1, k2, k3 = jax.random.split(key, 3)
    hi, ci = cfg.index_n_heads, cfg.index_head_dim
    return IndexerParams(
        wq_b=(std * jax.random.normal(k1, (cfg.q_lora_rank, hi * ci))).astype(jnp.dtype(cfg.dtype)),
        weights_proj=std * jax.random.normal(k2, (cfg.hidden_size, hi), jnp.float32),
        compressor=init_compressor(cfg, k3, cfg.csa_ratio, overlap=True, width=ci),
    )


def index_queries(
    p: IndexerParams,
    cfg: ModelConfig,
    q_latent: jax.Array,  # [B, T, q_lora_rank]
    x: jax.Array,  # [B, T, d]
    cos: jax.Array,  # [B, T, r/2]
    sin: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """-> index queries [B, T, H_I, c_I] fp32 (RoPE'd), head weights [B, T, H_I] fp32 (scaled)."""
    b, t, _ = q_latent.shape
    q = quant.matmul(q_latent, p.wq_b).reshape(b, t, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None]).astype(jnp.float32)
    weights = (x.astype(jnp.float32) @ p.weights_proj) * (cfg.index_n_heads**-0.5)
    return q, weights


def index_scores(
    q: jax.Array,  # [B, T, H_I, c_I]
    weights: jax.Array,  # [B, T, H_I]
    keys: jax.Array,  # [B, N, c_I]
) -> jax.Array:
    """-> [B, T, N] fp32 indexer scores (no masking)."""
    dots = jnp.einsum("bthc,bnc->bthn", q, keys.astype(jnp.float32))
    dots = jax.nn.relu(dots) * (q.shape[-1] ** -0.5)
    return jnp.einsum("bthn,bth->btn", dots, weights)
