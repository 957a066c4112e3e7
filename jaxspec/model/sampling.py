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
    """Sampling settings as traced values, plus the key every draw is folded from.

    Either one setting for the batch (every field []: each row folds its global row into the key) or one
    per row (every field [B]: a row's own settings and key, as a server's slots hold them, so a row's
    draws depend on its own key and counters only, never on its slot or on who shares the batch)."""

    temperature: jax.Array  # [] or [B] float32, 0 = greedy
    top_k: jax.Array  # [] or [B] int32, 0 = off
    top_p: jax.Array  # [] or [B] float32, 1 = off
    key: jax.Array  # [] or [B] typed PRNG key

    @property
    def per_row(self) -> bool:
        return self.key.ndim == 1

    @property
    def sampled_rows(self) -> jax.Array:
        """[] or [B] bool: which rows sample (temperature > 0)."""
        return self.temperature > 0

    @property
    def any_sampled(self) -> jax.Array:
        """[] bool: whether any row samples (a cond's predicate: greedy-only batches skip the sampling work)."""
        return jnp.any(self.temperature > 0)

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


def by_row(x: jax.Array, ndim: int) -> jax.Array:
    """A per-row setting ([B]) shaped to broadcast against an array of `ndim` axes whose first is B; a
    batch setting ([]) as it is."""
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (ndim - x.ndim))


def select_rows(rows: jax.Array, a, b):
    """Per leaf of two same-shaped pytrees of [B, ...] arrays: a's rows where `rows` ([] or [B] bool), else b's."""
    return jax.tree.map(lambda x, y: jnp.where(by_row(rows, x.ndim), x, y), a, b)


def fold(key: jax.Array, data) -> jax.Array:
    """fold_in for a batch key ([]; data []) or per-row keys ([B]; data [] or [B])."""
    if key.ndim == 0:
        return jax.random.fold_in(key, data)
    data = jnp.broadcast_to(jnp.asarray(data, jnp.uint32), key.shape)
    return jax.vmap(jax.random.fold_in)(key, data)


def processed_logprobs(
    logits: jax.Array,  # [..., V] (with per-row settings: [B, ..., V])
    temperature: jax.Array,  # [] or [B] float, > 0
    top_k: jax.Array,  # [] or [B] int, 0 = off
    top_p: jax.Array,  # [] or [B] float, 1 = off
) -> jax.Array:
    """Log-probabilities of the distribution actually sampled from (temperature, top-k, top-p).

    The truncation runs only when some row's top-k or top-p is on (a `lax.cond` on the traced settings):
    its vocabulary sort is the most expensive op of a sampled batch-1 cycle on a CPU, and with both off
    it would keep every token anyway (a row with both off keeps every token inside it too)."""
    temperature, top_k, top_p = (by_row(x, logits.ndim) for x in (temperature, top_k, top_p))
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    truncates = jnp.any((top_k > 0) | (top_p < 1.0))
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
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [] or [B, 1, ..., 1]
    kth = jnp.take_along_axis(descending, jnp.broadcast_to(k - 1, descending.shape[:-1] + (1,)), axis=-1)
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
    key: jax.Array,  # [] or [B]
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """-> [B] int32: argmax where temperature == 0, else a draw from `processed_logprobs`.

    With a batch key row r draws with fold_in(key, global row r), so a sequence's draws do not depend on
    how the batch is split over devices (or padded into a bucket); per-row keys are the rows' own.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    row_keys = key if key.ndim == 1 else jax.vmap(lambda r: jax.random.fold_in(key, r))(global_rows(logits.shape[0]))
    logp = processed_logprobs(logits, temperature, top_k, top_p)
    drawn = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(row_keys, logp)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


def gumbel_choice(
    logits: jax.Array,  # [B, ..., V]
    keys: jax.Array,  # [B, ...] typed keys, one per distribution
    sampling: Sampling,
) -> jax.Array:
    """-> [B, ...] int32: per row, argmax of the raw logits when temperature == 0, else the Gumbel-max
    draw argmax(processed_logprobs + Gumbel(key)), an exact sample from `processed_logprobs`."""
    vocab = logits.shape[-1]

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        flat = keys.reshape(-1)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(flat).reshape(logits.shape)
        logp = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return select_rows(sampling.sampled_rows, jnp.argmax(logp + noise, axis=-1).astype(jnp.int32), greedy())

    # A cond, not a select: greedy runs skip the vocab sort and the noise entirely.
    return jax.lax.cond(sampling.any_sampled, draw, greedy)


def node_keys(
    key: jax.Array,  # [] typed key, or [B] per-row keys
    cycle: jax.Array,  # [B] int32 per-sequence cycle counter
    num_nodes: int,
) -> jax.Array:
    """-> [B, N] independent keys of a speculative cycle's nodes: fold(fold(fold(key, cycle + 1), row), node)
    with a batch key, fold(fold(key_row, cycle + 1), node) with per-row keys.

    fold_in(key, 0) is left to the first token (sampled from the prefill, as `generate` does).
    Folding in the global row makes a sequence's draws independent of the batch bucket it lands
    in and of how the batch is split over devices; a per-row key is that row's already.
    """
    nodes = jnp.arange(num_nodes, dtype=jnp.int32)

    def per_node(k):
        return jax.vmap(lambda i: jax.random.fold_in(k, i))(nodes)

    if key.ndim == 1:
        return jax.vmap(lambda k, c: per_node(jax.random.fold_in(k, c + 1)))(key, cycle.astype(jnp.int32))
    rows = global_rows(cycle.shape[0])
    return jax.vmap(lambda c, r: per_node(jax.random.fold_in(jax.random.fold_in(key, c + 1), r)))(
        cycle.astype(jnp.int32), rows)
