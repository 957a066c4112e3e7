"""The incremental draft equals the exhaustive one (tests/draft_reference.py), and its work grows
linearly with its steps (XLA cost analysis on abstract shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_reference import draft_tree_exhaustive

import jaxspec as js
from jaxspec.model.network import abstract_params
from jaxspec.model.sampling import Sampling
from jaxspec.speculation import stages
from jaxspec.speculation.tree import prune_to_budget
from jaxspec.testing import mtp_models, mtp_prefill, mtp_speculator, mtp_tree


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


# Specs whose later steps draft from K slots (the incremental part); a one-step draft has none.
@pytest.mark.parametrize("spec", ["s3_k2_d6", "s5_k2_d16", "s4_k4_d16"])
@pytest.mark.parametrize("which", ["random", "agreeing"])
def test_incremental_draft_equals_the_exhaustive_draft(test_params, agreeing_params, test_cfg, spec, which):
    params = test_params if which == "random" else agreeing_params
    cfg, spec = test_cfg, js.SpecConfig.parse(spec)
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 0, 0, 0], [3] + [0] * 9, list(range(40, 50))], jnp.int32)
    state = mtp_prefill(params, cfg, tokens, [7, 1, 10], 64)
    whole = js.SpecConfig(spec.num_steps, spec.topk, spec.max_draft_tokens)  # every candidate kept
    got = mtp_tree(params, cfg, whole, state)
    pool = jax.jit(draft_tree_exhaustive, static_argnums=(1, 2))(params, cfg, spec, state)
    want = prune_to_budget(pool, state.root, whole.num_draft_tokens)
    for field in ("tokens", "parent", "rank", "depth"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
    assert _rel_err(got.score, want.score) <= 1e-5


def test_draft_work_grows_linearly_with_its_steps():
    cfg = js.ModelConfig.preset("tiny")
    params = abstract_params(cfg)

    def flops(name):
        sp = mtp_speculator(cfg, name)
        state = jax.eval_shape(lambda p: mtp_prefill(p, cfg, jnp.zeros((1, 8), jnp.int32), [8], 256, spec=name),
                               params)
        return stages.draft.lower(sp, mtp_models(params), state, Sampling.create()).cost_analysis()["flops"]

    ratio = flops("s7_k1_d8") / flops("s4_k1_d5")
    assert ratio <= 2.1, ratio  # 7 / 4 steps; the exhaustive draft measured 3.07

