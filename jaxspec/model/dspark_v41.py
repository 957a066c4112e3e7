"""DSpark on DeepSeek-V4.1 (docs/dspark.md, "V4.1's drafter"): the drafter of V4.1 release folders
(`mtp.0..2`), at the model level. `model.dspark` calls it for `V41DSparkParams`; the cycle sees one
DSpark drafter.

What differs from V4's: the stages are V4.1 blocks (single-pass hyper-connections, queries without a
per-head norm, the QAT roundings, their own MoE of `dcfg`'s size: 128 experts, top-3 in V4.1-Flash);
the context rows are the target's layer *inputs* (`network.forward(capture=...)` on V4.1); main_proj
reads its input FP8-rounded; there is no hc_head: the last stage's handed-on mix collapses the
streams for the norm and the target's head, as in V4.1's own forward. The rings, the non-causal
block over [anchor, noise x (γ-1)] and the Markov and confidence heads are V4's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.layers.attention import AttentionRows, attend, ring_positions
from jaxspec.layers.mhc import init_hyper_conn
from jaxspec.layers.moe import init_moe
from jaxspec.layers.v41_attention import PoolAttentionParams, init_pool_attention, project_out, window_kv, window_qkv
from jaxspec.model.state import LayerState, commit_layer
from jaxspec.model.v41 import V41BlockParams, V41Params, block_v41, first_mix, head_v41
from jaxspec.ops import fakequant, quant
from jaxspec.ops.norms import rms_norm
from jaxspec.ops.quant import Weight
from jaxspec.ops.rope import inv_freq, rope_angles
from jaxspec.sharding.rules import axes


@struct.dataclass
class V41DSparkParams:
    main_proj: Weight = axes("capture", "embed", quant="fp8_32")  # [n*d, d], n = len(target_layers)
    main_norm: jax.Array = axes("embed")  # [d]
    stages: tuple[V41BlockParams, ...]  # window-only V4.1 blocks, no Engram, the stages' own MoE
    norm: jax.Array = axes("embed")  # [d], before the target's head
    markov_w1: jax.Array = axes("vocab", "markov")  # [V, r] markov_head.embed
    markov_w2: jax.Array = axes("markov", "vocab")  # [r, V] markov_head.head, transposed
    confidence: jax.Array = axes("confidence", None)  # [d + r, 1] fp32, no bias


def init_v41_dspark_params(cfg: ModelConfig, dcfg: DSparkConfig, key: jax.Array,
                           std: float = 0.02) -> V41DSparkParams:
    """Random parameters (normal(std) matrices, unit norms, zero sinks and gate biases)."""
    dcfg.validate_for(cfg)
    scfg = dcfg.stage_config(cfg)
    d, v, r = cfg.hidden_size, cfg.vocab_size, dcfg.markov_rank
    dtype = jnp.dtype(cfg.dtype)
    keys = jax.random.split(key, dcfg.num_stages + 4)

    def normal(k, shape, dt=dtype):
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)

    def stage(k):
        k = jax.random.split(k, 4)
        return V41BlockParams(
            attn_norm=jnp.ones((d,), jnp.float32), attn=init_pool_attention(scfg, k[0], -1, std),
            ffn_norm=jnp.ones((d,), jnp.float32), ffn=init_moe(scfg, k[1], hash_routed=False, std=std),
            hc_attn=init_hyper_conn(scfg, k[2]), hc_ffn=init_hyper_conn(scfg, k[3]), engram=None)

    return V41DSparkParams(
        main_proj=normal(keys[0], (len(dcfg.target_layers) * d, d)),
        main_norm=jnp.ones((d,), jnp.float32),
        stages=tuple(stage(keys[4 + s]) for s in range(dcfg.num_stages)),
        norm=jnp.ones((d,), jnp.float32),
        markov_w1=normal(keys[1], (v, r)),
        markov_w2=normal(keys[2], (r, v)),
        confidence=normal(keys[3], (d + r, 1), jnp.float32),
    )


def context_rings(
    params: V41DSparkParams,
    cfg: ModelConfig,
    rings: tuple[LayerState, ...],  # each stage's window ring
    captured: jax.Array,  # [B, T, n*d] the target's tapped layer inputs at the rows
    positions: jax.Array,  # [B, T] int32
    take: jax.Array,  # [B, T] bool rows to commit
    new_length: jax.Array,  # [B] int32 context rows after the commit
) -> tuple[LayerState, ...]:
    """Every stage's ring with the taken rows written: main_x = main_norm(main_proj FQ8(taps)), then
    per stage kv_norm(wkv FQ8(main_x)) RoPE'd at the row's own position (base theta, no YaRN), FQ8-rounded."""
    fq = fakequant.roundings(cfg.v41.qat)
    main_x = rms_norm(quant.matmul(fq.fp8(captured.astype(jnp.dtype(cfg.dtype))), params.main_proj),
                      params.main_norm, cfg.rms_norm_eps)  # [B, T, d]
    cos, sin = rope_angles(positions, inv_freq(cfg, False))
    return tuple(
        commit_layer(cfg, "sliding", ring, AttentionRows(kv=window_kv(stage.attn, cfg, main_x, cos, sin)),
                     positions, take, new_length)
        for stage, ring in zip(params.stages, rings, strict=True))


def block_inputs(
    embed: jax.Array,  # [V, d] the target's
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    length: jax.Array,  # [B] int32 context rows committed
    anchor: jax.Array,  # [B] int32 the token at position `length`
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The block a DSpark pass reads (V4's and V4.1's alike): tokens [anchor, noise x (γ-1)] [B, γ], their
    positions p+1..p+γ [B, γ], and their embeddings in every hyper-connection copy [B, γ, hc, d]."""
    b, g = anchor.shape[0], dcfg.block_size
    tokens = jnp.concatenate([anchor[:, None].astype(jnp.int32),
                              jnp.full((b, g - 1), dcfg.noise_token_id, jnp.int32)], axis=1)
    positions = length[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
    streams = jnp.broadcast_to(embed[tokens][:, :, None, :], (b, g, cfg.hc_mult, cfg.hidden_size))
    return tokens, positions, streams


def stage_attention(
    p: PoolAttentionParams,
    cfg: ModelConfig,
    x: jax.Array,  # [B, γ, d] normed block rows
    ring: jax.Array,  # [B, W, c] this stage's context ring
    length: jax.Array,  # [B] context rows committed: the newest is p = length - 1
    rope: tuple[jax.Array, jax.Array],  # cos, sin at the block positions p+1..p+γ
) -> jax.Array:
    """The stage's attention: every block query reads the whole ring (positions p-W+1..p) and all γ
    block keys, no causal mask inside the block -> [B, γ, d]."""
    cos, sin = rope
    _, q, kv = window_qkv(p, cfg, x, cos, sin)
    b, g = x.shape[:2]
    newest = jnp.broadcast_to(length[:, None] - 1, (b, g))  # the window measured from p for every query
    out = attend(q, ring, ring_positions(length, ring.shape[1]), kv, jnp.ones((b, g, g), bool), newest, p.sink,
                 window=cfg.sliding_window, scale=cfg.head_dim**-0.5)
    return project_out(p, cfg, out, cos, sin, x.dtype)


def block_logits(
    params: V41DSparkParams,
    target: V41Params,  # its embed and head
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    rings: tuple[LayerState, ...],
    length: jax.Array,  # [B] int32 context rows committed
    anchor: jax.Array,  # [B] int32 the token at position `length`
) -> tuple[jax.Array, jax.Array]:
    """One pass of the stages over [anchor, noise x (γ-1)] at positions p+1..p+γ -> (base logits
    [B, γ, V] fp32, the collapsed rows before the norm [B, γ, d]: the confidence head's input)."""
    scfg = dcfg.stage_config(cfg)
    tokens, positions, streams = block_inputs(target.embed, cfg, dcfg, length, anchor)
    rope = rope_angles(positions, inv_freq(cfg, False))
    pre = first_mix(tokens.shape, cfg)
    for stage, ring in zip(params.stages, rings, strict=True):
        def attend_fn(x, stage=stage, ring=ring):
            return stage_attention(stage.attn, scfg, x, ring.swa_kv, length, rope), None

        streams, pre, _ = block_v41(stage, scfg, streams, pre, attend_fn)
    return head_v41(params.norm, target.head, cfg, streams, pre)
