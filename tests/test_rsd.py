"""Sampled drafts verified by the residual rule (chains) and recursive rejection (RSD-S, trees):
the emitted tokens follow the target's processed distribution exactly; wrong variants are caught.

Level 1, the rule on synthetic Markov models (fp32, vocabulary 8): the target's next-token logits
depend on (position, previous token), the draft's are a noisy copy. Each of 20k rows drafts a
fixed-shape tree by the loop's own `sampled_children` (Gumbel-top-K of the processed draft, the kept
children a prefix of each node's sampling order), is accepted by `residual_tree_accept`, and is
continued past the cycle with exact target draws; the first 3 tokens must then follow the target's
joint law p0(t1) p1(t2 | t1) p2(t3 | t2) (chi-square, cells with expected count < 5 pooled). Two
models (seeds) x chain / K = 2 / K = 4 x T = 0.6, 1.0 x top-p 1.0, 0.9 (with `JAXSPEC_LONG_TESTS=1`;
CI runs one model). Wrong variants (no residual update; kept children not a prefix of the sampling
order) must fail the same check.

Level 2, `speculative_generate(accept="residual")` end to end over 12,288 prompts (the harness of
test_sampling.py), zero recompiles across settings, greedy under the residual program == generate.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_laws import ALPHA, chi_square_p, reference_probs
from test_sampling import assert_samples_the_target, check_end_to_end

import jaxspec as js
from jaxspec.model.sampling import Sampling, node_keys, processed_logprobs
from jaxspec.speculation import verify
from jaxspec.speculation.generate import speculative_compile_count
from jaxspec.speculation.sampled import SampledDraft, make_sampled_draft, prior_log_values, sampled_children
from jaxspec.speculation.tree import Tree
from jaxspec.speculation.verify import (
    chain_residual_accept,
    recursive_rejection_accept,
    residual_tree_accept,
)

VOCAB = 8
NUM_EMITTED = 3
N = 20_480
# (parent, rank): parents precede children, each node's kept children are ranks 0..m-1.
TREES = {
    "chain": ([0, 0, 1, 2], [0, 0, 0, 0]),
    "k2": ([0, 0, 0, 1, 1, 3, 3], [0, 0, 1, 0, 1, 0, 1]),
    "k4": ([0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 2, 3, 0, 1, 2, 3]),
}
SETTINGS = {"t0.6": (0.6, None), "t0.6_p0.9": (0.6, 0.9), "t1": (1.0, None), "t1_p0.9": (1.0, 0.9)}


def markov_model(seed):
    """-> (target logits [depth, V, V], draft logits [depth, V, V]) by (position, previous token)."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(4, VOCAB, VOCAB)) * 1.5
    draft = target + rng.normal(size=target.shape) * 0.6
    return jnp.asarray(target, jnp.float32), jnp.asarray(draft, jnp.float32)


MAX_DEPTH, TREE_K, TREE_D = 3, 4, 9  # trees are padded to one shape: one compiled program for all


def padded_tree(name):
    """-> (parent, rank, depth) [TREE_D] int32; padding nodes are their own parents (never reached)."""
    parent, rank = TREES[name]
    pad = np.arange(len(parent), TREE_D)
    depth = [0] * len(parent)
    for c in range(1, len(parent)):
        depth[c] = depth[parent[c]] + 1
    return (np.concatenate([parent, pad]).astype(np.int32), np.concatenate([rank, 0 * pad]).astype(np.int32),
            np.concatenate([depth, 0 * pad + MAX_DEPTH + 1]).astype(np.int32))


def _step_without_residual(p, q, x, coin, try_it):
    """The deliberately wrong rule: a rejected sibling leaves p and q as they were (no residual)."""
    ok, _, _ = _EXACT_STEP(p, q, x, coin, try_it)
    return ok, p, q


_EXACT_STEP = verify._residual_step


@functools.partial(jax.jit, static_argnums=(5, 6, 8))
def _rows(target, draft, parent, rank, depth, n, chain, sampling, variant):
    """n rows: draft the tree level by level with `sampled_children`, accept, continue past the cycle
    with exact target draws -> ([n, 3] tokens, accepted [n]). Wrong variants: "non_prefix", the kept
    children are draws 2..K+1, not a prefix of the sampling order; "no_residual", a rejection leaves
    the target distribution as it was (traced with `_step_without_residual` in its place)."""
    d = parent.shape[0]
    cycle = jnp.zeros((n,), jnp.int32)
    keys = node_keys(jax.random.fold_in(sampling.key, 99), cycle, d)
    width = TREE_K + 1
    sampler = SampledDraft(sampling, keys, jnp.zeros((MAX_DEPTH, width), jnp.float32))
    unused = jnp.zeros((n, d * width), jnp.int32)  # the top-K children, used at temperature 0 only
    tokens = jnp.zeros((n, d), jnp.int32).at[:, 0].set(3)
    q = jnp.zeros((n, d, VOCAB), jnp.float32)
    pick = rank + int(variant == "non_prefix")
    for level in range(MAX_DEPTH):  # the children at depth level + 1 of every node
        logits = draft[jnp.minimum(depth, MAX_DEPTH)[None, :], tokens]  # [n, D, V]
        (drawn, _, _, _), logq = sampled_children(logits, jnp.zeros((n, d)), jnp.arange(d), level + 1, sampler,
                                                  (unused, unused, unused.astype(jnp.float32), unused))
        drawn = drawn.reshape(n, d, width)
        mine = depth == level + 1  # [D]
        tokens = jnp.where(mine[None, :], drawn[:, parent, pick], tokens)
        q = jnp.where(mine[None, :, None], logq[:, parent], q)
    t_logits = target[jnp.minimum(depth, MAX_DEPTH)[None, :], tokens]  # [n, D, V]
    parent_a, rank_a = (jnp.broadcast_to(x, (n, d)) for x in (parent, rank))
    if chain:  # nodes 0..3 in order: the loop's K = 1 rule
        max_depth, nodes = 3, 4
        chain_tree = Tree(tokens[:, :nodes], parent_a[:, :nodes], jnp.broadcast_to(depth[:nodes], (n, nodes)),
                          rank_a[:, :nodes], jnp.zeros((n, nodes)), jnp.ones((n, nodes)), q[:, :nodes])
        acc = residual_tree_accept(chain_tree, t_logits[:, :nodes], max_depth, 1, sampling,
                                   node_keys(sampling.key, cycle, nodes))
    else:
        logp = processed_logprobs(t_logits, sampling.temperature, sampling.top_k, sampling.top_p)
        verify._residual_step = _step_without_residual if variant == "no_residual" else _EXACT_STEP
        try:  # the swap lasts this trace only (variant is static: its own compiled program)
            acc = recursive_rejection_accept(tokens, parent_a, rank_a, jnp.exp(q), jnp.exp(logp),
                                             node_keys(sampling.key, cycle, d), MAX_DEPTH, TREE_K)
        finally:
            verify._residual_step = _EXACT_STEP
    path = jnp.take_along_axis(tokens, acc.path_nodes, axis=1)
    a = acc.num_accepted[:, None]
    slot = jnp.arange(MAX_DEPTH + 1)[None, :]
    drafted = jnp.concatenate([path[:, 1:], jnp.zeros((n, 1), jnp.int32)], axis=1)
    out = jnp.where(slot < a, drafted, acc.bonus[:, None])[:, :NUM_EMITTED]
    rest = jax.random.split(jax.random.fold_in(sampling.key, 7), NUM_EMITTED)
    for j in range(1, NUM_EMITTED):  # past the cycle: exact target draws
        logp = processed_logprobs(target[j, out[:, j - 1]], sampling.temperature, sampling.top_k, sampling.top_p)
        fresh = jax.random.categorical(rest[j], logp).astype(jnp.int32)
        out = out.at[:, j].set(jnp.where(acc.num_accepted + 1 > j, out[:, j], fresh))
    return out, acc.num_accepted


def check_rule(tree, setting, variant="exact", seed=0, n=N):
    """-> (p-value of the first 3 tokens against the target's joint law, mean accepted drafts)."""
    temperature, top_p = SETTINGS[setting]
    target, draft = markov_model(seed)
    sampling = Sampling.create(temperature, top_p=top_p, key=jax.random.key(seed + 1))
    parent, rank, depth = (jnp.asarray(x) for x in padded_tree(tree))
    out, accepted = _rows(target, draft, parent, rank, depth, n, tree == "chain", sampling, variant)
    p = reference_probs(target[:NUM_EMITTED], temperature, None, top_p)  # [3, V(prev), V], the numpy law
    joint = p[0, 3][:, None, None] * p[1][:, :, None] * p[2][None, :, :]
    cells = np.ravel_multi_index(tuple(np.asarray(out).T), (VOCAB,) * NUM_EMITTED)
    return chi_square_p(cells, joint.reshape(-1)), float(np.mean(accepted))


GRID = [(t, s) for t in TREES for s in SETTINGS]


@pytest.mark.parametrize("tree,setting", GRID)
def test_residual_rules_are_exact(tree, setting):
    p, accepted = check_rule(tree, setting)
    assert p > ALPHA, (p, accepted)
    assert accepted > 0.8, accepted  # deep paths are exercised, not only the bonus


@pytest.mark.long
@pytest.mark.parametrize("tree,setting", GRID)
def test_residual_rules_are_exact_second_model(tree, setting):
    p, accepted = check_rule(tree, setting, seed=5)
    assert p > ALPHA, (p, accepted)


@pytest.mark.parametrize("tree,variant", [("k2", "no_residual"), ("k4", "no_residual"), ("k2", "non_prefix")])
def test_wrong_variants_are_caught(tree, variant):
    p, accepted = check_rule(tree, "t1", variant)
    assert p < ALPHA, (p, accepted)


def test_rsd_tree_of_one_child_is_the_chain_rule():
    """K = 1 through the tree walk == `chain_residual_accept` (same keys: same coins and noise)."""
    n, steps = 256, 3
    rng = np.random.default_rng(0)
    logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(n, steps + 1, VOCAB)) * 1.5, jnp.float32), -1)
    logq = jax.nn.log_softmax(logp + jnp.asarray(rng.normal(size=logp.shape), jnp.float32), -1)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (n, steps + 1)), jnp.int32)
    keys = node_keys(jax.random.key(4), jnp.zeros((n,), jnp.int32), steps + 1)
    parent = jnp.broadcast_to(jnp.maximum(jnp.arange(steps + 1) - 1, 0), (n, steps + 1))
    chain = jax.jit(chain_residual_accept)(tokens, logq[:, 1:], logp, keys)
    tree = jax.jit(recursive_rejection_accept, static_argnums=(6, 7))(
        tokens, parent, jnp.zeros_like(parent), jnp.exp(logq), jnp.exp(logp), keys, steps, 1)
    np.testing.assert_array_equal(tree.num_accepted, chain.num_accepted)
    assert 0 < float(jnp.mean(chain.num_accepted)) < steps
    assert np.mean(np.asarray(tree.bonus) == np.asarray(chain.bonus)) > 0.99  # float ties of the residual aside


def test_values_keep_prefixes_and_reject_bad_tables(test_params, test_cfg):
    spec = js.SpecConfig.parse("s3_k4_d8")
    prior = prior_log_values(spec)
    assert prior.shape == (3, 4) and (np.diff(prior, axis=1) < 0).all() and (prior < 0).all()
    rising = jnp.asarray([[-2.0, -1.0, 0.5, -3.0]] * 3)
    made = make_sampled_draft(spec, Sampling.create(1.0), jnp.zeros((2,), jnp.int32), rising)
    np.testing.assert_allclose(made.log_value[0], [-2.0, -2.0, -2.0, -3.0])  # never rises with the rank
    with pytest.raises(ValueError, match="log_value"):
        make_sampled_draft(spec, Sampling.create(1.0), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="accept"):
        js.speculative_generate(test_params, test_cfg, [[1]], "s3_k2_d6", accept="rsd")


# ---------------------------------------------------------------------------------------------
# level 2: speculative_generate end to end
# ---------------------------------------------------------------------------------------------


# T = 0.5, and T = 1 with top-p 0.9 (plain T = 1: the widths, calibration and DSpark cases); the long tier fits an hour
FULL_E2E = [(s, t) for s in ("s3_k1_d4", "s3_k2_d6", "s2_k4_d9") for t in ("t0.5", "t1_p0.9")]


# CI runs the default rule ("residual") end to end in test_sampling.py (s3_k2_d6, T = 1, top-p 0.9).
@pytest.mark.long
@pytest.mark.parametrize("rule", ["residual", "target"])
@pytest.mark.parametrize("spec,setting", FULL_E2E)
def test_speculative_generate_samples_the_target_by_rule(confident_params, test_cfg, spec, setting, rule):
    result = check_end_to_end(confident_params, test_cfg, spec, setting, accept=rule)
    assert_samples_the_target(result)
    assert result["tau"] > 1.3, result


def test_residual_loop_compiles_once_and_greedy_is_generate(confident_params, test_cfg):
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5], [4], [3, 3, 3, 3]]
    kw = dict(max_new_tokens=8, accept="residual")
    first = js.speculative_generate(confident_params, test_cfg, prompts, "s2_k2_d4", temperature=1.0,
                                    rng=jax.random.key(0), **kw)
    before = speculative_compile_count()
    again = js.speculative_generate(confident_params, test_cfg, prompts[::-1], "s2_k2_d4", temperature=0.6,
                                    top_p=0.9, rng=jax.random.key(1), **kw)
    greedy = js.speculative_generate(confident_params, test_cfg, prompts, "s2_k2_d4", **kw)
    assert speculative_compile_count() == before  # settings, keys and prompts are traced
    assert first.stats["mean_accepted_length"] > 1.2 and again.stats["cycles"] > 0
    ref = js.generate(confident_params, test_cfg, prompts, max_new_tokens=8)
    np.testing.assert_array_equal(greedy.tokens, ref.tokens)
