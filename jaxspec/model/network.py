"""The DeepSeek-V4 forward over T new tokens per sequence against a committed decode state.

One function serves full prefill, chunked extend, 1-token decode and (with an ancestor mask)
tree verification: tokens sit at given absolute positions, see the committed state plus the new
tokens `visible` to them, and the per-token rows come back for the caller to commit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.layers.attention import AttentionContext, AttentionParams, AttentionRows, attention, init_attention
from jaxspec.layers.banded import band_block
from jaxspec.layers.mhc import (
    HyperConnParams,
    HyperHeadParams,
    hc_head,
    hc_post,
    hc_pre,
    init_hyper_conn,
    init_hyper_head,
)
from jaxspec.layers.moe import UNION_MAX_EXPERTS, MoEParams, init_moe, moe, stack_experts, unstack_experts
from jaxspec.layers.mtp import MTPInputParams, init_mtp_input, mtp_inputs
from jaxspec.model import state as state_lib
from jaxspec.model.state import DecodeState
from jaxspec.model.v41 import V41Params, check_v41_params, forward_v41, init_v41_params
from jaxspec.ops.norms import rms_norm
from jaxspec.ops.quant import abstract_block_scaled, release_layout
from jaxspec.sharding.rules import axes, map_declared


@struct.dataclass
class BlockParams:
    attn_norm: jax.Array = axes("embed")  # [d] fp32
    attn: AttentionParams
    ffn_norm: jax.Array = axes("embed")  # [d] fp32
    ffn: MoEParams
    hc_attn: HyperConnParams
    hc_ffn: HyperConnParams


@struct.dataclass
class MTPParams:
    inputs: MTPInputParams
    block: BlockParams
    hc_head: HyperHeadParams
    norm: jax.Array = axes("embed")  # [d] fp32


@struct.dataclass
class ModelParams:
    embed: jax.Array = axes("vocab", "embed")  # [V, d]
    layers: tuple[BlockParams, ...]
    hc_head: HyperHeadParams
    norm: jax.Array = axes("embed")  # [d] fp32
    head: jax.Array = axes("embed", "vocab")  # [d, V]
    mtp: MTPParams | None


@struct.dataclass
class Models:
    """The target's parameters and its drafter's own (MTPParams, a DSpark drafter's, ...): what speculation
    runs (the drafter's code is the `Speculator`'s `drafter`, its state `SpecState.drafter`)."""

    target: ModelParams
    drafter: Any


@struct.dataclass
class ForwardOutput:
    logits: jax.Array  # [B, T, V] fp32
    hidden: jax.Array  # [B, T, hc, d] final streams before hc_head (the MTP draft's input)
    rows: Any  # for `state.commit`: per layer AttentionRows (V4), a `state_v41.V41Rows` (V4.1)
    # [B, T, len(capture)*d]: per captured layer, the mean over the hc streams of its output (V4) or input
    # (V4.1): DSpark's context rows (docs/dspark.md "What a release holds"), concatenated in `capture`
    # order; None without capture.
    captured: jax.Array | None = None
    final: jax.Array | None = None  # [B, T, d] the normed rows the head reads (logits = final @ head)


def init_block(cfg: ModelConfig, key: jax.Array, kind: str, hash_routed: bool) -> BlockParams:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    d = cfg.hidden_size
    return BlockParams(
        attn_norm=jnp.ones((d,), jnp.float32),
        attn=init_attention(cfg, k1, kind),
        ffn_norm=jnp.ones((d,), jnp.float32),
        ffn=init_moe(cfg, k2, hash_routed),
        hc_attn=init_hyper_conn(cfg, k3),
        hc_ffn=init_hyper_conn(cfg, k4),
    )


def init_params(cfg: ModelConfig, key: jax.Array) -> ModelParams:
    """Random parameters (normal(0.02) matrices, unit norms, zero sinks/biases)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if cfg.v41 is not None:
        return init_v41_params(cfg, key)
    keys = jax.random.split(key, cfg.num_layers + 6)
    d, v, dtype = cfg.hidden_size, cfg.vocab_size, jnp.dtype(cfg.dtype)
    layers = tuple(
        init_block(cfg, keys[i], kind, i < cfg.num_hash_layers) for i, kind in enumerate(cfg.layer_types)
    )
    mtp = None
    if cfg.has_mtp:
        k = jax.random.split(keys[-1], 3)
        mtp = MTPParams(
            inputs=init_mtp_input(cfg, k[0]),
            block=init_block(cfg, k[1], "sliding", False),
            hc_head=init_hyper_head(cfg, k[2]),
            norm=jnp.ones((d,), jnp.float32),
        )
    return ModelParams(
        embed=(0.02 * jax.random.normal(keys[-2], (v, d))).astype(dtype),
        layers=layers,
        hc_head=init_hyper_head(cfg, keys[-3]),
        norm=jnp.ones((d,), jnp.float32),
        head=(0.02 * jax.random.normal(keys[-4], (d, v))).astype(dtype),
        mtp=mtp,
    )


WEIGHTS = ("plain", "fp8")


@functools.lru_cache(maxsize=16)
def abstract_params(cfg: ModelConfig, weights: str = "plain", experts: str = "fp4") -> Any:
    """ShapeDtypeStructs of `init_params(cfg)`. weights "fp8": the leaves DeepSeek's release stores
    quantized are BlockScaled as it stores them (`ops.quant.release_layout`; `experts` "fp4" for the
    instruct release's routed experts, "fp8" for the Base release's)."""
    return release_weights(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), weights, experts,
                           v41=cfg.v41 is not None)


def release_weights(params: Any, weights: str, experts: str = "fp4", v41: bool = False) -> Any:
    """Abstract parameters (any declared tree) with weights "fp8": the leaves DeepSeek's release stores
    quantized as BlockScaled (`ops.quant.release_layout`); "plain": unchanged. `v41`: a V4.1 release,
    which stores every FP8 weight in 32 x 32 blocks, those of the modules it shares with V4 (the shared
    expert) too."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "plain":
        return params

    def quantized(x, names, tag, path):
        if tag is None:
            return x
        if v41:
            tag = {"fp8": "fp8_32", "fp8_groups": "fp8_32_groups"}.get(tag, tag)
        block, fmt, scale_dtype = release_layout(tag, x.shape, experts)
        return abstract_block_scaled(x.shape, x.dtype, block, fmt, scale_dtype)

    return map_declared(params, quantized)


def residual_block(
    p: BlockParams,
    cfg: ModelConfig,
    streams: jax.Array,  # [B, T, hc, d]
    token_ids: jax.Array,  # [B, T] (hash routing uses the input token at each position)
    attend_fn: Callable[[jax.Array], tuple[jax.Array, Any]],  # normed [B, T, d] -> ([B, T, d], rows)
) -> tuple[jax.Array, Any]:
    """One block's hc_pre / attention / hc_post / hc_pre / MoE / hc_post around the attention it is
    given: the target's (`block`) or the DSpark stage's (`model.dspark`), one body for both."""
    collapsed, post, comb = hc_pre(p.hc_attn, cfg, streams)
    attn_out, rows = attend_fn(rms_norm(collapsed, p.attn_norm, cfg.rms_norm_eps))
    streams = hc_post(attn_out, streams, post, comb)
    collapsed, post, comb = hc_pre(p.hc_ffn, cfg, streams)
    ffn_out = moe(p.ffn, cfg, rms_norm(collapsed, p.ffn_norm, cfg.rms_norm_eps), token_ids)
    return hc_post(ffn_out, streams, post, comb), rows


def block(
    p: BlockParams,
    cfg: ModelConfig,
    kind: str,
    streams: jax.Array,  # [B, T, hc, d]
    token_ids: jax.Array,  # [B, T] (hash routing uses the input token at each position)
    layer_state: state_lib.LayerState,
    ctx: AttentionContext,
) -> tuple[jax.Array, AttentionRows]:
    return residual_block(p, cfg, streams, token_ids, lambda x: attention(p.attn, cfg, kind, x, layer_state, ctx))


def causal_context(committed: jax.Array, valid: jax.Array, band: int = 0) -> AttentionContext:
    """Context for a chain of new tokens at positions P, P+1, ... (prefill / extend / decode).

    band > 0 (`layers.banded.band_block`; `valid` a prefix of each row): the layers read the chain
    block by block and no [T, T] visibility or ancestor table is built."""
    b, t = valid.shape
    index = jnp.arange(t, dtype=jnp.int32)
    positions = committed[:, None] + index[None, :]
    if band:
        return AttentionContext(positions=positions, committed=committed, visible=None, ancestor_at_depth=None,
                                valid=valid, band=band)
    visible = (index[None, :] <= index[:, None])[None] & valid[:, None, :]
    ancestor = jnp.broadcast_to(index[None, None, :], (b, t, t))
    return AttentionContext(
        positions=positions, committed=committed, visible=visible, ancestor_at_depth=ancestor, valid=valid
    )


def head_rows(params: ModelParams, cfg: ModelConfig, streams: jax.Array, final: Any = None) -> jax.Array:
    """[B, T, hc, d] streams -> [B, T, d] the rows the head reads: hc_head, then the norm. `final`: a
    draft's own hc_head and norm (its params: MTPParams, ...), None = the target's."""
    top = params if final is None else final
    return rms_norm(hc_head(top.hc_head, cfg, streams), top.norm, cfg.rms_norm_eps)


def head_logits(params: ModelParams, cfg: ModelConfig, streams: jax.Array, final: Any = None) -> jax.Array:
    """[B, T, hc, d] streams -> [B, T, V] fp32 logits: `head_rows`, then the shared head."""
    x = head_rows(params, cfg, streams, final)
    return jnp.einsum("btd,dv->btv", x, params.head, preferred_element_type=jnp.float32)


def cpu_layout(params: Any, cfg: ModelConfig) -> Any:
    """`params` (ModelParams, a draft's params, any tree of blocks) with every routed expert weight
    unstacked into per-expert leaves (`moe.unstack_experts`) when they live on one CPU device and the
    CPU path reads experts in place (at most UNION_MAX_EXPERTS experts, k < E); else `params` itself.
    The same values: outputs are bit-identical, a CPU step skips one copy of every selected expert
    (docs/results.md, "Routed experts on the CPU"). Outside jit, once: `load_checkpoint` does it."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if cfg.v41 is not None:  # V4.1's experts gather the selected weights (layers.v41_moe)
        return params
    leaves = jax.tree.leaves(params)
    if not (k < e <= UNION_MAX_EXPERTS) or not leaves or not all(_on_one_cpu(x) for x in leaves):
        return params
    return _map_moe(params, lambda m: m.replace(experts=unstack_experts(m.experts)))


def standard_layout(params: Any) -> Any:
    """The inverse of `cpu_layout`: stacked expert weights, as stored."""
    return _map_moe(params, lambda m: m.replace(experts=stack_experts(m.experts)))


def _map_moe(tree: Any, fn: Any) -> Any:
    return jax.tree.map(lambda x: fn(x) if isinstance(x, MoEParams) else x, tree,
                        is_leaf=lambda x: isinstance(x, MoEParams))


def _on_one_cpu(x: Any) -> bool:
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    devices = x.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def without_mtp(params: Any) -> Any:
    """The target's parameters without its MTP block (a cycle passes the draft apart); V4.1's have none."""
    return params.replace(mtp=None) if isinstance(params, ModelParams) else params


def check_params(params: Any, cfg: ModelConfig) -> None:
    """ValueError unless `params` is a ModelParams of `cfg`'s vocabulary, width and depth (cheap: a
    dict, or another model's weights, fails here in one line instead of deep inside a trace)."""
    if cfg.v41 is not None:
        return check_v41_params(params, cfg)
    if not isinstance(params, ModelParams):
        raise ValueError(
            f"params must be a jaxspec ModelParams (from init_params / load_checkpoint), got {type(params).__name__}"
        )
    embed = tuple(getattr(params.embed, "shape", ()))
    layers = len(params.layers) if isinstance(params.layers, (tuple, list)) else None
    if embed != (cfg.vocab_size, cfg.hidden_size) or layers != cfg.num_layers:
        raise ValueError(
            f"params do not fit cfg: embed {embed} and {layers} layers, cfg implies "
            f"({cfg.vocab_size}, {cfg.hidden_size}) and {cfg.num_layers}"
        )


def forward(
    params: ModelParams,
    cfg: ModelConfig,
    state: DecodeState,
    tokens: jax.Array,  # [B, T] int32
    ctx: AttentionContext,
    *,
    capture: tuple[int, ...] = (),
) -> ForwardOutput:
    """Target forward over T new tokens; reads `state`, writes nothing (see `state.commit`).

    capture (static): layer ids whose streams are averaged over hc into `out.captured`: V4 taps their
    outputs, V4.1 their inputs (what each family's DSpark drafter reads)."""
    check_params(params, cfg)
    bad = [i for i in capture if not (isinstance(i, int) and 0 <= i < cfg.num_layers)]
    if bad:
        raise ValueError(f"capture must hold layer ids in [0, {cfg.num_layers}), got {bad}")
    if isinstance(params, V41Params):
        logits, hidden, rows, captured, final = forward_v41(params, cfg, state, tokens, ctx, capture)
        return ForwardOutput(logits=logits, hidden=hidden, rows=rows, captured=captured, final=final)
    streams = jnp.broadcast_to(params.embed[tokens][:, :, None, :], (*tokens.shape, cfg.hc_mult, cfg.hidden_size))
    all_rows, taps = [], {}
    for i, kind in enumerate(cfg.layer_types):
        streams, rows = block(params.layers[i], cfg, kind, streams, tokens, state.layers[i], ctx)
        all_rows.append(rows)
        if i in capture:
            taps[i] = jnp.mean(streams.astype(jnp.float32), axis=2).astype(streams.dtype)  # [B, T, d]
    captured = jnp.concatenate([taps[i] for i in capture], axis=-1) if capture else None
    final = head_rows(params, cfg, streams)
    return ForwardOutput(logits=jnp.einsum("btd,dv->btv", final, params.head, preferred_element_type=jnp.float32),
                         hidden=streams, rows=tuple(all_rows), captured=captured, final=final)


def extend(
    params: ModelParams,
    cfg: ModelConfig,
    state: DecodeState,
    tokens: jax.Array,  # [B, T] int32, left-aligned
    valid: jax.Array,  # [B, T] bool (ragged chunks: a prefix of each row is valid)
    banded: bool = True,
    capture: tuple[int, ...] = (),
) -> tuple[ForwardOutput, DecodeState]:
    """Append a chunk of tokens to every sequence: forward, then commit every valid token.

    banded: read a long chunk block by block (`layers.banded`; False: the dense [T, T] reference).
    capture: as `forward`'s."""
    banded = banded and cfg.v41 is None  # the banded chain is V4's layers' long-prompt path
    ctx = causal_context(state.length, valid, band_block(cfg, tokens.shape[1]) if banded else 0)
    out = forward(params, cfg, state, tokens, ctx, capture=capture)
    return out, state_lib.commit(cfg, state, out.rows, ctx.positions, valid)


def mtp_forward(
    params: ModelParams,  # the target: its embedding and head
    mtp: MTPParams,
    cfg: ModelConfig,
    ring: state_lib.LayerState,  # the MTP block's committed window ring
    hidden: jax.Array,  # [B, T, hc, d] streams (target's, or the MTP's own when drafting deeper)
    next_tokens: jax.Array,  # [B, T] token at position i+1 for the step at position i
    ctx: AttentionContext,  # positions / committed are MTP positions (position i consumes token i+1)
) -> tuple[jax.Array, jax.Array, AttentionRows]:
    """One MTP step per new position: -> logits for position i+2 [B, T, V], MTP streams Z
    [B, T, hc, d] (fed back as `hidden` for the next draft step), window rows to commit."""
    u = mtp_inputs(mtp.inputs, cfg, hidden, params.embed[next_tokens])
    z, rows = block(mtp.block, cfg, "sliding", u, next_tokens, ring, ctx)
    return head_logits(params, cfg, z, mtp), z, rows


def check_logits_inputs(params: ModelParams, cfg: Any, tokens: Any) -> jax.Array:
    """`tokens` [B, S] as int32 after the checks of every all-positions logits call (one-line errors)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    check_params(params, cfg)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be a [B, S] int array with S >= 1, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    if tokens.shape[1] > cfg.max_position_embeddings:
        raise ValueError(
            f"tokens has {tokens.shape[1]} positions, longer than max_position_embeddings={cfg.max_position_embeddings}"
        )
    return tokens.astype(jnp.int32)


def one_shot_logits(params: ModelParams, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """One full causal forward of `tokens` [B, S] from an empty state, the whole prompt in one
    extend -> logits [B, S, V]: the reference the chunked `jaxspec.prefill_logits` equals."""
    return jitted_one_shot_logits(params, cfg, check_logits_inputs(params, cfg, tokens))


@functools.partial(bounded_jit, static_argnums=(1,))
def jitted_one_shot_logits(params: ModelParams, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """`one_shot_logits` without the input checks (tokens [B, S] int32), for cost analyses that lower it."""
    b, s = tokens.shape
    state = state_lib.init_state(cfg, b, s)
    out, _ = extend(params, cfg, state, tokens, jnp.ones((b, s), bool), banded=False)  # the dense reference
    return out.logits
