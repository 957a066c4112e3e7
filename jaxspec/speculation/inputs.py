"""What the decoding entry points take in, checked once: prompts (ragged lists or an int array,
bucketed so a steady workload compiles once) and the decoding options both loops share."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.checks import is_int, next_power_of_two, positive_int
from jaxspec.core.config import ModelConfig
from jaxspec.model.sampling import Sampling, validate_sampling
from jaxspec.sharding.rules import check_mesh

MAX_BATCH_BUCKET = 64


def batch_bucket(batch: int) -> int:
    if batch <= MAX_BATCH_BUCKET:
        return next_power_of_two(batch)
    return -(-batch // MAX_BATCH_BUCKET) * MAX_BATCH_BUCKET


def length_bucket(length: int, limit: int, minimum: int = 16) -> int:
    return min(max(next_power_of_two(length), minimum), limit)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    tokens: np.ndarray  # [Bb, Sb] int32, left-aligned, zero padded
    lengths: np.ndarray  # [Bb] int32 (bucket padding rows have length 1)
    batch: int  # real batch size B


def prepare_prompts(
    cfg: ModelConfig, prompts: Any, max_new_tokens: int, prompt_lengths: Any = None, overshoot: int = 0
) -> PromptBatch:
    """Validate prompts (ragged lists, or an int array with optional lengths) and bucket them.

    The width bucket comes from the longest list prompt, or from an array's width: a caller that
    pads its prompts to one width gets one compiled program for every batch of them. `overshoot`: the
    slots past max_new_tokens a speculative cycle may write (S + 1), which must fit too.
    """
    _check_max_new_tokens(max_new_tokens)
    if isinstance(prompts, (np.ndarray, jax.Array)):
        array = np.asarray(prompts)
        if array.ndim != 2:
            raise ValueError(f"a prompt array must be [B, S], got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"prompt tokens must be integers, got dtype {array.dtype}")
        if prompt_lengths is None:
            lengths = np.full((array.shape[0],), array.shape[1], np.int64)
        else:
            lengths = np.asarray(prompt_lengths)
            if lengths.shape != (array.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
                raise ValueError(f"prompt_lengths must be [B={array.shape[0]}] ints, got {lengths!r}")
            if np.any(lengths > array.shape[1]):
                raise ValueError(f"prompt_lengths exceed the array width {array.shape[1]}: {lengths.tolist()}")
        rows = [array[i, : int(lengths[i])] for i in range(array.shape[0])]
        width = array.shape[1]
    elif isinstance(prompts, (list, tuple)):
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is only for array prompts; lists carry their own lengths")
        rows = []
        for i, p in enumerate(prompts):
            if not isinstance(p, (list, tuple, np.ndarray)):
                raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
            arr = np.asarray(p)
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompt {i} must hold integer token ids, got dtype {arr.dtype}")
            rows.append(arr.astype(np.int64).reshape(-1))
        width = max((r.size for r in rows), default=0)
    else:
        kind = type(prompts).__name__
        raise ValueError(f"prompts must be a list of token-id lists or a [B, S] int array, got {kind}")
    if not rows:
        raise ValueError("prompts is empty: need at least one prompt")
    for i, r in enumerate(rows):
        if r.size == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if r.min() < 0 or r.max() >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={cfg.vocab_size})")
        if r.size + max_new_tokens + overshoot > cfg.max_position_embeddings:
            spare = f" + {overshoot} slots a speculative cycle may write past the end" if overshoot else ""
            raise ValueError(
                f"prompt {i}: {r.size} prompt tokens + max_new_tokens={max_new_tokens}{spare} exceeds the model's "
                f"max length {cfg.max_position_embeddings}"
            )
    batch = len(rows)
    bb = batch_bucket(batch)
    sb = length_bucket(width, cfg.max_position_embeddings)
    tokens = np.zeros((bb, sb), np.int32)
    lengths = np.ones((bb,), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : r.size] = r
        lengths[i] = r.size
    return PromptBatch(tokens=tokens, lengths=lengths, batch=batch)


def _check_max_new_tokens(max_new_tokens: Any) -> None:
    positive_int("max_new_tokens", max_new_tokens)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """The decoding arguments `generate` and `speculative_generate` share, checked in one place."""

    max_new_tokens: int
    sampling: Sampling  # temperature (0 = greedy), top_k (0 = off), top_p (1 = off), base key
    eos_id: int  # -1 = none
    mesh: jax.sharding.Mesh | None

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        rng: jax.Array | None = None,
        mesh: Any = None,
    ) -> DecodeOptions:
        """ValueError naming the argument, the value and what is allowed, for anything wrong."""
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if mesh is not None:
            check_mesh(mesh)
        _check_max_new_tokens(max_new_tokens)
        temperature, top_k, top_p = validate_sampling(temperature, top_k, top_p)
        if eos_id is None:
            eos = -1
        elif not is_int(eos_id) or not 0 <= eos_id < cfg.vocab_size:
            raise ValueError(f"eos_id must be None or an int in [0, {cfg.vocab_size}), got {eos_id!r}")
        else:
            eos = int(eos_id)
        if rng is None:
            if temperature > 0:
                raise ValueError("sampling (temperature > 0) needs an explicit rng=jax.random.key(...)")
            rng = jax.random.key(0)
        elif not (isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)):
            raise ValueError("rng must be a typed key from jax.random.key(seed)")
        sampling = Sampling(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p), rng)
        return cls(max_new_tokens=int(max_new_tokens), sampling=sampling, eos_id=eos, mesh=mesh)
