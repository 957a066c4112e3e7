"""DSpark, DeepSeek's block drafter for V4 (docs/dspark.md, "What a release holds"), at the model level.

Context: the target's captured rows (per committed position, the hc-mean of the output streams of
`dcfg.target_layers`, concatenated: `network.forward(..., capture=...)`) go through main_proj ->
main_norm once, then through every stage's own wkv -> kv_norm -> RoPE at the row's own position
into that stage's ring (slot pos mod W). They enter the drafter only as attention keys / values.

Block: one pass of the stages (full V4 blocks: mHC, sliding-window attention, score-routed MoE)
over [anchor, noise x (γ-1)] at positions p+1..p+γ, p = the newest context row. Every block query
reads the whole window p-W+1..p and all γ block keys (non-causal). hc_head -> norm -> the target's
head give base logits U [B, γ, V]; the Markov head adds W1[prev] W2ᵀ position by position as tokens
are drafted; the confidence head reads [hc_head output ; W1[prev]].

The embedding and the LM head are the target's (`ModelParams.embed` / `.head`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.layers.attention import (
    AttentionParams,
    AttentionRows,
    attend,
    output,
    queries,
    ring_positions,
    window_kv,
)
from jaxspec.layers.mhc import HyperHeadParams, hc_head, init_hyper_head
from jaxspec.model import dspark_v41
from jaxspec.model.dspark_v41 import V41DSparkParams
from jaxspec.model.network import BlockParams, ModelParams, init_block, release_weights, residual_block
from jaxspec.model.state import LayerState, commit_layer
from jaxspec.ops import quant
from jaxspec.ops.norms import rms_norm
from jaxspec.ops.quant import Weight
from jaxspec.ops.rope import inv_freq, rope_angles
from jaxspec.sharding.rules import axes


@struct.dataclass
class DSparkParams:
    main_proj: Weight = axes("capture", "embed", quant="fp8")  # [n*d, d], n = len(target_layers)
    main_norm: jax.Array = axes("embed")  # [d] fp32
    stages: tuple[BlockParams, ...]  # kind "sliding", score-routed MoE (gate bias, no hash table)
    hc_head: HyperHeadParams  # the last stage's
    norm: jax.Array = axes("embed")  # [d] fp32, before the target's head
    markov_w1: jax.Array = axes("vocab", "markov")  # [V, r] embedding of the previous token
    markov_w2: jax.Array = axes("markov", "vocab")  # [r, V]
    confidence: jax.Array = axes("confidence", None)  # [d + r, 1] fp32, no bias


@struct.dataclass
class DSparkState:
    """Per stage the context ring (`LayerState.swa_kv` [B, W, c], slot pos mod W, W = the window);
    `length` context rows committed (positions 0..length-1). The anchor sits at position `length`."""

    stages: tuple[LayerState, ...]
    length: jax.Array = axes("batch")  # [B] int32


@struct.dataclass
class DraftChain:
    """The sequential Markov chain of one block (docs/dspark.md, "How a cycle drafts")."""

    tokens: jax.Array  # [B, γ] int32 drafted d_1..d_γ (d_k sampled from logits[:, k-1])
    logits: jax.Array  # [B, γ, V] fp32 Markov-corrected logits the tokens were drawn from
    confidence: jax.Array  # [B, γ] fp32 raw confidence logits (σ = P(d_k accepted | prefix accepted))


def init_dspark_params(cfg: ModelConfig, dcfg: DSparkConfig, key: jax.Array,
                       std: float = 0.02) -> DSparkParams | V41DSparkParams:
    """Random parameters (normal(std) matrices, unit norms, zero sinks and gate biases); a V4.1 target's
    drafter (`cfg.v41`) is V4.1's (`model.dspark_v41`)."""
    if cfg.v41 is not None:
        return dspark_v41.init_v41_dspark_params(cfg, dcfg, key, std)
    dcfg.validate_for(cfg)
    d, v, r = cfg.hidden_size, cfg.vocab_size, dcfg.markov_rank
    dtype = jnp.dtype(cfg.dtype)
    keys = jax.random.split(key, dcfg.num_stages + 5)

    def normal(k, shape, dt=dtype):
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)

    return DSparkParams(
        main_proj=normal(keys[0], (len(dcfg.target_layers) * d, d)),
        main_norm=jnp.ones((d,), jnp.float32),
        stages=tuple(init_block(cfg, keys[5 + s], "sliding", False) for s in range(dcfg.num_stages)),
        hc_head=init_hyper_head(cfg, keys[1]),
        norm=jnp.ones((d,), jnp.float32),
        markov_w1=normal(keys[2], (v, r)),
        markov_w2=normal(keys[3], (r, v)),
        confidence=normal(keys[4], (d + r, 1), jnp.float32),
    )


@functools.lru_cache(maxsize=16)
def abstract_dspark_params(cfg: ModelConfig, dcfg: DSparkConfig, weights: str = "plain",
                           experts: str = "fp4") -> DSparkParams:
    """ShapeDtypeStructs of `init_dspark_params(cfg, dcfg)`; weights "fp8": the leaves a release stores
    FP8 / FP4 block-scaled as it stores them (as `network.abstract_params`)."""
    params = jax.eval_shape(lambda: init_dspark_params(cfg, dcfg, jax.random.key(0)))
    return release_weights(params, weights, experts, v41=cfg.v41 is not None)


def init_dspark_state(cfg: ModelConfig, dcfg: DSparkConfig, batch: int) -> DSparkState:
    """Empty rings (no context row yet) for `batch` sequences."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    ring = jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), jnp.dtype(cfg.dtype))
    return DSparkState(stages=tuple(LayerState(swa_kv=ring) for _ in range(dcfg.num_stages)),
                       length=jnp.zeros((batch,), jnp.int32))


def _check(params: DSparkParams | V41DSparkParams, cfg: ModelConfig, dcfg: DSparkConfig) -> None:
    want = (len(dcfg.target_layers) * cfg.hidden_size, cfg.hidden_size)
    kind = V41DSparkParams if cfg.v41 is not None else DSparkParams
    if not isinstance(params, kind) or tuple(params.main_proj.shape) != want \
            or len(params.stages) != dcfg.num_stages:
        raise ValueError(f"params must be {kind.__name__} with main_proj {want} and {dcfg.num_stages} stages")


def commit_context(
    params: DSparkParams,
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    state: DSparkState,
    captured: jax.Array,  # [B, T, n*d] target rows (`ForwardOutput.captured` of dcfg.target_layers)
    positions: jax.Array,  # [B, T] int32 their absolute positions
    take: jax.Array,  # [B, T] bool: rows to commit; their positions must be length, length+1, ...
) -> DSparkState:
    """Write the taken rows into every stage's ring (RoPE'd at their own positions) and advance the
    length. Rows not taken (rejected drafts, padding) are never written."""
    _check(params, cfg, dcfg)
    new_length = state.length + jnp.sum(take, axis=1).astype(jnp.int32)
    if isinstance(params, V41DSparkParams):
        stages = dspark_v41.context_rings(params, cfg, state.stages, captured, positions, take, new_length)
        return state.replace(stages=stages, length=new_length)
    main_x = rms_norm(quant.matmul(captured.astype(jnp.dtype(cfg.dtype)), params.main_proj), params.main_norm,
                      cfg.rms_norm_eps)  # [B, T, d]
    cos, sin = rope_angles(positions, inv_freq(cfg, False))  # window-only layers: base theta, no YaRN
    stages = tuple(
        commit_layer(cfg, "sliding", ring, AttentionRows(kv=window_kv(stage.attn, cfg, main_x, cos, sin)),
                     positions, take, new_length)
        for stage, ring in zip(params.stages, state.stages, strict=True)
    )
    return state.replace(stages=stages, length=new_length)


def stage_attention(
    p: AttentionParams,
    cfg: ModelConfig,
    x: jax.Array,  # [B, γ, d] normed block rows
    ring: jax.Array,  # [B, W, c] this stage's context ring
    length: jax.Array,  # [B] context rows committed: the newest is p = length - 1
    positions: jax.Array,  # [B, γ] int32 block positions p+1..p+γ
) -> jax.Array:
    """DSparkAttention: the layer's own projections, softmax-with-sink and grouped output over the
    ring's window p-W+1..p plus all γ block keys, the same key set for every block query -> [B, γ, d]."""
    cos, sin = rope_angles(positions, inv_freq(cfg, False))
    q, _ = queries(p, cfg, x, cos, sin)
    kv = window_kv(p, cfg, x, cos, sin)
    b, g = positions.shape
    # `attend` keeps window keys at positions > pos - W: measured from p (not from each query), the
    # window is the whole ring, as the reference's one index row for all queries.
    newest = jnp.broadcast_to(length[:, None] - 1, (b, g))
    out = attend(q, ring, ring_positions(length, ring.shape[1]), kv, jnp.ones((b, g, g), bool), newest, p.sink,
                 window=cfg.sliding_window, scale=cfg.head_dim**-0.5)
    return output(p, cfg, out, cos, sin, x.dtype)


def block_logits(
    params: DSparkParams,
    target: ModelParams,  # its embed and head
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    state: DSparkState,
    anchor: jax.Array,  # [B] int32 the token at position state.length (the last bonus)
) -> tuple[jax.Array, jax.Array]:
    """One non-causal pass of the stages over [anchor, noise x (γ-1)] at positions p+1..p+γ ->
    (base logits U [B, γ, V] fp32 before the Markov bias, hc_head output hh [B, γ, d] before the
    norm: the confidence head's input). Slot k predicts the token at position p+2+k."""
    _check(params, cfg, dcfg)
    if isinstance(params, V41DSparkParams):
        return dspark_v41.block_logits(params, target, cfg, dcfg, state.stages, state.length, anchor)
    tokens, positions, streams = dspark_v41.block_inputs(target.embed, cfg, dcfg, state.length, anchor)
    for stage, ring in zip(params.stages, state.stages, strict=True):
        def attend_fn(x, stage=stage, ring=ring):
            return stage_attention(stage.attn, cfg, x, ring.swa_kv, state.length, positions), None

        streams, _ = residual_block(stage, cfg, streams, tokens, attend_fn)
    hh = hc_head(params.hc_head, cfg, streams)  # [B, γ, d]
    x = rms_norm(hh, params.norm, cfg.rms_norm_eps)
    return jnp.einsum("btd,dv->btv", x, target.head, preferred_element_type=jnp.float32), hh


def markov(params: DSparkParams, prev_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """prev_tokens [...] int -> (e = W1[prev] [..., r], bias = e W2 [..., V] fp32): the vanilla Markov
    head, added to the base logits of the position after `prev`."""
    e = params.markov_w1[prev_tokens]
    return e, jnp.einsum("...r,rv->...v", e, params.markov_w2, preferred_element_type=jnp.float32)


def confidence_logits(
    params: DSparkParams,
    hh: jax.Array,  # [..., d] hc_head output (before the norm) at the drafted position
    e: jax.Array,  # [..., r] W1 of the position's previous token
) -> jax.Array:
    """[...] fp32 raw logits c = wᵀ [hh ; e] (σ(c) read as P(accepted | prefix accepted); docs/dspark.md)."""
    features = jnp.concatenate([hh.astype(jnp.float32), e.astype(jnp.float32)], axis=-1)
    return (features @ params.confidence.astype(jnp.float32))[..., 0]


def draft_chain(
    params: DSparkParams,
    target: ModelParams,
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    state: DSparkState,
    anchor: jax.Array,  # [B] int32
    temperature: float = 0.0,
    key: jax.Array | None = None,
) -> DraftChain:
    """The reference's sequential Markov loop (§2.6): d_k from U_{k-1} + W1[d_{k-1}] W2ᵀ, d_0 = anchor;
    temperature 0 takes the argmax, else a Gumbel-max draw from softmax(logits / temperature)."""
    if temperature < 0 or (temperature > 0 and key is None):
        raise ValueError(f"temperature must be >= 0 (a key is needed when > 0), got {temperature}")
    base, hh = block_logits(params, target, cfg, dcfg, state, anchor)
    keys = jax.random.split(key, dcfg.block_size) if temperature > 0 else jnp.zeros((dcfg.block_size,), jnp.uint32)

    def step(prev, xs):
        u, k = xs  # [B, V], one key
        e, bias = markov(params, prev)
        logits = u + bias
        if temperature > 0:
            token = jnp.argmax(logits / temperature + jax.random.gumbel(k, logits.shape), axis=-1)
        else:
            token = jnp.argmax(logits, axis=-1)
        token = token.astype(jnp.int32)
        return token, (token, logits, e)

    _, (tokens, logits, e) = jax.lax.scan(step, anchor.astype(jnp.int32), (jnp.swapaxes(base, 0, 1), keys))
    tokens, logits, e = tokens.T, jnp.swapaxes(logits, 0, 1), jnp.swapaxes(e, 0, 1)
    return DraftChain(tokens=tokens, logits=logits, confidence=confidence_logits(params, hh, e))
