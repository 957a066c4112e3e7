"""Node values over two features (`values="both"`, specs named `_vb`): a greedy map over the node's own
draft probability and its slot's confidence sigma(c). The fit recovers an acceptance that depends on
both (which a one-feature map cannot), stays monotone in the directions the event implies, round-trips
through calibration.json, the engine's lookup is the fit's numpy twin, a `_vb` tree calibrated on a
DSpark drafter's own samples stays token-identical to `generate`, and the misuses are one-line errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.core.dspark import DSparkConfig
from jaxspec.harness.calibrate import calibration_errors, collect, fit
from jaxspec.harness.fit_values import fit_map, predict
from jaxspec.speculation.dspark import dspark_draft
from jaxspec.speculation.values import (
    CONFIDENCE_EDGES,
    Calibration,
    both_first_feature,
    draft_fingerprint,
    node_log_values,
)
from jaxspec.testing import agreeing_dspark

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(40, 50))]


def two_feature_samples(n=40_000, seed=0):
    """Rank 0 accepted with own * (0.4 + 0.6 c), rank 1 with own * (1 - c): the confidence of the slot's
    top child raises its own acceptance and lowers its sibling's, at every draft probability."""
    rng = np.random.default_rng(seed)
    depth = rng.integers(1, 4, n)  # three depth bins: enough samples per cell for a tight check
    rank = rng.integers(0, 2, n)
    own = rng.uniform(0, 1, n) / (1 + rank)
    conf = rng.uniform(0, 1, n)
    p = np.where(rank == 0, own * (0.4 + 0.6 * conf), own * (1 - conf))
    label = (rng.uniform(0, 1, n) < p).astype(np.float32)
    top1 = np.where(rank == 0, own, own + (1 - own) * rng.uniform(0, 1, n))  # the slot's top child's probability
    runner_up = top1 * rng.uniform(0, 1, n)  # the slot's second child's
    samples = {"depth": depth, "rank": rank, "own_prob": own, "parent_top1": top1, "runner_up": runner_up,
               "label": label, "confidence": conf.astype(np.float32), "context": np.ones(n, np.int32)}
    return samples, p


def test_two_feature_fit_recovers_what_one_feature_cannot():
    train, _ = two_feature_samples()
    test, truth = two_feature_samples(seed=1)
    args = ("greedy", 0.0, train["depth"], train["rank"], train["own_prob"], train["label"])
    both, one = fit_map(*args, confidence=train["confidence"]), fit_map(*args)
    assert both.two_features and not one.two_features
    pred_both = predict(both, test["depth"], test["rank"], test["own_prob"], test["confidence"])
    pred_one = predict(one, test["depth"], test["rank"], test["own_prob"])
    err_both, err_one = np.mean(np.abs(pred_both - truth)), np.mean(np.abs(pred_one - truth))
    assert err_both < 0.05 and err_both < 0.5 * err_one, (err_both, err_one)
    table = both.array()  # [depth bins, ranks, prob bins, confidence bins]
    assert table.shape[-1] == len(CONFIDENCE_EDGES) + 1
    assert np.all(np.diff(table, axis=2) >= -1e-7)  # nondecreasing in the node's own probability
    assert np.all(np.diff(table[:, 0], axis=-1) >= -1e-7)  # rank 0: nondecreasing in the confidence
    # rank 1 is left free along the confidence, and the fit finds that it falls there
    sibling = (test["rank"] == 1) & (test["own_prob"] > 0.3)
    low, high = (np.mean(pred_both[sibling & sel]) for sel in (test["confidence"] < 0.3, test["confidence"] > 0.7))
    assert low > high + 0.15, (low, high)
    with pytest.raises(ValueError, match="only greedy maps"):
        fit_map("sampling", 1.0, *args[2:], confidence=train["confidence"])
    with pytest.raises(ValueError, match="needs the confidence feature"):
        predict(both, test["depth"], test["rank"], test["own_prob"])


@pytest.fixture(scope="module")
def both_calibration():
    samples, _ = two_feature_samples()
    return fit({0.0: samples, 1.0: samples}, "fingerprint", feature="both")


def test_both_calibration_round_trips_and_refuses_other_bins(both_calibration, tmp_path):
    cal = both_calibration
    assert cal.greedy.two_features and all(m.two_features for m in cal.greedy_by_context)
    assert not any(m.two_features for m in cal.sampling)  # sampling maps keep the parent's top-1 probability
    data = json.loads(json.dumps(cal.to_json()))
    assert Calibration.from_json(data) == cal
    errors = calibration_errors(cal, {0.0: two_feature_samples(seed=2)[0]})["T=0"]
    assert errors["ece_calibrated"] < 0.02, errors
    with pytest.raises(ValueError, match="other confidence bins"):
        Calibration.from_json({**data, "confidence_edges": [0.5]})
    with pytest.raises(ValueError, match="every greedy map needs"):
        Calibration.from_json({**data, "feature": "confidence"})  # its greedy map has one axis too many
    with pytest.raises(ValueError, match="confidence axis"):
        Calibration(cal.fingerprint, cal.greedy, cal.sampling, feature="draft")


def test_engine_lookup_is_the_fit(both_calibration):
    """`node_log_values` (jnp, in the drafting step) reads the same cells as `predict` (numpy, the fit)."""
    rng = np.random.default_rng(3)
    own = np.sort(rng.uniform(0.01, 1, (2, 3, 4)), axis=-1)[..., ::-1].astype(np.float32)  # [B, n, K] descending
    conf = np.broadcast_to(rng.uniform(0, 1, (2, 3, 1)), own.shape).astype(np.float32)
    for depth in (1, 4, 8):
        got = np.exp(np.asarray(node_log_values(both_calibration, depth, jnp.log(own), jnp.float32(0), None,
                                                jnp.asarray(conf))))
        rank = np.broadcast_to(np.arange(4), own.shape)
        prob = both_first_feature(rank, own, own[..., :1], own[..., 1:2])  # rank 0: 1 - q_1 / q_0; later: q_r / q_0
        want = predict(both_calibration.greedy, np.full(own.shape, depth), rank, prob, conf)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="confidence head"):
        node_log_values(both_calibration, 1, jnp.log(own), jnp.float32(0))
    with pytest.raises(ValueError, match="runner-up"):  # a chain's K = 1 alone cannot be valued by it
        node_log_values(both_calibration, 1, jnp.log(own[..., :1]), jnp.float32(0), None, jnp.asarray(conf[..., :1]))


@pytest.fixture(scope="module")
def draft(agreeing_params, test_cfg):
    dcfg = DSparkConfig(block_size=5, noise_token_id=test_cfg.vocab_size - 1, target_layers=(1, 2, 3),
                        markov_rank=test_cfg.hidden_size, num_stages=1)
    return dspark_draft(agreeing_dspark(agreeing_params, test_cfg, dcfg, jax.random.key(2)), dcfg)


def test_both_tree_fitted_on_its_drafter_is_generate(agreeing_params, test_cfg, draft):
    """The whole path: `collect(values="both")` records the DSpark drafter's sigma(c) beside each node's
    draft probability, `fit(feature="both")` maps them, and the `_vb` tree ranked by it is exact."""
    samples = collect(agreeing_params, test_cfg, PROMPTS, cycles=6, batch_size=4, num_steps=4, draft=draft,
                      values="both")
    conf = samples["confidence"]
    assert np.all((conf > 0) & (conf < 1)) and np.ptp(conf) > 0.05, (conf.min(), conf.max())
    cal = fit({0.0: samples}, draft_fingerprint(draft.params, test_cfg), feature="both")
    ref = js.generate(agreeing_params, test_cfg, PROMPTS, max_new_tokens=40)
    out = js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "s4_k2_d8_vb", max_new_tokens=40, draft=draft,
                                  calibration=cal)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    assert out.stats["mean_accepted_length"] > 2.0, out.stats["mean_accepted_length"]


def test_vb_without_a_both_calibration_is_one_line(agreeing_params, test_cfg, draft):
    with pytest.raises(ValueError, match="no uncalibrated form") as e:
        js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "s4_k2_d8_vb", max_new_tokens=8, draft=draft)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="has no confidence head"):
        collect(agreeing_params, test_cfg, PROMPTS, values="both")  # the MTP draft


@pytest.mark.parametrize("k", [1, 2])
def test_both_values_draft_a_chain_without_sorting_the_vocabulary(both_calibration, k):
    """A `_vb` chain reads each slot's top 2 but keeps 1: XLA:CPU compiled that top_k as a stable sort of
    the whole vocabulary (the shipped DSpark chain's draft 3.0 ms against 0.7), which the expander's
    barrier prevents. The compiled children step holds no sort, and its values are the lookup's."""
    from jaxspec.speculation.tree import Expander

    vocab = 2048
    logits = jax.random.normal(jax.random.key(0), (1, 1, vocab)) * 3  # [B, n, V]
    confidence = jnp.asarray([[0.4]])  # [B, n]
    expander = Expander(jnp.float32(0.0), None, None, k, both_calibration, source="both")

    def children(logits, confidence):
        zero = jnp.zeros((1, 1), jnp.float32)
        return expander.children(logits, confidence, zero, jnp.full((1, 1), -1, jnp.int32),
                                 jnp.zeros((1,), jnp.int32), 1)[0]

    compiled = jax.jit(children).lower(logits, confidence).compile().as_text()
    assert " sort(" not in compiled, "a full sort of the vocabulary is back in the drafting step"
    token, _, score, rank, feature, _ = children(logits, confidence)
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logp, top_token = jax.lax.top_k(logp, 2)
    np.testing.assert_array_equal(np.asarray(token), np.asarray(top_token[..., :k]).reshape(1, k))
    conf = jnp.broadcast_to(jax.nn.sigmoid(confidence)[..., None], (1, 1, 2))
    want = node_log_values(both_calibration, 1, top_logp, jnp.float32(0), None, conf)[..., :k]
    np.testing.assert_allclose(np.asarray(score), np.asarray(want).reshape(1, k), rtol=1e-6)
