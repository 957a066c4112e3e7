"""Chunked prefill (jaxspec/model/prefill.py) == the one-shot `extend` over the whole prompt.

The `test` preset (window 8, CSA 4, HCA 16) with chunks of 4..16 crosses the same boundaries the
long lengths cross on `tiny` / V4 ratios: blocks straddling a chunk, CSA's overlapping windows, a
chunk longer than the window ring, prompts shorter than one chunk. The long lengths (1 .. 3000
tokens, tiny and a 2-layer V4-ratio config) are a long test (JAXSPEC_LONG_TESTS=1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.cli import main
from jaxspec.model import network as model
from jaxspec.model import prefill
from jaxspec.model.state import init_state
from jaxspec.speculation.generate import compile_count
from jaxspec.testing import mtp_prefill, one_shot_greedy, randomize

LENGTHS = [1, 31, 32, 33]  # one ragged batch: shorter than, equal to and across chunk multiples


def _prompts(cfg, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("chunk", [16, 32])  # 16 divides the 48 tokens, 32 does not (a half-full last chunk)
def test_prefill_logits_chunked_equal_one_shot(test_params, test_cfg, chunk):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, test_cfg.vocab_size, (2, 48)), jnp.int32)
    ref = model.one_shot_logits(test_params, test_cfg, tokens)
    got = prefill.chunked_logits(test_params, test_cfg, tokens, chunk=chunk)
    assert got.shape == ref.shape
    assert _max_rel(got, ref) <= 1e-5
    # The public entry point takes the chunk from the config (the same program: a cache hit).
    assert _max_rel(js.prefill_logits(test_params, test_cfg.replace(prefill_chunk=chunk), tokens), ref) <= 1e-5


# Long (three loops compiled for chunk 8 alone); CI holds the mechanism: the speculation state chunked equals one
# shot (below) and chunked prefill equals step decode (test_model.test_prefill_decode_chunked_agree).
@pytest.mark.long
def test_generate_ragged_chunked_equals_one_shot(agreeing_params, test_cfg):
    prompts = _prompts(test_cfg, LENGTHS)
    one_shot = test_cfg.replace(prefill_chunk=64)  # >= the width bucket: one chunk, the old program
    ref = js.generate(agreeing_params, one_shot, prompts, max_new_tokens=12)
    got = js.generate(agreeing_params, test_cfg.replace(prefill_chunk=8), prompts, max_new_tokens=12)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    spec = js.speculative_generate(agreeing_params, test_cfg.replace(prefill_chunk=8), prompts, "s3_k2_d6",
                                   max_new_tokens=12)
    np.testing.assert_array_equal(spec.tokens, ref.tokens)
    assert spec.stats["mean_accepted_length"] > 1.0  # the MTP ring the chunks filled drafts well


def test_speculation_state_chunked_equals_one_shot(test_params, test_cfg):
    prompts = _prompts(test_cfg, [33, 9, 1, 20], seed=1)
    width, max_len = 40, 64
    tokens = np.zeros((4, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    ref = mtp_prefill(test_params, test_cfg.replace(prefill_chunk=64), tokens, lengths, max_len)
    got = mtp_prefill(test_params, test_cfg.replace(prefill_chunk=4), tokens, lengths, max_len)
    np.testing.assert_array_equal(got.root, ref.root)
    assert _max_rel(got.drafter.last_hidden, ref.drafter.last_hidden) <= 1e-5
    for a, b in zip(jax.tree.leaves((got.target, got.drafter)), jax.tree.leaves((ref.target, ref.drafter)),
                    strict=True):
        if jnp.issubdtype(a.dtype, jnp.integer):
            np.testing.assert_array_equal(a, b)  # the target's and the MTP ring's lengths
        else:
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(float(jnp.max(jnp.abs(b))), 1.0)


def test_number_of_chunks_does_not_change_the_program(agreeing_params, test_cfg):
    # The shapes of the ragged test above (batch bucket 4, width bucket 64, 12 new tokens).
    cfg = test_cfg.replace(prefill_chunk=8)
    prompts = np.random.default_rng(2).integers(0, cfg.vocab_size, (4, 64)).astype(np.int32)
    js.generate(agreeing_params, cfg, prompts, max_new_tokens=12, prompt_lengths=[5, 9, 1, 2])  # 2 chunks
    before = compile_count()
    js.generate(agreeing_params, cfg, prompts, max_new_tokens=12, prompt_lengths=[60, 64, 3, 8])  # 8 chunks
    js.generate(agreeing_params, cfg, prompts, max_new_tokens=12, prompt_lengths=[1, 17, 2, 2])  # 3 chunks
    assert compile_count() == before


def test_chunk_choice():
    assert prefill.prefill_chunk(js.ModelConfig.preset("tiny")) == 256
    assert prefill.prefill_chunk(js.ModelConfig.preset("v4-flash")) == 512
    assert prefill.prefill_chunk(js.ModelConfig.preset("test", prefill_chunk=4)) == 4
    assert prefill.effective_chunk(js.ModelConfig.preset("tiny"), 20) == 32  # not padded to 256
    assert prefill.effective_chunk(js.ModelConfig.preset("tiny"), 3000, 1024) == 1024


@pytest.mark.parametrize("bad", [0, -4, 3, 12, 2.0, True])
def test_bad_chunk_is_one_line_error(test_params, test_cfg, bad):
    with pytest.raises(ValueError, match="power of two") as err:
        prefill.chunked_logits(test_params, test_cfg, [[1, 2, 3]], chunk=bad)
    assert "\n" not in str(err.value)
    if bad != 0:  # 0 in a config means "the default chunk"
        with pytest.raises(ValueError, match="prefill_chunk must be 0 .default. or a power of two"):
            test_cfg.replace(prefill_chunk=bad)


def test_prompt_longer_than_the_state_is_one_line_error(test_params, test_cfg):
    state = init_state(test_cfg, 1, 16)
    tokens = jnp.zeros((1, 20), jnp.int32)
    with pytest.raises(ValueError, match="longer than the state can hold") as err:
        prefill.chunked_prefill(test_params, test_cfg, state, tokens, jnp.asarray([20], jnp.int32))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        prefill.chunked_logits(test_params, test_cfg, np.zeros((1, test_cfg.max_position_embeddings + 1), np.int32))


@pytest.mark.parametrize("tokens,match", [
    ([[1, 2, 3], [4, 5]], r"rows of one length, got rows of 2\.\.3 tokens"),
    ([[1, 5000]], r"token id 5000 is outside the vocabulary \[0, "),
    (np.array([[-1, 2]]), r"token id -1 is outside the vocabulary"),
])
def test_prefill_logits_rejects_ragged_rows_and_foreign_ids(test_params, test_cfg, tokens, match):
    with pytest.raises(ValueError, match=match) as err:
        js.prefill_logits(test_params, test_cfg, tokens)
    assert "\n" not in str(err.value)


def test_demo_prompt_file_and_chunk(tmp_path, capsys):
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(str(i % 90) for i in range(40)))  # no tokenizer: token ids
    argv = ["demo", "--preset", "test", "--batch", "1", "--new-tokens", "4", "--spec", "none", "--repeats", "1",
            "--prompt-file", str(path)]
    assert main([*argv, "--prefill-chunk", "8"]) == 0
    assert "prompt: 40 tokens from" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main([*argv, "--prefill-chunk", "3"])
    assert "\n" not in str(err.value.code) and "power of two" in str(err.value.code)
    path.write_text("not token ids")
    with pytest.raises(SystemExit, match="must hold token ids"):
        main(argv)


# ---- long: the issue's lengths on tiny and on a 2-layer config with V4-Flash's ratios ------------------


def v4_ratio_config() -> js.ModelConfig:
    """Two layers (CSA, HCA) with V4-Flash's window 128, CSA 4 / HCA 128 and top-512 indexer, tiny widths."""
    return js.ModelConfig.preset(
        "tiny", num_layers=2, layer_types=("csa", "hca"), sliding_window=128, csa_ratio=4, hca_ratio=128,
        index_topk=512, num_hash_layers=1,
    )


def topk_gaps(params, cfg, seq) -> tuple[np.ndarray, np.ndarray]:
    """The one-shot logits of `seq` [S] and, per position, the smallest relative gap between the k-th
    and (k+1)-th CSA index score over its CSA layers -> ([S, V], [S]).

    Found by wrapping `jax.lax.top_k` while a fresh jit of the one-shot program traces: the indexer's
    call (k = index_topk) also takes the (k+1)-th value and reports the gap to the host."""
    gaps, k_index, top_k = [], cfg.index_topk, jax.lax.top_k

    def record(values):  # [1, S, k+1]
        v = np.asarray(values, np.float64)[0]
        with np.errstate(invalid="ignore"):  # fewer than k + 1 entries: the pick takes all, no tie
            gap = np.abs(v[:, -2] - v[:, -1]) / np.maximum(np.abs(v[:, -2]), 1e-30)
        gaps.append(np.where(np.isneginf(v[:, -1]), np.inf, gap))

    def wrapped(x, k, **kw):
        if k != k_index or x.ndim != 3 or x.shape[-1] <= k:
            return top_k(x, k, **kw)
        values, index = top_k(x, k + 1, **kw)
        jax.debug.callback(record, values)
        return values[..., :k], index[..., :k]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.lax, "top_k", wrapped)
        one_shot = jax.jit(model.jitted_one_shot_logits.__wrapped__, static_argnums=1)  # traced afresh
        logits = np.asarray(one_shot(params, cfg, jnp.asarray(seq[None])))[0]
    assert gaps, "the one-shot program made no CSA top-k pick"
    return logits, np.min(gaps, axis=0)


def assert_equal_or_tie(got, ref, gaps, what):
    """Chunked logits `got` [n, V] equal the one-shot `ref` [n, V] to 1e-5 relative, or first differ at
    a position where the one-shot CSA top-k meets a near-tie (k-th and (k+1)-th index scores within
    1e-5 relative): float32 rounding of the same sums may then pick the other entry, and every later
    position reads what that token wrote (docs/prefill.md). A chunking error starts anywhere else."""
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    err = np.max(np.abs(got.astype(np.float64) - ref), axis=-1) / scale  # [n]
    bad = np.flatnonzero(err > 1e-5)
    if bad.size:
        first = int(bad[0])
        assert gaps[first] < 1e-5, (what, first, float(err[first]), float(gaps[first]))


@pytest.mark.long  # ~5-9 minutes on one core (bench/prefill.py equal; docs/prefill.md)
@pytest.mark.parametrize("name", ["tiny", "v4-ratios"])
def test_issue_lengths_chunked_equal_one_shot(name):
    """Rows of 1 .. 3000 tokens of one sequence in one ragged batch: every prompt position's logits
    equal the one-shot prefill of the 3000-token row (causal: a prefix's logits are its first rows),
    or first differ where the one-shot CSA top-k sits on a near-tie; the greedy continuations of the
    1000- and 3000-token prompts equal the one-shot program's.

    Near-ties are common (ReLU index scores; ~5-7% of positions have a top-k gap below 1e-5), and which
    one a rounding difference tips depends on the batch's shapes and the XLA flags, so the bar is
    tie-aware rather than a choice of chunks that happened to miss them (docs/prefill.md)."""
    cfg = js.ModelConfig.preset("tiny") if name == "tiny" else v4_ratio_config()
    params = randomize(js.init_params(cfg, jax.random.key(0)), jax.random.key(1))
    lengths = [1, 31, 32, 33, 127, 128, 129, 1000, 3000]
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, 3000).astype(np.int32)
    ref, gaps = topk_gaps(params, cfg, seq)
    tokens, lens = jnp.asarray(np.tile(seq, (len(lengths), 1))), jnp.asarray(lengths, jnp.int32)
    chunks = (128, 256) if name == "tiny" else (512, 1024)  # tiny 256 and v4 512 / 1024 are banded
    for chunk in chunks:  # none divides 31, 33, 129, 1000 or 3000
        c = cfg.replace(prefill_chunk=chunk)
        run = jax.jit(lambda p, t, n, c=c: prefill.chunked_prefill(
            p, c, init_state(c, len(lengths), 3000), t, n, all_logits=True)[0].logits)
        got = np.asarray(run(params, tokens, lens))
        for i, n in enumerate(lengths):
            assert_equal_or_tie(got[i, :n], ref[:n], gaps, (n, chunk))
    del ref
    for n in (1000, 3000):
        want = one_shot_greedy(params, cfg, seq[:n], 16)
        for chunk in chunks:
            got = js.generate(params, cfg.replace(prefill_chunk=chunk), [seq[:n].tolist()], max_new_tokens=16)
            np.testing.assert_array_equal(got.tokens[0], want)
