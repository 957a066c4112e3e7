"""Chunked prefill: a prompt goes through `model.extend` a fixed-size chunk at a time (docs/prefill.md).

One `extend` over the whole prompt lets every layer attend over all T prompt positions ([T, T]
logits per head): time and memory grow quadratically. Each chunk instead attends to what a decode
step reads -- the committed window ring, the compressed caches (sized by the state's max_len / ratio)
and the chunk's own rows -- so a prompt costs a while-loop of identical chunk programs. The chunk
size is static; the number of chunks is a traced loop bound, so prompts of any length in one width
bucket share one compiled program.

Exactness across chunk boundaries comes from the position-addressed state (jaxspec/model/state.py): a
compressed block that straddles two chunks pools its committed rows from the compressor ring and its
new rows from the chunk (`ops.pooling.source_indices`); CSA's overlapping windows read the previous
block's rows the same way; a chunk longer than the window ring sees its own earlier rows as new keys.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.checks import is_power_of_two, next_power_of_two
from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model import state as state_lib
from jaxspec.model.network import ForwardOutput, ModelParams, check_logits_inputs, extend
from jaxspec.sharding.active import constrain_state

MIN_DEFAULT_CHUNK, MAX_DEFAULT_CHUNK = 256, 2048


def check_chunk(chunk: Any) -> int:
    """The chunk size as an int; ValueError unless it is a power of two >= 1."""
    if not is_power_of_two(chunk):
        raise ValueError(f"prefill chunk must be a power of two >= 1, got {chunk!r}")
    return int(chunk)


def prefill_chunk(cfg: ModelConfig) -> int:
    """Tokens per prefill chunk: `cfg.prefill_chunk` when set, else 4x the sliding window rounded up
    to a power of two and clamped to [256, 2048] (tiny: 256, V4-Flash / Pro: 512). Per token a chunk
    reads the window ring, up to two query blocks of the chunk (`layers.banded`, linear in C) and
    the compressed entries; 4W is long enough to amortise the loop step and to take the banded path
    (more than two blocks of max(W, 64) rows) on V4's window of 128."""
    if cfg.prefill_chunk:
        return check_chunk(cfg.prefill_chunk)
    want = next_power_of_two(4 * cfg.sliding_window)
    return min(max(want, MIN_DEFAULT_CHUNK), MAX_DEFAULT_CHUNK)


def effective_chunk(cfg: ModelConfig, width: int, chunk: int | None = None) -> int:
    """The chunk a prompt of `width` tokens runs with: never longer than the width's power of two
    (a 16-token prompt is not padded to 256)."""
    chunk = prefill_chunk(cfg) if chunk is None else check_chunk(chunk)
    return min(chunk, next_power_of_two(width))


@struct.dataclass
class PrefillOutput:
    last_logits: jax.Array  # [B, V] fp32 logits at each row's last prompt token
    logits: jax.Array | None = None  # [B, S, V] fp32 every position (all_logits=True only)
    followed: Any = None  # what `follow` made of the chunks (a draft's state), when given


# follow(carry, out, tokens [B, C], positions [B, C], valid [B, C]) -> carry, after every chunk: a draft
# model's state follows the prompt's committed rows as they are made (speculation/drafter.py).
Follow = Callable[[Any, ForwardOutput, jax.Array, jax.Array, jax.Array], Any]


def chunked_prefill(
    params: ModelParams,
    cfg: ModelConfig,
    state: state_lib.DecodeState,
    tokens: jax.Array,  # [B, S] int32, left-aligned, zero padded
    lengths: jax.Array,  # [B] int32 prompt tokens per row, >= 1
    *,
    chunk: int | None = None,
    all_logits: bool = False,
    banded: bool = True,
    capture: tuple[int, ...] = (),
    follow: tuple[Follow, Any] | None = None,
) -> tuple[PrefillOutput, state_lib.DecodeState]:
    """Append each row's prompt to `state` chunk by chunk (traceable; call it inside a jit).

    all_logits: keep the logits of every position ([B, S, V]). follow: (function, initial carry), called
    after each chunk with what it committed (a draft's state following the prompt, `PrefillOutput.followed`);
    capture: the target layers whose hyper-connection means the follower reads (`forward`).
    banded: a chunk longer than two query blocks reads its own keys block by block (`layers.banded`,
    linear in the chunk); False: the dense [chunk, chunk] reference.
    """
    b, s = tokens.shape
    if s > state.max_len:
        raise ValueError(f"the prompt width {s} is longer than the state can hold (max_len={state.max_len})")
    c = effective_chunk(cfg, s, chunk)
    num_slots = -(-s // c)
    padded = jnp.pad(tokens, ((0, 0), (0, num_slots * c - s)))
    num_chunks = (jnp.max(lengths) + c - 1) // c  # traced: the loop bound, not the program
    batch_index = jnp.arange(b)
    index = jnp.arange(c, dtype=jnp.int32)
    out0 = PrefillOutput(
        last_logits=jnp.zeros((b, cfg.vocab_size), jnp.float32),
        logits=jnp.zeros((b, num_slots * c, cfg.vocab_size), jnp.float32) if all_logits else None,
        followed=None if follow is None else follow[1],
    )

    def body(carry):
        step, state, acc = carry
        start = step * c
        chunk_tokens = jax.lax.dynamic_slice_in_dim(padded, start, c, axis=1)  # [B, C]
        valid = (start + index)[None, :] < lengths[:, None]
        positions = state.length[:, None] + index[None, :]
        out, state = extend(params, cfg, state, chunk_tokens, valid, banded=banded, capture=capture)
        last = lengths - 1 - start  # [B] index of the row's last prompt token in this chunk
        here = (last >= 0) & (last < c)
        at = jnp.clip(last, 0, c - 1)
        acc = acc.replace(last_logits=jnp.where(here[:, None], out.logits[batch_index, at], acc.last_logits))
        if all_logits:
            acc = acc.replace(logits=jax.lax.dynamic_update_slice_in_dim(acc.logits, out.logits, start, axis=1))
        if follow is not None:
            acc = acc.replace(followed=follow[0](acc.followed, out, chunk_tokens, positions, valid))
        return step + 1, constrain_state(state), acc

    _, state, acc = jax.lax.while_loop(lambda carry: carry[0] < num_chunks, body, (jnp.int32(0), state, out0))
    if all_logits:
        acc = acc.replace(logits=acc.logits[:, :s])
    return acc, state


def chunked_logits(params: ModelParams, cfg: ModelConfig, tokens: Any, chunk: int | None = None) -> jax.Array:
    """Causal logits of every position of `tokens` [B, S] from an empty state, chunked -> [B, S, V]
    (`model.one_shot_logits` is the one-shot reference it equals)."""
    tokens = check_logits_inputs(params, cfg, tokens)
    chunk = prefill_chunk(cfg) if chunk is None else check_chunk(chunk)
    return jitted_chunked_logits(params, cfg.replace(prefill_chunk=chunk), tokens)


@functools.partial(bounded_jit, static_argnums=(1,))
def jitted_chunked_logits(params: ModelParams, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """`chunked_logits` without the input checks (tokens [B, S] int32; the chunk is cfg's): the
    program the sharded runner places on a mesh."""
    b, s = tokens.shape
    state = constrain_state(state_lib.init_state(cfg, b, s))
    lengths = jnp.full((b,), s, jnp.int32)
    out, _ = chunked_prefill(params, cfg, state, tokens, lengths, all_logits=True)
    return out.logits


@functools.partial(bounded_jit, static_argnums=(1,), donate_argnums=(2,))
def prefill_program(
    params: ModelParams,
    cfg: ModelConfig,
    state: state_lib.DecodeState,  # fresh, donated: the prefill writes it in place
    tokens: jax.Array,  # [B, S] int32
    lengths: jax.Array,  # [B] int32
) -> tuple[jax.Array, state_lib.DecodeState]:
    """The target prefill alone (no MTP, last logits only), the state donated: what benchmarks time."""
    out, state = chunked_prefill(params, cfg, state, tokens, lengths)
    return out.last_logits, state
