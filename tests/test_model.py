"""Ladder rung 3: prefill == token-by-token decode == chunked extend, logits and states."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model import network as model
from jaxspec.model import state as state_lib
from jaxspec.testing import randomize

extend = jax.jit(model.extend, static_argnums=(1,))

# Prompt lengths that hit every boundary of the `test` preset (W=8, CSA 4, HCA 16): P < 4,
# multiples of 4 and of 16, just past the window, CSA entry 0, and 3*16+1.
LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 32, 33, 47, 48, 49]
WIDTH = 64


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _run_chunks(params, cfg, tokens, lengths, chunk_sizes):
    """Feed `tokens` [B, WIDTH] in chunks; row b stops at lengths[b]. -> logits [B, WIDTH, V], state."""
    b = tokens.shape[0]
    state = state_lib.init_state(cfg, b, 2 * WIDTH)
    logits = np.zeros((b, WIDTH, cfg.vocab_size), np.float32)
    start = 0
    for size in chunk_sizes:
        idx = np.arange(start, start + size)
        valid = jnp.asarray(idx[None, :] < np.asarray(lengths)[:, None])
        out, state = extend(params, cfg, state, tokens[:, start : start + size], valid)
        logits[:, start : start + size] = np.asarray(out.logits)
        start += size
    assert start == WIDTH
    return logits, state


def _assert_states_equal(a, b, tol):
    np.testing.assert_array_equal(np.asarray(a.length), np.asarray(b.length))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        assert _rel(x, y) <= tol if np.abs(np.asarray(y)).max() > 0 else np.abs(np.asarray(x)).max() == 0, path


def _random_chunks(rng, total):
    sizes = []
    while sum(sizes) < total:
        sizes.append(int(min(rng.choice([1, 2, 3, 5, 7, 16]), total - sum(sizes))))
    return sizes


@pytest.mark.parametrize("window", [8, 6])
def test_prefill_decode_chunked_agree(test_params, test_cfg, window):
    cfg = test_cfg.replace(sliding_window=window)
    params = test_params
    tokens = jax.random.randint(jax.random.key(2), (len(LENGTHS), WIDTH), 0, cfg.vocab_size)
    lengths = np.asarray(LENGTHS)
    full, full_state = _run_chunks(params, cfg, tokens, lengths, [WIDTH])
    step, step_state = _run_chunks(params, cfg, tokens, lengths, [1] * WIDTH)
    rng = np.random.default_rng(window)
    chunk, chunk_state = _run_chunks(params, cfg, tokens, lengths, _random_chunks(rng, WIDTH))
    mask = np.arange(WIDTH)[None, :] < lengths[:, None]
    assert _rel(step[mask], full[mask]) <= 1e-5
    assert _rel(chunk[mask], full[mask]) <= 1e-5
    _assert_states_equal(step_state, full_state, 1e-5)
    _assert_states_equal(chunk_state, full_state, 1e-5)
    np.testing.assert_array_equal(np.asarray(full_state.length), lengths)


def test_prefill_logits_matches_per_prefix(test_params, test_cfg):
    """A causal model: logits of a prefix prefill equal the full prefill's first positions."""
    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, test_cfg.vocab_size)
    full = js.prefill_logits(test_params, test_cfg, tokens)
    for n in (3, 16, 17):
        part = js.prefill_logits(test_params, test_cfg, tokens[:, :n])
        assert _rel(part, full[:, :n]) <= 1e-5


def test_compressed_entries_match_definition(test_params, test_cfg):
    """HCA entry w pools exactly tokens [16w, 16w+15]: changing token 16 changes entry 1 only."""
    cfg, params = test_cfg, test_params
    tokens = jax.random.randint(jax.random.key(4), (1, 48), 0, cfg.vocab_size)
    changed = tokens.at[0, 16].set((tokens[0, 16] + 1) % cfg.vocab_size)
    valid = jnp.ones((1, 48), bool)
    _, s1 = extend(params, cfg, state_lib.init_state(cfg, 1, 64), tokens, valid)
    _, s2 = extend(params, cfg, state_lib.init_state(cfg, 1, 64), changed, valid)
    hca = cfg.layer_types.index("hca")
    e1, e2 = np.asarray(s1.layers[hca].comp_kv[0]), np.asarray(s2.layers[hca].comp_kv[0])
    # entry 0 is pooled before token 16 at this layer; later entries differ
    np.testing.assert_array_equal(e1[0], e2[0])
    assert np.abs(e1[1] - e2[1]).max() > 0


def test_mtp_chunked_equals_sequential(test_params, test_cfg):
    """The MTP block over T positions at once equals one position at a time."""
    cfg, params = test_cfg, test_params
    b, t = 2, 30
    tokens = jax.random.randint(jax.random.key(5), (b, t + 1), 0, cfg.vocab_size)
    out, state = extend(params, cfg, state_lib.init_state(cfg, b, 64), tokens[:, :t], jnp.ones((b, t), bool))

    @functools.partial(jax.jit, static_argnums=(1,))
    def mtp_step(params, cfg, ring, length, hidden, next_tokens):
        valid = jnp.ones(next_tokens.shape, bool)
        ctx = model.causal_context(length, valid)
        logits, z, rows = model.mtp_forward(params, params.mtp, cfg, ring, hidden, next_tokens, ctx)
        length = length + next_tokens.shape[1]
        return logits, z, state_lib.commit_layer(cfg, "sliding", ring, rows, ctx.positions, valid, length), length

    ring, length = state_lib.layer_state(cfg, "sliding", b, 64), jnp.zeros((b,), jnp.int32)
    all_logits, all_z, ring_all, _ = mtp_step(params, cfg, ring, length, out.hidden, tokens[:, 1:])
    for i in range(t):
        step_in = (out.hidden[:, i : i + 1], tokens[:, i + 1 : i + 2])
        logits, z, ring, length = mtp_step(params, cfg, ring, length, *step_in)
        assert _rel(logits[:, 0], all_logits[:, i]) <= 1e-5
        assert _rel(z[:, 0], all_z[:, i]) <= 1e-5
    assert _rel(ring.swa_kv, ring_all.swa_kv) <= 1e-5
    np.testing.assert_array_equal(np.asarray(length), [t, t])


def test_no_mtp_refuses(test_cfg):
    cfg = test_cfg.replace(num_mtp_layers=0)
    params = js.init_params(cfg, jax.random.key(0))
    assert params.mtp is None
    with pytest.raises(ValueError, match="no MTP block; pass draft="):
        js.speculative_generate(params, cfg, [[1, 2]], "s2_k1_d3")


@pytest.mark.parametrize("name,expected", [("v4-flash", 284e9), ("v4-pro", 1.6e12)])
def test_official_presets_shapes(name, expected):
    cfg = js.ModelConfig.preset(name)
    shapes = jax.eval_shape(lambda: js.init_params(cfg, jax.random.key(0)))
    main = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes.replace(mtp=None)))
    mtp = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes.mtp))
    if name == "v4-flash":
        assert abs(main - expected) / expected <= 0.01, main
    else:
        # "1.6T" is a two-significant-digit figure: the main model counts 1.573T, 1.599T with MTP.
        assert round(main / 1e11) == 16, main
    assert 1e9 < mtp < 3e10
    attn = shapes.layers[2].attn  # a CSA layer in both
    d, h = cfg.hidden_size, cfg.num_heads
    assert attn.wq_a.shape == (d, cfg.q_lora_rank)
    assert attn.wq_b.shape == (cfg.q_lora_rank, h * 512)
    assert attn.wkv.shape == (d, 512)
    assert attn.wo_a.shape == (cfg.o_groups, h * 512 // cfg.o_groups, 1024)
    assert attn.wo_b.shape == (cfg.o_groups * 1024, d)
    assert attn.compressor.wkv.shape == (d, 1024) and attn.compressor.ape.shape == (4, 1024)
    assert attn.indexer.wq_b.shape == (cfg.q_lora_rank, 64 * 128)
    assert attn.indexer.weights_proj.shape == (d, 64)
    assert attn.indexer.compressor.wkv.shape == (d, 256) and attn.indexer.compressor.ape.shape == (4, 256)
    hca = shapes.layers[3].attn
    assert hca.compressor.wkv.shape == (d, 512) and hca.compressor.ape.shape == (128, 512)
    assert hca.indexer is None


def test_state_is_abstract_for_real_presets():
    cfg = js.ModelConfig.preset("v4-flash")
    shapes = state_lib.abstract_state(cfg, batch=2, max_len=65536)
    csa = shapes.layers[2]
    assert csa.swa_kv.shape == (2, 128, 512)
    assert csa.comp_kv.shape == (2, 16384, 512)
    assert csa.comp_rows_kv.shape == (2, 8, 1024)
    assert csa.idx_kv.shape == (2, 16384, 128)
    hca = shapes.layers[3]
    assert hca.comp_kv.shape == (2, 512, 512) and hca.comp_rows_kv.shape == (2, 128, 512)


def test_randomize_changes_zero_inits(test_cfg):
    p = randomize(js.init_params(test_cfg, jax.random.key(0)), jax.random.key(1))
    assert float(jnp.abs(p.layers[1].attn.sink).max()) > 0
    assert float(jnp.abs(p.layers[1].attn.compressor.ape).max()) > 0
