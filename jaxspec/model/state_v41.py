"""DeepSeek-V4.1's decode state (docs/v41.md): what a committed prefix leaves behind.

Every layer keeps its window ring (slot = pos mod W). A kv source also keeps its group's pool (entry
j = tokens r*j .. r*j+r-1, FP4-rounded and RoPE'd), one index key per entry, and at ratio 2 the fp32
compressor rows of the last two positions (a half-full group waits there for its second token). The
layers that reuse the pool keep nothing more. Engram keeps the compressed ids of the last N-1 tokens
(slot = pos mod N-1), so an n-gram reaches back across chunk and prompt boundaries. As in V4, nothing
is rolled back: `commit` writes only the tokens a caller takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.layers.attention import AttentionRows
from jaxspec.model.rings import write_entries, write_ring
from jaxspec.sharding.rules import axes


@struct.dataclass
class V41LayerState:
    swa_kv: jax.Array = axes("batch", "window", "kv")  # [B, W, c]
    comp_kv: jax.Array | None = axes("batch", "entries", "kv", default=None)  # [B, Lc, c] the pool (owners)
    idx_kv: jax.Array | None = axes("batch", "entries", "index_kv", default=None)  # [B, Lc, c_I] index keys
    comp_rows_kv: jax.Array | None = axes("batch", "rows", "kv", default=None)  # [B, 2, c] fp32 (ratio-2 owners)
    comp_rows_gate: jax.Array | None = axes("batch", "rows", "kv", default=None)  # [B, 2, c] fp32


@struct.dataclass
class V41State:
    layers: tuple[V41LayerState, ...]
    ngram_ids: jax.Array | None = axes("batch", None)  # [B, N-1] int32 compressed ids, slot = pos mod N-1
    length: jax.Array = axes("batch")  # [B] int32 committed tokens per sequence
    max_len: int = struct.field(pytree_node=False, default=0)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]


def init_v41_state(cfg: ModelConfig, batch: int, max_len: int) -> V41State:
    v = cfg.v41
    dtype = jnp.dtype(cfg.dtype)
    c, ci = cfg.head_dim, cfg.index_head_dim
    layers = []
    for i, ratio in enumerate(v.ratios):
        layer = V41LayerState(swa_kv=jnp.zeros((batch, cfg.sliding_window, c), dtype))
        if i in v.kv_sources:
            entries = -(-max_len // ratio)
            layer = layer.replace(comp_kv=jnp.zeros((batch, entries, c), dtype),
                                  idx_kv=jnp.zeros((batch, entries, ci), dtype))
            if ratio == 2:
                layer = layer.replace(comp_rows_kv=jnp.zeros((batch, 2, c), jnp.float32),
                                      comp_rows_gate=jnp.zeros((batch, 2, c), jnp.float32))
        layers.append(layer)
    ngram = jnp.zeros((batch, v.engram_max_ngram - 1), jnp.int32) if v.engram_layers else None
    return V41State(layers=tuple(layers), ngram_ids=ngram, length=jnp.zeros((batch,), jnp.int32), max_len=max_len)


@struct.dataclass
class V41Rows:
    """A forward's rows for `commit`: per layer, and the compressed ids the new tokens carry."""

    layers: tuple[AttentionRows, ...]
    ngram_ids: jax.Array | None  # [B, T] int32


def commit_v41_state(
    cfg: ModelConfig,
    state: V41State,
    rows: V41Rows,
    positions: jax.Array,  # [B, T]
    take: jax.Array,  # [B, T] bool: tokens to commit (their positions must be P, P+1, ...)
) -> V41State:
    v = cfg.v41
    new_length = state.length + jnp.sum(take, axis=1).astype(jnp.int32)
    layers = []
    for i, (layer, r) in enumerate(zip(state.layers, rows.layers, strict=True)):
        layer = layer.replace(swa_kv=write_ring(layer.swa_kv, r.kv, positions, take, new_length))
        if i in v.kv_sources:
            ratio = v.ratios[i]
            layer = layer.replace(comp_kv=write_entries(layer.comp_kv, r.comp_entry, positions, take, ratio),
                                  idx_kv=write_entries(layer.idx_kv, r.idx_entry, positions, take, ratio))
            if ratio == 2:
                layer = layer.replace(
                    comp_rows_kv=write_ring(layer.comp_rows_kv, r.comp_kv, positions, take, new_length),
                    comp_rows_gate=write_ring(layer.comp_rows_gate, r.comp_gate, positions, take, new_length))
        layers.append(layer)
    ngram = state.ngram_ids
    if ngram is not None:
        ngram = write_ring(ngram, rows.ngram_ids, positions, take, new_length)
    return state.replace(layers=tuple(layers), ngram_ids=ngram, length=new_length)
