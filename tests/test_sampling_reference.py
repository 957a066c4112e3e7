"""Sampling against laws computed without `jaxspec.model.sampling`: `processed_logprobs` equals the
float64 numpy reference of tests/sampling_laws.py (hand-made edge cases: ties at the top-k cut, top_k
>= V, top-p after top-k and after the temperature, the token that reaches top_p, masked logits),
`sample_tokens` draws from it, and plain `generate` at T = 0.6 and 1.0 with top-k and top-p emits
sequences whose every token follows the reference law of the model's own logits given what came
before (randomized probability integral transform over all positions, its consecutive pairs, and the
first token's chi-square). Seeds are fixed: every p-value is deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_laws import ALPHA, chi_square_p, consecutive_pairs_p, randomized_pit, reference_probs, uniform_p

import jaxspec as js
from jaxspec.model.sampling import processed_logprobs, sample_tokens
from jaxspec.testing import sharpened

_processed = jax.jit(processed_logprobs)


def processed(logits, temperature, top_k=None, top_p=None) -> np.ndarray:
    """jaxspec's processed distribution (float64 probabilities) with the traced settings' off values."""
    logp = _processed(jnp.asarray(logits, jnp.float32), jnp.float32(temperature), jnp.int32(top_k or 0),
                      jnp.float32(1.0 if top_p is None else top_p))
    return np.exp(np.asarray(logp, np.float64))


LOG4 = np.log([0.4, 0.3, 0.2, 0.1])
# (logits, temperature, top_k, top_p, the tokens kept)
EDGE_CASES = {
    "ties_at_the_kth": ([3, 2, 2, 2, 1, 0], 1.0, 2, None, [0, 1, 2, 3]),
    "top_k_1_tied_top": ([5, 1, 5, 0], 0.7, 1, None, [0, 2]),
    "top_k_eq_vocab": ([0.5, -1, 2, 0], 1.0, 4, None, [0, 1, 2, 3]),
    "top_k_over_vocab": ([0.5, -1, 2, 0], 1.0, 11, None, [0, 1, 2, 3]),
    "top_p_tiny_keeps_the_top": (LOG4, 1.0, None, 1e-6, [0]),
    "top_p_tiny_keeps_tied_tops": ([1, 3, 3, 0], 1.0, None, 1e-6, [1, 2]),
    "top_p_crossing_token_kept": (LOG4, 1.0, None, 0.65, [0, 1]),
    "top_p_just_past_a_mass": (LOG4, 1.0, None, 0.701, [0, 1, 2]),
    "top_p_just_below_a_mass": (LOG4, 1.0, None, 0.699, [0, 1]),
    "top_p_tie_at_the_cut": ([2, 1, 1, 0], 1.0, None, 0.6, [0, 1, 2]),  # 0.53 < 0.6: a 1 kept, so both
    "top_p_one_is_off": (LOG4, 1.0, None, 1.0, [0, 1, 2, 3]),
    "top_p_after_top_k": (LOG4, 1.0, 2, 0.5, [0]),  # renormalized over 2 tokens: 4/7 >= 0.5
    "top_p_without_top_k": (LOG4, 1.0, None, 0.5, [0, 1]),
    "top_p_after_temperature": (LOG4, 0.5, None, 0.5, [0]),  # T = 0.5: 0.16 / 0.30 > 0.5
    "masked_logits": ([0.0, -np.inf, 1.0, -np.inf], 1.0, 3, None, [0, 2]),
    "top_p_off_keeps_a_tiny_tail": ([0, -20, -25], 1.0, 2, None, [0, 1]),
    "top_p_over_tokens_tied_at_the_kth": ([4.75, 4.5, 3.75, 3.5, 3.0, 3.0], 1.0, 5, 0.9, [0, 1, 2, 3, 4, 5]),
}
# The last two were departures of `processed_logprobs` from its rule until it took top-p's mass over every
# token top-k kept (by value) and let top_p = 1 cut nothing.


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_processing_edge_cases(case):
    logits, temperature, top_k, top_p, kept = EDGE_CASES[case]
    ref = reference_probs(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.flatnonzero(ref), kept)  # the reference says what the docstring says
    z = np.asarray(logits, np.float64)[kept] / temperature
    np.testing.assert_allclose(ref[kept], np.exp(z - z.max()) / np.exp(z - z.max()).sum(), rtol=1e-12)
    got = processed(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.flatnonzero(got), kept)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_processing_matches_the_reference_on_random_rows(ties):
    """64 rows of V = 96 (distinct logits, or many ties: logits on a 0.25 grid; spread kept where no
    tail token's mass falls below float32's resolution), every combination of the settings."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 96)).astype(np.float32)
    if ties:
        logits = np.round(logits * 4) / 4
    for temperature in (0.6, 1.0, 1.7):
        for top_k in (None, 1, 5, 96, 200):
            for top_p in (None, 0.3, 0.9):
                ref = reference_probs(logits, temperature, top_k, top_p)
                got = processed(logits, temperature, top_k, top_p)
                setting = (temperature, top_k, top_p)
                np.testing.assert_array_equal(got > 0, ref > 0, err_msg=str(setting))
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7, err_msg=str(setting))


@pytest.mark.parametrize("setting", [(0.6, 5, 0.9), (1.0, None, 0.8), (1.0, 3, None)])
def test_sample_tokens_draws_from_the_reference(setting):
    temperature, top_k, top_p = setting
    rng = np.random.default_rng(1)
    rows, n = 3, 8192
    logits = rng.normal(size=(rows, 96)).astype(np.float32) * 2.0
    drawn = np.asarray(jax.jit(sample_tokens)(
        jnp.asarray(np.repeat(logits, n, axis=0)), jax.random.key(2), jnp.float32(temperature),
        jnp.int32(top_k or 0), jnp.float32(top_p or 1.0))).reshape(rows, n)
    ref = reference_probs(logits, temperature, top_k, top_p)
    for r in range(rows):
        assert chi_square_p(drawn[r], ref[r]) > ALPHA / rows, (setting, r)
    greedy = jax.jit(sample_tokens)(jnp.asarray(logits), jax.random.key(2), jnp.float32(0), jnp.int32(0),
                                    jnp.float32(1))
    np.testing.assert_array_equal(greedy, np.argmax(logits, -1))


# ---------------------------------------------------------------------------------------------
# plain generate, end to end
# ---------------------------------------------------------------------------------------------

PROMPT = [5, 6, 7, 8, 9, 10, 11]
ROWS, NEW = 512, 12  # prompt 7 + 12 tokens: crosses the window (8), CSA (4) and HCA (16) boundaries
GENERATE_SETTINGS = {"t0.6_k8_p0.9": (0.6, 8, 0.9), "t1_k24_p0.8": (1.0, 24, 0.8)}


@pytest.fixture(scope="module")
def sampling_params(test_params):
    """The random test params with logits 4x sharper (same argmax; at T = 1 the raw test params' top
    token has ~2%), so top-k and top-p cut real mass and the temperature changes the law visibly."""
    return sharpened(test_params, 4.0)


@pytest.fixture(scope="module")
def generated(sampling_params, test_cfg):
    """setting -> (ROWS x NEW tokens sampled by `generate`, the one-shot logits [ROWS, NEW, V] that
    predicted each of them); one sampling run per setting for the module."""
    done = {}

    def get(name):
        if name not in done:
            temperature, top_k, top_p = GENERATE_SETTINGS[name]
            out = js.generate(sampling_params, test_cfg, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=temperature,
                              top_k=top_k, top_p=top_p, rng=jax.random.key(0))
            assert (out.lengths == NEW).all()
            sequences = np.concatenate([np.tile(PROMPT, (ROWS, 1)), out.tokens], axis=1)
            logits = js.prefill_logits(sampling_params, test_cfg, jnp.asarray(sequences[:, :-1], jnp.int32))
            done[name] = out.tokens, np.asarray(logits)[:, len(PROMPT) - 1:]
        return done[name]

    return get


def law_statistics(tokens, logits, law_setting, seed=0):
    """Tokens [ROWS, NEW] and the logits that predicted them -> p-values under `reference_probs(logits,
    *law_setting)`: the transformed tokens uniform, their consecutive pairs independent, the first
    token's chi-square; and how many tokens the law gives probability 0."""
    law = reference_probs(logits, *law_setting)  # [ROWS, NEW, V]
    u, impossible = randomized_pit(tokens, law, np.random.default_rng(seed))
    stats = {"uniform": uniform_p(u), "pairs": consecutive_pairs_p(u), "impossible": impossible}
    if not impossible:
        stats["token1"] = chi_square_p(tokens[:, 0], law[0, 0])  # every row shares the prompt
    return stats


@pytest.mark.parametrize("setting", list(GENERATE_SETTINGS))
def test_generate_samples_the_exact_law(generated, setting):
    stats = law_statistics(*generated(setting), GENERATE_SETTINGS[setting])
    assert stats["impossible"] == 0, stats
    assert min(stats["uniform"], stats["pairs"], stats["token1"]) > ALPHA / 3, stats  # Bonferroni over 3


@pytest.mark.parametrize("wrong", [(1.0, 8, 0.9), (0.6, 8, None), (0.6, None, 0.9)], ids=["T", "top_p", "top_k"])
def test_generate_check_catches_a_wrong_law(generated, wrong):
    """The same samples (T = 0.6, top-k 8, top-p 0.9) judged against a law with one setting changed."""
    stats = law_statistics(*generated("t0.6_k8_p0.9"), wrong)
    assert stats["impossible"] > 0 or min(stats["uniform"], stats["pairs"], stats["token1"]) < ALPHA, stats
