"""Speculation at V4.1's geometry: a 128-token window, ratio-2 pairs and ratio-1 entries in pools shared
by the layers after their owner, a top-24 inside 4 candidate blocks of 8 entries (so both levels of the
top-k select), Engram 2- and 3-grams at a window layer and a pool reuser, and V4.1's DSpark drafter right
about half the time (`testing.v41_mixed_acceptance`). Prompts end on odd and even positions (the root
opens or closes a pair) just before the window wraps and around a candidate-block boundary; every draft
n-gram spans the root. After the prefill and after every cycle the whole speculative state (every target
leaf, the Engram history, the drafter's rings) equals step-by-step decoding of the committed tokens
(`committed_state`), every emitted token is that decode's argmax, and siblings and partial paths are
asserted to happen. Continuous model (QAT off), float32: see tests/test_v41_dspark.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from committed_state import DSparkStepReference, run_and_check

import jaxspec as js
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.core.v41 import V41Layout
from jaxspec.model.network import Models
from jaxspec.model.sampling import Sampling
from jaxspec.speculation import stages
from jaxspec.speculation.cycle import Speculator
from jaxspec.speculation.dspark import DSparkDrafter, dspark_draft
from jaxspec.speculation.policy import Policy
from jaxspec.testing import v41_mixed_acceptance

LAYOUT = V41Layout(
    ratios=(0, 2, 2, 1, 1, 1), kv_sources=(1, 3), index_sources=(1, 3, 5), candidate_source=3,
    candidate_topk_blocks=4, candidate_block_size=8, engram_layers=(0, 2), engram_num_embeddings=(290, 370),
    engram_max_ngram=3, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=64, engram_compressed_vocab=200,
    engram_pad_id=2, qat=False)
LENGTHS = (126, 127, 135, 136)  # odd / even roots; decoding crosses 128; ratio-1 entry 136 opens block 17
MAX_LEN = 512


@pytest.fixture(scope="module")
def setup():
    cfg = js.ModelConfig.preset("v41-test", dtype="float32", num_layers=6, sliding_window=128, index_topk=24,
                                layer_types=tuple(LAYOUT.kind(i) for i in range(6)), v41=LAYOUT)
    dcfg = DSparkConfig(block_size=5, noise_token_id=255, target_layers=(3, 4, 5), markov_rank=cfg.hidden_size,
                        n_routed_experts=4, num_experts_per_tok=2)
    params, dp = v41_mixed_acceptance(js.init_params(cfg, jax.random.key(7)), cfg, dcfg, jax.random.key(8))
    return cfg, dcfg, params, dp


def _prompts(cfg, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, cfg.vocab_size, n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("spec", ["s4_k1_d5", "s4_k2_d8"])
def test_committed_state_equals_step_decode_v41(setup, spec):
    cfg, dcfg, params, dp = setup
    prompts = _prompts(cfg, 0)
    tokens = np.zeros((len(prompts), max(LENGTHS)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    sp = Speculator(cfg, SpecConfig.parse(spec), DSparkDrafter(dcfg), Policy("greedy", None))
    models = Models(target=params, drafter=dp)
    state = stages.prefill(sp, models, jnp.asarray(tokens), jnp.asarray(LENGTHS, jnp.int32), MAX_LEN,
                           Sampling.create())
    ref = DSparkStepReference(params, dp, cfg, dcfg, len(prompts), MAX_LEN)
    got = run_and_check(sp, models, params, state, prompts, MAX_LEN, cycles=6, ref=ref)
    ends = [n + e for n, e in zip(LENGTHS, got["emitted"], strict=True)]
    assert ends[0] > 128 and ends[1] > 128, ends  # decoding crossed the window
    stops = got["stops"]
    assert stops[0] > 0 and stops[1:-1].sum() > 0, got  # rejected at the root, and part-way down a path
    if spec == "s4_k2_d8":
        assert got["rank_hist"][1] > 0, got  # a second branch accepted


@pytest.mark.long  # the state test above asserts every emitted token is step decode's argmax
def test_greedy_speculative_equals_generate_v41(setup):
    cfg, dcfg, params, dp = setup
    prompts = _prompts(cfg, 1)
    want = np.asarray(js.generate(params, cfg, prompts, max_new_tokens=16).tokens)
    out = js.speculative_generate(params, cfg, prompts, "s3_k2_d6", max_new_tokens=16, draft=dspark_draft(dp, dcfg))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
