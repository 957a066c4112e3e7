"""Sampled-draft values that read the parent's processed draft distribution (Calibration.residual,
speculation/sampled.py): the tree shape then varies per row and cycle, the kept children of every node
stay a prefix of its sampling order, and the output still follows the target exactly.

CI: the synthetic Markov models of test_rsd.py (vocabulary 8, fp32) drafted by the engine's own
`sampled_children` in the engine's beam (s3_k2_d5: 10 candidates, 4 kept), pruned by `prune_to_budget`,
accepted by `sampled_accept`; 20k rows against the target's joint law of the first 3 tokens.
A value that reads the child's own q(x) (forbidden) fails the same check. Long: the same through
`speculative_generate` on the test model, and the shapes of the real draft.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from test_rsd import NUM_EMITTED, VOCAB, markov_model
from test_sampling import ALPHA, assert_samples_the_target, check_end_to_end, chi_square_p

import jaxspec as js
from jaxspec.model.sampling import Sampling, node_keys, processed_logprobs
from jaxspec.speculation.policy import Policy
from jaxspec.speculation.sampled import make_sampled_draft, residual_table
from jaxspec.speculation.tree import Expander, grow_beam, prune_to_budget
from jaxspec.speculation.values import DEPTH_EDGES, NUM_RANKS, PROB_EDGES, Calibration, ValueMap
from jaxspec.speculation.verify import sampled_accept
from jaxspec.testing import mtp_prefill, mtp_tree

SHAPE = (len(DEPTH_EDGES) + 1, NUM_RANKS, len(PROB_EDGES) + 1)


def branchy_map(temperature=1.0):
    """A residual map that branches where the parent's draft is unsure: rank 0 worth ~its top-1
    probability, rank 1 worth more the flatter the parent (and worth more than a deep rank-0 path)."""
    centers = np.asarray([0.0, *PROB_EDGES]) + np.diff([0.0, *PROB_EDGES, 1.0]) / 2  # [P]
    table = np.empty(SHAPE)
    table[:, 0] = np.clip(centers, 0.05, 0.97)
    table[:, 1] = np.clip(0.9 * (1 - centers), 0.02, 0.9)
    table[:, 2:] = 0.01
    return ValueMap("residual", temperature, tuple(table.ravel().tolist()), (0,) * table.size)


def step_map(temperature, mode="residual"):
    """Unsure parent (processed top-1 < 0.4): both children worth keeping; sure: only the first."""
    unsure = np.asarray([0.0, *PROB_EDGES]) < 0.4  # [P], by each bin's lower edge
    table = np.empty(SHAPE)
    table[:, 0] = np.where(unsure, 0.6, 0.95)
    table[:, 1] = np.where(unsure, 0.5, 0.03)
    table[:, 2:] = 0.01
    return ValueMap(mode, temperature, tuple(table.ravel().tolist()), (0,) * table.size)


ROOTS = (3, 0)  # the Markov draft is sure after 3 (top-1 0.59 at T = 1, 0.82 at 0.6), unsure after 0 (0.28, 0.38)


def calibration_with(maps):
    flat = ValueMap("greedy", 0.0, (0.5,) * int(np.prod(SHAPE)), (0,) * int(np.prod(SHAPE)))
    by_mode = {mode: tuple(sorted((m for m in maps if m.mode == mode), key=lambda m: m.temperature))
               for mode in ("residual", "block")}
    return Calibration("test", flat, (), residual=by_mode["residual"], block=by_mode["block"])


SPEC = js.SpecConfig.parse("s3_k2_d5")


@struct.dataclass
class _Forbidden(Expander):
    """The engine's children, valued (when `own_prob`, traced) by the child's own draft probability:
    the forbidden value, which must fail the check."""

    own_prob: jax.Array = None  # [] bool

    def children(self, logits, confidence, score, pool_index, slots, depth):
        (token, parent, value, rank, feature, confidence), logq = super().children(
            logits, confidence, score, pool_index, slots, depth)
        b, k = score.shape[0], self.k
        own = jnp.take_along_axis(logq, token.reshape(b, -1, k), axis=2).reshape(b, -1)
        value = jnp.where(self.own_prob, jnp.repeat(score, k, axis=1) + own, value)
        return (token, parent, value, rank, feature, confidence), logq


@functools.partial(jax.jit, static_argnums=(2, 4, 6, 7))
def _synthetic_cycle(target, draft, n, sampling, values, own_prob, rule, spec=SPEC):
    """n rows of one cycle: the engine's beam (`tree.grow_beam`) over the Markov draft with sampled
    children, pruned, accepted, continued with exact target draws -> (first 3 tokens [n, 3], accepted [n], tree)."""
    s_steps, k = spec.num_steps, spec.topk
    cycle = jnp.zeros((n,), jnp.int32)
    sampler = make_sampled_draft(spec, sampling, cycle, None, Policy(rule, values).sampled_maps())
    root = jnp.asarray(ROOTS, jnp.int32)[jnp.arange(n) % len(ROOTS)]
    expander = _Forbidden(sampling.temperature, None, sampler, k, values, own_prob=own_prob)
    pool = grow_beam(spec, expander, root, lambda tok, parent, step, carry: (draft[step - 1][tok], None, carry), None)
    tree = prune_to_budget(pool, root, spec.num_draft_tokens)
    keys = node_keys(sampling.key, cycle, spec.num_draft_tokens)
    acc = sampled_accept(tree, target[tree.depth, tree.tokens], s_steps, k, sampling, keys, rule,
                         spec.greedy_set)
    path = jnp.take_along_axis(tree.tokens, acc.path_nodes, axis=1)
    slot = jnp.arange(s_steps + 1)[None, :]
    drafted = jnp.concatenate([path[:, 1:], jnp.zeros((n, 1), jnp.int32)], axis=1)
    out = jnp.where(slot < acc.num_accepted[:, None], drafted, acc.bonus[:, None])[:, :NUM_EMITTED]
    rest = jax.random.split(jax.random.fold_in(sampling.key, 7), NUM_EMITTED)
    for j in range(1, NUM_EMITTED):  # past the cycle: exact target draws
        logp = processed_logprobs(target[j, out[:, j - 1]], sampling.temperature, sampling.top_k, sampling.top_p)
        fresh = jax.random.categorical(rest[j], logp).astype(jnp.int32)
        out = out.at[:, j].set(jnp.where(acc.num_accepted + 1 > j, out[:, j], fresh))
    return out, acc.num_accepted, tree


def check_synthetic(temperature, variant="exact", n=20_480, seed=0, rule="block", spec=SPEC):
    target, draft = markov_model(seed)
    sampling = Sampling.create(temperature, key=jax.random.key(seed + 1))
    # each rule reads its own maps: the step table under both modes
    values = calibration_with([step_map(1.0), step_map(1.0, "block")])
    out, accepted, tree = _synthetic_cycle(target, draft, n, sampling, values,
                                           jnp.asarray(variant == "own_prob"), rule, spec)
    p = np.exp(np.asarray(processed_logprobs(target[:NUM_EMITTED], jnp.float32(temperature), jnp.int32(0),
                                             jnp.float32(1.0)), np.float64))
    p /= p.sum(-1, keepdims=True)
    # rows alternate between the roots: (root, t1, t2, t3) against the half-half mixture of their laws
    joint = np.stack([p[0, r][:, None, None] * p[1][:, :, None] * p[2][None, :, :] for r in ROOTS]) / len(ROOTS)
    which = np.arange(n) % len(ROOTS)
    cells = np.ravel_multi_index((which, *np.asarray(out).T), (len(ROOTS),) + (VOCAB,) * NUM_EMITTED)
    return chi_square_p(cells, joint.reshape(-1)), float(np.mean(accepted)), tree


def assert_prefixes(parent, rank):
    for p, r in zip(parent, rank, strict=True):
        for node in range(len(p)):
            kids = np.flatnonzero(p[1:] == node) + 1
            assert sorted(r[kids].tolist()) == list(range(len(kids))), (p, r)  # a prefix of the sampling order


@pytest.mark.parametrize("rule", ["block", "residual"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_value_driven_shapes_sample_the_target(temperature, rule):
    p, accepted, tree = check_synthetic(temperature, rule=rule)
    parent, rank = np.asarray(tree.parent), np.asarray(tree.rank)
    shapes = {tuple(a) + tuple(b) for a, b in zip(parent, rank, strict=True)}
    assert len(shapes) >= 4, shapes  # the value reads the draft: the shape varies per row
    assert set(np.sum(parent[:, 1:] == 0, axis=1).tolist()) == {1, 2}  # the root branches or not
    assert_prefixes(parent[:2000], rank[:2000])
    assert p > ALPHA, (p, accepted)
    assert accepted > 0.8, accepted


@pytest.mark.parametrize("rule", ["block", "residual"])
def test_value_driven_greedy_sets_sample_the_target(rule):
    """The greedy draft set (s3_k2_d5_gs: each node's argmax, then draws without it) in the engine's beam with
    shapes that vary per row, so that some argmaxes stand alone and some have their drawn sibling."""
    spec = js.SpecConfig.parse("s3_k2_d5_gs")
    p, accepted, tree = check_synthetic(1.0, rule=rule, spec=spec)
    parent = np.asarray(tree.parent)
    assert set(np.sum(parent[:, 1:] == 0, axis=1).tolist()) == {1, 2}  # the root's argmax alone or with a draw
    assert p > ALPHA, (p, accepted)
    assert accepted > 0.8, accepted


def test_value_reading_the_childs_own_probability_is_caught():
    p, accepted, _ = check_synthetic(1.0, "own_prob")
    assert p < ALPHA, (p, accepted)


def _draft(params, cfg, spec, tokens, lengths, sampling, values):
    state = mtp_prefill(params, cfg, tokens, lengths, 64, sampling, spec=spec)
    return mtp_tree(params, cfg, spec, state, "residual", values, sampling)


@pytest.mark.long  # ~1 minute of compiling on one core; the synthetic test above checks the same in CI
def test_residual_values_vary_the_shape_and_keep_prefixes(confident_params, test_cfg):
    spec = js.SpecConfig.parse("s3_k2_d6")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, test_cfg.vocab_size, (128, 8)), jnp.int32)
    lengths = jnp.full((128,), 8, jnp.int32)
    sampling = Sampling.create(1.0, key=jax.random.key(3))
    tree = _draft(confident_params, test_cfg, spec, tokens, lengths, sampling, calibration_with([branchy_map()]))
    parent, rank = np.asarray(tree.parent), np.asarray(tree.rank)
    shapes = {tuple(p) + tuple(r) for p, r in zip(parent, rank, strict=True)}
    assert len(shapes) >= 3, shapes  # the value reads the draft: the shape is not fixed
    root_children = np.sum((parent[:, 1:] == 0), axis=1)
    assert set(root_children.tolist()) == {1, 2}, np.bincount(root_children)  # branches at the root or not
    assert_prefixes(parent, rank)
    # the prior (no residual maps) keeps one shape for every row
    prior = _draft(confident_params, test_cfg, spec, tokens, lengths, sampling, calibration_with([]))
    assert len({tuple(p) for p in np.asarray(prior.parent)}) == 1


def test_residual_table_is_monotone_and_nearest_in_temperature():
    rising = np.full(SHAPE, 0.2)
    rising[:, 1] = 0.6  # rank 1 above rank 0: must be cut to rank 0's value
    maps = (ValueMap("residual", 0.6, tuple(rising.ravel()), (0,) * rising.size), branchy_map(1.0))
    spec = js.SpecConfig.parse("s3_k4_d8")
    low = np.asarray(residual_table(maps, spec, jnp.float32(0.7)))
    assert low.shape == (3, 4, len(PROB_EDGES) + 1)
    np.testing.assert_allclose(low[:, 1], np.log(0.2), rtol=1e-6)
    high = np.asarray(residual_table(maps, spec, jnp.float32(0.9)))
    np.testing.assert_allclose(high[:, 0], np.log(branchy_map().array()[:3, 0]), rtol=1e-6)
    assert (np.diff(high, axis=1) <= 0).all() and (high <= 0).all()


def test_residual_maps_round_trip_json():
    cal = calibration_with([branchy_map(1.0), branchy_map(0.6), step_map(1.0, "block")])
    back = Calibration.from_json(cal.to_json())
    assert [m.temperature for m in back.residual] == [0.6, 1.0] and back.sampling == ()
    assert back.residual == cal.residual and back.greedy == cal.greedy and back.block == cal.block
    # each sampled rule reads its own maps; the block rule falls back to the residual maps, else the prior
    assert Policy("block", back).sampled_maps() == back.block
    assert Policy("residual", back).sampled_maps() == back.residual
    assert Policy("block", dataclasses.replace(back, block=())).sampled_maps() == back.residual
    assert Policy("block", None).sampled_maps() == ()
    no_residual = dataclasses.replace(cal, residual=())
    assert Calibration.from_json(no_residual.to_json()).residual == ()


@pytest.mark.long  # ~2 minutes; test_value_driven_shapes_sample_the_target checks the rule with the same values
@pytest.mark.parametrize("setting", ["t1"])
def test_residual_values_sample_the_target(confident_params, test_cfg, monkeypatch, setting):
    """The chi-square harness of test_sampling.py through a K = 2 tree ranked by the branchy values."""
    cal = calibration_with([branchy_map(1.0)])
    monkeypatch.setattr(js, "speculative_generate", functools.partial(js.speculative_generate, calibration=cal))
    result = check_end_to_end(confident_params, test_cfg, "s3_k2_d6", setting)
    assert_samples_the_target(result)
    assert result["tau"] > 1.3, result


def test_residual_collection_labels_one_accepted_rank_at_most(confident_params, test_cfg):
    """`collect_residual` (jaxspec/harness/calibrate_residual.py) on the test model: every node's labels are
    shares in [0, 1] summing to at most 1 over its ranks (one child accepted per replay at most), and
    a first draw is accepted more often than a second on this confident draft."""
    from jaxspec.harness.calibrate_residual import collect_residual

    samples = collect_residual(confident_params, test_cfg, [[5, 6, 7, 8, 9, 10, 11], [3, 4]], 1.0, cycles=3,
                               batch_size=2, num_steps=3, topk=2, replays=4)
    label, rank = samples["label"], samples["rank"]
    assert label.size and np.all((label >= 0) & (label <= 1))
    per_node = label.reshape(-1, 2).sum(1)  # ranks 0, 1 of one node are adjacent
    assert np.all(per_node <= 1 + 1e-6) and np.array_equal(rank.reshape(-1, 2), np.tile([0, 1], (per_node.size, 1)))
    assert label[rank == 0].mean() > 2 * label[rank == 1].mean(), (label[rank == 0], label[rank == 1])


def test_block_replay_values_match_their_formulas():
    """`calibrate_block.replay_values` against closed forms (float64 numpy): with parent weight w and target
    T = w p, the rank-0 child passes with E min(1, T(x)/q(x)) = sum min(q, T), the rank-1 child with
    sum_v (q - T)+(v) sum_{x != v} min(q(x) / (1 - q(v)), (T - q)+(x) / (1 - sum min(q, T)))."""
    from jaxspec.harness.calibrate_block import replay_values

    rng = np.random.default_rng(0)
    n, vocab = 6, 8
    logq = np.log(rng.dirichlet(np.ones(vocab), n))
    p = rng.dirichlet(np.ones(vocab) * 0.7, n)
    w = np.asarray([1.0, 0.8, 0.5, 0.3, 0.9, 0.05])
    got = np.asarray(replay_values(jnp.asarray(logq, jnp.float32), jnp.asarray(p, jnp.float32),
                                   jnp.asarray(w, jnp.float32), jax.random.key(0), 2, 40_000))
    q, t = np.exp(logq), w[:, None] * p
    rank0 = np.minimum(q, t).sum(1)
    rest = np.maximum(t - q, 0.0) / (1.0 - rank0)[:, None]
    rank1 = np.asarray([sum(max(q[i, v] - t[i, v], 0.0) * sum(
        min(q[i, x] / (1.0 - q[i, v]), rest[i, x]) for x in range(vocab) if x != v) for v in range(vocab))
        for i in range(n)])
    np.testing.assert_allclose(got[:, 0], rank0, atol=0.01)
    np.testing.assert_allclose(got[:, 1], rank1, atol=0.01)
    assert np.all(got.sum(1) <= w + 0.01)  # the children never pass more often than their parent


def test_block_collection_weighs_labels_by_the_parent(confident_params, test_cfg):
    """`collect_block` on the test model: labels are non-negative shares of the parent's weight whose ratio of
    expectations per rank (and over a node's ranks) is at most 1, and the fitted block map reads the weights."""
    from jaxspec.harness.calibrate_block import collect_block, fit_block

    samples = collect_block(confident_params, test_cfg, [[5, 6, 7, 8, 9, 10, 11], [3, 4]], 1.0, cycles=3,
                            batch_size=2, num_steps=3, topk=2, replays=4)
    label, rank, weight = samples["label"], samples["rank"], samples["weight"]
    assert label.size and np.all(label >= 0) and np.all((weight > 0) & (weight <= 1))

    def ratio(x, w):
        return np.sum(x * w) / np.sum(w)

    assert ratio(label[rank == 0], weight[rank == 0]) <= 1 + 1e-5
    assert ratio(label.reshape(-1, 2).sum(1), weight[rank == 0]) <= 1 + 1e-5
    assert label[rank == 0].mean() > 2 * label[rank == 1].mean()
    fitted = fit_block(samples, 1.0)
    assert fitted.mode == "block" and all(0 < x < 1 for x in fitted.table)


def test_block_fit_keeps_labels_above_one():
    """A replayed label is a few draws of min(1, w_n p(x) / q(x)) / w_n, above 1 wherever p(x) > q(x) at a
    parent of small weight, while its expectation is at most 1: the fit is the cell's weighted mean of the
    labels as they are (clipping each sample at 1 would value deep chain nodes low)."""
    from jaxspec.harness.calibrate_block import fit_block
    from jaxspec.harness.fit_values import predict

    rng = np.random.default_rng(0)
    n = 4000
    weight = rng.uniform(0.05, 0.3, n)  # a deep node's parents: reached rarely
    label = np.where(rng.uniform(size=n) < 0.3, 2.4, 0.3)  # mean 0.93, 30% of the samples above 1
    samples = {"depth": np.full(n, 12), "rank": np.zeros(n, int), "parent_top1": np.full(n, 0.5),
               "label": label, "weight": weight}
    fitted = fit_block(samples, 1.0)
    truth = np.sum(label * weight) / np.sum(weight)
    got = predict(fitted, np.array([12]), np.array([0]), np.array([0.5]))[0]
    assert abs(got - truth) < 0.02 and got > 0.8  # clipped samples would give ~0.51
