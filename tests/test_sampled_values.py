"""Sampled-draft values that read the parent's processed draft distribution (Calibration.residual,
tree/sampled.py): the tree shape then varies per row and cycle, the kept children of every node stay a
prefix of its sampling order, and `speculative_generate` still samples the target exactly."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import assert_samples_the_target, check_end_to_end

import jaxspec as js
from jaxspec.prefill import prefill_for_speculation
from jaxspec.sampling import Sampling
from jaxspec.tree.rules import draft_and_prune
from jaxspec.tree.sampled import residual_table
from jaxspec.tree.values import DEPTH_EDGES, NUM_RANKS, PROB_EDGES, Calibration, ValueMap

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


def calibration_with(maps):
    flat = ValueMap("greedy", 0.0, (0.5,) * int(np.prod(SHAPE)), (0,) * int(np.prod(SHAPE)))
    return Calibration("test", flat, (), residual=tuple(maps))


@functools.partial(jax.jit, static_argnums=(1, 2, 6))
def _draft(params, cfg, spec, tokens, lengths, sampling, values):
    state, root, hidden = prefill_for_speculation(params, cfg, tokens, lengths, 64, sampling)
    cycle = jnp.zeros((tokens.shape[0],), jnp.int32)
    return draft_and_prune(params, cfg, spec, state, root, hidden, "residual", sampling, cycle, values=values)


def test_residual_values_vary_the_shape_and_keep_prefixes(confident_params, test_cfg):
    spec = js.SpecConfig.parse("s3_k2_d6")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, test_cfg.vocab_size, (256, 8)), jnp.int32)
    lengths = jnp.full((256,), 8, jnp.int32)
    sampling = Sampling.create(1.0, key=jax.random.key(3))
    tree = _draft(confident_params, test_cfg, spec, tokens, lengths, sampling, calibration_with([branchy_map()]))
    parent, rank = np.asarray(tree.parent), np.asarray(tree.rank)
    shapes = {tuple(p) + tuple(r) for p, r in zip(parent, rank, strict=True)}
    assert len(shapes) >= 3, shapes  # the value reads the draft: the shape is not fixed
    root_children = np.sum((parent[:, 1:] == 0), axis=1)
    assert set(root_children.tolist()) == {1, 2}, np.bincount(root_children)  # branches at the root or not
    for p, r in zip(parent, rank, strict=True):
        for node in range(spec.num_draft_tokens):
            kids = np.flatnonzero(p[1:] == node) + 1
            assert sorted(r[kids].tolist()) == list(range(len(kids))), (p, r)  # a prefix of the sampling order
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
    np.testing.assert_allclose(high[:, 0], np.log(np.asarray(branchy_map().array()[0, 0])), rtol=1e-6)
    assert (np.diff(high, axis=1) <= 0).all() and (high <= 0).all()


def test_residual_maps_round_trip_json():
    cal = calibration_with([branchy_map(1.0), branchy_map(0.6)])
    back = Calibration.from_json(cal.to_json())
    assert [m.temperature for m in back.residual] == [0.6, 1.0] and back.sampling == ()
    assert back.residual[1] == cal.residual[1] and back.greedy == cal.greedy
    no_residual = dataclasses.replace(cal, residual=())
    assert Calibration.from_json(no_residual.to_json()).residual == ()


@pytest.mark.parametrize("setting", ["t1"])
def test_residual_values_sample_the_target(confident_params, test_cfg, monkeypatch, setting):
    """The chi-square harness of test_sampling.py through a K = 2 tree ranked by the branchy values."""
    cal = calibration_with([branchy_map(1.0)])
    monkeypatch.setattr(js, "speculative_generate", functools.partial(js.speculative_generate, calibration=cal))
    result = check_end_to_end(confident_params, test_cfg, "s3_k2_d6", setting)
    assert_samples_the_target(result)
    assert result["tau"] > 1.3, result
