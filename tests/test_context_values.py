"""Per-context greedy values (speculation/values.py `greedy_by_context`, `context_bins`; speculation/policy.py
`Policy.context`): the bins follow the sequence's own acceptance, each row reads its own map, the maps
round-trip and a file with other bins is a one-line error, and a deep tree (S >= CONTEXT_CAP) ranked
by them stays token-identical to `generate` and compiles once."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_calibration import PROMPTS, synthetic_samples

import jaxspec as js
from jaxspec.harness.calibrate import calibration_errors, fit, predict_values
from jaxspec.speculation.cycle import SpecStats
from jaxspec.speculation.generate import speculative_compile_count
from jaxspec.speculation.policy import Policy
from jaxspec.speculation.tree import Expander
from jaxspec.speculation.values import (
    CONTEXT_CAP,
    CONTEXT_EDGES,
    Calibration,
    context_bins,
    draft_fingerprint,
    load_calibration,
    node_log_values,
)
from jaxspec.testing import mtp_models, mtp_prefill, mtp_speculator


def context_samples(seed=0):
    """Synthetic greedy samples whose rank-0 acceptance rises with the context bin: 0.3 / 0.6 / 0.95."""
    samples, _ = synthetic_samples(n=9000, seed=seed)
    rng = np.random.default_rng(seed + 1)
    context = rng.integers(0, len(CONTEXT_EDGES) + 1, samples["label"].size)
    p = np.where(samples["rank"] == 0, np.asarray([0.3, 0.6, 0.95])[context], 0.02)
    samples["label"] = (rng.uniform(0, 1, p.size) < p).astype(np.float32)
    samples["context"] = context
    return samples


@pytest.fixture(scope="module")
def context_calibration(agreeing_params, test_cfg):
    samples = context_samples()
    return fit({0.0: samples, 1.0: samples}, draft_fingerprint(agreeing_params.mtp, test_cfg))


def test_context_bins_follow_the_mean_capped_acceptance(context_calibration):
    # cycles 0: the start bin; means 2, 3.5, 5, 5.5, 8
    capped = jnp.asarray([0, 8, 14, 20, 11, 24])
    cycles = jnp.asarray([0, 4, 4, 4, 2, 3])
    np.testing.assert_array_equal(np.asarray(context_bins(capped, cycles)), [1, 0, 1, 1, 2, 2])
    # the loop's stats: depth_hits[:, j] counts cycles that accepted more than j drafts
    spec = js.SpecConfig(10, 2, 12)
    stats = SpecStats.zeros(spec, 2).replace(depth_hits=jnp.asarray([[3] * 10, [2, 2, 1] + [0] * 7]),
                                             cycles=jnp.asarray([3, 2]))

    def loop_context(spec, values, stats):
        return Policy("greedy", values).context(spec, stats)

    np.testing.assert_array_equal(np.asarray(loop_context(spec, context_calibration, stats)), [2, 0])  # 8, 2.5
    assert loop_context(spec, None, stats) is None  # no calibration
    assert loop_context(spec, dataclasses.replace(context_calibration, greedy_by_context=()), stats) is None
    assert loop_context(js.SpecConfig(CONTEXT_CAP - 1, 2, 9), context_calibration, stats) is None  # too shallow


def test_each_row_reads_its_context_map(context_calibration):
    cal = context_calibration
    assert len(cal.greedy_by_context) == len(CONTEXT_EDGES) + 1
    logp = jnp.log(jnp.broadcast_to(jnp.asarray([0.5, 0.2]), (3, 1, 2)))  # [B=3, n=1, K=2], the same draft
    got = np.exp(np.asarray(node_log_values(cal, 2, logp, jnp.float32(0.0), jnp.asarray([0, 1, 2]))))
    rank0 = got[:, 0, 0]
    assert rank0[0] < rank0[1] < rank0[2], rank0
    np.testing.assert_allclose(rank0, [0.3, 0.6, 0.95], atol=0.08)
    pooled = np.exp(np.asarray(node_log_values(cal, 2, logp, jnp.float32(0.0))))
    assert not np.allclose(pooled, got)
    # sampling (temperature > 0) keeps its own map whatever the context
    sampled = node_log_values(cal, 2, logp, jnp.float32(1.0), jnp.asarray([0, 1, 2]))
    np.testing.assert_allclose(np.asarray(sampled), np.asarray(node_log_values(cal, 2, logp, jnp.float32(1.0))))
    heldout = context_samples(seed=5)
    errors = calibration_errors(cal, {0.0: heldout})["T=0"]
    assert errors["ece_per_context"] < 0.03, errors
    # both are calibrated on average; only the per-context values resolve the contexts (Brier score)
    by_context = np.mean((predict_values(cal, cal.greedy, heldout) - heldout["label"]) ** 2)
    pooled = np.mean((predict_values(dataclasses.replace(cal, greedy_by_context=()), cal.greedy, heldout)
                      - heldout["label"]) ** 2)
    assert by_context < pooled - 0.01, (by_context, pooled)


def test_context_maps_round_trip_and_other_bins_are_one_line(tmp_path, context_calibration):
    path = context_calibration.save(tmp_path)
    assert load_calibration(path) == context_calibration
    data = json.loads(path.read_text())
    assert data["context"]["edges"] == list(CONTEXT_EDGES) and data["context"]["cap"] == CONTEXT_CAP
    data["context"]["edges"] = [2.0, 4.0]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="context maps use other bins") as e:
        load_calibration(path)
    assert "\n" not in str(e.value)
    no_context = dataclasses.replace(context_calibration, greedy_by_context=())
    assert "context" not in no_context.to_json() and Calibration.from_json(no_context.to_json()) == no_context


def test_the_context_changes_the_tree(context_calibration, test_params, test_cfg):
    cfg, params, spec = test_cfg, test_params, js.SpecConfig(4, 2, 5)
    state = mtp_prefill(params, cfg, [PROMPTS[0]] * 3, [7] * 3, 64, spec=spec)
    sp = mtp_speculator(cfg, spec, values=context_calibration)
    expander = Expander(jnp.float32(0), jnp.asarray([0, 1, 2]), None, spec.topk, context_calibration)
    tree = jax.jit(lambda s, e: sp.drafter.draft(mtp_models(params), cfg, spec, s.drafter, s.root, e))(state, expander)
    score = np.asarray(tree.score)
    assert not np.allclose(score[0], score[2])  # same prompt, other context: other values
    parent = np.asarray(tree.parent)
    assert np.all(score[:, 1:] < np.take_along_axis(score, parent[:, 1:], axis=1))  # ancestors kept


def test_context_ranked_deep_tree_is_greedy_exact_and_compiles_once(context_calibration, agreeing_params, test_cfg):
    cfg = dataclasses.replace(test_cfg, sliding_window=16)  # room for S = CONTEXT_CAP draft steps
    spec = js.SpecConfig(CONTEXT_CAP, 2, CONTEXT_CAP + 2, "calibrated")
    ref = js.generate(agreeing_params, cfg, PROMPTS, max_new_tokens=40)
    out = js.speculative_generate(agreeing_params, cfg, PROMPTS, spec, max_new_tokens=40,
                                  calibration=context_calibration)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats["mean_accepted_length"] > 1.5
    before = speculative_compile_count()
    other = [[p + 1 for p in prompt] for prompt in PROMPTS]
    js.speculative_generate(agreeing_params, cfg, other, spec, max_new_tokens=40, calibration=context_calibration)
    assert speculative_compile_count() == before
