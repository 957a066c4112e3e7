"""The acceptance rule of a speculative cycle and the drafting it needs (docs/sampling.md).

- "target": top-K drafts accepted by the target-only rule (`verify.tree_accept`): a child is accepted
  when an independent target draw equals it. Exact for any draft fixed before the draws; the
  reference, and what greedy decoding runs (the argmax walk).
- "residual": at temperature > 0 children are *sampled* from the draft (`speculation/sampled.py`) and
  verified by the residual rule (chains) or recursive rejection without replacement (trees),
  `verify.residual_tree_accept`; at temperature 0 the same program takes the greedy branch.
"""

from __future__ import annotations

import jax

from jaxspec.core.config import ModelConfig, SpecConfig
from jaxspec.model.network import ModelParams, forward
from jaxspec.model.sampling import Sampling
from jaxspec.model.state import DecodeState
from jaxspec.speculation.draft import Tree, draft
from jaxspec.speculation.plan import build_plan, verify_context
from jaxspec.speculation.sampled import make_sampled_draft
from jaxspec.speculation.values import Calibration
from jaxspec.speculation.verify import Acceptance, residual_tree_accept, tree_accept

ACCEPT_RULES = ("residual", "target")


def choose_rule(accept: str | None, temperature: float) -> str:
    """The static rule of a run: `accept` checked, None = "residual" when sampling, else "target"
    (greedy: both rules walk the argmax; "target" is the smaller program)."""
    if accept is None:
        return "residual" if temperature > 0 else "target"
    if accept not in ACCEPT_RULES:
        raise ValueError(f"accept must be None or one of {ACCEPT_RULES}, got {accept!r}")
    return accept


def draft_and_prune(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: DecodeState,
    root: jax.Array,  # [B] int32
    last_hidden: jax.Array,  # [B, hc, d]
    accept: str,
    sampling: Sampling | None,
    cycle: jax.Array | None,  # [B] int32
    log_value: jax.Array | None = None,  # [S, K] value hook for sampled drafts (speculation/sampled.py)
    values: Calibration | None = None,  # calibrated node values of top-K drafts (speculation/values.py)
    context: jax.Array | None = None,  # [B] int32 context bin (speculation/values.py `context_bins`), None = pooled
) -> Tree:
    """`draft.draft` with the children the rule needs: sampled at temperature > 0 under "residual"."""
    sampler = None
    if accept == "residual" and sampling is not None:
        residual = values.residual if values is not None else ()  # calibrated values, else the prior
        sampler = make_sampled_draft(spec, sampling, cycle, log_value, residual)
    return draft(params, cfg, spec, state, root, last_hidden, values=values, sampling=sampling, sampler=sampler,
                 context=context)


def verify_tree(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: DecodeState,
    tree: Tree,
    sampling: Sampling | None,
    cycle: jax.Array | None,  # [B] int32
):
    """plan -> target forward over the tree -> accept, nothing committed -> (verify_out, acceptance)."""
    plan = build_plan(tree.parent, state.length, spec.num_steps)
    verify_out = forward(params, cfg, state, tree.tokens, verify_context(plan, state.length))
    return verify_out, accept_tree(spec, tree, verify_out.logits, sampling, cycle)


def accept_tree(
    spec: SpecConfig,
    tree: Tree,
    logits: jax.Array,  # [B, D, V] target verify logits
    sampling: Sampling | None,
    cycle: jax.Array | None,  # [B] int32
) -> Acceptance:
    """The rule the tree was drafted for: sampled drafts carry their q."""
    if tree.q is not None:
        return residual_tree_accept(
            tree.tokens, tree.parent, tree.rank, tree.q, logits, spec.num_steps, spec.topk, sampling, cycle
        )
    return tree_accept(tree.tokens, tree.parent, logits, spec.num_steps, sampling, cycle)
