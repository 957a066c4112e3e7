"""The DSpark draft (DeepSeek's block drafter, June 2026 on; docs/dspark.md), as a tree drafter.

Its state is one ring of context rows per draft stage, written from the target's captured rows of the
committed positions only (`model.dspark.commit_context`). A cycle runs the stages once over
[root, noise x (gamma-1)] (`block_logits`): the block is noise, so its base logits U_1..U_gamma do not
depend on any drafted token and one pass serves every branch. The beam (`tree.grow_beam`) then gives a
node at depth k holding token v the children of U_{k+1} + W1[v] W2^T: one rank-r product per expanded
node, the Markov head conditioning each child on its own parent. With K = 1 that is DSpark's chain.
The confidence head values a slot's best child, sigma(w . [h_k ; W1[v]]) (`Expander.source`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.model.dspark import (
    DSparkParams,
    DSparkState,
    block_logits,
    commit_context,
    confidence_logits,
    init_dspark_state,
    markov,
)
from jaxspec.model.network import Models
from jaxspec.speculation.drafter import Draft, Exposed
from jaxspec.speculation.tree import Expander, Tree, grow_beam, prune_to_budget


@dataclasses.dataclass(frozen=True)
class DSparkDrafter:
    config: DSparkConfig
    name: str = "dspark"

    @property
    def capture(self) -> tuple[int, ...]:
        return self.config.target_layers

    def check(self, cfg: ModelConfig, spec: SpecConfig) -> None:
        self.config.validate_for(cfg)
        block = self.config.block_size
        if spec.num_steps > block:
            raise ValueError(f"num_steps={spec.num_steps} drafts deeper than the DSpark block of {block} positions: "
                             f"allowed 1..{block}")

    def init_state(self, cfg: ModelConfig, batch: int, max_len: int) -> DSparkState:
        return init_dspark_state(cfg, self.config, batch)

    def follow(self, models: Models, cfg: ModelConfig, state: DSparkState, rows: Exposed) -> DSparkState:
        if rows.captured is None:
            raise ValueError(f"the DSpark draft reads target layers {self.capture}: forward(capture=...) gave none")
        return commit_context(models.drafter, cfg, self.config, state, rows.captured, rows.positions, rows.take)

    def draft(self, models: Models, cfg: ModelConfig, spec: SpecConfig, state: DSparkState, root: jax.Array,
              expander: Expander) -> Tree:
        base, hh = block_logits(models.drafter, models.target, cfg, self.config, state, root)  # [B, g, V], [B, g, d]

        def step_logits(new_token: jax.Array, parent: jax.Array, step: int, carry: None):
            e, bias = markov(models.drafter, new_token)  # [B, n, r], [B, n, V]: conditioned on each slot's own token
            position = step - 1  # the slot after a node at depth step - 1
            h = jnp.broadcast_to(hh[:, position][:, None], (*e.shape[:2], hh.shape[-1]))
            confidence = confidence_logits(models.drafter, h, e)  # [B, n]
            return base[:, position][:, None] + bias, confidence, carry

        pool = grow_beam(spec, expander, root, step_logits, None)
        return prune_to_budget(pool, root, spec.num_draft_tokens)


def dspark_draft(params: DSparkParams, config: DSparkConfig, name: str = "dspark", calibration=None,
                 tuning=None, value_calibrations=None) -> Draft:
    """The Draft of a DSpark drafter (a release's `mtp.*` stages, or a drafts/<name>/ folder)."""
    return Draft(name, DSparkDrafter(config), params, calibration, tuning, dict(value_calibrations or {}))
