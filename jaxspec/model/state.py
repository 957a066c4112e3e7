"""Decode state: static-shape pytrees addressed by absolute position (docs/architecture.md §7).

Per layer: the sliding-window ring (slot = pos mod W), and on compressed layers the compressor's
fp32 rows (slot = pos mod coff*ratio: exactly the history a block closed later still needs), the
compressed entries (index w = pos // ratio) and, on CSA layers, the indexer's rows and keys. The
committed length P per sequence says which slots are valid; nothing is ever rolled back, because
`commit` writes only what a caller accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.layers.attention import AttentionRows
from jaxspec.model import state_v41
from jaxspec.model.rings import write_entries, write_ring
from jaxspec.sharding.rules import axes


@struct.dataclass
class LayerState:
    swa_kv: jax.Array = axes("batch", "window", "kv")  # [B, W, c]
    # [B, Lc, c] compressed entries, Lc = ceil(max_len / ratio)
    comp_kv: jax.Array | None = axes("batch", "entries", "kv", default=None)
    comp_rows_kv: jax.Array | None = axes("batch", "rows", "compress", default=None)  # [B, coff*ratio, coff*c] fp32
    comp_rows_gate: jax.Array | None = axes("batch", "rows", "compress", default=None)  # [B, coff*ratio, coff*c] fp32
    idx_kv: jax.Array | None = axes("batch", "entries", "index_kv", default=None)  # [B, Lc, c_I] indexer keys (CSA)
    idx_rows_kv: jax.Array | None = axes("batch", "rows", "index_compress", default=None)  # [B, 2*ratio, 2*c_I] fp32
    idx_rows_gate: jax.Array | None = axes("batch", "rows", "index_compress", default=None)  # [B, 2*ratio, 2*c_I]


@struct.dataclass
class DecodeState:
    layers: tuple[LayerState, ...]
    length: jax.Array = axes("batch")  # [B] int32 committed tokens per sequence
    max_len: int = struct.field(pytree_node=False, default=0)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]


@struct.dataclass
class MTPState:
    """The MTP draft's own state (speculation/mtp.py follows and drafts with it)."""

    ring: LayerState  # the MTP block's window ring over committed MTP positions
    length: jax.Array = axes("batch")  # [B] int32 MTP positions filled (= committed tokens - 1)
    last_hidden: jax.Array = axes("batch", None, "embed")  # [B, hc, d] target streams at the last committed row


def init_mtp_state(cfg: ModelConfig, batch: int, max_len: int) -> MTPState:
    """An empty MTP state: position i of the ring will consume (H_i, token i+1)."""
    return MTPState(ring=layer_state(cfg, "sliding", batch, max_len), length=jnp.zeros((batch,), jnp.int32),
                    last_hidden=jnp.zeros((batch, cfg.hc_mult, cfg.hidden_size), jnp.dtype(cfg.dtype)))


def layer_state(cfg: ModelConfig, kind: str, batch: int, max_len: int) -> LayerState:
    """An empty state of one layer of `kind` (a draft's sliding-window block: "sliding")."""
    dtype = jnp.dtype(cfg.dtype)
    c, ci = cfg.head_dim, cfg.index_head_dim
    swa = jnp.zeros((batch, cfg.sliding_window, c), dtype)
    g = cfg.geometry(kind)
    if not g.compressed:
        return LayerState(swa_kv=swa)
    ratio, coff = g.ratio, g.coff
    num_entries = -(-max_len // ratio)
    state = LayerState(
        swa_kv=swa,
        comp_kv=jnp.zeros((batch, num_entries, c), dtype),
        comp_rows_kv=jnp.zeros((batch, coff * ratio, coff * c), jnp.float32),
        comp_rows_gate=jnp.zeros((batch, coff * ratio, coff * c), jnp.float32),
    )
    if g.indexed:
        state = state.replace(
            idx_kv=jnp.zeros((batch, num_entries, ci), jnp.float32),
            idx_rows_kv=jnp.zeros((batch, 2 * ratio, 2 * ci), jnp.float32),
            idx_rows_gate=jnp.zeros((batch, 2 * ratio, 2 * ci), jnp.float32),
        )
    return state


def init_state(cfg: ModelConfig, batch: int, max_len: int) -> DecodeState | state_v41.V41State:
    """An empty target state for `batch` sequences of up to `max_len` tokens (a draft keeps its own);
    a V4.1 config's is a `state_v41.V41State`."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if max_len < 1 or max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len must be in [1, {cfg.max_position_embeddings}], got {max_len}")
    if cfg.v41 is not None:
        return state_v41.init_v41_state(cfg, batch, max_len)
    return DecodeState(
        layers=tuple(layer_state(cfg, kind, batch, max_len) for kind in cfg.layer_types),
        length=jnp.zeros((batch,), jnp.int32),
        max_len=max_len,
    )


def abstract_state(cfg: ModelConfig, batch: int, max_len: int) -> DecodeState:
    """Shapes and dtypes of a state without allocating it."""
    return jax.eval_shape(lambda: init_state(cfg, batch, max_len))


def commit_layer(
    cfg: ModelConfig,
    kind: str,
    layer: LayerState,
    rows: AttentionRows,
    positions: jax.Array,  # [B, T]
    take: jax.Array,  # [B, T] bool: tokens to commit (their positions must be P, P+1, ... )
    new_length: jax.Array,  # [B]
) -> LayerState:
    out = layer.replace(swa_kv=write_ring(layer.swa_kv, rows.kv, positions, take, new_length))
    g = cfg.geometry(kind)
    if not g.compressed:
        return out
    ratio = g.ratio
    out = out.replace(
        comp_rows_kv=write_ring(layer.comp_rows_kv, rows.comp_kv, positions, take, new_length),
        comp_rows_gate=write_ring(layer.comp_rows_gate, rows.comp_gate, positions, take, new_length),
        comp_kv=write_entries(layer.comp_kv, rows.comp_entry, positions, take, ratio),
    )
    if g.indexed:
        out = out.replace(
            idx_rows_kv=write_ring(layer.idx_rows_kv, rows.idx_kv, positions, take, new_length),
            idx_rows_gate=write_ring(layer.idx_rows_gate, rows.idx_gate, positions, take, new_length),
            idx_kv=write_entries(layer.idx_kv, rows.idx_entry, positions, take, ratio),
        )
    return out


def commit(
    cfg: ModelConfig,
    state: DecodeState,
    rows: tuple[AttentionRows, ...],
    positions: jax.Array,  # [B, T]
    take: jax.Array,  # [B, T] bool
) -> DecodeState:
    """Write the taken tokens' rows into the committed state and advance the length."""
    if isinstance(state, state_v41.V41State):
        return state_v41.commit_v41_state(cfg, state, rows, positions, take)
    new_length = state.length + jnp.sum(take, axis=1).astype(jnp.int32)
    layers = tuple(
        commit_layer(cfg, kind, layer, layer_rows, positions, take, new_length)
        for kind, layer, layer_rows in zip(cfg.layer_types, state.layers, rows, strict=True)
    )
    return state.replace(layers=layers, length=new_length)
