"""DeepSeek-V4's block-scaled weights in numpy: dequantize (for loading) and quantize (for writing).

Formats of the official checkpoints (inference/model.py, convert.py):

* FP8: `weight [out, in]` float8 e4m3 with one scale per 128 x 128 block, `scale [ceil(out/128),
  ceil(in/128)]`; w = q * scale[i // 128, j // 128]. The instruct checkpoints store scales as UE8M0
  (float8_e8m0fnu: byte b is 2^(b-127), a power of two); Base checkpoints' routed experts carry
  float32 scales.
* FP4 (routed experts of the instruct checkpoints, `expert_dtype: fp4`): e2m1 values (0, 0.5, 1,
  1.5, 2, 3, 4, 6 and negatives), two per byte, low nibble first, `weight [out, in/2]` (stored as
  I8), one UE8M0 scale per 1 x 32 block, `scale [out, ceil(in/32)]`.

Dequantization runs in float32, where q * 2^k is exact; the caller casts to the run dtype once.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 nibble -> value (nibbles 8..15 are the negatives), from ml_dtypes' own decoding.
FP4_TABLE = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the scale of a [out, in] weight in blocks of `block`: ceil division per axis."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """uint8/int8 [..., n] (two e2m1 per byte, low nibble first) -> float32 [..., 2n]."""
    b = packed.view(np.uint8)
    out = np.empty((*b.shape[:-1], 2 * b.shape[-1]), np.float32)
    out[..., 0::2] = FP4_TABLE[b & 0xF]
    out[..., 1::2] = FP4_TABLE[b >> 4]
    return out


def apply_scale(
    values: np.ndarray,  # [r, c] float32, rows row0.. and columns col0.. of the weight
    scale: np.ndarray,  # [R, C] float32, block rows row0 // br.. and block columns col0 // bc..
    row0: int,
    col0: int,
    block: tuple[int, int],
) -> np.ndarray:
    """values * scale of each element's block, for a region starting at (row0, col0)."""
    br, bc = block
    rows = np.arange(row0, row0 + values.shape[0]) // br - row0 // br
    cols = np.arange(col0, col0 + values.shape[1]) // bc - col0 // bc
    return values * scale[np.ix_(rows, cols)]


def dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """A whole weight: FP8 q [out, in] or packed FP4 q [out, in/2] (int8/uint8) -> float32 [out, in]."""
    values = unpack_fp4(q) if q.dtype in (np.int8, np.uint8) else q.astype(np.float32)
    return apply_scale(values, scale.astype(np.float32), 0, 0, block)


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Max |w| per block of a [out, in] float32 array (edge blocks padded with zeros)."""
    gr, gc = scale_grid(w.shape, block)
    padded = np.zeros((gr * block[0], gc * block[1]), np.float32)
    padded[: w.shape[0], : w.shape[1]] = np.abs(w)
    return padded.reshape(gr, block[0], gc, block[1]).max(axis=(1, 3))


def _pow2_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """The smallest power of two s with amax / s <= qmax (1 for an all-zero block)."""
    ratio = np.where(amax > 0, amax, qmax).astype(np.float64) / qmax
    exp = np.ceil(np.log2(ratio))
    exp += ratio > np.exp2(exp)  # log2 rounded down onto an integer just above a power of two
    return np.exp2(np.clip(exp, -127, 127)).astype(np.float32)


def _expand(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: shape[0], : shape[1]]


def quantize_fp8(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK, scale_dtype: str = "e8m0"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (e4m3 [out, in], scale [ceil(out/128), ceil(in/128)]).

    scale_dtype "e8m0": power-of-two scales stored as float8_e8m0fnu (the instruct checkpoints);
    "float32": amax / 448 per block (the Base checkpoints' experts). Rounding is to nearest even.
    """
    w = np.asarray(w, np.float32)
    amax = _block_amax(w, block)
    if scale_dtype == "e8m0":
        scale = _pow2_scale(amax, E4M3_MAX)
    elif scale_dtype == "float32":
        scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    else:
        raise ValueError(f"scale_dtype must be 'e8m0' or 'float32', got {scale_dtype!r}")
    q = np.clip(w / _expand(scale, w.shape, block), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale.astype(ml_dtypes.float8_e8m0fnu) if scale_dtype == "e8m0" else scale


def quantize_fp4(w: np.ndarray, block: tuple[int, int] = FP4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] (in even) -> (packed int8 [out, in/2], e8m0 scale [out, ceil(in/32)])."""
    w = np.asarray(w, np.float32)
    if w.shape[1] % 2:
        raise ValueError(f"FP4 packs two values per byte: the input dim must be even, got {w.shape}")
    scale = _pow2_scale(_block_amax(w, block), E2M1_MAX)
    q = (w / _expand(scale, w.shape, block)).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8) & 0xF
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.view(np.int8), scale.astype(ml_dtypes.float8_e8m0fnu)
