"""Weights kept FP8 / FP4 (`weights="fp8"`): block-scaled leaves dequantized inside the matmuls.

The reference for the model is the same checkpoint loaded the default way (dequantized once, in
numpy); the reference for the block math is `jaxspec.checkpoint.quant.dequantize` in the release's
[out, in] orientation. The memory plan is checked against bytes written out from the architecture.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxspec as js
import jaxspec.testing
from jaxspec.checkpoint.quant import dequantize as np_dequantize
from jaxspec.ops import quant
from jaxspec.ops.quant import BlockScaled
from jaxspec.sharding.placement import abstract_params

CFG = js.ModelConfig.preset("test")  # float32
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 40)), jnp.int32)


def _leaves(params):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=quant.is_quantized)[0]}


def _params(cfg, seed=0):
    """Random params of cfg's structure from numpy (norms near 1, matrices ~0.1, valid hash tables):
    built in milliseconds, where an eager init_params takes seconds."""
    rng = np.random.default_rng(seed)
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
        if jnp.issubdtype(x.dtype, jnp.floating):
            noise = rng.standard_normal(x.shape).astype(np.float32)
            out.append(jnp.asarray((1 + 0.1 * noise) if "norm" in jax.tree_util.keystr(path) else 0.1 * noise, x.dtype))
        else:
            out.append(jnp.asarray(np.argsort(rng.random((x.shape[0], cfg.n_routed_experts)), axis=-1)[:, : x.shape[1]],
                                   x.dtype))
    return jax.tree_util.tree_unflatten(jax.tree.structure(abstract_params(cfg)), out)


def _np_dequantize(w: BlockScaled) -> np.ndarray:
    """numpy reference in our orientation: FP4 bytes unpacked along `in` (low nibble = even row)
    through ml_dtypes' e2m1, times each element's block scale."""
    data = np.asarray(w.data)
    if w.fmt == "fp4":
        nibbles = np.stack([data & 0xF, data >> 4], axis=-2).reshape(w.shape)
        values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    else:
        values = data.astype(np.float32)
    scale = np.asarray(w.scale).astype(np.float32)
    for axis, b in enumerate(w.block):
        scale = np.repeat(scale, b, axis=axis).take(np.arange(w.shape[axis]), axis=axis)
    return values * scale


# ---- the block math, ragged edges ------------------------------------------------------------------
def _random_release_weight(rng, out, inp, fmt):
    """A weight as the release stores it ([out, in]): random codes and power-of-two scales."""
    if fmt == "fp4":
        q = rng.integers(0, 256, size=(out, inp // 2), dtype=np.uint8)
        scale = np.exp2(rng.integers(-4, 3, size=(out, -(-inp // 32)))).astype(ml_dtypes.float8_e8m0fnu)
        return q, scale, (1, 32)
    q = rng.uniform(-448, 448, size=(out, inp)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.exp2(rng.integers(-12, -4, size=(-(-out // 128), -(-inp // 128)))).astype(ml_dtypes.float8_e8m0fnu)
    return q, scale, (128, 128)


@pytest.mark.parametrize("fmt, out, inp", [("fp8", 200, 300), ("fp8", 130, 257), ("fp4", 50, 80)])
def test_matmul_with_a_block_scaled_weight_equals_dequantize_then_dot(fmt, out, inp):
    """Shapes that are no multiple of the block: the edge blocks are cut (300 = 2 x 128 + 44, 80 =
    2 x 32 + 16); our leaf is the release's tensor transposed (FP4 bytes too: packed along `in`)."""
    rng = np.random.default_rng(1)
    q, scale, block = _random_release_weight(rng, out, inp, fmt)
    reference = np_dequantize(q, scale, block).T  # [in, out] float32
    w = BlockScaled(data=jnp.asarray(q.T), scale=jnp.asarray(scale.T), block=block[::-1], dtype="float32")
    assert w.shape == (inp, out) and w.fmt == fmt
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), reference)
    x = jnp.asarray(rng.standard_normal((3, inp)), jnp.float32)
    got = np.asarray(jax.jit(quant.matmul)(x, w))
    np.testing.assert_allclose(got, np.asarray(x) @ reference, rtol=1e-5, atol=1e-5 * np.abs(got).max())
    # a stack of two (experts): slice 1 is -w (FP4: both nibbles' sign bits flipped) or 2w (FP8: scales doubled)
    if fmt == "fp4":
        data, scale, factor = jnp.stack([w.data, w.data ^ 0x88]), jnp.stack([w.scale, w.scale]), -1.0
    else:
        data, scale, factor = jnp.stack([w.data, w.data]), jnp.stack([w.scale, (2 * w.scale.astype(jnp.float32))
                                                                          .astype(w.scale.dtype)]), 2.0
    stack = BlockScaled(data=data, scale=scale, block=(1, *w.block), dtype="float32")
    picked = quant.take(stack, jnp.asarray([1, 0, 1]))  # gathered still quantized, dequantized after
    assert picked.data.shape[0] == 3 and picked.scale.shape[0] == 3
    whole = np.asarray(quant.dequantize(stack))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(picked)), whole[[1, 0, 1]])
    np.testing.assert_array_equal(whole[1], factor * reference)


def test_plain_weights_pass_through_unchanged():
    w = jnp.arange(6.0).reshape(2, 3)
    assert quant.dequantize(w) is w and quant.take(w, jnp.asarray([1]))[0].tolist() == [3.0, 4.0, 5.0]
    jaxpr = jax.make_jaxpr(lambda x, w: quant.matmul(x, w))(jnp.ones((1, 2)), w)
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general"]  # the plain path adds no op


# ---- bytes: the memory plan and the cost model -----------------------------------------------------
def _flash_fp8_params_by_hand(t: int, experts: str = "fp4") -> int:
    """v4-flash per-device parameter bytes on mesh (1, t, 1) with the release's storage, written out
    from the architecture: FP8 (1 byte) + one UE8M0 byte per 128 x 128 block for the attention,
    indexer-query, shared-expert and MTP projections; routed experts FP4 (half a byte) + one UE8M0
    byte per 32 inputs (instruct) or FP8 + a float32 per 128 x 128 block (Base); the rest as today."""
    V, d, H, c, q, g, do = 129280, 4096, 64, 512, 1024, 8, 1024
    HI, cI, E, k, I, hc = 64, 128, 256, 6, 2048, 4
    bf16, f32 = 2, 4

    def fp8(rows, cols, split=1, scale_bytes=1):
        return (rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * scale_bytes) // split

    if experts == "fp4":
        routed = 3 * E * (d * I // 2 + d * I // 32) // t
    else:
        routed = 3 * E * fp8(d, I, scale_bytes=4) // t
    hyper = (hc * d * (2 + hc) * hc + (2 + hc) * hc + 3) * f32
    attn = (fp8(d, q) + q * f32 + fp8(q, H * c, t) + fp8(d, c) + c * f32
            + fp8(H * c, do, t) + fp8(g * do, d, t) + H * f32 // t)
    csa_comp = 2 * d * 2 * c * f32 + 4 * 2 * c * f32 + c * f32
    indexer = fp8(q, HI * cI) + d * HI * f32 + 2 * d * 2 * cI * f32 + 4 * 2 * cI * f32 + cI * f32
    hca_comp = 2 * d * c * f32 + 128 * c * f32 + c * f32
    moe = d * E * bf16 + routed + 3 * fp8(d, I, t)
    block = 2 * d * f32 + 2 * hyper + attn + moe

    def layer(i, kind):
        extra = {"sliding": 0, "csa": csa_comp + indexer, "hca": hca_comp}[kind]
        return block + extra + (V * k * 4 if i < 3 else E * f32)

    kinds = ["sliding", "sliding"] + ["csa", "hca"] * 20 + ["csa"]
    hc_head = (hc * d * hc + hc + 1) * f32
    params = 2 * V * d * bf16 // t + d * f32 + hc_head + sum(layer(i, kind) for i, kind in enumerate(kinds))
    return params + 2 * fp8(d, d) + 2 * d * f32 + block + E * f32 + hc_head + d * f32  # MTP


def test_memory_plan_counts_the_stored_bytes():
    flash = js.ModelConfig.preset("v4-flash")
    bf16 = js.memory_plan(flash, (1, 8, 1), batch=16, context=65536)
    fp8 = js.memory_plan(flash, (1, 8, 1), batch=16, context=65536, weights="fp8")
    assert fp8.param_bytes == _flash_fp8_params_by_hand(8)
    assert fp8.total_param_bytes == _flash_fp8_params_by_hand(1)
    assert fp8.state_bytes == bf16.state_bytes and fp8.param_bytes < 0.3 * bf16.param_bytes
    base = js.memory_plan(flash, (1, 8, 1), batch=16, context=65536, weights="fp8", experts="fp8")
    assert base.param_bytes == _flash_fp8_params_by_hand(8, "fp8")


