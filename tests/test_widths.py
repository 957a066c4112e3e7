"""Width chosen per cycle (`speculation/cycle.py`): `shrink` keeps what pruning the pool to that budget keeps,
the width follows the widest active row, spec names carry the widths, and the loop with per-cycle
widths stays exact (greedy token-identical to `generate`, one compile; the chi-square harness at
T = 0.6 / 1.0 under both rules in the long tier)."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_sampled_values import branchy_map, calibration_with
from test_sampling import assert_samples_the_target, check_end_to_end

import jaxspec as js
from jaxspec.speculation.cycle import choose_width
from jaxspec.speculation.generate import speculative_compile_count
from jaxspec.speculation.tree import DraftPool, Tree, prune_to_budget, shrink
from jaxspec.testing import mtp_prefill, mtp_tree

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def test_spec_names_carry_the_widths():
    spec = js.SpecConfig.parse("s15_k2_d16_w4.8")
    assert spec.widths == (4, 8, 16) and spec.name == "s15_k2_d16_w4.8"
    assert js.SpecConfig.parse(spec.name) == spec
    assert js.SpecConfig.parse("s3_k2_d6").widths == ()
    for bad in ((4, 2, 6), (1, 6), (3, 5)):
        with pytest.raises(ValueError, match="widths must be ascending"):
            js.SpecConfig(3, 2, 6, widths=bad)
    with pytest.raises(ValueError, match="width_threshold"):
        js.SpecConfig(3, 2, 6, widths=(3, 6), width_threshold=1.5)


def test_shrink_keeps_what_pruning_the_pool_keeps(test_params, test_cfg):
    cfg, params = test_cfg, test_params
    whole = js.SpecConfig(4, 2, js.SpecConfig(4, 2, 8).max_draft_tokens)  # the tree of every candidate = the pool
    state = mtp_prefill(params, cfg, PROMPTS[2:] * 2, [9, 9], 64, spec=whole)
    every = mtp_tree(params, cfg, whole, state)
    pool = DraftPool(token=every.tokens[:, 1:], parent=every.parent[:, 1:] - 1, score=every.score[:, 1:],
                     rank=every.rank[:, 1:], depth=every.depth[:, 1:], feature=every.feature[:, 1:],
                     confidence=every.confidence[:, 1:])
    tree = prune_to_budget(pool, state.root, 8)
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(mtp_tree(params, cfg, "s4_k2_d8", state).tokens))
    for width in (2, 4, 5, 8):
        got, want = shrink(tree, width), prune_to_budget(pool, state.root, width)
        for name in ("tokens", "parent", "depth", "rank", "score", "feature", "confidence"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)


def test_the_widest_active_row_decides():
    spec = js.SpecConfig(3, 2, 6, widths=(2, 4, 6), width_threshold=0.3)
    log = np.log
    score = jnp.asarray([[0.0, log(0.9), log(0.5), log(0.2), log(0.1), log(0.05)],  # 3 nodes clear 0.3
                         [0.0, log(0.9), log(0.8), log(0.7), log(0.6), log(0.5)],  # all 6
                         [0.0, log(0.2), log(0.1), log(0.1), log(0.1), log(0.1)]], jnp.float32)  # the root only
    zeros = jnp.zeros((3, 6), jnp.int32)
    tree = Tree(tokens=zeros, parent=zeros, depth=zeros, rank=zeros, score=score, feature=jnp.exp(score))
    def width(active):
        return spec.widths[int(choose_width(spec, tree, jnp.asarray(active)))]

    assert width([True, False, False]) == 4
    assert width([True, True, True]) == 6
    assert width([False, False, True]) == 2
    assert width([False, False, False]) == 2  # nothing active: the narrowest


def test_per_cycle_widths_are_greedy_exact_and_compile_once(agreeing_params, test_cfg):
    cfg, params = test_cfg, agreeing_params
    # a threshold between the tree's values, so the width really changes from cycle to cycle
    spec = js.SpecConfig(3, 2, 6, "draft", widths=(3, 6), width_threshold=0.6)
    ref = js.generate(params, cfg, PROMPTS, max_new_tokens=24)
    out = js.speculative_generate(params, cfg, PROMPTS, spec, max_new_tokens=24)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert 3 < out.stats["mean_verified"] < 6, out.stats
    assert out.stats["spec"] == "s3_k2_d6_w3"
    before = speculative_compile_count()
    other = [[p + 1 for p in prompt] for prompt in PROMPTS]
    out = js.speculative_generate(params, cfg, other, spec, max_new_tokens=24)
    np.testing.assert_array_equal(out.tokens, js.generate(params, cfg, other, max_new_tokens=24).tokens)
    assert speculative_compile_count() == before


@pytest.mark.long  # 12,288 sequences per case; the CI test above checks the mechanism greedily
@pytest.mark.parametrize("accept", ["residual", "target"])
@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_per_cycle_widths_sample_the_target(confident_params, test_cfg, accept, temperature):
    # Top-K drafts ranked by raw draft log-probs: at 0.98 the width varies from cycle to cycle (2-4 of 6).
    # Sampled drafts ranked by residual values that read the parent's q: this confident draft puts
    # every row in the same bins, so at 0.9 the cycles verify 4 of the 6 nodes (a sub-tree of sampled
    # children and their q); the switching itself is checked greedily above.
    spec = js.SpecConfig(3, 2, 6, widths=(2, 3, 4, 6), width_threshold=0.9 if accept == "residual" else 0.98)
    calibration = calibration_with([branchy_map(temperature)]) if accept == "residual" else None
    result = check_end_to_end(confident_params, test_cfg, spec, (temperature, None, None), accept=accept,
                              calibration=calibration)
    assert_samples_the_target(result)
    assert result["mean_verified"] < 6, result
