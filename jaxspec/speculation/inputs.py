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


def _check_max_new_tokens(max_new_tokens: Any, name: str = "max_new_tokens") -> None:
    positive_int(name, max_new_tokens)


MAX_STOP_IDS = 16  # stop token ids a request may name (a row's stop list is a static-width array)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's decoding options, checked when made (vLLM's SamplingParams): the value `generate`,
    `speculative_generate` and the server all take.

    temperature 0 is greedy; top_k None / top_p None are off; stop_token_ids end a sequence (the token is
    kept, as eos_id is); seed: the request's draws are a function of it (and of its own positions) only;
    None with temperature > 0 asks the caller for a key (`generate`'s rng=) or the server for a fresh seed.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        _check_max_new_tokens(self.max_tokens, "max_tokens")
        temperature, top_k, top_p = validate_sampling(self.temperature, self.top_k, self.top_p)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", top_k or None)
        object.__setattr__(self, "top_p", None if top_p >= 1.0 else top_p)
        stops = self.stop_token_ids
        if is_int(stops):
            stops = (stops,)
        if not isinstance(stops, (list, tuple)) or not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids holds {len(stops)} ids; at most {MAX_STOP_IDS}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")

    def key(self) -> jax.Array:
        """The request's typed key: key(low 32 bits of the seed) with the high bits folded in."""
        if self.seed is None:
            raise ValueError("this request has no seed")
        return jax.random.fold_in(jax.random.key(self.seed & 0xFFFFFFFF), self.seed >> 32)


def stop_array(stop_ids: tuple[int, ...], width: int = 1) -> np.ndarray:
    """[width] int32 stop ids, -1 padded (-1 never matches a token)."""
    out = np.full((max(width, len(stop_ids), 1),), -1, np.int32)
    out[: len(stop_ids)] = stop_ids
    return out


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """The decoding arguments `generate` and `speculative_generate` share, checked in one place."""

    max_new_tokens: int
    sampling: Sampling  # temperature (0 = greedy), top_k (0 = off), top_p (1 = off), base key
    stop_ids: tuple[int, ...]  # eos_id and any stop_token_ids; () = none
    mesh: jax.sharding.Mesh | None

    @property
    def stop(self) -> np.ndarray:
        return stop_array(self.stop_ids)

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
        params: SamplingParams | None = None,
    ) -> DecodeOptions:
        """ValueError naming the argument, the value and what is allowed, for anything wrong. `params`: a
        SamplingParams in place of max_new_tokens / temperature / top_k / top_p (its seed in place of rng,
        its stop_token_ids beside eos_id); passing both is an error."""
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if mesh is not None:
            check_mesh(mesh)
        if params is not None:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling must be a jaxspec SamplingParams, got {type(params).__name__}")
            if (max_new_tokens, temperature, top_k, top_p) != (128, 0.0, None, None):
                raise ValueError("pass either sampling=SamplingParams(...) or max_new_tokens / temperature / top_k / "
                                 "top_p, not both")
            if params.seed is not None and rng is not None:
                raise ValueError("pass either SamplingParams(seed=...) or rng=, not both")
            params.check_vocab(cfg.vocab_size)
            max_new_tokens, temperature = params.max_tokens, params.temperature
            top_k, top_p = params.top_k, params.top_p
            rng = params.key() if params.seed is not None else rng
            extra_stops = params.stop_token_ids
        else:
            extra_stops = ()
        _check_max_new_tokens(max_new_tokens)
        temperature, top_k, top_p = validate_sampling(temperature, top_k, top_p)
        if eos_id is None:
            stops = ()
        elif not is_int(eos_id) or not 0 <= eos_id < cfg.vocab_size:
            raise ValueError(f"eos_id must be None or an int in [0, {cfg.vocab_size}), got {eos_id!r}")
        else:
            stops = (int(eos_id),)
        stops += tuple(t for t in extra_stops if t not in stops)
        if rng is None:
            if temperature > 0:
                raise ValueError("sampling (temperature > 0) needs an explicit rng=jax.random.key(...) "
                                 "(or SamplingParams(seed=...))")
            rng = jax.random.key(0)
        elif not (isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)):
            raise ValueError("rng must be a typed key from jax.random.key(seed)")
        sampling = Sampling(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p), rng)
        return cls(max_new_tokens=int(max_new_tokens), sampling=sampling, stop_ids=stops, mesh=mesh)
