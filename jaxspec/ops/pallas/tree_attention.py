"""Tree attention for V4 layers: one online softmax over the committed window, the committed
compressed entries a node may see, its ancestors among the new tokens and the branch-local
entries those ancestors emitted, with the per-head sink in the denominator
(docs/architecture.md §2, docs/tree_verification.md §4).

Layout (MQA: every head reads the same single K=V vector per key): one program per (sequence,
node, head block, split). A node's committed keys are streamed in blocks of `block_k` through
one flash-decoding loop; when the grid is too small to fill the GPU the committed stream is cut
into splits whose partial (acc, max, sum) are merged by log-sum-exp afterwards, the tree part
riding in the last split (the cascade shape: shared prefix + per-node tree keys). Compressed
entries come as lengths (HCA: entries [0, n) for every node) or index lists (CSA: the node's
top-k), never as masks over the history. The same call serves 1-token decode, chunked prefill
(a chain is a tree) and tree verification.

The contract is that of `layers.attention.attend`, the layer's jnp path, which the layer calls
instead when `kernels="xla"` and which the tests hold the kernel to.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.core.checks import next_power_of_two
from jaxspec.ops.pallas._common import (
    SQUEEZED,
    by_platform,
    exact_dot_precision,
    multiple_of,
    num_sms,
    pad_axis,
    round_up,
    triton_params,
)

_META = 8  # per-node int32 scalars: pos, committed-compressed count, kv lo/hi, entry lo/hi, unused x2

# Hopper defaults: 32 heads x 512 channels of fp32 accumulator over 8 warps, 64-key tiles (two
# 64 KiB bf16 stages of shared memory); interpret mode takes small tiles to keep tests quick.
GPU_BLOCK_H, GPU_BLOCK_K, GPU_NUM_WARPS, GPU_NUM_STAGES = 32, 64, 8, 2
CPU_BLOCK_K = 16
MAX_SPLITS = 8


# ---------------------------------------------------------------------------------------------
# kernel


def _cdiv(a, b: int):
    """Ceil division of a non-negative int32 scalar (truncating lax.div lowers everywhere)."""
    return lax.div(jnp.asarray(a, jnp.int32) + (b - 1), jnp.int32(b))


def _tree_attention_kernel(
    meta_ref,  # [_META] int32
    q_ref,  # [bh, c]
    sink_ref,  # [bh] fp32
    win_ref,  # [Wp, c]
    win_pos_ref,  # [Wp] int32
    new_ref,  # [Np, c] uncommitted keys (a scratch, then the new tokens)
    new_mask_ref,  # [Np] int8
    *refs,  # comp [Lcp, c], comp ids [Kp] (sparse), entries [Tp, c], entry mask [Tp]; then outputs
    mode: str,
    has_entries: bool,
    block_k: int,
    window: int,
    scale: float,
    splits: int,
    precision,
):
    refs = list(refs)
    comp_ref = refs.pop(0) if mode != "none" else None
    comp_ids_ref = refs.pop(0) if mode == "sparse" else None
    ent_ref, ent_mask_ref = (refs.pop(0), refs.pop(0)) if has_entries else (None, None)
    bk = block_k
    q = q_ref[...]
    bh, c = q.shape
    pos = meta_ref[0]
    count = meta_ref[1]
    split = pl.program_id(3)
    last = split == splits - 1

    attend = functools.partial(_attend_block, q=q, scale=scale, precision=precision)

    carry = (
        jnp.full((bh,), -jnp.inf, jnp.float32),
        jnp.zeros((bh,), jnp.float32),
        jnp.zeros((bh, c), jnp.float32),
    )

    # Committed keys: window blocks [0, nw) then compressed blocks [nw, nw + nc), split evenly.
    nw = win_ref.shape[0] // bk
    nc = _cdiv(count, bk) if mode != "none" else 0
    total = nw + nc
    per = _cdiv(total, splits)
    lo = split * per
    hi = jnp.minimum(lo + per, total)

    def window_block(j, carry):
        start = multiple_of(j * bk, bk)
        kpos = win_pos_ref[pl.ds(start, bk)]
        return attend(carry, win_ref[pl.ds(start, bk), :], (kpos >= 0) & (kpos > pos - window))

    carry = lax.fori_loop(jnp.minimum(lo, nw), jnp.minimum(hi, nw), window_block, carry)

    if mode == "dense":
        lc = comp_ref.shape[0]

        def dense_block(j, carry):
            # The last block is shifted back to end at the array's end instead of reading past
            # it; keys the previous block already covered are masked out.
            start = jnp.minimum(j * bk, lc - bk)
            idx = start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
            return attend(carry, comp_ref[pl.ds(start, bk), :], (idx >= j * bk) & (idx < count))

        carry = lax.fori_loop(jnp.maximum(lo, nw) - nw, jnp.maximum(hi, nw) - nw, dense_block, carry)
    elif mode == "sparse":

        def sparse_block(j, carry):
            ids = comp_ids_ref[pl.ds(multiple_of(j * bk, bk), bk)]
            return attend(carry, comp_ref[jnp.maximum(ids, 0)], ids >= 0)

        carry = lax.fori_loop(jnp.maximum(lo, nw) - nw, jnp.maximum(hi, nw) - nw, sparse_block, carry)

    def tree_part(carry, keys_ref, mask_ref, key_lo, key_hi):
        def block(j, carry):
            start = multiple_of(j * bk, bk)
            return attend(carry, keys_ref[pl.ds(start, bk), :], mask_ref[pl.ds(start, bk)] != 0)

        first = jnp.where(last, lax.div(key_lo, bk), 0)
        end = jnp.where(last, _cdiv(key_hi, bk), 0)
        return lax.fori_loop(first, end, block, carry)

    carry = tree_part(carry, new_ref, new_mask_ref, meta_ref[2], meta_ref[3])
    if has_entries:
        carry = tree_part(carry, ent_ref, ent_mask_ref, meta_ref[4], meta_ref[5])

    _write_output(carry, sink_ref, refs, splits)


def _attend_block(carry, keys, valid, *, q, scale, precision):  # keys [bk, c], valid [bk] bool
    """One block of keys into the online softmax (running max m, sum l, weighted values acc)."""
    m, l, acc = carry
    s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale  # [bh, bk]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    pv = lax.dot_general(p.astype(keys.dtype), keys, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)  # [bh, c]
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv


def _write_output(carry, sink_ref, out_refs, splits: int) -> None:
    """One split: the normalised output (the sink joins the softmax); several: the partial m, l, acc
    the wrapper combines."""
    m, l, acc = carry
    if splits == 1:
        o_ref = out_refs[0]
        sink = sink_ref[...]
        top = jnp.maximum(m, sink)
        keep = jnp.exp(m - top)
        o_ref[...] = acc * (keep / (l * keep + jnp.exp(sink - top)))[:, None]
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _validate(q, window_kv, window_pos, new_kv, new_mask, positions, sink, comp_kv, comp_len, comp_index,
              tree_entries, tree_entry_mask):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, c], got shape {q.shape}")
    b, t, h, c = q.shape
    expect = {
        "window_kv": (window_kv, (b, None, c)),
        "window_pos": (window_pos, (b, window_kv.shape[1] if window_kv.ndim == 3 else None)),
        "new_kv": (new_kv, (b, None, c)),
        "new_mask": (new_mask, (b, t, new_kv.shape[1] if new_kv.ndim == 3 else None)),
        "positions": (positions, (b, t)),
        "sink": (sink, (h,)),
    }
    if comp_kv is not None:
        expect["comp_kv"] = (comp_kv, (b, None, c))
        if (comp_len is None) == (comp_index is None):
            raise ValueError("with comp_kv give exactly one of comp_len (dense, HCA) or comp_index (sparse, CSA)")
        if comp_len is not None:
            expect["comp_len"] = (comp_len, (b,))
        else:
            expect["comp_index"] = (comp_index, (b, t, None))
    elif comp_len is not None or comp_index is not None:
        raise ValueError("comp_len / comp_index need comp_kv")
    if (tree_entries is None) != (tree_entry_mask is None):
        raise ValueError("tree_entries and tree_entry_mask go together")
    if tree_entries is not None:
        expect["tree_entries"] = (tree_entries, (b, t, c))
        expect["tree_entry_mask"] = (tree_entry_mask, (b, t, t))
    for name, (x, shape) in expect.items():
        if x.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape, strict=True)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want} (from q {q.shape}), got {x.shape}")
    if comp_kv is not None and comp_kv.shape[1] < 1:
        raise ValueError("comp_kv must hold at least one entry slot")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")


def _key_range(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, T, N] bool -> first and one-past-last true index per row (N, 0 when none)."""
    n = mask.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    lo = jnp.min(jnp.where(mask, idx, n), axis=-1)
    hi = jnp.max(jnp.where(mask, idx + 1, 0), axis=-1)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def default_splits(b: int, t: int, head_blocks: int, committed_blocks: int) -> int:
    """Enough programs to fill the GPU's SMs, each split keeping >= 2 blocks of committed keys;
    splits cost a [rows, c] fp32 partial each, so none when the grid already fills the GPU."""
    programs = b * t * head_blocks
    want = -(-num_sms() // programs)
    return int(max(1, min(want, MAX_SPLITS, committed_blocks // 2)))


def tree_attention(
    q: jax.Array,  # [B, T, H, c]
    window_kv: jax.Array,  # [B, W, c]
    window_pos: jax.Array,  # [B, W] int32 (-1: empty slot)
    new_kv: jax.Array,  # [B, N, c]
    new_mask: jax.Array,  # [B, T, N] bool
    positions: jax.Array,  # [B, T] int32
    sink: jax.Array,  # [H] fp32
    *,
    window: int,
    scale: float,
    comp_kv: jax.Array | None = None,  # [B, Lc, c]
    comp_len: jax.Array | None = None,  # [B] int32
    comp_index: jax.Array | None = None,  # [B, T, K] int32, -1 = none
    tree_entries: jax.Array | None = None,  # [B, T, c]
    tree_entry_mask: jax.Array | None = None,  # [B, T, T] bool
    block_h: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Pallas tree attention; the contract of `layers.attention.attend` -> [B, T, H, c] fp32.

    `interpret=None` runs the Triton lowering where the program is lowered for CUDA and the
    interpreter elsewhere (`_common.by_platform`). Indices in `comp_index` must be < Lc (larger
    ones are clamped to Lc - 1 rather than read out of bounds).
    """
    _validate(q, window_kv, window_pos, new_kv, new_mask, positions, sink, comp_kv, comp_len, comp_index,
              tree_entries, tree_entry_mask)
    args = dict(window=window, scale=scale, comp_kv=comp_kv, comp_len=comp_len, comp_index=comp_index,
                tree_entries=tree_entries, tree_entry_mask=tree_entry_mask, block_h=block_h, block_k=block_k,
                num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    return by_platform(
        lambda interp: _tree_attention(q, window_kv, window_pos, new_kv, new_mask, positions, sink,
                                       interpret=interp, **args),
        interpret,
    )


def _tree_attention(q, window_kv, window_pos, new_kv, new_mask, positions, sink, *, window, scale, comp_kv,
                    comp_len, comp_index, tree_entries, tree_entry_mask, block_h, block_k, num_splits, num_warps,
                    num_stages, interpret: bool):
    gpu = not interpret
    b, t, h, c = q.shape
    dt = q.dtype
    bk, bh, hp, cp = _tiles(h, c, block_h, block_k, gpu)

    def keys(x, axis_len=None):  # [B, N, c] -> dtype, channels padded, N padded to axis_len
        x = pad_axis(x.astype(dt), 2, cp)
        return x if axis_len is None else pad_axis(x, 1, axis_len)

    qp = pad_axis(pad_axis(q, 3, cp), 2, hp)
    sinkp = pad_axis(sink.astype(jnp.float32), 0, hp)
    wp = round_up(window_kv.shape[1], bk)
    win = keys(window_kv, wp)
    win_pos = pad_axis(window_pos.astype(jnp.int32), 1, wp, value=-1)
    tp = round_up(t, bk)
    np_ = round_up(new_kv.shape[1], bk)
    new = keys(new_kv, np_)
    new_mask_p = pad_axis(new_mask, 2, np_, value=False)
    kv_lo, kv_hi = _key_range(new_mask_p)

    mode = "none" if comp_kv is None else ("dense" if comp_len is not None else "sparse")
    has_entries = tree_entries is not None
    count, extra_in, extra_specs, committed_blocks = _compressed_operands(
        mode, comp_kv, comp_len, comp_index, keys, b, t, bk, cp, wp // bk)
    sq = SQUEEZED
    ent_lo = ent_hi = jnp.zeros((b, t), jnp.int32)
    if has_entries:
        ent_mask = pad_axis(tree_entry_mask, 2, tp, value=False)
        ent_lo, ent_hi = _key_range(ent_mask)
        extra_in += [keys(tree_entries, tp), ent_mask.astype(jnp.int8)]
        extra_specs += [
            pl.BlockSpec((sq, tp, cp), lambda i, j, k, s: (i, 0, 0)),
            pl.BlockSpec((sq, sq, tp), lambda i, j, k, s: (i, j, 0)),
        ]
    zeros = jnp.zeros((b, t), jnp.int32)
    meta = jnp.stack([positions.astype(jnp.int32), count, kv_lo, kv_hi, ent_lo, ent_hi, zeros, zeros], axis=-1)

    head_blocks = hp // bh
    splits = int(num_splits) if num_splits else (default_splits(b, t, head_blocks, committed_blocks) if gpu else 1)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    grid = (b, t, head_blocks, splits)
    in_specs = [
        pl.BlockSpec((sq, sq, _META), lambda i, j, k, s: (i, j, 0)),
        pl.BlockSpec((sq, sq, bh, cp), lambda i, j, k, s: (i, j, k, 0)),
        pl.BlockSpec((bh,), lambda i, j, k, s: (k,)),
        pl.BlockSpec((sq, wp, cp), lambda i, j, k, s: (i, 0, 0)),
        pl.BlockSpec((sq, wp), lambda i, j, k, s: (i, 0)),
        pl.BlockSpec((sq, np_, cp), lambda i, j, k, s: (i, 0, 0)),
        pl.BlockSpec((sq, sq, np_), lambda i, j, k, s: (i, j, 0)),
        *extra_specs,
    ]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, t, hp, cp), jnp.float32)
        out_specs = pl.BlockSpec((sq, sq, bh, cp), lambda i, j, k, s: (i, j, k, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((b, t, splits, hp, cp), jnp.float32),
            jax.ShapeDtypeStruct((b, t, splits, hp), jnp.float32),
            jax.ShapeDtypeStruct((b, t, splits, hp), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((sq, sq, sq, bh, cp), lambda i, j, k, s: (i, j, s, k, 0)),
            pl.BlockSpec((sq, sq, sq, bh), lambda i, j, k, s: (i, j, s, k)),
            pl.BlockSpec((sq, sq, sq, bh), lambda i, j, k, s: (i, j, s, k)),
        )
    kernel = functools.partial(
        _tree_attention_kernel,
        mode=mode,
        has_entries=has_entries,
        block_k=bk,
        window=int(window),
        scale=float(scale),
        splits=splits,
        precision=exact_dot_precision(dt),
    )
    extra = {}
    if gpu:
        extra["compiler_params"] = triton_params(num_warps or GPU_NUM_WARPS, num_stages or GPU_NUM_STAGES)
    result = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name=f"tree_attention_{mode}",
        **extra,
    )(meta, qp, sinkp, win, win_pos, new, new_mask_p.astype(jnp.int8), *extra_in)
    out = result if splits == 1 else _combine_splits(*result, sinkp)
    return out[:, :, :h, :c]


def _combine_splits(acc, m, l, sinkp):  # [B, T, S, Hp, cp], [B, T, S, Hp] x2, [Hp]
    """The key splits' partial softmaxes into one output, the sink joining once."""
    top = jnp.maximum(jnp.max(m, axis=2), sinkp[None, None, :])  # [B, T, Hp]
    keep = jnp.exp(m - top[:, :, None])
    denom = jnp.sum(l * keep, axis=2) + jnp.exp(sinkp[None, None, :] - top)
    return jnp.sum(acc * keep[..., None], axis=2) / denom[..., None]


def _tiles(h: int, c: int, block_h, block_k, gpu: bool) -> tuple[int, int, int, int]:
    """-> (block_k, block_h, padded heads, padded channels); Triton matmuls need every side >= 16."""
    bk = int(block_k or (GPU_BLOCK_K if gpu else CPU_BLOCK_K))
    if bk < 1 or bk & (bk - 1):
        raise ValueError(f"block_k must be a power of two, got {bk}")
    min_tile = 16 if gpu else 1
    if gpu and bk < 16:
        raise ValueError(f"block_k must be >= 16 on GPU, got {bk}")
    hp = max(next_power_of_two(h), min_tile)
    bh = min(int(block_h or (GPU_BLOCK_H if gpu else hp)), hp)
    if bh < min_tile or bh & (bh - 1):
        raise ValueError(f"block_h must be a power of two >= {min_tile}, got {bh}")
    return bk, bh, hp, max(next_power_of_two(c), min_tile)


def _compressed_operands(mode, comp_kv, comp_len, comp_index, keys, b, t, bk, cp, committed_blocks):
    """The compressed keys (and, sparse, the sorted top-k ids) as kernel operands -> (entries per
    node [B, T], operands, their BlockSpecs, committed key blocks in all)."""
    sq = SQUEEZED
    count = jnp.zeros((b, t), jnp.int32)
    extra_in, extra_specs = [], []
    if mode == "none":
        return count, extra_in, extra_specs, committed_blocks
    lc = comp_kv.shape[1]
    comp = keys(comp_kv, max(lc, bk))  # only a cache shorter than one block is copied
    extra_in.append(comp)
    extra_specs.append(pl.BlockSpec((sq, comp.shape[1], cp), lambda i, j, k, s: (i, 0, 0)))
    if mode == "dense":
        count = jnp.broadcast_to(jnp.minimum(comp_len.astype(jnp.int32), lc)[:, None], (b, t))
        return count, extra_in, extra_specs, committed_blocks + comp.shape[1] // bk
    ids = comp_index.astype(jnp.int32)
    ok = ids >= 0
    # Valid ids first (ascending: neighbouring rows, friendlier gathers), so a node reads only
    # ceil(count / block_k) blocks.
    ids = jnp.sort(jnp.where(ok, jnp.minimum(ids, lc - 1), lc), axis=-1)
    ids = jnp.where(ids < lc, ids, -1)
    kp = round_up(ids.shape[-1], bk)
    ids = pad_axis(ids, 2, kp, value=-1)
    extra_in.append(ids)
    extra_specs.append(pl.BlockSpec((sq, sq, kp), lambda i, j, k, s: (i, j, 0)))
    return jnp.sum(ok, axis=-1).astype(jnp.int32), extra_in, extra_specs, committed_blocks + kp // bk
