"""Banded chunks (jaxspec/layers/banded.py): a long prefill chunk read in query blocks equals the
dense chunk and the one-shot program, and builds nothing [chunk, chunk]-sized.

`test` preset (window 8, CSA 4, HCA 16): blocks of 64 rows, so a chunk of 256 is 4 blocks; prompts of
several blocks and chunks, lengths that do and do not divide the chunk, in one ragged batch. The
same on `tiny` with 1,024-token chunks is a long test.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.layers.banded import band_block
from jaxspec.model import network as model
from jaxspec.model import prefill
from jaxspec.model.state import init_state
from jaxspec.testing import mtp_prefill, one_shot_greedy, randomize


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _check_chunked(params, cfg, lengths, chunks):
    """Every row's logits, chunked banded and dense, against the one-shot prefill of the longest row."""
    width = max(lengths)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, width).astype(np.int32)
    ref = np.asarray(model.one_shot_logits(params, cfg, jnp.asarray(seq[None])))[0]  # causal: prefixes are rows
    tokens, lens = jnp.asarray(np.tile(seq, (len(lengths), 1))), jnp.asarray(lengths, jnp.int32)
    got = {}
    for chunk in chunks:
        assert band_block(cfg, chunk) > 0  # the chunk does take the banded path
        for banded in (True, False):
            c = cfg.replace(prefill_chunk=chunk)
            run = jax.jit(lambda p, t, n, c=c, b=banded: prefill.chunked_prefill(
                p, c, init_state(c, len(lengths), width), t, n, all_logits=True, banded=b)[0].logits)
            got[chunk, banded] = np.asarray(run(params, tokens, lens))
            for i, n in enumerate(lengths):
                assert _max_rel(got[chunk, banded][i, :n], ref[:n]) <= 1e-5, (chunk, banded, n)
        for i, n in enumerate(lengths):  # past a row's length the rows are padding
            assert _max_rel(got[chunk, True][i, :n], got[chunk, False][i, :n]) <= 1e-5, (chunk, n)
    return seq


def test_banded_chunk_equals_dense_and_one_shot(test_params, test_cfg):
    # 320 = a chunk + 64 (does not divide), 256 = one chunk (divides), 129 = 2 blocks + 1, 1 token.
    _check_chunked(test_params, test_cfg, [320, 256, 129, 1], chunks=[256])


def test_banded_greedy_generate_equals_one_shot(test_params, test_cfg):
    cfg = test_cfg.replace(prefill_chunk=256)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 300)
    want = one_shot_greedy(test_params, cfg, prompt, 8)
    np.testing.assert_array_equal(js.generate(test_params, cfg, [prompt.tolist()], max_new_tokens=8).tokens[0], want)


def test_banded_speculation_state_equals_dense(test_params, test_cfg):
    """The MTP ring is filled through the banded path too: the whole state after the speculative
    prefill with banded chunks (256) equals dense chunks (64, <= 2 blocks)."""
    rng = np.random.default_rng(1)
    lengths = [300, 256, 77]
    tokens = np.zeros((3, 300), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(0, test_cfg.vocab_size, n)
    args = (tokens, lengths, 320)
    ref = mtp_prefill(test_params, test_cfg.replace(prefill_chunk=64), *args)
    got = mtp_prefill(test_params, test_cfg.replace(prefill_chunk=256), *args)
    np.testing.assert_array_equal(got.root, ref.root)
    for a, b in zip(jax.tree.leaves((got.target, got.drafter)), jax.tree.leaves((ref.target, ref.drafter)),
                    strict=True):
        if jnp.issubdtype(a.dtype, jnp.integer):
            np.testing.assert_array_equal(a, b)
        else:
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(float(jnp.max(jnp.abs(b))), 1.0)


def _square_tensors(text: str, t: int) -> list[str]:
    """StableHLO tensor types with two or more dimensions of size t."""
    types = re.findall(r"tensor<([0-9x]+)x[a-z]", text)
    return [ty for ty in types if ty.split("x").count(str(t)) >= 2]


@pytest.mark.parametrize("banded", [True, False])
def test_banded_chunk_builds_nothing_chunk_squared(test_params, test_cfg, banded):
    t = 256
    state = init_state(test_cfg, 1, 512)
    tokens, valid = jnp.zeros((1, t), jnp.int32), jnp.ones((1, t), bool)
    text = jax.jit(lambda p, s, x, v: model.extend(p, test_cfg, s, x, v, banded=banded)).lower(
        test_params, state, tokens, valid).as_text()
    square = _square_tensors(text, t)
    if banded:
        assert square == []
    else:  # the dense reference does build [T, T] masks and logits: the check can fail
        assert square


def test_band_block_choice():
    tiny, flash = js.ModelConfig.preset("tiny"), js.ModelConfig.preset("v4-flash")
    assert band_block(tiny, 256) == 64 and band_block(tiny, 2048) == 64
    assert band_block(tiny, 128) == 0  # two blocks or fewer: the dense path
    assert band_block(tiny, 1) == 0  # decode steps stay dense
    assert band_block(flash, 512) == 128 and band_block(flash, 256) == 0  # blocks of >= the window (128)
    assert band_block(tiny.replace(kernels="pallas"), 1024) == 0  # the kernels keep their contract


@pytest.mark.long  # ~3 minutes on one core
def test_banded_tiny_long_chunks():
    cfg = js.ModelConfig.preset("tiny")
    params = randomize(js.init_params(cfg, jax.random.key(0)), jax.random.key(1))
    seq = _check_chunked(params, cfg, [1100, 1024, 300, 33], chunks=[256, 1024])
    want = one_shot_greedy(params, cfg, seq, 12)
    got = js.generate(params, cfg.replace(prefill_chunk=1024), [seq.tolist()], max_new_tokens=12).tokens[0]
    np.testing.assert_array_equal(got, want)
