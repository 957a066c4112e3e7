"""Trees over DSpark (speculation/dspark.py): greedy DSpark chains and parent-conditioned trees are
token-identical to `generate`, sampled ones follow the target (chi-square), the loop compiles once, a
0731-style release folder (plain, FP8, FP4) speculates through `load_release`, and a depth beyond the block
or the other draft is a one-line error.

Acceptance is made realistic with `testing.agreeing_dspark` (its Markov head computes the agreeing
target's next-token function): per-depth acceptance ~0.6-0.9 with sibling accepts, so the identity
runs exercise partial paths and sibling commits, which the tests assert happened."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dspark_layout import write_folder
from sampling_laws import ALPHA
from test_sampling import PROMPT, assert_samples_the_target, check_end_to_end
from test_sampling_reference import law_statistics

import jaxspec as js
from jaxspec.core.dspark import DSparkConfig
from jaxspec.speculation.dspark import dspark_draft
from jaxspec.speculation.generate import speculative_compile_count
from jaxspec.testing import agreeing_dspark

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(40, 50))]


@pytest.fixture(scope="module")
def dcfg(test_cfg):
    return DSparkConfig(block_size=5, noise_token_id=test_cfg.vocab_size - 1, target_layers=(1, 2, 3),
                        markov_rank=test_cfg.hidden_size, num_stages=1)


@pytest.fixture(scope="module")
def draft(agreeing_params, test_cfg, dcfg):
    return dspark_draft(agreeing_dspark(agreeing_params, test_cfg, dcfg, jax.random.key(2)), dcfg)


@pytest.fixture(scope="module")
def confident_draft(confident_params, test_cfg, dcfg):
    """The agreeing DSpark drafter of the sharpened target: the sampling tests' draft, built once."""
    return dspark_draft(agreeing_dspark(confident_params, test_cfg, dcfg, jax.random.key(2)), dcfg)


# CI: a chain, a K = 2 tree and a confidence-width tree; the wide deep tree (K = 4, D = 12) is long.
@pytest.mark.parametrize("spec", ["s4_k1_d5", "s4_k2_d8", pytest.param("s5_k4_d12", marks=pytest.mark.long),
                                  "s5_k2_d8_vc"])
def test_greedy_dspark_chains_and_trees_are_generate(agreeing_params, test_cfg, draft, spec):
    ref = js.generate(agreeing_params, test_cfg, PROMPTS, max_new_tokens=40)
    out = js.speculative_generate(agreeing_params, test_cfg, PROMPTS, spec, max_new_tokens=40, draft=draft)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    depth = np.asarray(out.stats["per_depth_acceptance"])
    # partial paths: every depth is reached and some cycles stop before the last one
    assert depth[0] > 0.5 and depth[-1] > 0.2 and depth[-1] < depth[0], depth
    if js.SpecConfig.parse(spec).topk > 1:  # a sibling (rank >= 1) was accepted and committed
        assert sum(out.stats["rank_histogram"][1:]) >= 2, out.stats["rank_histogram"]


def test_dspark_confidence_chooses_the_verify_width(agreeing_params, test_cfg, draft):
    """The confidence head as a per-cycle verify width: `_vc` values the nodes by the confidence head's
    path value, and `_w4` verifies 4 or 8 nodes by that value (a static threshold); output exact."""
    ref = js.generate(agreeing_params, test_cfg, PROMPTS, max_new_tokens=40)
    spec = dataclasses.replace(js.SpecConfig.parse("s4_k2_d8_w4_vc"), width_threshold=0.5)
    out = js.speculative_generate(agreeing_params, test_cfg, PROMPTS, spec, max_new_tokens=40, draft=draft)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    seq = out.stats["per_sequence"]
    per_cycle = np.sum(seq["verified"]) / np.sum(seq["cycles"])
    assert 4 < per_cycle < 8, per_cycle  # both widths were chosen


def test_dspark_loop_compiles_once_and_checks_its_depth(agreeing_params, test_cfg, draft):
    js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "s4_k2_d8", max_new_tokens=16, draft=draft)
    before = speculative_compile_count()
    other = [[p + 1 for p in prompt] for prompt in PROMPTS]
    out = js.speculative_generate(agreeing_params, test_cfg, other, "s4_k2_d8", max_new_tokens=16, draft=draft)
    assert speculative_compile_count() == before and out.stats["cycles"] > 3
    with pytest.raises(ValueError, match=r"deeper than the DSpark block of 5 positions: allowed 1\.\.5$"):
        js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "s6_k1_d7", draft=draft)


def test_a_pruned_tree_accepts_the_beam_path_nodes_it_keeps(agreeing_params, test_cfg, draft):
    """What `experiments/dspark/ranking_bound.py` reads a ranking's tau off: from the same state, a tree of
    D nodes accepts exactly the nodes of the whole beam's accepted path that are among the beam's D - 1
    best-scoring candidates (the whole beam verified at once, s4_k2_d15, against its pruning s4_k2_d8)."""
    from jaxspec.model.network import Models
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation.cycle import (
        Speculator,
        accept_stage,
        commit_stage,
        draft_stage,
        plan_stage,
        prefill,
        verify_stage,
    )
    from jaxspec.speculation.policy import Policy

    full, pruned = (Speculator(test_cfg, js.SpecConfig.parse(s), draft.drafter, Policy("greedy"))
                    for s in ("s4_k2_d15", "s4_k2_d8"))
    models = Models(target=agreeing_params.replace(mtp=None), drafter=draft.params)
    sampling = Sampling.create(0.0, key=jax.random.key(0))
    width = max(map(len, PROMPTS))
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in PROMPTS], jnp.int32)
    lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)

    def run(sp, state):
        tree = draft_stage(sp, models, state, sampling)
        out = verify_stage(sp, models, state.target, tree, plan_stage(sp, state.target, tree))
        return tree, out, accept_stage(sp, tree, out.logits, sampling, state.stats.cycles)

    @jax.jit
    def cycle(state):
        tree, out, acc = run(full, state)
        small_tree, _, small = run(pruned, state)
        _, best = jax.lax.top_k(tree.score[:, 1:], 7)  # the pruning's choice among the beam's 14
        best = jnp.sort(best, axis=1) + 1
        rows = jnp.arange(3)[:, None]
        on_path = jnp.zeros(tree.score.shape, bool).at[rows, acc.path_nodes].max(
            jnp.arange(acc.path_nodes.shape[1])[None, :] <= acc.num_accepted[:, None])
        state, _ = commit_stage(full, models, state, tree, out, acc, jnp.ones((3,), bool))
        kept_tokens = jnp.take_along_axis(tree.tokens, best, axis=1)
        return (state, acc.num_accepted, jnp.sum(on_path[rows, best], axis=1), small.num_accepted, kept_tokens,
                small_tree.tokens[:, 1:])

    state = prefill(full, models, tokens, lengths, 64, sampling)
    seen = []
    for _ in range(10):
        state, whole, expected, got, kept_tokens, pruned_tokens = cycle(state)
        np.testing.assert_array_equal(pruned_tokens, kept_tokens)  # the D = 8 tree is the beam's 7 best
        np.testing.assert_array_equal(got, expected)
        seen.append((np.asarray(whole), np.asarray(got)))
    whole, got = (np.concatenate(x) for x in zip(*seen, strict=True))
    assert np.any(got < whole) and np.any(got > 0), seen  # the pruning cut some paths, and kept some


# Long: the first three tokens of 4,096 rows by chi-square (marginals and conditionals); CI samples the same
# tree over 16 tokens below (the transformed tokens' law, at both temperatures).
@pytest.mark.long
@pytest.mark.parametrize("spec,setting", [("s3_k1_d4", "t1_p0.9"), ("s3_k2_d6", (0.6, 8, 0.9))])
def test_sampled_dspark_chain_and_tree_follow_the_target(confident_params, test_cfg, confident_draft, spec, setting):
    draft = confident_draft
    result = check_end_to_end(confident_params, test_cfg, spec, setting, n=4096, draft=draft)
    assert_samples_the_target(result)
    assert result["tau"] > 1.5, result  # the sampled drafts are accepted, not just the bonus


# A DSpark chain and a K = 2 tree, each at T = 0.6 and T = 1 with top-k and top-p; the settings are traced, so
# one compiled loop per spec serves both temperatures.
# CI: the tree (the chain adds ~75 s of compiling; the block rule's chains pass the chi-square in CI on synthetic
# models, tests/test_rsd.py, and the DSpark drafter's sampled path is the tree's).
@pytest.mark.parametrize("spec,setting", [pytest.param("s3_k1_d4", (0.6, 8, 0.9), marks=pytest.mark.long),
                                          pytest.param("s3_k1_d4", (1.0, None, 0.9), marks=pytest.mark.long),
                                          ("s3_k2_d6", (1.0, 24, 0.8)), ("s3_k2_d6", (0.6, 8, 0.9))])
def test_sampled_dspark_rows_follow_the_target_over_cycles(confident_params, test_cfg, confident_draft, spec,
                                                           setting):
    """512 rows x 16 tokens after a 7-token prompt: several cycles per row, across the sliding window (8),
    CSA (4) and HCA (16) boundaries. Every token's randomized probability integral transform under the
    target's law at its position (a one-shot prefill of the row, numpy's temperature / top-k / top-p)
    is uniform, and consecutive tokens' are independent, iff the rows follow the target: the statistics
    `generate` passes in test_sampling_reference.py, here over cycle and compression boundaries."""
    check_rows_follow_the_target(confident_params, test_cfg, confident_draft, spec, setting, min_tau=1.5)


def check_rows_follow_the_target(params, cfg, draft, spec, setting, min_tau):
    """512 rows x 16 tokens after PROMPT, sampled with `draft`: at least 3 cycles a row and tau > `min_tau`;
    every token's randomized probability integral transform under the target's law is uniform and
    consecutive ones independent, and the same tokens fail them under a 1.25x temperature (the check has power)."""
    rows, new = 512, 16
    temperature, top_k, top_p = setting
    out = js.speculative_generate(params, cfg, [PROMPT] * rows, spec, max_new_tokens=new,
                                  temperature=temperature, top_k=top_k, top_p=top_p, rng=jax.random.key(5),
                                  draft=draft)
    assert (out.lengths == new).all()
    cycles = np.asarray(out.stats["per_sequence"]["cycles"])
    assert cycles.min() >= 3 and out.stats["mean_accepted_length"] > min_tau, (cycles.mean(), out.stats)
    sequences = np.concatenate([np.tile(PROMPT, (rows, 1)), out.tokens], axis=1)
    logits = np.asarray(js.prefill_logits(params, cfg, jnp.asarray(sequences[:, :-1], jnp.int32)))
    stats = law_statistics(out.tokens, logits[:, len(PROMPT) - 1:], setting)
    assert stats["impossible"] == 0, stats
    assert min(stats["uniform"], stats["pairs"], stats["token1"]) > ALPHA / 3, stats  # Bonferroni over 3
    wrong = law_statistics(out.tokens, logits[:, len(PROMPT) - 1:], (temperature * 1.25, top_k, top_p))
    assert wrong["impossible"] > 0 or min(wrong["uniform"], wrong["pairs"]) < ALPHA, wrong  # the check has power


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folders = {}
    for fmt in ("f32", "fp8", "fp4"):
        path = tmp_path_factory.mktemp(f"v4-dspark-{fmt}")
        write_folder(str(path), fmt)
        folders[fmt] = str(path)
    return folders


@pytest.mark.parametrize("fmt", ["f32", "fp8", "fp4"])
def test_release_folder_speculates_greedy_exactly(release, fmt):
    ckpt = js.load_release(release[fmt], dtype="float32")
    assert ckpt.draft.name == "dspark" and ckpt.params.mtp is None
    cfg, params, _ = ckpt
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82]]
    ref = js.generate(params, cfg, prompts, max_new_tokens=24)
    # A tree (its chain is the grid's above): every format dequantizes to the same float32 program.
    out = js.speculative_generate(params, cfg, prompts, "s4_k2_d8", max_new_tokens=24, draft=ckpt.draft)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_release_folder_draft_mismatch_is_one_line(release, tmp_path):
    april = tmp_path / "april"
    write_folder(str(april), "f32", draft="mtp")
    with pytest.raises(ValueError, match="holds a mtp draft, not a dspark draft") as e:
        js.load_release(april, draft="dspark")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="holds a dspark draft, not a mtp draft"):
        js.load_release(release["f32"], draft="mtp")
    assert js.load_release(april).draft.drafter.name == "mtp"
    assert js.load_release(release["f32"], draft="none").draft is None


def test_a_dspark_draft_beside_a_checkpoint_round_trips(tmp_path, agreeing_params, test_cfg, draft):
    """drafts/<name>/ holds a DSpark drafter (dspark/ + dspark.json); load_checkpoint(draft=name) brings it,
    the target stays the checkpoint's own, and a bad name lists the drafts."""
    from jaxspec.checkpoint.drafts import draft_names, save_draft

    js.save_checkpoint(tmp_path, test_cfg, agreeing_params)
    save_draft(tmp_path, "dspark", test_cfg, draft.params, {"recipe": "test"}, config=draft.drafter.config)
    assert draft_names(tmp_path) == ["default", "dspark"]
    ckpt = js.load_checkpoint(tmp_path, draft="dspark", cpu_experts=True)
    assert ckpt.draft.drafter == draft.drafter and ckpt.draft.name == "dspark"
    assert ckpt.params.mtp is not None  # the checkpoint's own MTP block is still its own
    out = js.speculative_generate(ckpt.params, ckpt.cfg, PROMPTS, "s4_k2_d8", max_new_tokens=16, draft=ckpt.draft)
    want = js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "s4_k2_d8", max_new_tokens=16, draft=draft)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    assert out.stats["per_sequence"] == want.stats["per_sequence"]  # the same drafts: the same acceptance
    with pytest.raises(ValueError, match="has no draft 'spark'; drafts: default, dspark"):
        js.load_checkpoint(tmp_path, draft="spark")


def test_a_release_folder_brings_its_calibration_and_tuning(release, tmp_path):
    """`jaxspec calibrate / tune --checkpoint RELEASE` write beside the weights; load_release reads them
    back onto the draft (a calibration fitted for it; an unreadable tune.json warns and is kept)."""
    import shutil

    from jaxspec.speculation.drafter import Unreadable
    from jaxspec.speculation.values import Calibration, ValueMap, draft_fingerprint

    folder = tmp_path / "release"
    shutil.copytree(release["f32"], folder)
    ckpt = js.load_release(folder, dtype="float32")
    assert ckpt.draft.calibration is None and ckpt.draft.tuning is None
    cells = 7 * 4 * 13
    greedy = ValueMap("greedy", 0.0, (0.5,) * cells, (1,) * cells)
    Calibration(fingerprint=draft_fingerprint(ckpt.draft.params, ckpt.cfg), greedy=greedy, sampling=()).save(
        str(folder))
    (folder / "tune.json").write_text("{not json")
    with pytest.warns(UserWarning, match="tune.json is unreadable"):
        again = js.load_release(folder, dtype="float32")
    assert again.draft.calibration is not None and again.draft.calibration.greedy.table[0] == 0.5
    assert isinstance(again.draft.tuning, Unreadable)
