"""Routed experts: the sparse paths (gathered, grouped) equal the dense reference, and a device
runs only the assignments of the experts it holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.layers.moe import (
    dense_experts,
    gathered_experts,
    gathers_on_cpu,
    grouped_experts,
    moe,
    route,
    sparse_experts,
)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


@pytest.mark.parametrize("layer", [0, 2], ids=["hash-routed", "score-routed"])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_sparse_experts_equal_the_dense_reference(test_params, test_cfg, layer, tokens):
    p, cfg = test_params.layers[layer].ffn, test_cfg
    assert (p.tid2eid is not None) == (layer < cfg.num_hash_layers)
    x = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size))
    ids = jax.random.randint(jax.random.key(tokens + 1), (tokens,), 0, cfg.vocab_size)
    indices, weights = route(p, cfg, x, ids)
    want = dense_experts(p.experts, cfg, x, indices, weights)
    for path in (gathered_experts, grouped_experts, sparse_experts):
        assert _rel_err(path(p.experts, cfg, x, indices, weights), want) <= 1e-6, path.__name__
    # the whole layer (router, sparse experts, shared expert) against the dense formula
    got = moe(p, cfg, x[None], ids[None])[0]
    shared = p.shared
    dense = want + (jax.nn.silu(jnp.minimum(x @ shared.w1, cfg.swiglu_limit))
                    * jnp.clip(x @ shared.w3, -cfg.swiglu_limit, cfg.swiglu_limit)) @ shared.w2
    assert _rel_err(got, dense) <= 1e-6


def test_sparse_experts_skip_assignments_held_elsewhere(test_params, test_cfg):
    """A device holding experts [2, 4) sees the others as index >= its count: they add nothing."""
    p, cfg = test_params.layers[2].ffn, test_cfg
    x = jax.random.normal(jax.random.key(0), (8, cfg.hidden_size))
    indices, weights = route(p, cfg, x, jnp.zeros((8,), jnp.int32))
    held = jax.tree.map(lambda w: w[2:], p.experts)
    local = jnp.where(indices >= 2, indices - 2, 2)
    want = dense_experts(p.experts, cfg, x, indices, jnp.where(indices >= 2, weights, 0.0))
    assert (np.asarray(local) == 2).any() and (np.asarray(local) < 2).any()
    for path in (gathered_experts, grouped_experts):
        assert _rel_err(path(held, cfg, x, local, weights), want) <= 1e-6, path.__name__



@pytest.mark.parametrize("tokens, gathered", [(1, True), (6, True), (7, False), (8, False)])
def test_cpu_path_gathers_up_to_one_and_a_half_assignments_per_expert(tokens, gathered):
    """On the CPU the selected experts are gathered while N*k <= 1.5 E (8 experts, k = 2: up to 6
    tokens) and every expert runs on every token beyond that; the rule is read off the lowered
    program (a dot over the whole [E, d, I] stack only on the dense path)."""
    from jaxspec.config import ModelConfig
    from jaxspec.gpu_export import expert_stack_dots
    from jaxspec.layers.moe import MLPParams

    cfg = ModelConfig.preset("tiny")
    e, d, i, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    assert (e, k) == (8, 2)
    s = jax.ShapeDtypeStruct
    experts = MLPParams(w1=s((e, d, i), jnp.float32), w3=s((e, d, i), jnp.float32), w2=s((e, i, d), jnp.float32))
    args = (experts, s((tokens, d), jnp.float32), s((tokens, k), jnp.int32), s((tokens, k), jnp.float32))
    text = jax.jit(lambda ex, x, idx, w: sparse_experts(ex, cfg, x, idx, w)).lower(*args).as_text()
    assert bool(expert_stack_dots(text, e, d, i)) is not gathered


def test_cpu_path_is_dense_when_every_token_takes_every_expert():
    assert gathers_on_cpu(4, 4, 2) and not gathers_on_cpu(4, 4, 4)  # k = E: nothing to skip
    assert gathers_on_cpu(12, 8, 2) and not gathers_on_cpu(14, 8, 2)  # the 1.5 E edge
