"""The stages of `speculation/cycle.py` as separately jitted programs, for whoever measures a cycle
stage by stage (`jaxspec tune`, `bench/`, the cost analysis on abstract shapes): each is the function
the loop runs, nothing re-written, and its compiled programs share the bounded LRU of
`jaxspec.core.programs` with the loops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model.network import ForwardOutput, ModelParams, Models, extend
from jaxspec.model.sampling import Sampling
from jaxspec.model.state import DecodeState
from jaxspec.speculation import cycle as cycle_lib
from jaxspec.speculation.cycle import SpecState, Speculator
from jaxspec.speculation.tree import Tree

STAGES = ("draft", "plan", "verify", "commit")

# (sp, models, tokens [B, S], lengths [B], max_len, sampling) -> SpecState
prefill = bounded_jit(cycle_lib.prefill, static_argnums=(0, 4))
# (sp, models, state, sampling) -> Tree
draft = bounded_jit(cycle_lib.draft_stage, static_argnums=(0,))
# (sp, target state, tree) -> TreePlan
plan = bounded_jit(cycle_lib.plan_stage, static_argnums=(0,))
# (sp, models, target state, tree, plan) -> ForwardOutput
verify = bounded_jit(cycle_lib.verify_stage, static_argnums=(0,))


@functools.partial(bounded_jit, static_argnums=(1,), donate_argnums=(2,))
def ar_step(params: ModelParams, cfg: ModelConfig, state: DecodeState, last: jax.Array):  # last: [B] int32
    """One greedy autoregressive step: -> (state, next token [B])."""
    out, state = extend(params, cfg, state, last[:, None], jnp.ones((last.shape[0], 1), bool))
    return state, jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)


@functools.partial(bounded_jit, static_argnums=(0,))
def commit(sp: Speculator, models: Models, state: SpecState, tree: Tree, verify_out: ForwardOutput,
           sampling: Sampling) -> SpecState:
    """Acceptance + commit of the accepted path (every row active) -> the next state."""
    acc = cycle_lib.accept_stage(sp, tree, verify_out.logits, sampling, state.stats.cycles)
    active = jnp.ones(state.root.shape, bool)
    return cycle_lib.commit_stage(sp, models, state, tree, verify_out, acc, active)[0]


@functools.partial(bounded_jit, static_argnums=(0,), donate_argnums=(2,))
def cycle(sp: Speculator, models: Models, state: SpecState, sampling: Sampling):
    """One whole cycle, every row active (state donated, as in the loop): -> (state, CycleOut)."""
    return cycle_lib.speculative_cycle(sp, models, state, sampling, jnp.ones(state.root.shape, bool))
