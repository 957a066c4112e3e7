"""Commit of the accepted path: the only place a verify result reaches the committed state.

The target's rows (window kv, compressor and indexer rows, compressed entries emitted on the path)
are taken from the verify scratch for root + accepted nodes only; rejected branches are simply not
taken. Then the MTP window ring is refreshed from the target's hidden states of the newly
committed positions (draft-time MTP rows came from draft hidden states and are never committed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.model import state as state_lib
from jaxspec.model.network import ForwardOutput, ModelParams, causal_context, mtp_forward
from jaxspec.model.state import DecodeState
from jaxspec.speculation.verify import Acceptance


def commit_accepted_path(
    params: ModelParams,
    cfg: ModelConfig,
    state: DecodeState,
    tokens: jax.Array,  # [B, D] tree tokens
    verify_out: ForwardOutput,
    acceptance: Acceptance,
    last_hidden: jax.Array,  # [B, hc, d] target streams at position P-1
    active: jax.Array,  # [B] bool: finished sequences commit nothing
) -> tuple[DecodeState, jax.Array]:
    """-> (state with P + a + 1 committed and the MTP ring refreshed, streams at the new P-1)."""
    # Only the <= S+1 path nodes' rows are gathered and written: the path is a chain at positions
    # P, P+1, ..., and a compressed entry is written only where a path node closes a block.
    path = acceptance.path_nodes  # [B, S+1]
    steps = path.shape[1]
    on_path = (jnp.arange(steps)[None, :] <= acceptance.num_accepted[:, None]) & active[:, None]  # [B, S+1]

    def path_rows(x):  # [B, D, ...] -> [B, S+1, ...]
        return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)

    rows = jax.tree.map(path_rows, verify_out.rows)
    positions = state.length[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    state = state_lib.commit(cfg, state, rows, positions, on_path)

    # MTP positions P-1 .. P+a-1 consume (H at that position, token one later).
    b = tokens.shape[0]
    batch_index = jnp.arange(b)[:, None]
    path_tokens = jnp.take_along_axis(tokens, path, axis=1)
    path_hidden = verify_out.hidden[batch_index, path]  # [B, S+1, hc, d]
    hidden_in = jnp.concatenate([last_hidden[:, None], path_hidden[:, :-1]], axis=1)
    ctx = causal_context(state.mtp_length, on_path)
    _, _, mtp_rows = mtp_forward(params, cfg, state, hidden_in, path_tokens, ctx)
    state = state_lib.commit_mtp(cfg, state, mtp_rows, ctx.positions, on_path)
    new_last = verify_out.hidden[jnp.arange(b), acceptance.last_node]
    return state, jnp.where(active[:, None, None], new_last, last_hidden)
