"""Calibrated node values (speculation/values.py; harness/calibrate.py, harness/fit_values.py): the fit is
monotone and round-trips, calibrated and deep trees stay exact (greedy token-identical to `generate`,
sampling passes the chi-square harness), the loop compiles once, and bad input is one line."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import assert_samples_the_target, check_end_to_end

import jaxspec as js
from jaxspec.checkpoint import load_checkpoint, save_checkpoint
from jaxspec.cli import main
from jaxspec.harness.calibrate import calibration_errors, chain_with_children, collect, fit
from jaxspec.harness.fit_values import expected_calibration_error, fit_map, predict
from jaxspec.model.network import cpu_layout
from jaxspec.speculation.generate import speculative_compile_count
from jaxspec.speculation.values import (
    NUM_RANKS,
    PROB_EDGES,
    Calibration,
    draft_fingerprint,
    load_calibration,
    node_log_values,
    resolve_scores,
)
from jaxspec.testing import mtp_models, mtp_prefill, mtp_speculator, mtp_tree

TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-v4" / "tokenizer.json"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def synthetic_samples(n=6000, seed=0, depth_gain=0.0):
    """Samples whose true acceptance is known: rank 0 accepted with 0.5 + 0.5 * own_prob (far above
    the raw prob, as on the shipped draft), later ranks rarely."""
    rng = np.random.default_rng(seed)
    depth = rng.integers(1, 12, n)
    rank = rng.integers(0, 3, n)
    own = rng.uniform(0, 1, n) / (1 + rank)
    top1 = np.where(rank == 0, own, rng.uniform(own, 1))
    p = np.where(rank == 0, np.clip(0.5 + 0.5 * own + depth_gain * depth, 0, 1), 0.3 * (1 - top1))
    label = (rng.uniform(0, 1, n) < p).astype(np.float32)
    return {"depth": depth, "rank": rank, "own_prob": own, "parent_top1": top1, "label": label}, p


@pytest.fixture(scope="module")
def calibration(agreeing_params, test_cfg):
    samples, _ = synthetic_samples()
    return fit({0.0: samples, 1.0: samples}, draft_fingerprint(agreeing_params.mtp, test_cfg))


def test_fit_is_monotone_and_calibrated():
    samples, truth = synthetic_samples()
    greedy = fit_map("greedy", 0.0, samples["depth"], samples["rank"], samples["own_prob"], samples["label"])
    sampled = fit_map("sampling", 1.0, samples["depth"], samples["rank"], samples["parent_top1"], samples["label"])
    g, s = greedy.array(), sampled.array()
    assert g.shape[1:] == (NUM_RANKS, len(PROB_EDGES) + 1)
    assert np.all(np.diff(g, axis=-1) >= 0)  # nondecreasing in the node's own probability
    assert np.all(np.diff(s[:, 0], axis=-1) >= 0) and np.all(np.diff(s[:, 1:], axis=-1) <= 0)
    assert np.all((g > 0) & (g < 1))
    fitted = predict(greedy, samples["depth"], samples["rank"], samples["own_prob"])
    # the raw probability underrates rank 0 badly; the fit is close to the truth
    raw_err = expected_calibration_error(samples["own_prob"], samples["label"])
    fit_err = expected_calibration_error(fitted, samples["label"])
    assert raw_err > 0.08 and fit_err < 0.03, (raw_err, fit_err)
    assert np.mean(np.abs(fitted - truth)) < 0.06
    with pytest.raises(ValueError, match="mode must be"):
        fit_map("beam", 0.0, [1], [0], [0.5], [1.0])


def test_calibration_round_trips_and_checks_its_checkpoint(tmp_path, calibration, agreeing_params, test_params,
                                                            test_cfg):
    path = calibration.save(tmp_path)
    assert path.name == "calibration.json"
    assert load_calibration(path) == calibration and calibration.feature == "draft"
    samples, _ = synthetic_samples()  # a confidence-valued calibration keeps its feature through a trip
    confidence = fit({0.0: samples}, calibration.fingerprint, feature="confidence")
    assert load_calibration(confidence.save(tmp_path / "vc")).feature == "confidence"
    assert hash(load_calibration(tmp_path)) == hash(calibration)  # static in jit: hashable, equal after a trip
    # float32 cast of the same draft: same fingerprint; another draft: one-line error
    cast = jax.tree.map(lambda x: x.astype(jnp.float32), agreeing_params.mtp)
    assert draft_fingerprint(cast, test_cfg) == calibration.fingerprint
    # the CPU layout of the same weights (one leaf per expert): the same fingerprint
    assert draft_fingerprint(cpu_layout(agreeing_params.mtp, test_cfg), test_cfg) == calibration.fingerprint
    with pytest.raises(ValueError, match="fitted for another draft") as e:
        load_calibration(path, test_params.mtp, test_cfg)
    assert "\n" not in str(e.value)
    data = json.loads(path.read_text())
    data["maps"][0]["table"][0] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="values in"):
        load_calibration(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a jaxspec calibration"):
        load_calibration(path)


def test_load_checkpoint_carries_its_calibration_and_rejects_another(tmp_path, calibration, agreeing_params,
                                                                     test_params, test_cfg):
    save_checkpoint(tmp_path / "ok", test_cfg, agreeing_params)
    calibration.save(tmp_path / "ok")
    ckpt = load_checkpoint(tmp_path / "ok")
    assert ckpt.draft.calibration == calibration
    assert resolve_scores(js.SpecConfig(2, 2, 4), ckpt.draft.calibration)[1] == calibration
    assert resolve_scores(js.SpecConfig(2, 2, 4), None)[1] is None  # no calibration: raw draft values
    assert resolve_scores(js.SpecConfig(2, 2, 4, "draft"), calibration)[1] is None
    # nothing is registered behind the caller's back: params alone speculate with raw values
    out = js.speculative_generate(ckpt.params, test_cfg, PROMPTS[:1], "s2_k2_d4", max_new_tokens=4)
    assert out.stats["scores"] == "draft"
    out = js.speculative_generate(ckpt.params, test_cfg, PROMPTS[:1], "s2_k2_d4", max_new_tokens=4, draft=ckpt.draft)
    assert out.stats["scores"] == "calibrated"
    save_checkpoint(tmp_path / "other", test_cfg, test_params)
    calibration.save(tmp_path / "other")
    with pytest.raises(ValueError, match="another draft"):
        load_checkpoint(tmp_path / "other")
    with pytest.raises(ValueError, match="another draft"):
        js.speculative_generate(test_params, test_cfg, PROMPTS[:1], "s2_k2_d4", max_new_tokens=4,
                                calibration=tmp_path / "other")
    with pytest.raises(ValueError, match='scores="calibrated" needs a calibration'):
        resolve_scores(js.SpecConfig(2, 2, 4, "calibrated"), None)
    with pytest.raises(ValueError, match="scores must be one of"):
        js.SpecConfig(2, 2, 4, "beam")
    with pytest.raises(ValueError, match="needs a draft"):
        js.speculative_generate(test_params.replace(mtp=None), test_cfg, PROMPTS[:1], "s2_k2_d4")


def test_calibrated_values_change_the_tree(calibration, test_params, test_cfg):
    """Raw log-probs of an unsure draft put the budget on siblings; the calibrated values (rank 0
    accepted 0.5-1) on depth."""
    cfg, params = test_cfg, test_params
    spec = js.SpecConfig(5, 2, 6)
    state = mtp_prefill(params, cfg, [PROMPTS[0]], [7], 64)
    raw = mtp_tree(params, cfg, spec, state)
    cal = mtp_tree(params, cfg, spec, state, values=calibration)
    assert not np.array_equal(np.asarray(raw.parent), np.asarray(cal.parent))
    def depth(tree):
        return int(np.asarray(tree.depth).max())

    assert depth(cal) >= depth(raw)
    # scores fall along every path, so pruning keeps ancestors
    score, parent = np.asarray(cal.score)[0], np.asarray(cal.parent)[0]
    assert np.all(score[1:] < score[parent[1:]])
    # the sampling map never reads the child's own probability: siblings differ only by rank
    logp = jnp.log(jnp.asarray([[[0.5, 0.3], [0.5, 0.1]]]))
    by_own = node_log_values(calibration, 2, logp, jnp.float32(1.0))
    assert np.allclose(by_own[0, 0], by_own[0, 1])
    greedy = node_log_values(calibration, 2, jnp.log(jnp.asarray([[[0.9, 0.05], [0.2, 0.1]]])), jnp.float32(0.0))
    assert greedy[0, 0, 0] > greedy[0, 1, 0]  # greedy: a surer top-1 child is worth more


@pytest.mark.parametrize("spec", ["s3_k2_d4", pytest.param("s5_k2_d6", marks=pytest.mark.long)])  # S = D - 1, K = 2
def test_calibrated_and_deep_trees_are_greedy_exact(calibration, agreeing_params, test_cfg, spec):
    cfg, params = test_cfg, agreeing_params
    ref = js.generate(params, cfg, PROMPTS, max_new_tokens=24)
    for scores, cal in (("calibrated", calibration), ("draft", None)):
        s = js.SpecConfig.parse(spec)
        out = js.speculative_generate(params, cfg, PROMPTS, js.SpecConfig(s.num_steps, s.topk, s.num_draft_tokens,
                                      scores), max_new_tokens=24, calibration=cal)
        assert out.stats["scores"] == scores
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        assert out.stats["mean_accepted_length"] > 1.5


def test_calibrated_loop_compiles_once(calibration, agreeing_params, test_cfg):
    cfg, params = test_cfg, agreeing_params
    spec = js.SpecConfig(3, 2, 4, "calibrated")  # the program the test above compiled (same spec and lengths)
    js.speculative_generate(params, cfg, PROMPTS, spec, max_new_tokens=24, calibration=calibration)
    before = speculative_compile_count()
    other = [[p + 1 for p in prompt] for prompt in PROMPTS]  # same buckets, more cycles
    out = js.speculative_generate(params, cfg, other, spec, max_new_tokens=24, calibration=calibration)
    assert out.stats["cycles"] > 3 and speculative_compile_count() == before


def test_chain_collection_matches_draft_tree(agreeing_params, test_cfg, calibration):
    cfg, params = test_cfg, agreeing_params
    state = mtp_prefill(params, cfg, PROMPTS[2:] * 2, [9, 9], 64)
    chain, top_logp, top_token, confidence = jax.jit(chain_with_children, static_argnums=(0, 3))(
        mtp_speculator(cfg, "s4_k1_d5"), mtp_models(params), state, 3, jnp.float32(0))
    tree = mtp_tree(params, cfg, "s4_k1_d5", state)  # the drafter's own sS_k1 chain
    np.testing.assert_array_equal(np.asarray(chain.tokens), np.asarray(tree.tokens))
    np.testing.assert_array_equal(np.asarray(top_token[..., 0]), np.asarray(tree.tokens[:, 1:]))
    np.testing.assert_allclose(np.cumsum(np.asarray(top_logp[..., 0]), 1), np.asarray(tree.score[:, 1:]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(confidence), 1.0)  # an MTP draft has no confidence head
    samples = collect(params, cfg, PROMPTS, 0.0, cycles=3, batch_size=4, num_steps=4, topk=3)
    assert set(np.unique(samples["rank"])) == {0, 1, 2} and samples["depth"].max() <= 4
    assert set(np.unique(samples["label"])) <= {0.0, 1.0}
    # per parent accepted, at most one of its children is the target's argmax
    assert samples["label"].sum() <= samples["rank"].size / 3 + 1e-6
    errors = calibration_errors(calibration, {0.0: samples})
    assert set(errors["T=0"]) == {"ece_raw", "ece_calibrated", "mean_label", "samples"}
    with pytest.raises(ValueError, match="needs a draft"):
        collect(params.replace(mtp=None), cfg, PROMPTS)


@pytest.mark.parametrize("argv,expected", [
    (["calibrate", "--checkpoint", "nowhere", "--datasets", "gsm8k,wiki"], "unknown dataset 'wiki'"),
    (["calibrate", "--checkpoint", "nowhere", "--temperatures", "0"], "--temperatures must be > 0"),
    (["calibrate", "--checkpoint", "nowhere"], "does not exist"),
])
def test_calibrate_bad_input_is_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value.code)
    assert expected in message and "\n" not in message


def test_calibrate_needs_a_draft(tmp_path):
    cfg = js.ModelConfig.preset("test").replace(num_mtp_layers=0)
    save_checkpoint(tmp_path, cfg, js.init_params(cfg, jax.random.key(0)))
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")  # any tokenizer: the MTP check comes first
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--checkpoint", str(tmp_path)])
    assert "has no draft" in str(e.value.code) and "\n" not in str(e.value.code)


def test_confidence_values_need_a_confidence_head(agreeing_params, test_cfg):
    """values="confidence" (`jaxspec calibrate --values confidence`) reads a DSpark drafter's confidence head;
    an MTP draft has none, and its samples would silently be draft probabilities."""
    with pytest.raises(ValueError, match="has no confidence head"):
        collect(agreeing_params, test_cfg, PROMPTS, values="confidence")


CI_SAMPLING = [("s3_k2_d6", "t1", 4096)]
LONG_SAMPLING = [(spec, t, 12_288) for spec in ("s3_k2_d6", "s5_k2_d6") for t in ("t0.5", "t1")]


def _sampling_case(calibration, params, cfg, spec, setting, n):
    result = check_end_to_end(params, cfg, spec, setting, n=n, calibration=calibration)
    assert_samples_the_target(result)
    assert result["tau"] > 1.3, result


@pytest.mark.long  # ~2 minutes; test_sampling's CI case checks the loop's sampling, test_rsd the rules
@pytest.mark.parametrize("spec,setting,n", CI_SAMPLING)
def test_calibrated_tree_samples_the_target(calibration, confident_params, test_cfg, spec, setting, n):
    cal = Calibration(draft_fingerprint(confident_params.mtp, test_cfg), calibration.greedy, calibration.sampling)
    _sampling_case(cal, confident_params, test_cfg, spec, setting, n)


@pytest.mark.long
@pytest.mark.parametrize("spec,setting,n", LONG_SAMPLING)
def test_calibrated_deep_trees_sample_the_target_long(calibration, confident_params, test_cfg, spec, setting, n):
    cal = Calibration(draft_fingerprint(confident_params.mtp, test_cfg), calibration.greedy, calibration.sampling)
    _sampling_case(cal, confident_params, test_cfg, spec, setting, n)


def test_cli_calibrate_fits_block_values_too(tmp_path):
    """`jaxspec calibrate` on the shipped checkpoint, tiny settings: the file holds the greedy and sampling maps
    and the block rule's maps at each temperature, and loads against the draft (docs/block_verification.md)."""
    import os

    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.cli import main
    from jaxspec.speculation.values import load_calibration
    from jaxspec.training.data import data_available

    if not (os.path.isdir("checkpoints/tiny-v4") and data_available()):
        pytest.skip("needs the shipped checkpoint and ../shared/data")
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--checkpoint", "checkpoints/tiny-v4", "--datasets", "gsm8k", "--num-prompts", "2",
                 "--cycles", "2", "--steps", "3", "--topk", "2", "--temperatures", "1.0", "--heldout", "0",
                 "--batch-size", "2", "--out", str(out)]) == 0
    ckpt = load_checkpoint("checkpoints/tiny-v4", dtype="float32")
    cal = load_calibration(out, ckpt.draft.params, ckpt.cfg)
    assert [m.temperature for m in cal.sampling] == [1.0] and [m.mode for m in cal.block] == ["block"]
