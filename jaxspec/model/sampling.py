"""Token sampling shared by `generate` and speculative verification.

Sampling settings are traced values (temperature 0 = greedy, top_k 0 = off, top_p 1 = off), so one
compiled program serves every setting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.checks import is_int
from jaxspec.sharding.active import global_rows


@struct.dataclass
class Sampling:
    """Sampling settings as traced values, plus the base key every draw is folded from."""

    temperature: jax.Array  # [] float32, 0 = greedy
    top_k: jax.Array  # [] int32, 0 = off
    top_p: jax.Array  # [] float32, 1 = off
    key: jax.Array  # [] typed PRNG key

    @classmethod
    def create(cls, temperature=0.0, top_k=None, top_p=None, key=None) -> Sampling:
        """From user arguments (validated as by `validate_sampling`); key defaults to key(0)."""
        temperature, top_k, top_p = validate_sampling(temperature, top_k, top_p)
        key = jax.random.key(0) if key is None else key
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p), key)


def validate_sampling(temperature, top_k, top_p) -> tuple[float, int, float]:
    """Check user sampling arguments; -> (temperature, top_k (0 = off), top_p (1.0 = off))."""
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}") from None
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is None:
        top_k = 0
    elif not is_int(top_k) or top_k < 1:
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is None:
        top_p = 1.0
    else:
        try:
            top_p = float(top_p)
        except (TypeError, ValueError):
            raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}") from None
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return temperature, top_k, top_p


def processed_logprobs(
    logits: jax.Array,  # [..., V]
    temperature: jax.Array,  # [] float, > 0
    top_k: jax.Array,  # [] int, 0 = off
    top_p: jax.Array,  # [] float, 1 = off
) -> jax.Array:
    """Log-probabilities of the distribution actually sampled from (temperature, top-k, top-p).

    The truncation runs only when top-k or top-p is on (a `lax.cond` on the traced settings): its
    vocabulary sort is the most expensive op of a sampled batch-1 cycle on a CPU, and with both off
    it would keep every token anyway."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    truncates = (top_k > 0) | (top_p < 1.0)
    scaled = jax.lax.cond(truncates, _truncated, lambda s, k, p: s, scaled, top_k, top_p)
    return jax.nn.log_softmax(scaled, axis=-1)


def _truncated(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:  # scaled: [..., V]
    """Top-k, then top-p over what top-k left; the tokens cut are -inf.

    top-k keeps every token at least as likely as the k-th (ties with it included), and top-p's mass
    is taken over exactly those tokens; top-p keeps the smallest prefix of them, in descending order,
    whose mass reaches top_p, plus every token tied with the last one kept. top_p = 1 cuts nothing
    (a float32 cumulative mass may round to 1 before the tail)."""
    vocab = scaled.shape[-1]
    descending = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take(descending, k - 1, axis=-1)[..., None]
    # top-p over what top-k kept: by value, so tokens tied with the k-th (sorted past k) count too.
    kept_by_k = jnp.where(descending >= kth, descending, -jnp.inf)
    sorted_probs = jax.nn.softmax(kept_by_k, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
    # the smallest kept logit is the cut-off value (never below the k-th: kept_by_k is -inf past it)
    cutoff = jnp.min(jnp.where(keep_sorted, kept_by_k, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled < jnp.maximum(cutoff, kth), -jnp.inf, scaled)


def sample_tokens(
    logits: jax.Array,  # [B, V]
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """-> [B] int32: argmax when temperature == 0, else a draw from `processed_logprobs`.

    Row r draws with fold_in(key, global row r), so a sequence's draws do not depend on how the
    batch is split over devices (or padded into a bucket).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(global_rows(logits.shape[0]))
    logp = processed_logprobs(logits, temperature, top_k, top_p)
    drawn = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(row_keys, logp)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


def gumbel_choice(
    logits: jax.Array,  # [..., V]
    keys: jax.Array,  # [...] typed keys, one per distribution
    sampling: Sampling,
) -> jax.Array:
    """-> [...] int32: per row, argmax of the raw logits when temperature == 0, else the Gumbel-max
    draw argmax(processed_logprobs + Gumbel(key)), an exact sample from `processed_logprobs`."""
    vocab = logits.shape[-1]

    def draw():
        flat = keys.reshape(-1)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(flat).reshape(logits.shape)
        logp = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return jnp.argmax(logp + noise, axis=-1).astype(jnp.int32)

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    # A cond, not a select: greedy runs skip the vocab sort and the noise entirely.
    return jax.lax.cond(sampling.temperature > 0, draw, greedy)


def node_keys(
    key: jax.Array,  # [] typed key
    cycle: jax.Array,  # [B] int32 per-sequence cycle counter
    num_nodes: int,
) -> jax.Array:
    """-> [B, N] independent keys of a speculative cycle's nodes: fold(fold(fold(key, cycle + 1), row), node).

    fold_in(key, 0) is left to the first token (sampled from the prefill, as `generate` does).
    Folding in the global row makes a sequence's draws independent of the batch bucket it lands
    in and of how the batch is split over devices.
    """
    rows = global_rows(cycle.shape[0])
    nodes = jnp.arange(num_nodes, dtype=jnp.int32)

    def per_row(c, r):
        k = jax.random.fold_in(jax.random.fold_in(key, c + 1), r)
        return jax.vmap(lambda i: jax.random.fold_in(k, i))(nodes)

    return jax.vmap(per_row)(cycle.astype(jnp.int32), rows)
