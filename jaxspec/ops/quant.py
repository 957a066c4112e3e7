"""Weight-only block-scaled quantization: FP8 / FP4 weights kept as DeepSeek-V4's release stores them
(values + one scale per block) and dequantized right before the contraction that reads them.

A `BlockScaled` is a parameter leaf in our orientation ([..., in, out], x @ W), so a layer writes
`matmul(x, w)` / `einsum(spec, x, w)` and runs unchanged on a plain array (the identity path: no
op is added) or on a BlockScaled (values * scale of their block, cast to the plain leaf's dtype,
then the same contraction). Dequantization is exact in float32 (q * 2^k, or q * a float32 scale),
so with float32 weights the result is bit-equal to a model whose weights were dequantized at load.

Formats (see `jaxspec.checkpoint.quant` for the release's [out, in] orientation):
* FP8: `data` float8 e4m3 [..., in, out], scale per 128 x 128 block (UE8M0, or float32 for the
  Base release's experts).
* FP4: e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives) packed two per byte along `in`: `data` uint8
  [..., in/2, out], row 2i in the low nibble and 2i+1 in the high one (the release packs along
  its last axis, which is our `in`); scale per 32 x 1 block (the release's 1 x 32), UE8M0.
Stacked leading axes (experts, output groups) have block 1: one scale grid per slice.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FP8_BLOCK = (128, 128)  # (in, out): the release's 128 x 128
FP4_BLOCK = (32, 1)  # (in, out): the release's 1 x 32 along its input axis
# How the release stores a leaf, declared beside the field (`sharding.rules.axes(..., quant=)`):
# "fp8": FP8 128 x 128 (attention, indexer query, shared expert, MTP projections); "fp8_groups":
# the same for wo_a, whose release rows are our (group, column) pairs; "expert": routed experts,
# FP4 1 x 32 (instruct release) or FP8 128 x 128 with float32 scales (Base release).
# V4.1 (32 x 32 blocks): "fp8_32" for its FP8 weights, "fp8_32_groups" for its wo_a, "rows" for the Engram
# tables (FP8, one scale per 32 columns of a row).
QUANT_TAGS = ("fp8", "fp8_groups", "expert", "fp8_32", "fp8_32_groups", "rows")
EXPERT_FORMATS = ("fp4", "fp8")


@struct.dataclass
class BlockScaled:
    """A weight [..., in, out] as block-scaled values; `shape` is the weight's, not the storage's."""

    data: jax.Array  # [..., in, out] float8, or [..., in/2, out] uint8 (FP4, two per byte along in)
    scale: jax.Array  # [..., ceil(in/block[-2]), ceil(out/block[-1])] float8_e8m0fnu or float32
    block: tuple[int, ...] = struct.field(pytree_node=False)  # per weight dim; 1 on stacked dims
    dtype: str = struct.field(pytree_node=False)  # dtype of the dequantized weight (cfg.dtype)

    @property
    def packed(self) -> bool:
        return jnp.dtype(self.data.dtype) == jnp.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.data.shape)
        if self.packed:
            s[-2] *= 2
        return tuple(s)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def fmt(self) -> str:
        return "fp4" if self.packed else "fp8"


# A weight field of the parameter trees: a plain array, or its block-scaled storage.
Weight = jax.Array | BlockScaled


def is_quantized(x: Any) -> bool:
    return isinstance(x, BlockScaled)


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scale grid of a weight of `shape` in blocks of `block` (ceil per axis)."""
    return tuple(-(-n // b) for n, b in zip(shape, block, strict=True))


def stored_nbytes(x: Any) -> int:
    """Bytes a (possibly abstract) leaf occupies as stored: data plus scales for a BlockScaled."""
    leaves = [x.data, x.scale] if isinstance(x, BlockScaled) else [x]
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in leaves)


# ---------------------------------------------------------------------------------------------
# dequantization and the contractions the layers call
# ---------------------------------------------------------------------------------------------
def decode_fp4(codes: jax.Array) -> jax.Array:
    """e2m1 codes (uint8 0..15, sign in bit 3) -> float32, elementwise (fuses into its consumer):
    exponent e = bits 1..2, mantissa m = bit 0; e = 0 is 0.5 * m, else (2 + m) * 2^e / 4."""
    mag = (codes & 7).astype(jnp.int32)
    e, m = mag >> 1, mag & 1
    value = jnp.where(e == 0, 0.5 * m, ((2 + m) << e).astype(jnp.float32) * 0.25)
    return jnp.where((codes & 8) != 0, -value, value)


def _values(w: BlockScaled) -> jax.Array:
    """The block values as float32 [..., in, out] (FP4 unpacked: low nibble = even row)."""
    if not w.packed:
        return w.data.astype(jnp.float32)
    pairs = jnp.stack([decode_fp4(w.data & 0xF), decode_fp4(w.data >> 4)], axis=-2)  # [..., in/2, 2, out]
    return pairs.reshape(w.shape)


def dequantize(w: Any) -> jax.Array:
    """A BlockScaled -> the plain weight (values * block scale in float32, cast once to `w.dtype`);
    a plain array is returned as it is."""
    if not isinstance(w, BlockScaled):
        return w
    with _count(math.prod(w.shape) * jnp.dtype(w.dtype).itemsize, stored_nbytes(w)):
        values = _values(w)
        scale = w.scale.astype(jnp.float32)
        for axis, b in enumerate(w.block):
            if b > 1:  # each scale covers b consecutive elements; a ragged edge block is cut
                scale = jax.lax.slice_in_dim(jnp.repeat(scale, b, axis=axis), 0, values.shape[axis], axis=axis)
        return (values * scale).astype(w.dtype)


def dequantize_params(tree: Any) -> Any:
    """A params tree with every BlockScaled dequantized (the plain params of the same config)."""
    return jax.tree.map(dequantize, tree, is_leaf=is_quantized)


def matmul(x: jax.Array, w: Any) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out]; w plain or BlockScaled."""
    return x @ dequantize(w)


def einsum(spec: str, x: jax.Array, w: Any, **kwargs: Any) -> jax.Array:
    """jnp.einsum(spec, x, w) with w plain or BlockScaled (dequantized just before)."""
    return jnp.einsum(spec, x, dequantize(w), **kwargs)


def index(w: Any, i: int) -> Any:
    """w[i] along the leading (stacked) axis, `i` static: for a BlockScaled, that slice's values and
    scales with the leading (unblocked) axis dropped from its block too."""
    if not isinstance(w, BlockScaled):
        return w[i]
    if w.block[0] != 1:
        raise ValueError(f"index: the leading axis of a BlockScaled must be unblocked, got block {w.block}")
    return w.replace(data=w.data[i], scale=w.scale[i], block=w.block[1:])


def stack(ws: Sequence[Any]) -> Any:
    """The inverse of `index` over every i: same-shaped weights stacked along a new leading axis."""
    if not isinstance(ws[0], BlockScaled):
        return jnp.stack(ws)
    return ws[0].replace(data=jnp.stack([w.data for w in ws]), scale=jnp.stack([w.scale for w in ws]),
                         block=(1, *ws[0].block))


def take(w: Any, index: jax.Array) -> Any:
    """w[index] along the leading (stacked) axis: for a BlockScaled, the selected slices' values and
    scales, still quantized (the gathered copy is as small as the stored weights)."""
    if not isinstance(w, BlockScaled):
        return w[index]
    if w.block[0] != 1:
        raise ValueError(f"take: the leading axis of a BlockScaled must be unblocked, got block {w.block}")
    picked = math.prod(jnp.shape(index))
    plain = picked * math.prod(w.shape[1:]) * jnp.dtype(w.dtype).itemsize
    stored = picked * sum(math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize for a in (w.data, w.scale))
    with _count(2 * plain, 2 * stored):  # read from the stack and written as the gathered copy
        return w.replace(data=w.data[index], scale=w.scale[index])


# ---------------------------------------------------------------------------------------------
# abstract leaves (memory plan, cost model) and the release's layouts
# ---------------------------------------------------------------------------------------------
def release_layout(tag: str, shape: Sequence[int], experts: str = "fp4") -> tuple[tuple[int, ...], str, Any]:
    """How the release stores a leaf of `shape` (our orientation) tagged `tag` -> (block, "fp8" or
    "fp4", scale dtype). `experts`: the routed experts' format, "fp4" (instruct) or "fp8" (Base)."""
    if tag not in QUANT_TAGS:
        raise ValueError(f"quantization tag must be one of {QUANT_TAGS}, got {tag!r}")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS}, got {experts!r}")
    lead = (1,) * (len(shape) - 2)
    if tag == "fp8_32":
        return (*lead, 32, 32), "fp8", jnp.float8_e8m0fnu
    if tag == "rows":
        return (*lead, 1, 32), "fp8", jnp.float8_e8m0fnu
    if tag in ("fp8_groups", "fp8_32_groups"):  # wo_a [g, H*c/g, d_o]: release rows j*d_o + r; its blocks may
        # span groups, so per group the output axis is blocked by gcd(d_o, block), which never crosses one
        b = FP8_BLOCK[0] if tag == "fp8_groups" else 32
        return (*lead, b, math.gcd(shape[-1], b)), "fp8", jnp.float8_e8m0fnu
    if tag == "expert" and experts == "fp4":
        return (*lead, *FP4_BLOCK), "fp4", jnp.float8_e8m0fnu
    return (*lead, *FP8_BLOCK), "fp8", jnp.float32 if tag == "expert" else jnp.float8_e8m0fnu


def group_scale_rows(groups: Any, out_blocks: Any, d_o: int, b: int, release_rows: int) -> np.ndarray:
    """wo_a kept stored: the release's scale row of each of our blocks (group j, output block r of b rows)
    -> [len(groups), len(out_blocks)]. The release stores [g * d_o, in], group j's rows at j * d_o, in
    blocks of `release_rows`; b divides d_o and the release block, so our block lies in exactly one."""
    return (np.asarray(groups)[:, None] * d_o + np.asarray(out_blocks)[None, :] * b) // release_rows


def abstract_block_scaled(shape: Sequence[int], dtype: Any, block: Sequence[int], fmt: str,
                          scale_dtype: Any) -> BlockScaled:
    """ShapeDtypeStructs of a BlockScaled weight of `shape` (dequantizing to `dtype`)."""
    shape, block = tuple(shape), tuple(block)
    if fmt == "fp4":
        if shape[-2] % 2:
            raise ValueError(f"FP4 packs two values per byte along the input axis: it must be even, got {shape}")
        data = jax.ShapeDtypeStruct((*shape[:-2], shape[-2] // 2, shape[-1]), jnp.uint8)
    else:
        data = jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct(scale_shape(shape, block), jnp.dtype(scale_dtype))
    return BlockScaled(data=data, scale=scale, block=block, dtype=jnp.dtype(dtype).name)


# ---------------------------------------------------------------------------------------------
# weight bytes read by a traced program (the cost model's stored-bytes accounting)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class WeightReads:
    """Bytes of BlockScaled weights a traced program reads: as the plain weights they stand for
    (`dequantized`) and as stored (`stored`). A gathered slice counts twice (read, then written as
    the gathered copy) before the read of its dequantization. `accesses`: (scope, dequantized,
    stored) per access; its ops are traced under `jax.named_scope(scope)`, so `live` can drop the
    accesses whose result the program discards (dead code that lowering removes)."""

    dequantized: int = 0
    stored: int = 0
    accesses: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)

    def live(self, scopes: set[str]) -> WeightReads:
        """The accesses whose scope is in `scopes` (those with an op left after dead-code elimination)."""
        kept = [a for a in self.accesses if a[0] in scopes]
        return WeightReads(sum(a[1] for a in kept), sum(a[2] for a in kept), kept)


_READS: contextvars.ContextVar[WeightReads | None] = contextvars.ContextVar("jaxspec_weight_reads", default=None)
SCOPE = "jaxspec_weight_read_"  # prefix of the named scope of each counted access


@contextlib.contextmanager
def count_weight_reads() -> Iterator[WeightReads]:
    """Tally the BlockScaled accesses of everything traced inside (call the function's Python body:
    a jit cache hit traces nothing)."""
    tally = WeightReads()
    token = _READS.set(tally)
    try:
        yield tally
    finally:
        _READS.reset(token)


def _count(dequantized: int, stored: int) -> contextlib.AbstractContextManager:
    """Tally one access (when counting) and -> the named scope its ops are traced under."""
    tally = _READS.get()
    if tally is None:
        return contextlib.nullcontext()
    scope = f"{SCOPE}{len(tally.accesses)}"
    tally.accesses.append((scope, dequantized, stored))
    tally.dequantized += dequantized
    tally.stored += stored
    return jax.named_scope(scope)
