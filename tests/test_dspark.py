"""DSpark at the model level: the target's capture, the drafter's context rings and chain, and the
0731-style folder (target + `mtp.0/1/2` drafter) loaded plain, FP8 / FP4, or refused in one line
when the folder holds the other draft. The folders are written by tests/dspark_layout.py (names,
shapes and config spelled from the reference doc, official_layout's formats and writer).
Parity with mlx-vlm's drafter: tests/test_dspark_parity.py."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dspark_layout import DSPARK, config, random_tensors, store, write, write_folder
from official_layout import raw

from jaxspec.checkpoint import LoadStats, load_hf_checkpoint, load_hf_dspark
from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.model import dspark as ds
from jaxspec.model.network import block, causal_context, forward
from jaxspec.model.state import init_state
from jaxspec.ops.quant import BlockScaled
from jaxspec.sharding.rules import make_mesh

DCFG = DSparkConfig(block_size=5, noise_token_id=95, target_layers=(1, 2, 3), markov_rank=8, num_stages=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("dspark") / "f32"
    _, ref = write_folder(str(path), "f32")
    return path, ref


@pytest.fixture(scope="module")
def loaded(folder):
    return load_hf_dspark(folder[0], dtype="float32")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _commit(dp, cfg, dcfg, state, rows, positions, take):
    return ds.commit_context(dp, cfg, dcfg, state, rows, positions, take)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _chain(dp, tp, cfg, dcfg, state, anchor):
    return ds.draft_chain(dp, tp, cfg, dcfg, state, anchor)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ---- target capture ------------------------------------------------------------------------------
def test_forward_capture_is_the_hc_mean_of_each_layers_output(loaded):
    cfg, params = loaded[0], loaded[1]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    state = init_state(cfg, 2, 8)
    ctx = causal_context(state.length, jnp.ones((2, 6), bool))

    @jax.jit
    def both(params, state, tokens, ctx):
        out = forward(params, cfg, state, tokens, ctx, capture=(3, 1))
        # independently: the layers one at a time, each one's output streams averaged over hc
        streams = jnp.broadcast_to(params.embed[tokens][:, :, None, :], (2, 6, cfg.hc_mult, cfg.hidden_size))
        means = []
        for i, kind in enumerate(cfg.layer_types):
            streams, _ = block(params.layers[i], cfg, kind, streams, tokens, state.layers[i], ctx)
            means.append(jnp.mean(streams, axis=2))
        return out.captured, jnp.concatenate([means[3], means[1]], axis=-1)

    captured, want = both(params, state, tokens, ctx)
    assert captured.shape == (2, 6, 2 * cfg.hidden_size)
    np.testing.assert_allclose(captured, want, rtol=1e-5, atol=1e-6)
    plain = jax.eval_shape(lambda: forward(params, cfg, state, tokens, ctx))
    assert plain.captured is None
    with pytest.raises(ValueError, match="capture must hold layer ids") as e:
        forward(params, cfg, state, tokens, ctx, capture=(cfg.num_layers,))
    _one_line(e)


# ---- the drafter ------------------------------------------------------------------------------------
def test_dspark_config_checks():
    assert DSparkConfig.from_hf_config(config(), num_stages=3) == DCFG
    assert DCFG.to_hf_config() == DSPARK
    assert hash(DCFG) == hash(DSparkConfig(5, 95, (1, 2, 3), 8))
    for bad, match in [(dict(block_size=0), "block_size"), (dict(target_layers=(3, 1)), "increasing"),
                       (dict(target_layers=[1]), "tuple"), (dict(noise_token_id=-1), "noise_token_id"),
                       (dict(markov_rank=0), "markov_rank"), (dict(num_stages=0), "num_stages")]:
        with pytest.raises(ValueError, match=match) as e:
            DSparkConfig(**{**DCFG.__dict__, **bad})
        _one_line(e)
    cfg = ModelConfig.preset("test", hca_ratio=128)
    for bad, match in [(dict(target_layers=(1, 4)), "num_layers"), (dict(noise_token_id=96), "vocab_size")]:
        with pytest.raises(ValueError, match=match):
            DSparkConfig(**{**DCFG.__dict__, **bad}).validate_for(cfg)
    with pytest.raises(ValueError, match="missing"):
        DSparkConfig.from_hf_config({"dspark_block_size": 5}, num_stages=3)


def test_commit_context_writes_taken_rows_at_their_own_positions(loaded):
    """Rows go to slot pos mod W, RoPE'd at their position; untaken rows (rejected drafts) never land;
    two commits equal one."""
    cfg, _, dp, dcfg = loaded
    w = cfg.sliding_window
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((2, 11, 96)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    take = jnp.asarray([[True] * 11, [True] * 6 + [False] * 5])
    state = _commit(dp, cfg, dcfg, ds.init_dspark_state(cfg, dcfg, 2), rows, pos, take)
    np.testing.assert_array_equal(state.length, [11, 6])
    # in two steps: 4 rows, then the rest (row 1 takes 2 more, then a rejected tail)
    half = _commit(dp, cfg, dcfg, ds.init_dspark_state(cfg, dcfg, 2), rows[:, :4], pos[:, :4], take[:, :4])
    half = _commit(dp, cfg, dcfg, half, rows[:, 4:], pos[:, 4:], take[:, 4:])
    for a, b in zip(state.stages, half.stages, strict=True):
        np.testing.assert_allclose(a.swa_kv, b.swa_kv, rtol=1e-6, atol=1e-6)
    # row 1's ring: positions 0..5 in slots 0..5, the rest untouched (zeros)
    ring = np.asarray(state.stages[0].swa_kv[1])
    assert np.all(ring[6:] == 0) and np.all(np.abs(ring[:6]).sum(-1) > 0)
    # row 0's ring holds the last W positions 3..10, position q in slot q mod W: re-committing
    # position 10 alone into an empty ring puts the same vector in slot 10 mod W
    one = _commit(dp, cfg, dcfg, ds.init_dspark_state(cfg, dcfg, 2).replace(length=jnp.array([10, 10])),
                  rows[:, 10:], pos[:, 10:], take[:, 10:])
    np.testing.assert_allclose(one.stages[2].swa_kv[0, 10 % w], state.stages[2].swa_kv[0, 10 % w], rtol=1e-6)


def test_draft_chain_is_the_markov_loop_over_block_logits(loaded):
    """draft_chain = block_logits + W1[prev] W2ᵀ step by step; greedy takes the argmax, a near-zero
    temperature's Gumbel draw the same; confidence = wᵀ[hh ; W1[prev]]."""
    cfg, tp, dp, dcfg = loaded
    rows = jnp.asarray(np.random.default_rng(2).standard_normal((2, 10, 96)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    state = _commit(dp, cfg, dcfg, ds.init_dspark_state(cfg, dcfg, 2), rows, pos, pos < jnp.array([[10], [3]]))
    anchor = jnp.array([7, 40], jnp.int32)

    @jax.jit
    def chains(dp, tp, state, anchor, key):  # one program (the stages' pass is shared)
        base, hh = ds.block_logits(dp, tp, cfg, dcfg, state, anchor)
        return (base, hh, ds.draft_chain(dp, tp, cfg, dcfg, state, anchor),
                ds.draft_chain(dp, tp, cfg, dcfg, state, anchor, 1e-6, key),
                ds.draft_chain(dp, tp, cfg, dcfg, state, anchor, 1.0, key))

    base, hh, chain, cold, hot = chains(dp, tp, state, anchor, jax.random.key(0))
    assert chain.tokens.shape == (2, 5) and chain.logits.shape == (2, 5, cfg.vocab_size) and hh.shape == (2, 5, 32)
    prev = jnp.concatenate([anchor[:, None], chain.tokens[:, :-1]], axis=1)
    e, bias = ds.markov(dp, prev)
    np.testing.assert_allclose(chain.logits, base + bias, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(chain.tokens, jnp.argmax(chain.logits, -1))
    np.testing.assert_allclose(chain.confidence, ds.confidence_logits(dp, hh, e), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cold.tokens, chain.tokens)
    assert hot.tokens.shape == (2, 5) and not np.array_equal(hot.tokens, chain.tokens)
    with pytest.raises(ValueError, match="temperature"):
        ds.draft_chain(dp, tp, cfg, dcfg, state, anchor, 1.0)


# ---- loading ---------------------------------------------------------------------------------------
def test_0731_folder_loads_target_and_drafter(folder, loaded):
    path, ref = folder
    cfg, params, dp, dcfg = loaded
    assert dcfg == DCFG and cfg.num_mtp_layers == 0 and params.mtp is None
    assert cfg.layer_types == ("sliding", "csa", "hca", "csa") and cfg.hca_ratio == 128
    np.testing.assert_array_equal(dp.main_proj, ref["mtp.0.main_proj.weight"].T)
    np.testing.assert_array_equal(dp.main_norm, ref["mtp.0.main_norm.weight"])
    np.testing.assert_array_equal(dp.markov_w1, ref["mtp.2.markov_head.markov_w1.weight"])
    np.testing.assert_array_equal(dp.markov_w2, ref["mtp.2.markov_head.markov_w2.weight"].T)
    np.testing.assert_array_equal(dp.confidence, ref["mtp.2.confidence_head.proj.weight"].T)
    np.testing.assert_array_equal(dp.hc_head.fn, ref["mtp.2.hc_head_fn"].T)
    np.testing.assert_array_equal(dp.stages[1].ffn.gate_bias, ref["mtp.1.ffn.gate.bias"])
    np.testing.assert_array_equal(dp.stages[2].ffn.experts.w2[3], ref["mtp.2.ffn.experts.3.w2.weight"].T)
    assert dp.stages[0].ffn.tid2eid is None
    # the target alone, as today's callers load it: the same leaves
    cfg2, target = load_hf_checkpoint(path, dtype="float32")
    assert cfg2 == cfg and target.mtp is None
    for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    # placed on a mesh, leaf by leaf in its declared sharding
    _, _, placed, _ = load_hf_dspark(path, dtype="float32", mesh=make_mesh())
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(dp), strict=True):
        np.testing.assert_array_equal(a, b)


def test_folders_holding_the_other_draft_are_one_line_errors(folder, tmp_path):
    april = tmp_path / "april"
    write_folder(str(april), "f32", draft="mtp")
    cfg, params = load_hf_checkpoint(april)  # the April layout of the same writer loads as today
    assert cfg.num_mtp_layers == 1 and params.mtp is not None
    with pytest.raises(ValueError, match="holds the April MTP block") as e:
        load_hf_dspark(april)
    _one_line(e)
    with pytest.raises(ValueError, match="holds a DSpark draft") as e:
        load_hf_checkpoint(folder[0], draft="mtp")
    _one_line(e)
    bare = tmp_path / "bare"
    write_folder(str(bare), "f32", draft=None)
    cfg, params, dp, dcfg = load_hf_dspark(bare)
    assert dp is None and dcfg is None and params.mtp is None
    with pytest.raises(ValueError, match="holds no draft"):
        load_hf_checkpoint(bare, draft="mtp")
    _, none = load_hf_checkpoint(april, draft="none")
    assert none.mtp is None


def test_dspark_detected_by_its_weights_alone_and_damaged_drafters(tmp_path):
    """Without the dspark_* keys the weights still mark the folder DSpark (the target loads, the
    drafter asks for its config); a missing stage tensor or a missing config are one-line errors."""
    c = config()
    tensors = random_tensors(c)
    stored, _ = store(tensors, "f32")
    no_keys = tmp_path / "no_keys"
    write(str(no_keys), {k: v for k, v in c.items() if not k.startswith("dspark_")}, stored)
    cfg, target = load_hf_checkpoint(no_keys)
    assert target.mtp is None
    with pytest.raises(ValueError, match="dspark_block_size") as e:
        load_hf_dspark(no_keys)
    _one_line(e)
    holed = tmp_path / "holed"
    write(str(holed), c, {k: v for k, v in stored.items() if k != "mtp.1.attn.wkv.weight"})
    load_hf_checkpoint(holed)
    with pytest.raises(ValueError, match="missing tensor 'mtp.1.attn.wkv.weight'") as e:
        load_hf_dspark(holed)
    _one_line(e)
    odd = tmp_path / "odd"
    write(str(odd), c, {**stored, "mtp.1.markov_head.extra.weight": raw("F32", np.zeros(2, np.float32))})
    with pytest.raises(ValueError, match="unexpected tensor 'mtp.1.markov_head.extra.weight'"):
        load_hf_dspark(odd)
    empty = tmp_path / "empty"
    write(str(empty), c, {k: v for k, v in stored.items() if not k.startswith("mtp.")})
    with pytest.raises(ValueError, match="holds no mtp"):
        load_hf_dspark(empty)


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_quantized_0731_folder_equals_its_dequantization(tmp_path, experts):
    """FP8 stages / main_proj and FP4 (or FP8) experts load to exactly the numpy dequantization
    of the stored values; kept stored (weights="fp8") they give the same block logits."""
    c = config()
    tensors = random_tensors(c)
    stored, ref = store(tensors, experts)
    write(str(tmp_path / "q"), c, stored, quantized=True)
    write(str(tmp_path / "ref"), c, store(ref, "f32")[0])
    stats = LoadStats()
    cfg, tp, dp, dcfg = load_hf_dspark(tmp_path / "q", dtype="float32", stats=stats)
    _, tp_ref, dp_ref, _ = load_hf_dspark(tmp_path / "ref", dtype="float32")
    for a, b in zip(jax.tree.leaves((tp, dp)), jax.tree.leaves((tp_ref, dp_ref)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert stats.bytes_read["mtp.0.main_proj.scale"] > 0 and stats.total_read >= stats.bytes_in_files > 0
    assert 1e-3 < _rel(dp.main_proj, tensors["mtp.0.main_proj.weight"].T) < 0.3  # the quantization is real
    rows = jnp.asarray(np.random.default_rng(3).standard_normal((1, 9, 96)), jnp.float32)
    pos, take = jnp.arange(9, dtype=jnp.int32)[None], jnp.ones((1, 9), bool)

    def logits(tp, dp):
        state = _commit(dp, cfg, dcfg, ds.init_dspark_state(cfg, dcfg, 1), rows, pos, take)
        return _chain(dp, tp, cfg, dcfg, state, jnp.array([5], jnp.int32)).logits

    _, tp_kept, dp_kept, _ = load_hf_dspark(tmp_path / "q", dtype="float32", weights="fp8")
    assert isinstance(dp_kept.main_proj, BlockScaled) and isinstance(dp_kept.stages[0].ffn.experts.w1, BlockScaled)
    plain = logits(tp, dp)
    assert _rel(logits(tp_kept, dp_kept), plain) <= 1e-5
    assert _rel(plain, logits(tp_ref, dp_ref)) <= 1e-5


def test_bf16_release_dtypes_load(tmp_path):
    """The release's unquantized dtypes (BF16 weights, F32 hc / sinks / biases) as written."""
    c = config()
    stored, ref = store(random_tensors(c), "bf16")
    write(str(tmp_path / "bf16"), c, stored)
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["compress_ratios"] == [0, 4, 128, 4, 0, 0, 0]
    cfg, _, dp, _ = load_hf_dspark(tmp_path / "bf16", dtype="float32")
    np.testing.assert_array_equal(dp.markov_w2, ref["mtp.2.markov_head.markov_w2.weight"].T)
    np.testing.assert_array_equal(dp.stages[0].attn.sink, ref["mtp.0.attn.attn_sink"])
    assert dp.confidence.dtype == jnp.float32 and cfg.dtype == "float32"
