"""The routed experts' grouped-matmul kernel (ops/pallas/grouped_matmul.py, `layers.moe.kernel_experts`)
against `dense_experts`, in interpret mode on this CPU: plain, FP8 (128 x 128, float32 and UE8M0
scales) and FP4 (32 x 1, UE8M0) experts, at 1, 8, 64 and 300 tokens, and experts off this device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxspec as js
from jaxspec.layers import moe
from jaxspec.ops import quant
from jaxspec.ops.pallas.grouped_matmul import grouped_matmul
from jaxspec.ops.quant import BlockScaled

E, K, D, I = 8, 2, 256, 128
CFG = js.ModelConfig.preset("test").replace(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K,
                                            moe_intermediate_size=I)


def _fp8(rng, shape, scale_dtype):
    g, din, dout = shape
    data = jnp.asarray(rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn))
    exps = rng.integers(-8, -3, size=(g, -(-din // 128), -(-dout // 128))).astype(np.float32)
    scale = jnp.asarray(2.0**exps).astype(scale_dtype)
    return BlockScaled(data=data, scale=scale, block=(1, 128, 128), dtype="float32")


def _fp4(rng, shape):
    g, din, dout = shape
    data = jnp.asarray(rng.integers(0, 256, size=(g, din // 2, dout), dtype=np.uint8))
    exps = rng.integers(-8, -3, size=(g, din // 32, dout)).astype(np.float32)
    return BlockScaled(data=data, scale=jnp.asarray(2.0**exps).astype(jnp.float8_e8m0fnu), block=(1, 32, 1),
                       dtype="float32")


def _experts(fmt, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"w1": (E, D, I), "w3": (E, D, I), "w2": (E, I, D)}
    if fmt == "plain":
        make = lambda s: jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    elif fmt == "fp4":
        make = lambda s: _fp4(rng, s)  # noqa: E731
    else:
        make = lambda s: _fp8(rng, s, jnp.float32 if fmt == "fp8" else jnp.float8_e8m0fnu)  # noqa: E731
    return moe.MLPParams(**{k: make(s) for k, s in shapes.items()})


def _inputs(n, seed=1, num_experts=E):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, D)), jnp.float32)
    idx = jnp.asarray(np.argsort(rng.random((n, num_experts)), axis=-1)[:, :K], jnp.int32)
    w = jnp.asarray(rng.random((n, K)), jnp.float32)
    return x, idx, w


# CI: every size for plain experts and one per quantized format; the long tier the rest.
CASES = [(f, n) for f in ("plain", "fp8", "fp8_e8m0", "fp4") for n in (1, 8, 64, 300)]
IN_CI = {("fp8", 64), ("fp8_e8m0", 300), ("fp4", 300)}


@pytest.mark.parametrize("fmt,n", [c if c[0] == "plain" or c in IN_CI else
                                   pytest.param(*c, marks=pytest.mark.long) for c in CASES])
def test_kernel_experts_equal_dense_experts(fmt, n):
    experts = _experts(fmt)
    x, idx, w = _inputs(n, seed=n)
    want = moe.dense_experts(experts, CFG, x, idx, w)
    got = jax.jit(lambda *a: moe.kernel_experts(experts, CFG, *a, interpret=True))(x, idx, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))),
                               err_msg=f"{fmt}, {n} tokens")


def test_experts_off_this_device_contribute_nothing():
    """Indices >= E (another device's experts under expert parallelism) sort past every group; the
    kernel never writes those rows and they must not reach the output (not even as NaN * 0)."""
    experts = _experts("plain")
    x, idx, w = _inputs(64, num_experts=2 * E)
    got = moe.kernel_experts(experts, CFG, x, idx, w, interpret=True)
    np.testing.assert_allclose(got, moe.dense_experts(experts, CFG, x, idx, w), rtol=1e-5, atol=1e-5)
    assert bool(jnp.all(jnp.isfinite(got)))


def test_grouped_matmul_equals_ragged_dot_with_empty_groups():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 64, 32)), jnp.float32)
    sizes = jnp.asarray([0, 17, 0, 23, 0], jnp.int32)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])
    got = grouped_matmul(x, w, offsets, interpret=True)
    want = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.long  # on CPU the model differentiates the dense path; this is the GPU path's rule
def test_kernel_experts_gradients_are_the_grouped_paths():
    experts = _experts("plain")
    x, idx, w = _inputs(8)
    f = lambda fn: lambda ex, xx, ww: jnp.sum(fn(ex, CFG, xx, idx, ww) ** 2)  # noqa: E731
    got = jax.grad(f(lambda *a: moe.kernel_experts(*a, interpret=True)), argnums=(0, 1, 2))(experts, x, w)
    want = jax.grad(f(moe.dense_experts), argnums=(0, 1, 2))(experts, x, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(r))))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="offsets"):
        grouped_matmul(jnp.zeros((4, 16)), jnp.zeros((2, 16, 16)), jnp.zeros((2,), jnp.int32), interpret=True)
    assert quant.is_quantized(_experts("fp4").w1)
