"""Where a drafter's greedy cycles start: the anchors decoding gives a DSpark drafter, read off the
target's greedy continuations by teacher-forced blocks (no decoding), and a cache that samples them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model.dspark import DSparkParams
from jaxspec.model.network import ModelParams
from jaxspec.training.dspark import Blocks, Cache, block_forward, greedy_match, to_blocks


@functools.partial(bounded_jit, static_argnums=(2, 3))
def accepted_drafts(params: DSparkParams, target: ModelParams, cfg: ModelConfig, dcfg: DSparkConfig,
                    blocks: Blocks) -> jax.Array:
    """[N] int32: how many of each block's drafts a greedy chain accepts (its teacher-forced argmaxes
    equal the labels, up to the first miss): on the target's greedy continuations, what decoding does."""
    g = dcfg.block_size
    logits, _ = block_forward(params, target, cfg, dcfg, blocks.window, blocks.anchor_pos, blocks.tokens[:, :g])
    match = greedy_match(jnp.argmax(logits, axis=-1), blocks)
    return jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)


def decoding_anchors(params: DSparkParams, target: ModelParams, cfg: ModelConfig, dcfg: DSparkConfig, cache: Cache,
                     depth: int, batch: int = 256, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """The anchor rows where greedy decoding with a chain of `depth` tokens a cycle (depth - 1 drafts of
    `params`) starts its cycles, on `cache`'s sequences (which must be the target's greedy
    continuations, so that a teacher-forced block is the decoding cycle): the first response token,
    then after each cycle's accepted drafts and the target's bonus token. These are the positions right
    after the draft got a token wrong (or ran out of depth), harder text than uniform anchors.
    -> sorted anchor rows [A'] int64."""
    if not 2 <= depth <= dcfg.block_size:
        raise ValueError(f"a chain of depth {depth} needs 2 <= depth <= the block size {dcfg.block_size}")
    # each sequence's anchors are consecutive rows: its first and last
    first = np.full(int(cache.seq.max()) + 1, np.iinfo(np.int64).max, np.int64)
    last = np.full_like(first, -1)
    seq_of = cache.seq[cache.anchors]
    np.minimum.at(first, seq_of, cache.anchors)
    np.maximum.at(last, seq_of, cache.anchors)
    have = last >= 0
    frontier, limit = first[have], last[have]
    visited = []
    total = len(cache.anchors)  # an upper bound for the progress bar: every anchor once
    while len(frontier):
        visited.append(frontier)
        accepted = np.concatenate([
            np.asarray(jax.device_get(accepted_drafts(params, target, cfg, dcfg, to_blocks(host))))[:n]
            for n, host in cache.batches(frontier, batch, cfg.sliding_window, dcfg.block_size)])
        frontier = frontier + np.minimum(accepted, depth - 1) + 1
        keep = frontier <= limit
        frontier, limit = frontier[keep], limit[keep]
        if progress is not None:
            progress(sum(map(len, visited)), total)
    rows = np.sort(np.concatenate(visited))
    if progress is not None:
        progress(len(rows), len(rows))
    return rows


def with_anchors(cache: Cache, extra: np.ndarray, share: float) -> Cache:
    """`cache` whose sampled anchors are `extra` rows with probability ~`share` and uniform over every
    anchor otherwise (share 1: `extra` only), by repeating rows: `sample_anchors` stays uniform."""
    if not 0 < share <= 1 or len(extra) == 0:
        raise ValueError(f"need a share in (0, 1] and some anchors, got {share} and {len(extra)} rows")
    if share == 1:
        return dataclasses.replace(cache, anchors=np.asarray(extra, np.int64))
    reps = max(1, round(share / (1 - share) * len(cache.anchors) / len(extra)))
    return dataclasses.replace(cache, anchors=np.concatenate([cache.anchors, np.tile(extra, reps)]).astype(np.int64))
