"""DeepSeek-V4.1's DSpark drafter (docs/dspark.md, "V4.1's drafter"): loaded from a release folder's
`mtp.*`, fed the target's layer inputs, speculating chains and trees whose output is `generate`'s.

Token identity is asserted on the continuous model (QAT roundings off, float32): with them on, the
verify's and a decode step's last-bit differences can flip an FP8 / FP4 rounding and with it a routing
or top-k choice (docs/v41.md), which no speculative method controls."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_dspark_speculation import check_rows_follow_the_target

import jaxspec as js
from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.model import network
from jaxspec.model.dspark_v41 import V41DSparkParams
from jaxspec.speculation.dspark import DSparkDrafter, dspark_draft
from jaxspec.speculation.generate import speculative_compile_count
from jaxspec.testing import agreeing_dspark, sharpened, v41_mixed_acceptance, write_v41_release


def _continuous(cfg):
    return cfg.replace(v41=dataclasses.replace(cfg.v41, qat=False))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41_dspark")
    values = write_v41_release(path)
    return path, values


def test_release_loads_its_dspark_drafter(release, capsys):
    path, values = release
    ck = js.load_release(path, dtype="float32")
    assert isinstance(ck.draft.drafter, DSparkDrafter) and isinstance(ck.draft.params, V41DSparkParams)
    dcfg = ck.draft.drafter.config
    assert (dcfg.block_size, dcfg.noise_token_id, dcfg.target_layers, dcfg.markov_rank, dcfg.num_stages,
            dcfg.n_routed_experts, dcfg.num_experts_per_tok) == (5, 255, (5, 6, 7), 32, 3, 4, 2)
    dp = ck.draft.params
    np.testing.assert_array_equal(np.asarray(dp.main_proj), values["mtp.0.main_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(dp.markov_w1), values["mtp.2.markov_head.embed.weight"])
    np.testing.assert_array_equal(np.asarray(dp.markov_w2), values["mtp.2.markov_head.head.weight"].T)
    np.testing.assert_array_equal(np.asarray(dp.confidence), values["mtp.2.confidence_head.proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(dp.stages[1].ffn.experts.w2[3]), values["mtp.1.ffn.experts.3.w2.weight"].T)
    np.testing.assert_array_equal(np.asarray(dp.stages[0].attn.wq_b), values["mtp.0.attn.wq_b.weight"].T)
    assert dp.stages[2].attn.compressor is None and dp.stages[2].engram is None
    assert dp.stages[0].ffn.experts.w1.shape[0] == 4  # the stages' own MoE, not the target's 8 experts
    assert "skipped the vision tower" in capsys.readouterr().out
    assert js.load_release(path, dtype="float32", draft="none").draft is None
    with pytest.raises(ValueError, match="draft='auto', 'dspark' or 'none'"):
        js.load_release(path, dtype="float32", draft="mtp")


def test_taps_are_the_inputs_of_the_target_layers(release):
    """capture=(i,) on V4.1 is the hc mean of the streams entering layer i: the final streams of the
    same model cut before layer i (no Engram at i)."""
    ck = js.load_release(release[0], dtype="float32", draft="none")
    cfg, params = _continuous(ck.cfg), ck.params
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 11)).astype(np.int32)

    def run(cfg, params, capture):
        state = js.init_state(cfg, 2, 16)
        out, _ = network.extend(params, cfg, state, tokens, np.ones(tokens.shape, bool), capture=capture)
        return out

    full = run(cfg, params, (6, 7))
    for cut in (6, 7):
        v = cfg.v41
        sources = tuple(s for s in v.index_sources if s < cut)
        short_v = dataclasses.replace(v, ratios=v.ratios[:cut], index_sources=sources)
        short = cfg.replace(num_layers=cut, layer_types=cfg.layer_types[:cut], v41=short_v)
        hidden = run(short, params.replace(layers=params.layers[:cut]), ()).hidden
        want = np.asarray(hidden, np.float32).mean(axis=2)
        got = np.asarray(full.captured)[..., (cut - 6) * cfg.hidden_size: (cut - 5) * cfg.hidden_size]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def agreeing():
    """v41-test (every layer kind) with a DSpark drafter right about half the time (`v41_mixed_acceptance`)."""
    cfg = _continuous(ModelConfig.preset("v41-test", dtype="float32"))
    dcfg = DSparkConfig(block_size=5, noise_token_id=255, target_layers=(5, 6, 7), markov_rank=cfg.hidden_size,
                        n_routed_experts=4, num_experts_per_tok=2)
    params, dp = v41_mixed_acceptance(network.init_params(cfg, jax.random.key(0)), cfg, dcfg, jax.random.key(1))
    return cfg, params, dspark_draft(dp, dcfg)


# CI: the K = 2 tree (~35 s); the chain adds ~55 s of compiling (CI runs DSpark chains on V4: the same cycle at K = 1).
@pytest.mark.parametrize("spec", [pytest.param("s4_k1_d5", marks=pytest.mark.long), "s4_k2_d8"])
def test_dspark_chains_and_trees_equal_generate(agreeing, spec):
    """Greedy speculation with V4.1's drafter == generate, with drafts accepted, rejected part-way and
    (tree) accepted on a second branch; a second batch of other prompts compiles nothing new."""
    cfg, params, draft = agreeing
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 250, n)) for n in (5, 13, 2, 30)]
    want = np.asarray(js.generate(params, cfg, prompts, max_new_tokens=24).tokens)
    out = js.speculative_generate(params, cfg, prompts, spec, draft=draft, max_new_tokens=24)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    depth = out.stats["per_depth_acceptance"]
    assert out.stats["mean_accepted_length"] > 1.3 and 0 < depth[-1] < depth[0] < 0.9, out.stats
    if spec == "s4_k2_d8":
        assert out.stats["rank_histogram"][1] > 0, out.stats  # a sibling accepted
    compiled = speculative_compile_count()
    others = [list(rng.integers(3, 250, n)) for n in (7, 11, 3, 29)]
    out = js.speculative_generate(params, cfg, others, spec, draft=draft, max_new_tokens=24)
    np.testing.assert_array_equal(np.asarray(out.tokens),
                                  np.asarray(js.generate(params, cfg, others, max_new_tokens=24).tokens))
    assert speculative_compile_count() == compiled


# Long (~60 s): CI loads the folder's drafter (above) and runs the same cycle with the agreeing drafter (below).
@pytest.mark.long
@pytest.mark.parametrize("spec", ["s4_k1_d5", "s4_k2_d8"])
def test_release_folder_speculates_with_its_own_drafter(release, spec):
    """The issue's bar on our own folder (random weights, so drafts are rejected): a chain and a K = 2
    tree of the folder's DSpark drafter give `generate`'s tokens."""
    ck = js.load_release(release[0], dtype="float32")
    cfg = _continuous(ck.cfg)
    prompts = [[5, 9, 100, 3, 7], [17, 201, 33, 4, 90, 12, 61, 250, 8, 44, 101, 2, 77]]
    want = np.asarray(js.generate(ck.params, cfg, prompts, max_new_tokens=10).tokens)
    out = js.speculative_generate(ck.params, cfg, prompts, spec, max_new_tokens=10, draft=ck.draft)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


@pytest.fixture(scope="module")
def confident(agreeing):
    """The damped target without near-tied pairs, sharpened (x16 logits), and a drafter agreeing with it
    (no skew): sampled drafts get accepted."""
    cfg, _, draft = agreeing
    dcfg = draft.drafter.config
    target, _ = v41_mixed_acceptance(network.init_params(cfg, jax.random.key(0)), cfg, dcfg, jax.random.key(1),
                                     gap=1.0, skew=0.0)
    target = sharpened(target, 16.0)
    return cfg, target, dspark_draft(agreeing_dspark(target, cfg, dcfg, jax.random.key(2)), dcfg)


@pytest.mark.parametrize("spec,setting", [pytest.param("s3_k1_d4", (0.6, 8, 0.9), marks=pytest.mark.long),
                                          pytest.param("s3_k2_d6", (1.0, 24, 0.8), marks=pytest.mark.long)])
def test_sampled_v41_dspark_rows_follow_the_target(confident, spec, setting):
    """512 rows x 16 tokens after a 7-token prompt, several cycles a row across ratio-2 pairs, ratio-1
    candidate blocks and the window (8): every token's randomized probability integral transform under the
    target's law at its position is uniform and consecutive ones independent (test_dspark_speculation.py's
    statistics), and the same tokens fail them under a 1.25x temperature."""
    cfg, params, draft = confident
    check_rows_follow_the_target(params, cfg, draft, spec, setting, min_tau=1.3)


def _tiny_v41():
    import os

    return os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-v41")


def test_shipped_tiny_v41_is_v41_with_its_drafter():
    """checkpoints/tiny-v41 (docs/v41.md, "A trained tiny-v41"): every V4.1 layer role, Engram classes derived
    from its tokenizer, the continuous model; its DSpark drafter (block 5, Markov rank 256) with calibrations
    of both value sources."""
    import json
    import os

    from jaxspec.checkpoint.v41_load import derive_token_map
    from jaxspec.speculation.values import Calibration

    ck = js.load_checkpoint(_tiny_v41(), draft="dspark", dtype="float32")
    v = ck.cfg.v41
    assert set(ck.cfg.layer_types) == {"sliding", "pool2", "pool1"} and v.engram_layers and not v.qat
    assert v.candidate_source in v.index_sources and any(v.uses_candidates(i) for i in range(ck.cfg.num_layers))
    classes = derive_token_map(os.path.join(_tiny_v41(), "tokenizer.json"))
    assert np.asarray(ck.params.engram_token_map).tolist() == classes.tolist()
    assert v.engram_compressed_vocab == int(classes.max()) + 1
    assert isinstance(ck.draft.drafter, DSparkDrafter) and isinstance(ck.draft.params, V41DSparkParams)
    dcfg = ck.draft.drafter.config
    assert (dcfg.block_size, dcfg.markov_rank) == (5, 256)
    assert isinstance(ck.draft.calibration, Calibration) and ck.draft.calibration_for("both").feature == "both"
    info = json.load(open(os.path.join(_tiny_v41(), "training.json")))
    assert info["final"] and info["last_eval"]["heldout_main"] < info["unigram_heldout"] - 2.0


@pytest.mark.long  # ~2 minutes (the 8-layer loop compiles); CI: the identity grid at V4.1 geometry
def test_shipped_tiny_v41_tree_is_generate():
    from jaxspec.training.tokenizer import encode

    ck = js.load_checkpoint(_tiny_v41(), draft="dspark", dtype="float32")
    prompt = [encode(ck.tokenizer, "Question: Tom has 3 apples and buys 5 more. How many apples?\nAnswer:")]
    want = js.generate(ck.params, ck.cfg, prompt, max_new_tokens=24)
    for spec in ("s5_k1_d6", "s5_k3_d8_vb"):
        out = js.speculative_generate(ck.params, ck.cfg, prompt, spec, max_new_tokens=24, draft=ck.draft)
        assert out.tokens[0, : int(out.lengths[0])].tolist() == want.tokens[0, : int(want.lengths[0])].tolist()
        assert out.stats["cycles"] < 24  # it drafts tokens the target accepts
