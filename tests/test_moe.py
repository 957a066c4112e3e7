"""Routed experts: the sparse paths (gathered, grouped) equal the dense reference, and a device
runs only the assignments of the experts it holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.layers.moe import dense_experts, gathered_experts, grouped_experts, moe, route, sparse_experts


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

