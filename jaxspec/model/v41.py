"""The DeepSeek-V4.1 forward over T new tokens against a committed `V41State` (docs/v41.md).

The same contract as V4's `network.forward` (the seam the speculative cycle sees: init_state /
forward / commit): tokens sit at given absolute positions, read the committed state plus the new
tokens `ctx.visible` to them, and their rows come back for the caller to commit. What V4.1 changes
is inside: single-pass hyper-connections (a sub-layer's `pre` mix is consumed by the next one; the
first is copy 0, the last collapses the streams for the head, no hc_head), attention over pools
shared by layer groups (`layers.v41_attention`), Engram's n-gram rows at some layers
(`layers.engram`), and QAT-rounded experts (`layers.v41_moe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.layers.attention import AttentionContext
from jaxspec.layers.engram import EngramParams, engram, init_engram
from jaxspec.layers.mhc import HyperConnParams, hc_collapse, hc_mixes, hc_post_fp32, init_hyper_conn
from jaxspec.layers.moe import MoEParams, init_moe
from jaxspec.layers.v41_attention import PoolAttentionParams, PoolShare, init_pool_attention, pool_attention
from jaxspec.layers.v41_moe import qat_moe
from jaxspec.model.state_v41 import V41Rows, V41State
from jaxspec.ops.ngram_hash import hash_rows, ngram_tables
from jaxspec.ops.norms import rms_norm
from jaxspec.sharding.rules import axes


@struct.dataclass
class V41BlockParams:
    attn_norm: jax.Array = axes("embed")  # [d]
    attn: PoolAttentionParams
    ffn_norm: jax.Array = axes("embed")  # [d]
    ffn: MoEParams
    hc_attn: HyperConnParams
    hc_ffn: HyperConnParams
    engram: EngramParams | None  # Engram layers


@struct.dataclass
class V41Params:
    embed: jax.Array = axes("vocab", "embed")  # [V, d]
    layers: tuple[V41BlockParams, ...]
    norm: jax.Array = axes("embed")  # [d]
    head: jax.Array = axes("embed", "vocab")  # [d, V]
    # [V] int32: each token's class in Engram's normalized id space (from the tokenizer); None without Engram
    engram_token_map: jax.Array | None = axes("vocab")


def init_v41_params(cfg: ModelConfig, key: jax.Array) -> V41Params:
    """Random parameters (normal(0.02) matrices, unit norms, zero sinks and biases); the Engram token
    map sends token id i to class i mod the compressed vocabulary."""
    v = cfg.v41
    keys = jax.random.split(key, cfg.num_layers + 3)
    d, vocab, dtype = cfg.hidden_size, cfg.vocab_size, jnp.dtype(cfg.dtype)
    layers = []
    for i in range(cfg.num_layers):
        k = jax.random.split(keys[i], 5)
        eng = None
        if i in v.engram_layers:
            eng = init_engram(cfg, k[4], v.engram_table_rows(i))
        layers.append(V41BlockParams(
            attn_norm=jnp.ones((d,), jnp.float32), attn=init_pool_attention(cfg, k[0], i),
            ffn_norm=jnp.ones((d,), jnp.float32), ffn=init_moe(cfg, k[1], hash_routed=False),
            hc_attn=init_hyper_conn(cfg, k[2]), hc_ffn=init_hyper_conn(cfg, k[3]), engram=eng))
    token_map = None
    if v.engram_layers:
        token_map = jnp.arange(vocab, dtype=jnp.int32) % v.engram_compressed_vocab
    return V41Params(
        embed=(0.02 * jax.random.normal(keys[-1], (vocab, d))).astype(dtype), layers=tuple(layers),
        norm=jnp.ones((d,), jnp.float32), head=(0.02 * jax.random.normal(keys[-2], (d, vocab))).astype(dtype),
        engram_token_map=token_map)


def ngram_ids(
    params: V41Params, cfg: ModelConfig, state: V41State, tokens: jax.Array, ctx: AttentionContext,  # tokens: [B, T]
) -> tuple[jax.Array, jax.Array]:
    """-> each new token's n-gram as compressed ids [B, T, N] (itself first, then the tokens before it
    on its own chain: new ancestors, then the committed history; the pad class before position 0),
    and the new tokens' own ids [B, T] (what a commit keeps)."""
    v = cfg.v41
    n = v.engram_max_ngram
    own = params.engram_token_map[tokens]  # [B, T]
    b, t = tokens.shape
    src = ctx.positions[..., None] - jnp.arange(n)  # [B, T, N] positions of the n-gram's tokens
    depth = src - ctx.committed[:, None, None]
    new_index = jnp.take_along_axis(ctx.ancestor_at_depth, jnp.clip(depth, 0, t - 1), axis=-1)
    from_new = jnp.take_along_axis(jnp.broadcast_to(own[:, None, :], (b, t, t)), new_index, axis=-1)
    history = jnp.take_along_axis(state.ngram_ids[:, None, :], jnp.mod(src, n - 1), axis=-1)
    pad = params.engram_token_map[v.engram_pad_id]
    return jnp.where(src < 0, pad, jnp.where(depth >= 0, from_new, history)), own


def forward_v41(
    params: V41Params,
    cfg: ModelConfig,
    state: V41State,
    tokens: jax.Array,  # [B, T] int32
    ctx: AttentionContext,  # dense (band = 0): visible and ancestor_at_depth [B, T, T]
    capture: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, V41Rows, jax.Array | None, jax.Array]:
    """-> logits [B, T, V] fp32, final streams [B, T, hc, d], the rows for `state_v41.commit_v41_state`,
    with `capture` (static layer ids) the hc means of the streams *entering* those layers (after their
    Engram), concatenated [B, T, len(capture) * d] (V4.1's DSpark taps layer inputs), and the normed
    rows the head reads [B, T, d]."""
    v = cfg.v41
    if ctx.band:
        raise ValueError("the V4.1 forward reads a dense context (band = 0)")
    streams = jnp.broadcast_to(params.embed[tokens][:, :, None, :], (*tokens.shape, cfg.hc_mult, cfg.hidden_size))
    own = None
    if v.engram_layers:
        grams, own = ngram_ids(params, cfg, state, tokens, ctx)
        tables = ngram_tables(v)
    pre = first_mix(tokens.shape, cfg)
    share, rows, taps = PoolShare(), [], {}
    for i, p in enumerate(params.layers):
        if p.engram is not None:
            streams = engram(p.engram, cfg, streams, hash_rows(tables, v.engram_layers.index(i), grams))
        if i in capture:
            taps[i] = jnp.mean(streams.astype(jnp.float32), axis=2).astype(streams.dtype)  # [B, T, d]

        def attend(x, i=i, p=p, share=share):
            out, layer_rows, new_share = pool_attention(p.attn, cfg, i, x, state.layers[i], ctx, share)
            return out, (layer_rows, new_share)

        streams, pre, (layer_rows, share) = block_v41(p, cfg, streams, pre, attend)
        rows.append(layer_rows)
    captured = jnp.concatenate([taps[i] for i in capture], axis=-1) if capture else None
    logits, collapsed = head_v41(params.norm, params.head, cfg, streams, pre)
    return logits, streams, V41Rows(layers=tuple(rows), ngram_ids=own), captured, \
        rms_norm(collapsed, params.norm, cfg.rms_norm_eps)


def first_mix(shape: tuple[int, ...], cfg: ModelConfig) -> jax.Array:
    """The `pre` mix the first sub-layer collapses the streams with: copy 0 -> [*shape, hc] fp32."""
    return jax.nn.one_hot(jnp.zeros(shape, jnp.int32), cfg.hc_mult, dtype=jnp.float32)


def block_v41(
    p: V41BlockParams,
    cfg: ModelConfig,  # a DSpark stage's: its own expert count and top-k
    streams: jax.Array,  # [B, T, hc, d]
    pre: jax.Array,  # [B, T, hc] the mix the sub-layer before handed on
    attend: Callable[[jax.Array], tuple[jax.Array, Any]],  # normed rows [B, T, d] -> (output [B, T, d], aux)
) -> tuple[jax.Array, jax.Array, Any]:
    """One block under single-pass hyper-connections: each sub-layer collapses the streams with the
    `pre` mix of the one before it and hands its own on -> (streams, pre for the next, attend's aux)."""
    eps = cfg.rms_norm_eps
    attn_pre, post, comb = hc_mixes(p.hc_attn, cfg, streams)
    out, aux = attend(rms_norm(hc_collapse(pre, streams), p.attn_norm, eps))
    streams = hc_post_fp32(out, streams, post, comb)
    pre, post, comb = hc_mixes(p.hc_ffn, cfg, streams)
    x = rms_norm(hc_collapse(attn_pre, streams), p.ffn_norm, eps)
    return hc_post_fp32(qat_moe(p.ffn, cfg, x), streams, post, comb), pre, aux


def head_v41(
    norm: jax.Array,  # [d]
    head: jax.Array,  # [d, V]
    cfg: ModelConfig,
    streams: jax.Array,  # [B, T, hc, d]
    pre: jax.Array,  # [B, T, hc] the last sub-layer's handed-on mix (no hc_head in V4.1)
) -> tuple[jax.Array, jax.Array]:
    """-> logits [B, T, V] fp32 and the collapsed rows before the norm [B, T, d]."""
    xh = hc_collapse(pre, streams)
    x = rms_norm(xh, norm, cfg.rms_norm_eps)
    return jnp.einsum("btd,dv->btv", x.astype(jnp.float32), head.astype(jnp.float32)), xh


def check_v41_params(params: Any, cfg: ModelConfig) -> None:
    if not isinstance(params, V41Params):
        raise ValueError(f"a V4.1 config takes V41Params (init_params / load_release), got {type(params).__name__}")
    embed = tuple(getattr(params.embed, "shape", ()))
    if embed != (cfg.vocab_size, cfg.hidden_size) or len(params.layers) != cfg.num_layers:
        raise ValueError(f"params do not fit cfg: embed {embed} and {len(params.layers)} layers, cfg implies "
                         f"({cfg.vocab_size}, {cfg.hidden_size}) and {cfg.num_layers}")
