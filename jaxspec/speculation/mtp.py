"""The MTP draft (April DeepSeek-V4): S serial steps of the MTP block, a top-K beam.

MTP position i consumes (H_i, token i+1): the target's streams at position i and the token after it.
Its state is the block's window ring over the committed positions plus the target streams at the
last committed position, which the next row pairs with. Step 1 of a cycle expands the root (the
bonus token at position P, paired with H_{P-1}); every later step the K best candidates of the
previous one. Each step's attention sees the committed ring plus exactly its own ancestors' steps,
never a sibling's (docs/tree_verification.md §2): their window kv lives in a draft scratch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.layers.attention import AttentionContext
from jaxspec.layers.banded import band_block
from jaxspec.model import state as state_lib
from jaxspec.model.network import Models, causal_context, mtp_forward
from jaxspec.model.state import MTPState
from jaxspec.speculation.drafter import Exposed
from jaxspec.speculation.tree import Expander, Tree, grow_beam, num_slots, prune_to_budget


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    name: str = "mtp"
    capture: tuple[int, ...] = ()

    def check(self, cfg: ModelConfig, spec: SpecConfig) -> None:
        if spec.num_steps >= cfg.sliding_window:
            raise ValueError(f"num_steps={spec.num_steps} must stay below the sliding window ({cfg.sliding_window}): "
                             f"allowed 1..{cfg.sliding_window - 1}")

    def init_state(self, cfg: ModelConfig, batch: int, max_len: int) -> MTPState:
        return state_lib.init_mtp_state(cfg, batch, max_len)

    def follow(self, models: Models, cfg: ModelConfig, state: MTPState, rows: Exposed) -> MTPState:
        """Committed rows t_P.. (streams H_P..) give MTP positions P-1.. the pairs (H_{P-1}, t_P), (H_P, t_{P+1}),
        ...; the prompt's first token pairs with nothing, so a row starting at position 0 drops it."""
        b, t = rows.tokens.shape
        hidden = jnp.concatenate([state.last_hidden[:, None], rows.hidden[:, :-1]], axis=1)  # [B, T, hc, d]
        tokens, take = rows.tokens, rows.take
        first = (rows.positions[:, 0] == 0)[:, None]  # the prompt's start: shift its pairs by one
        shift = jnp.arange(t)[None, :] + first
        tokens = jnp.take_along_axis(jnp.pad(tokens, ((0, 0), (0, 1))), shift, axis=1)
        hidden = jnp.take_along_axis(jnp.pad(hidden, ((0, 0), (0, 1), (0, 0), (0, 0))),
                                     shift[:, :, None, None], axis=1)
        take = jnp.take_along_axis(jnp.pad(take, ((0, 0), (0, 1))), shift, axis=1)
        ctx = causal_context(state.length, take, band_block(cfg, t))
        _, _, ring_rows = mtp_forward(models.target, models.drafter, cfg, state.ring, hidden, tokens, ctx)
        length = state.length + jnp.sum(take, axis=1).astype(jnp.int32)
        ring = state_lib.commit_layer(cfg, "sliding", state.ring, ring_rows, ctx.positions, take, length)
        count = jnp.sum(rows.take, axis=1)  # the last committed row's streams: the next row's pair
        last = rows.hidden[jnp.arange(b), jnp.maximum(count - 1, 0)]
        return MTPState(ring=ring, length=length,
                        last_hidden=jnp.where((count > 0)[:, None, None], last, state.last_hidden))

    def draft(self, models: Models, cfg: ModelConfig, spec: SpecConfig, state: MTPState, root: jax.Array,
              expander: Expander) -> Tree:
        """The beam over S MTP steps, each running the MTP block and the head over its new slots only
        (1 at step one, K after): O(S*K) token-forwards. A slot drafted at step s sits at MTP position
        length + s - 1 and reads the committed ring plus the window kv its ancestors left in the scratch
        (`AttentionContext.prior_*`): the pool equals the exhaustive reference's (tests/draft_reference.py)."""
        b = root.shape[0]
        slots, width = num_slots(spec, expander), expander.width
        scratch = (jnp.zeros((b, slots, cfg.head_dim), jnp.dtype(cfg.dtype)),  # window kv of drafted slots
                   jnp.zeros((b, slots), jnp.int32),  # their MTP positions
                   jnp.zeros((b, 1, slots), bool),  # per new slot: its ancestor slots
                   state.last_hidden[:, None],  # [B, n, hc, d] streams the new slots pair with
                   jnp.zeros((1,), jnp.int32))  # the new slots' indices

        def step_logits(new_token: jax.Array, parent: jax.Array, step: int, carry: Any):
            kv, pos, ancestors, parent_z, new_slots = carry
            n = new_token.shape[1]
            if step > 1:  # the new slots descend from the previous step's slots `parent`
                prev = new_slots
                new_slots = jnp.arange(1 + (step - 2) * width, 1 + (step - 1) * width, dtype=jnp.int32)
                ancestors = jnp.take_along_axis(ancestors, parent[..., None], axis=1) | (
                    prev[parent][..., None] == jnp.arange(slots))
                parent_z = jnp.take_along_axis(parent_z, parent[:, :, None, None], axis=1)
            positions = jnp.broadcast_to(state.length[:, None] + (step - 1), (b, n))
            ctx = AttentionContext(
                positions=positions, committed=state.length,
                visible=jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n)),  # siblings never see each other
                ancestor_at_depth=jnp.zeros((b, n, n), jnp.int32), valid=jnp.ones((b, n), bool),
                prior_kv=kv, prior_positions=pos, prior_visible=ancestors,
            )
            logits, z, rows = mtp_forward(models.target, models.drafter, cfg, state.ring, parent_z, new_token, ctx)
            kv = kv.at[:, new_slots].set(rows.kv.astype(kv.dtype))
            pos = pos.at[:, new_slots].set(positions)
            return logits, None, (kv, pos, ancestors, z, new_slots)

        pool = grow_beam(spec, expander, root, step_logits, scratch)
        return prune_to_budget(pool, root, spec.num_draft_tokens)
