"""`generate`: greedy equals an argmax rollout of full prefills, ragged batches equal batch 1,
eos / max_new_tokens honoured, one compilation per bucket, clear errors on bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model import network as model
from jaxspec.model import state
from jaxspec.speculation.generate import compile_count

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


@jax.jit
def _full_prefill_last_logits(params, tokens, length):
    """A full causal prefill of tokens[:, :length] (padded to a fixed width: one compile)."""
    cfg = js.ModelConfig.preset("test")
    valid = jnp.arange(tokens.shape[1])[None, :] < length
    out, _ = model.extend(params, cfg, state.init_state(cfg, 1, tokens.shape[1]), tokens, valid)
    return out.logits[0, length - 1]


def _rollout(params, cfg, prompt, n, width=64):
    assert cfg == js.ModelConfig.preset("test")
    seq = np.zeros((1, width), np.int32)
    seq[0, : len(prompt)] = prompt
    length, out = len(prompt), []
    for _ in range(n):
        out.append(int(jnp.argmax(_full_prefill_last_logits(params, jnp.asarray(seq), length))))
        seq[0, length] = out[-1]
        length += 1
    return out


def test_greedy_equals_prefill_rollout(test_params, test_cfg):
    n = 24  # crosses the window (8) and an HCA block (16) from each prompt
    out = js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=n)
    assert out.tokens.shape == (3, n)
    np.testing.assert_array_equal(out.lengths, [n, n, n])
    for i, p in enumerate(PROMPTS):
        assert out.tokens[i].tolist() == _rollout(test_params, test_cfg, p, n), i


def test_ragged_batch_equals_single(test_params, test_cfg):
    batch = js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=20)
    for i, p in enumerate(PROMPTS):
        single = js.generate(test_params, test_cfg, [p], max_new_tokens=20)
        np.testing.assert_array_equal(single.tokens[0], batch.tokens[i])


def test_array_prompts_with_lengths(test_params, test_cfg):
    array = np.zeros((2, 18), np.int32)
    array[0, :7] = PROMPTS[0]
    array[1, :] = PROMPTS[2]
    out = js.generate(test_params, test_cfg, array, max_new_tokens=10, prompt_lengths=[7, 18])
    ref = js.generate(test_params, test_cfg, [PROMPTS[0], PROMPTS[2]], max_new_tokens=10)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_eos_and_max_new_tokens(test_params, test_cfg):
    free = js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=16)
    eos = int(free.tokens[0, 5])  # a token the first sequence emits at step 5
    out = js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=16, eos_id=eos)
    for i in range(3):
        row = free.tokens[i].tolist()
        stop = row.index(eos) + 1 if eos in row else 16
        assert out.lengths[i] == stop
        assert out.tokens[i, :stop].tolist() == row[:stop]
        assert np.all(out.tokens[i, stop:] == eos)  # padded with eos after the end
    assert out.lengths[0] <= 6


def test_sampling_is_reproducible_and_respects_top_k(test_params, test_cfg):
    kwargs = dict(max_new_tokens=12, temperature=1.0, top_k=1, rng=jax.random.key(3))
    top1 = js.generate(test_params, test_cfg, PROMPTS, **kwargs)
    greedy = js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=12)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)  # top_k=1 sampling is greedy
    a = js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=12, temperature=1.0, rng=jax.random.key(7))
    b = js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=12, temperature=1.0, rng=jax.random.key(7))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, greedy.tokens)


def test_one_compile_per_bucket(test_params, test_cfg):
    js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=9)
    before = compile_count()
    # same buckets (batch 3 and 4 -> 4; prompt <= 32; cache 64), other values and settings
    js.generate(test_params, test_cfg, [[1, 2], [3], [4, 5, 6], [9] * 20], max_new_tokens=9)
    js.generate(test_params, test_cfg, PROMPTS, max_new_tokens=9, temperature=0.7, top_p=0.9, rng=jax.random.key(0))
    assert compile_count() == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=[[1, 2]], max_new_tokens=5000), "exceeds the model's max length"),
        (dict(prompts=np.ones((2, 3), np.float32)), "integers"),
        (dict(prompts=[[1.5, 2.0]]), "integer token ids"),
        (dict(prompts=[[1, 999]]), "outside"),
        (dict(prompts=[[1]], temperature=-0.5), "temperature"),
        (dict(prompts=[[1]], top_p=0.0), "top_p"),
        (dict(prompts=[[1]], top_p=1.5), "top_p"),
        (dict(prompts=[[1]], top_k=0), "top_k"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[1]], eos_id=10_000), "eos_id"),
        (dict(prompts=[[1]], temperature=1.0), "rng"),
        (dict(prompts="hello"), "prompts must be"),
    ],
)
def test_bad_input(test_params, test_cfg, kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        js.generate(test_params, test_cfg, **kwargs)
