"""A cycle's policy: how it values nodes, how children are drawn and which acceptance rule runs
(docs/sampling.md). Static: it is part of the compiled program, chosen once by the entry points.

- "greedy": temperature 0, top-K children, the argmax walk (bit-identical to `generate`).
- "target": top-K drafts accepted by the target-only rule (`verify.greedy_accept` over independent
  target draws): exact for any draft fixed before the draws.
- "block" (the default at temperature > 0): children *sampled* from the draft (`speculation/sampled.py`),
  verified sequence by sequence: block verification for chains, its tree form (a post-order traversal)
  for trees. It accepts at least as much as "residual" in expectation.
- "residual": the same sampled children verified token by token: the residual rule (chains) or
  recursive rejection without replacement (trees).
Both sampled rules walk the argmax at temperature 0 in the same program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.core.spec import SpecConfig
from jaxspec.model.sampling import Sampling
from jaxspec.speculation.sampled import make_sampled_draft
from jaxspec.speculation.tree import Expander
from jaxspec.speculation.values import CONTEXT_CAP, Calibration, context_bins

ACCEPT_RULES = ("block", "residual", "target")
SAMPLED = ("block", "residual")  # the rules whose children are drawn from the draft
RULES = ("greedy", *ACCEPT_RULES)


@dataclasses.dataclass(frozen=True)
class Policy:
    rule: str = "greedy"
    values: Calibration | None = None  # calibrated node values to rank by; None = raw draft log-probs

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")

    @classmethod
    def choose(cls, accept: str | None, temperature: float, values: Calibration | None = None) -> Policy:
        """The policy of a run: `accept` checked (None = "block" when sampling); temperature 0 with
        top-K drafts is the greedy walk."""
        if accept is not None and accept not in ACCEPT_RULES:
            raise ValueError(f"accept must be None or one of {ACCEPT_RULES}, got {accept!r}")
        if accept is None:
            accept = "block" if temperature > 0 else "target"
        rule = "greedy" if accept == "target" and temperature == 0 else accept
        return cls(rule, values)

    def context(self, spec: SpecConfig, stats: Any) -> jax.Array | None:
        """-> [B] int32 context bin of each sequence from its own cycles so far (`cycle.SpecStats`: cycles
        [B] and depth_hits [B, S]), or None (pooled values) when there are no context maps or the tree is
        too shallow to count min(accepted, CONTEXT_CAP)."""
        if spec.num_steps < CONTEXT_CAP or self.values is None or not self.values.greedy_by_context:
            return None
        capped = jnp.sum(stats.depth_hits[:, :CONTEXT_CAP], axis=1)  # sum of min(accepted, 8) per cycle
        return context_bins(capped, stats.cycles)

    def sampled_maps(self) -> tuple:
        """The calibration's value maps for this sampled rule (block maps under "block", falling back to the
        residual maps where a calibration has none), or () for the prior."""
        if self.values is None:
            return ()
        if self.rule == "block" and self.values.block:
            return self.values.block
        return self.values.residual

    def expander(self, spec: SpecConfig, sampling: Sampling, cycle: jax.Array, context: jax.Array | None) -> Expander:
        """How this cycle's expanded slots get children (`cycle` [B] int32 folds the draft keys)."""
        sampler = None
        if self.rule in SAMPLED:
            residual = self.sampled_maps()
            sampler = make_sampled_draft(spec, sampling, cycle, None, residual)
        temperature = jnp.float32(0.0) if self.rule == "greedy" else sampling.temperature
        return Expander(temperature, context, sampler, spec.topk, self.values, source=spec.values)
