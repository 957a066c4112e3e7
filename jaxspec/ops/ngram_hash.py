"""Engram's n-gram hash (DeepSeek-V4.1; docs/v41.md, "Engram"): which table rows a token reads.

At Engram layer l a token at position t with tokenizer-normalized ids c_t, c_{t-1}, ... reads, for
each n-gram size n = 2 .. N and head h, row

    (XOR_{k<n} c_{t-k} * M_l[k])  mod  P_l[n][h]  +  offset_l[(n-2) * H + h]

where ids before the sequence start are the pad token's class, the multipliers M_l are odd 63-bit
numbers drawn from numpy's PCG64 seeded 10007 * l (bounded so that c * M never overflows int64), and
the P are distinct primes: for each layer and n, the first H unused primes above the Engram vocab
size. The products and XORs need exact 64-bit integers, which JAX only has with x64 on; here they
are carried as eight 8-bit limbs in uint32 lanes (every partial sum stays below 2^19) and reduced
modulo P by Horner's rule over the limbs (P < 2^24, so r * 256 + limb < 2^32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import V41Layout

_LIMBS = 8  # bytes of a 64-bit product
_TOKEN_LIMBS = 3  # bytes of a compressed id (< 2^24, checked by the config)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


@dataclasses.dataclass(frozen=True)
class NgramTables:
    """The static constants of the hash for every Engram layer (`ngram_tables`)."""

    primes: tuple[tuple[int, ...], ...]  # per Engram layer: the (N-1)*H bucket primes, column order
    offsets: tuple[tuple[int, ...], ...]  # per Engram layer: exclusive cumsum of its primes
    multipliers: tuple[tuple[int, ...], ...]  # per Engram layer: N odd multipliers (k = 0 .. N-1)


@functools.lru_cache(maxsize=8)
def ngram_tables(layout: V41Layout) -> NgramTables:
    """Primes, offsets and multipliers of `layout`'s Engram layers; ValueError if the table sizes in
    the config are not the prime sums (rows would be read out of range)."""
    n_max, heads = layout.engram_max_ngram, layout.engram_n_heads
    seen: set[int] = set()
    primes = []
    for _ in layout.engram_layers:
        row = []
        for _ in range(n_max - 1):
            current = layout.engram_vocab_size - 1
            for _ in range(heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                row.append(current)
        primes.append(tuple(row))
    if any(p >= 1 << 24 for row in primes for p in row):
        raise ValueError("Engram bucket primes must stay below 2^24 (engram_vocab_size too large)")
    sums = tuple(sum(row) for row in primes)
    if sums != tuple(layout.engram_num_embeddings):
        raise ValueError(f"engram_num_embeddings must be the sums of the bucket primes {sums}, "
                         f"got {tuple(layout.engram_num_embeddings)}")
    bound = max(1, (np.iinfo(np.int64).max // layout.engram_compressed_vocab) // 2)
    multipliers = tuple(
        tuple(int(m) * 2 + 1 for m in np.random.default_rng(10007 * layer).integers(0, bound, n_max, dtype=np.int64))
        for layer in layout.engram_layers
    )
    offsets = tuple(tuple(int(x) for x in np.cumsum((0, *row[:-1]))) for row in primes)
    return NgramTables(primes=tuple(primes), offsets=offsets, multipliers=multipliers)


def _product_limbs(tokens: jax.Array, multiplier: int) -> list[jax.Array]:
    """tokens [...] uint32 (< 2^24) times a 63-bit constant -> its 8 bytes, least significant first."""
    t = [(tokens >> (8 * i)) & 0xFF for i in range(_TOKEN_LIMBS)]
    m = [(multiplier >> (8 * j)) & 0xFF for j in range(_LIMBS)]
    out, carry = [], jnp.zeros_like(tokens)
    for c in range(_LIMBS):
        col = carry
        for i in range(min(c + 1, _TOKEN_LIMBS)):
            if m[c - i]:
                col = col + t[i] * jnp.uint32(m[c - i])
        out.append(col & 0xFF)
        carry = col >> 8
    return out  # the product is < 2^63 by the multipliers' bound: nothing is carried out


def hash_rows(
    tables: NgramTables,
    layer: int,  # index into the Engram layers (not the layer id)
    ngram_ids: jax.Array,  # [..., N] int32 compressed ids c_t, c_{t-1}, ..., c_{t-N+1} (pads filled in)
) -> jax.Array:
    """-> [..., (N-1)*H] int32 table rows of the layer's n-grams, in column order."""
    n_max = ngram_ids.shape[-1]
    primes, offsets, mults = tables.primes[layer], tables.offsets[layer], tables.multipliers[layer]
    heads = len(primes) // (n_max - 1)
    ids = ngram_ids.astype(jnp.uint32)
    rolling = _product_limbs(ids[..., 0], mults[0])
    cols = []
    for n in range(2, n_max + 1):
        rolling = [a ^ b for a, b in zip(rolling, _product_limbs(ids[..., n - 1], mults[n - 1]), strict=True)]
        for h in range(heads):
            c = (n - 2) * heads + h
            p = jnp.uint32(primes[c])
            r = jnp.zeros_like(rolling[0])
            for limb in reversed(rolling):
                r = (r * jnp.uint32(256) + limb) % p
            cols.append(r.astype(jnp.int32) + jnp.int32(offsets[c]))
    return jnp.stack(cols, axis=-1)
