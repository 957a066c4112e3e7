"""Small helpers shared by the kernels: platform choice, version-tolerant Pallas names, padding.

The Triton lowering requires every loaded tile to have a power-of-two size and every matmul side
to be at least 16, so the wrappers pad heads, keys and feature dims; they never read past an
array: ragged lengths are handled by clamped block starts plus masks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# `None` in a block shape means "squeezed" on every jax we support; newer ones spell it pl.squeezed.
SQUEEZED = getattr(pl, "squeezed", None)

# An alignment hint only; fall back to identity should a jax drop it.
multiple_of = getattr(pl, "multiple_of", lambda x, _: x)

# H200 SXM; used only when the device does not report its SM count.
DEFAULT_NUM_SMS = 132


T = TypeVar("T")


def by_platform(run: Callable[[bool], T], interpret: bool | None) -> T:
    """`run(interpret)` for an explicit choice; for `None` the compiled kernel when the program is
    lowered for CUDA and the interpreter for any other platform.

    The choice is made by `jax.lax.platform_dependent` at lowering time, not from the process's
    default backend at trace time, so a program exported for CUDA from a CPU host holds the
    kernels (and one lowered for both platforms holds both paths). Both branches are traced.

    Inputs are validated before this call, so a ValueError while tracing the CUDA branch is a
    tile configuration only the interpreter takes (e.g. an explicit block_k < 16, which Triton's
    matmuls refuse): the CUDA branch then runs the interpreter too, as `interpret=True` would.
    """
    if interpret is not None:
        return run(bool(interpret))

    def cuda():
        try:
            return run(False)
        except ValueError:
            return run(True)

    return jax.lax.platform_dependent(cuda=cuda, default=lambda: run(True))


def num_sms() -> int:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return DEFAULT_NUM_SMS
    return int(getattr(dev, "core_count", 0) or DEFAULT_NUM_SMS)


def triton_params(num_warps: int | None, num_stages: int | None):
    """Triton compiler params under whichever name this jax exports (renamed in jax 0.7).

    Passing them is what selects the Triton lowering: without them a GPU pallas_call goes to
    Mosaic GPU, which these kernels are not written for.
    """
    try:
        from jax.experimental.pallas import triton as plgpu
    except ImportError:  # jax 0.11 deprecated the Triton backend; a later one may drop it
        plgpu = None
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
    if cls is None:
        raise RuntimeError(
            f"jax {jax.__version__} has no Pallas Triton backend (jax.experimental.pallas.triton); "
            "run with kernels='xla' or a jax that still ships it (<= 0.12 was targeted)"
        )
    return cls(num_warps=num_warps, num_stages=num_stages)



def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad `axis` of x at the end up to `size` (no copy when it already fits)."""
    if x.shape[axis] == size:
        return x
    if x.shape[axis] > size:
        raise ValueError(f"cannot pad axis {axis} of shape {x.shape} down to {size}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def exact_dot_precision(dtype) -> jax.lax.Precision | None:
    """fp32 inputs get IEEE fp32 matmuls (Triton defaults to TF32); bf16 runs on tensor cores."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
