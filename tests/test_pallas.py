"""Ladder rung 1: the Pallas kernels (interpret mode on CPU) equal their jnp references over random
trees, ragged batches, lengths that are not block multiples, empty compressed sets and the tree
boundary cases; the model's pallas path equals its XLA path (layer outputs, speculative tokens);
the kernels lower to Triton for V4 shapes; `bench/kernels.py --smoke` runs."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.core.config import LayerGeometry
from jaxspec.layers.attention import attend, attention, ring_positions
from jaxspec.layers.compressor import CompressorParams, PoolRows, pool_entries
from jaxspec.model import state as state_lib
from jaxspec.model.network import causal_context
from jaxspec.ops.pallas.chain_compress import chain_compress
from jaxspec.ops.pallas.tree_attention import tree_attention
from jaxspec.ops.pooling import pool_rows
from jaxspec.ops.rope import inv_freq
from jaxspec.speculation.plan import build_plan, verify_context

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
ROOT = Path(__file__).resolve().parents[1]


def _random_parents(rng, b, t, max_depth):
    out = []
    for _ in range(b):
        parent, depth = [0], [0]
        for _ in range(1, t):
            p = int(rng.choice([i for i in range(len(parent)) if depth[i] < max_depth]))
            parent.append(p)
            depth.append(depth[p] + 1)
        out.append(parent)
    return jnp.asarray(out, jnp.int32)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


def _attention_inputs(seed, mode, t, h, c, dtype, chain=False, window=8, lc=13, topk=3, ratio=4,
                      committed=(2, 9, 21)):
    """Random tree (or causal chunk with padding) over a ragged batch: by default P < 4, P near W, P > W."""
    rng = np.random.default_rng(seed)
    committed = jnp.asarray(committed, jnp.int32)
    b = committed.shape[0]
    if chain:
        valid = jnp.arange(t)[None, :] < jnp.asarray([t, t // 2, 0])[:, None]  # ragged chunk, one empty row
        ctx = causal_context(committed, valid)
        mask, positions = ctx.visible, ctx.positions
    else:
        plan = build_plan(_random_parents(rng, b, t, max_depth=6), committed, 6)
        mask, positions = plan.ancestor_mask, plan.positions
    keys = jax.random.split(jax.random.key(seed), 6)

    def normal(k, shape):
        return jax.random.normal(k, shape, jnp.float32).astype(dtype)

    args = (
        normal(keys[0], (b, t, h, c)),
        normal(keys[1], (b, window, c)),
        ring_positions(committed, window),
        normal(keys[2], (b, t, c)),
        mask & (positions[:, None, :] > positions[:, :, None] - window),
        positions,
        jax.random.normal(keys[3], (h,), jnp.float32),
    )
    kw = dict(window=window, scale=c**-0.5)
    if mode != "none":
        emits = (positions + 1) % ratio == 0
        kw.update(comp_kv=normal(keys[4], (b, lc, c)), tree_entries=normal(keys[5], (b, t, c)),
                  tree_entry_mask=mask & emits[:, None, :])
        n = np.minimum(np.asarray(committed) // ratio, lc)
        if mode == "dense":
            kw["comp_len"] = jnp.asarray(n, jnp.int32)
        else:
            ids = rng.integers(0, np.maximum(n, 1)[:, None, None], (b, t, topk))
            drop = (rng.random((b, t, topk)) < 0.3) | (n[:, None, None] == 0)
            kw["comp_index"] = jnp.asarray(np.where(drop, -1, ids), jnp.int32)
    return args, kw


ATTENTION_CASES = {
    # name: (dtype, mode, nodes, heads, head_dim, chain, kernel options); the cache holds 13 entries
    "fp32-dense-clamped-last-block-splits": (jnp.float32, "dense", 7, 4, 32, False, dict(block_k=4, num_splits=3)),
    "fp32-dense-cache-under-one-block-padded-heads-dims": (jnp.float32, "dense", 5, 3, 24, False, dict(block_h=4)),
    "fp32-sparse-splits-head-blocks": (jnp.float32, "sparse", 7, 4, 32, False, dict(block_k=4, num_splits=2,
                                                                                    block_h=2)),
    "fp32-window-only-decode": (jnp.float32, "none", 1, 4, 32, False, {}),
    "fp32-chunked-prefill-ragged": (jnp.float32, "dense", 12, 4, 32, True, dict(block_k=4)),
    "bf16-sparse": (jnp.bfloat16, "sparse", 7, 4, 32, False, {}),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_tree_attention_equals_reference(name):
    dtype, mode, t, h, c, chain, opts = ATTENTION_CASES[name]
    args, kw = _attention_inputs(len(name), mode, t, h, c, dtype, chain=chain)
    want = jax.jit(lambda *a: attend(*a, **kw))(*args)  # the layer's jnp path
    got = jax.jit(lambda *a: tree_attention(*a, **kw, **opts))(*args)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert _rel_err(got, want) <= TOL[dtype], name


def test_tree_attention_bad_inputs():
    args, kw = _attention_inputs(0, "dense", 3, 4, 32, jnp.float32)
    with pytest.raises(ValueError, match="exactly one of comp_len"):
        tree_attention(*args, **kw, comp_index=jnp.zeros((3, 3, 2), jnp.int32))
    with pytest.raises(ValueError, match="new_mask must have shape"):
        tree_attention(*args[:4], args[4][:, :2], *args[5:], **kw)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        tree_attention(*args, **kw, block_k=6)
    with pytest.raises(ValueError, match="go together"):
        tree_attention(*args, window=8, scale=1.0, tree_entries=kw["tree_entries"])


# CSA main (overlap, width 32), CSA indexer (width 16), HCA (ratio 16): committed lengths below one
# block (entry 0's previous-block slots are empty), on a block boundary, and trees crossing boundaries.
COMPRESS_CASES = {
    "csa": (4, True, 32, [1, 4, 13], {}),
    "csa-indexer-two-row-blocks": (4, True, 16, [3, 8, 10], dict(block_rows=2)),
    "hca": (16, False, 32, [10, 16, 26], dict(block_rows=4)),
}


@pytest.mark.parametrize("name", list(COMPRESS_CASES))
def test_chain_compress_equals_reference_and_model(name, test_cfg):
    ratio, overlap, width, committed, opts = COMPRESS_CASES[name]
    cfg = test_cfg
    b, t, coff = len(committed), 9, 2 if overlap else 1
    committed = jnp.asarray(committed, jnp.int32)
    # siblings at depths 2-4 close the same block index differently; the chain reaches depth 8
    parents = jnp.asarray([[0, 0, 1, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 2, 2, 5, 6, 6]])
    plan = build_plan(parents, committed, 8)
    keys = jax.random.split(jax.random.key(len(name)), 5)
    rows = [jax.random.normal(k, (b, coff * ratio if i < 2 else t, coff * width)) for i, k in enumerate(keys[:4])]
    norm = 1.0 + 0.1 * jax.random.normal(keys[4], (width,))
    freqs = inv_freq(cfg, True)
    args = (*rows, plan.positions, committed, plan.ancestor_at_depth, norm, freqs)
    kw = dict(ratio=ratio, overlap=overlap, eps=cfg.rms_norm_eps)
    # The layer's jnp path pools every node as if it closed a block; the kernel zeroes the rest.
    want = np.array(jax.jit(lambda *a: pool_rows(*a, **kw))(*args))
    got = jax.jit(lambda *a: chain_compress(*a, **kw, **opts))(*args)
    emits = np.asarray((plan.positions + 1) % ratio == 0)
    assert emits.any() and not emits.all()
    want[~emits] = 0.0
    assert _rel_err(got, want) <= 1e-5
    assert not np.asarray(got)[~emits].any()
    params = CompressorParams(None, None, None, norm)
    geo = LayerGeometry("csa" if overlap else "hca", ratio, indexed=overlap)
    ctx = verify_context(plan, committed)
    model = jax.jit(lambda *a: pool_entries(params, cfg, geo, PoolRows(*a[:2]), PoolRows(*a[2:4]), a[4], freqs))(
        *rows, ctx)
    assert _rel_err(np.asarray(want)[emits], np.asarray(model)[emits]) <= 1e-6


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_layer_pallas_equals_xla(test_params, test_cfg, kind):
    """One attention layer on a random committed state and tree: output and emitted entries."""
    cfg = test_cfg
    layer = cfg.layer_types.index(kind)
    b, t = 2, 6
    committed = jnp.asarray([14, 29], jnp.int32)  # trees cross CSA and HCA (16) boundaries
    state = state_lib.init_state(cfg, b, 64).layers[layer]
    leaves, treedef = jax.tree.flatten(state)
    ks = jax.random.split(jax.random.key(7), len(leaves) + 1)
    state = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(ks, leaves,
                                                                                               strict=False)])
    plan = build_plan(jnp.asarray([[0, 0, 1, 2, 2, 3], [0, 0, 0, 1, 3, 4]], jnp.int32), committed, 5)
    ctx = verify_context(plan, committed)
    x = jax.random.normal(ks[-1], (b, t, cfg.hidden_size))
    p = test_params.layers[layer].attn

    def run(impl):
        return jax.jit(lambda x, s: attention(p, cfg.replace(kernels=impl), kind, x, s, ctx))(x, state)

    (out_x, rows_x), (out_p, rows_p) = run("xla"), run("pallas")
    assert _rel_err(out_p, out_x) <= 1e-5
    emits = np.asarray(plan.positions + 1) % (cfg.csa_ratio if kind == "csa" else cfg.hca_ratio) == 0
    assert emits.any()
    assert _rel_err(np.asarray(rows_p.comp_entry)[emits], np.asarray(rows_x.comp_entry)[emits]) <= 1e-5
    if kind == "csa":
        assert _rel_err(np.asarray(rows_p.idx_entry)[emits], np.asarray(rows_x.idx_entry)[emits]) <= 1e-5


def test_speculative_generate_pallas_equals_xla(test_params, test_cfg):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 4]]
    ref = js.speculative_generate(test_params, test_cfg, prompts, "s2_k2_d4", max_new_tokens=16)
    out = js.speculative_generate(test_params, test_cfg.replace(kernels="pallas"), prompts, "s2_k2_d4",
                                  max_new_tokens=16)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)


def _cuda_lowering(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_kernels_lower_to_triton_for_v4_shapes():
    """Lowered (not compiled) for CUDA on the CPU: catches tiles that are not powers of two and
    primitives the Triton lowering lacks, without a GPU."""
    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    try:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import triton as plgpu

        probe = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                               compiler_params=plgpu.CompilerParams(num_warps=4))
        _cuda_lowering(probe, jnp.zeros((16,)))
    except Exception as e:  # no Triton backend or no cross-lowering in this jax
        pytest.skip(f"Pallas Triton cross-lowering unavailable: {type(e).__name__}: {e}")
    cfg = js.ModelConfig.preset("v4-flash")
    b, t, h, c, w = 2, 6, cfg.num_heads, cfg.head_dim, cfg.sliding_window
    bf = jnp.bfloat16
    args = (jnp.zeros((b, t, h, c), bf), jnp.zeros((b, w, c), bf), jnp.zeros((b, w), jnp.int32),
            jnp.zeros((b, t, c), bf), jnp.ones((b, t, t), bool), jnp.zeros((b, t), jnp.int32), jnp.zeros((h,)))
    comp = dict(comp_kv=jnp.zeros((b, 1000, c), bf), tree_entries=jnp.zeros((b, t, c), bf),
                tree_entry_mask=jnp.ones((b, t, t), bool))
    variants = [{}, dict(comp, comp_len=jnp.asarray([3, 900])),
                dict(comp, comp_index=jnp.zeros((b, t, cfg.index_topk), jnp.int32))]
    for kw in variants:
        for splits in (1, 3):
            text = _cuda_lowering(lambda *a, kw=kw, s=splits: tree_attention(
                *a, window=w, scale=0.1, interpret=False, num_splits=s, **kw), *args)
            assert "triton" in text
    for ratio, overlap, width in [(4, True, c), (4, True, cfg.index_head_dim), (cfg.hca_ratio, False, c)]:
        coff = 2 if overlap else 1
        rows = [jnp.zeros((b, n, coff * width)) for n in (coff * ratio, coff * ratio, t, t)]
        text = _cuda_lowering(lambda *a, r=ratio, o=overlap: chain_compress(
            *a, ratio=r, overlap=o, eps=1e-6, interpret=False), *rows, jnp.zeros((b, t), jnp.int32),
            jnp.zeros((b,), jnp.int32), jnp.zeros((b, t, t), jnp.int32), jnp.ones((width,)), jnp.ones((32,)))
        assert "triton" in text


def test_bench_kernels_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--budget", "600"]) == 0
    out = capsys.readouterr().out
    assert "6 cases, 0 failed, 0 skipped" in out, out


@pytest.mark.parametrize("shape", [(1, 1, 4, 4), (3, 5, 4, 4), (2, 70, 4, 4), (7, 2, 2)])
def test_sinkhorn_kernel_equals_the_loop(shape):
    """The fused Sinkhorn (interpret mode) equals the loop hc_pre runs, over token counts that are not
    block multiples (padded and cut), and leaves doubly-stochastic matrices."""
    from jaxspec.ops.pallas.sinkhorn import sinkhorn, sinkhorn_kernel, sinkhorn_reference

    comb = jax.nn.softmax(jax.random.normal(jax.random.key(len(shape)), shape), axis=-1) + 1e-6
    want = sinkhorn_reference(comb, 19, 1e-6)
    np.testing.assert_allclose(sinkhorn_kernel(comb, 19, 1e-6, interpret=True), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(jax.jit(lambda c: sinkhorn(c, 19, 1e-6))(comb), want)  # CPU: the loop itself
    np.testing.assert_allclose(np.asarray(want).sum(-1), 1.0, atol=1e-3)
    np.testing.assert_allclose(np.asarray(want).sum(-2), 1.0, atol=1e-3)
    with pytest.raises(ValueError, match="square"):
        sinkhorn_kernel(jnp.ones((2, 4, 3)), 19, 1e-6, interpret=True)

