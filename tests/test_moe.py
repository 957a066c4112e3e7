"""Routed experts: the sparse paths (union, blocked, gathered, grouped) equal the dense reference, and
a device runs only the assignments of the experts it holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.layers.moe import (
    blocked_experts,
    cpu_experts_path,
    dense_experts,
    expert_block,
    gathered_experts,
    grouped_experts,
    moe,
    route,
    sparse_experts,
    stack_experts,
    union_experts,
    unstack_experts,
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
    for path in (gathered_experts, grouped_experts, union_experts, blocked_experts, sparse_experts):
        assert _rel_err(path(p.experts, cfg, x, indices, weights), want) <= 1e-6, path.__name__
    unstacked = unstack_experts(p.experts)
    assert isinstance(unstacked.w1, tuple) and len(unstacked.w1) == cfg.n_routed_experts
    # per-expert leaves (model.cpu_layout): the same values
    for path in (union_experts, blocked_experts, sparse_experts):
        np.testing.assert_array_equal(path(unstacked, cfg, x, indices, weights),
                                      path(p.experts, cfg, x, indices, weights), err_msg=path.__name__)
    np.testing.assert_array_equal(stack_experts(unstacked).w2, p.experts.w2)
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
    for path in (gathered_experts, grouped_experts, union_experts, blocked_experts):
        assert _rel_err(path(held, cfg, x, local, weights), want) <= 1e-6, path.__name__


@pytest.mark.parametrize("tokens", [5, 41])
def test_blocked_experts_run_an_expert_over_many_blocks(test_params, test_cfg, tokens):
    """Every token on the same two experts: each runs ceil(N / B) blocks, the last one partial, and the
    other experts none. Values and gradients (x and the routing weights) equal the dense path's."""
    p, cfg = test_params.layers[2].ffn, test_cfg
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.hidden_size))
    indices = jnp.tile(jnp.array([[3, 0]], jnp.int32), (tokens, 1))
    weights = jax.random.uniform(jax.random.key(2), (tokens, 2))
    block = expert_block(2 * tokens, cfg.n_routed_experts)
    assert tokens % block and tokens > block  # several blocks per expert, the last one partial
    assert _rel_err(blocked_experts(p.experts, cfg, x, indices, weights),
                    dense_experts(p.experts, cfg, x, indices, weights)) <= 1e-6

    def grads(path):
        return jax.grad(lambda x, w: jnp.sum(path(p.experts, cfg, x, indices, w) ** 2), argnums=(0, 1))(x, weights)

    for got, want in zip(grads(blocked_experts), grads(dense_experts), strict=True):
        assert _rel_err(got, want) <= 1e-5


def test_expert_block_sizes():
    # a quarter of the mean rows per expert, as a power of two in [4, 16]
    assert [expert_block(a, 8) for a in (2, 16, 32, 64, 128, 256, 512, 4096)] == [4, 4, 4, 4, 4, 8, 16, 16]


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_cpu_path_reads_only_the_selected_experts(tokens):
    """With at most UNION_MAX_EXPERTS experts the CPU reads each expert's own weights, never a dot over
    the whole [E, d, I] stack: a decode step (N*k <= E) by a conditional per expert (the union path),
    a verify or prefill chunk by one switch over the experts inside a loop over row blocks (the
    blocked path); three dots per expert either way, read off the lowered program."""
    from jaxspec.core.config import ModelConfig
    from jaxspec.core.gpu_export import expert_stack_dots
    from jaxspec.layers.moe import MLPParams

    cfg = ModelConfig.preset("tiny")
    e, d, i, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    assert (e, k) == (8, 2)
    s = jax.ShapeDtypeStruct
    experts = MLPParams(w1=s((e, d, i), jnp.float32), w3=s((e, d, i), jnp.float32), w2=s((e, i, d), jnp.float32))
    args = (experts, s((tokens, d), jnp.float32), s((tokens, k), jnp.int32), s((tokens, k), jnp.float32))
    text = jax.jit(lambda ex, x, idx, w: sparse_experts(ex, cfg, x, idx, w)).lower(*args).as_text()
    assert not expert_stack_dots(text, e, d, i)
    assert text.count("stablehlo.dot_general") >= 3 * e
    if tokens * k <= e:
        assert text.count("stablehlo.case") >= e  # a conditional per expert (platform_dependent adds its own)
        assert "stablehlo.while" not in text
    else:
        assert "stablehlo.while" in text and "stablehlo.case" in text


def test_cpu_path_rules():
    assert cpu_experts_path(4, 4, 4) == "dense"  # k = E: nothing to skip
    assert cpu_experts_path(2, 8, 2) == cpu_experts_path(8, 8, 2) == cpu_experts_path(60, 64, 6) == "union"
    assert cpu_experts_path(10, 8, 2) == cpu_experts_path(512, 8, 2) == cpu_experts_path(66, 64, 6) == "blocked"
    # many experts (a branch each would bloat the program): gathered up to 1.5 E assignments, then dense
    assert cpu_experts_path(384, 256, 8) == "gathered" and cpu_experts_path(392, 256, 8) == "dense"


def test_cpu_layout_unstacks_experts_and_changes_no_output(test_params, test_cfg):
    from jaxspec.model.network import cpu_layout, standard_layout
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation.generate import LoopShape, _generate_loop

    converted = cpu_layout(test_params, test_cfg)
    assert cpu_layout(converted, test_cfg).layers[2].ffn.experts.w1 is converted.layers[2].ffn.experts.w1  # idempotent
    assert isinstance(converted.layers[2].ffn.experts.w1, tuple)
    restored = standard_layout(converted)  # and back, bit for bit
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(test_params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert isinstance(converted.mtp.block.ffn.experts.w1, tuple)
    assert not isinstance(test_params.layers[2].ffn.experts.w1, tuple)  # the caller's params untouched
    # the loop as `generate` runs it, on the stacked and on the unstacked experts: the same tokens
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 0, 0, 0], [9, 2, 6, 0, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 3], jnp.int32)
    sampling = Sampling(jnp.float32(0), jnp.int32(0), jnp.float32(1), jax.random.key(0))
    shape, no_stream = LoopShape(24, 64), np.int32(0)
    stacked = _generate_loop(test_params, test_cfg, tokens, lengths, shape, jnp.int32(-1), sampling, no_stream)
    unstacked = _generate_loop(converted, test_cfg, tokens, lengths, shape, jnp.int32(-1), sampling, no_stream)
    np.testing.assert_array_equal(stacked[0], unstacked[0])
