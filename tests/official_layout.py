"""DeepSeek-V4's official checkpoint layout, written by the tests' own code.

Independent of `jaxspec.checkpoint`'s writer and quantizer: the e4m3 / e2m1 grids are decoded from
their bit patterns here, rounding is to the nearest grid value (ties to the even code), scales are
powers of two stored as UE8M0 bytes (exponent + 127), FP4 is packed two per byte, low nibble first,
and the files are written byte by byte. Which tensors are quantized, and how, follows the official
release (reference doc section 3.7 for the names; FP8 128 x 128 for the attention, indexer-query,
shared-expert and MTP projections; routed experts FP4 1 x 32 with UE8M0 scales in the instruct
checkpoints, FP8 128 x 128 with float32 scales in the Base ones).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
# config.json's quantization_config as the release writes it
QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}


# ---- the names of the reference doc (section 3.7 and the release's files) ----------------------------
def block_names(prefix: str, kind: str, hash_routed: bool, experts: int) -> set[str]:
    """Tensors of one block: `layers.{i}` or `mtp.0` (kind "sliding" / "csa" / "hca")."""
    attn = [f"attn.{w}.weight" for w in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")]
    attn.append("attn.attn_sink")
    comp = ["wkv.weight", "wgate.weight", "ape", "norm.weight"]
    if kind in ("csa", "hca"):
        attn += [f"attn.compressor.{c}" for c in comp]
    if kind == "csa":
        attn += ["attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"]
        attn += [f"attn.indexer.compressor.{c}" for c in comp]
    rest = ["attn_norm.weight", "ffn_norm.weight", "ffn.gate.weight"]
    rest += [f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")]
    rest.append("ffn.gate.tid2eid" if hash_routed else "ffn.gate.bias")
    rest += [f"ffn.experts.{e}.{w}.weight" for e in range(experts) for w in ("w1", "w2", "w3")]
    rest += [f"ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")]
    return {f"{prefix}.{n}" for n in attn + rest}


def official_names(layer_types, num_hash_layers: int, experts: int, mtp: bool) -> set[str]:
    names = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    for i, kind in enumerate(layer_types):
        names |= block_names(f"layers.{i}", kind, i < num_hash_layers, experts)
    if mtp:
        names |= block_names("mtp.0", "sliding", False, experts)
        names |= {f"mtp.0.{n}" for n in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                                          "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")}
    return names


FP8_NAMES = re.compile(
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|mtp\.0\.(e_proj|h_proj))\.weight$"
)
EXPERT_NAMES = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


# ---- number formats, from the bits -----------------------------------------------------------------
def _e4m3_value(code: int) -> float:
    e, m = (code >> 3) & 0xF, code & 7
    return m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3_POS = np.array([_e4m3_value(c) for c in range(127)])  # codes 0..126 (127 is NaN), increasing
E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0..7


def _nearest_code(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """|x| -> code of the nearest grid value (ties to the even code); |x| <= grid[-1]."""
    a = np.abs(x).astype(np.float64)
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return code.astype(np.uint8)


def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest k with amax / 2^k <= qmax (0 for an all-zero block)."""
    k = np.zeros(amax.shape, np.int64)
    for idx in np.ndindex(amax.shape):
        a = float(amax[idx])
        if a > 0:
            k[idx] = math.ceil(math.log2(a / qmax))
            while a / 2.0 ** k[idx] > qmax:
                k[idx] += 1
    return k


def _blocks(shape, block):
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _expand(s, shape, block):
    return np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: shape[0], : shape[1]]


def _block_amax(w, block):
    gr, gc = _blocks(w.shape, block)
    out = np.zeros((gr, gc))
    for i in range(gr):
        for j in range(gc):
            out[i, j] = np.abs(w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]).max()
    return out


def quant_fp8(w: np.ndarray, float32_scale: bool = False):
    """fp32 [out, in] -> (e4m3 codes uint8, scale bytes/values, dequantized fp32)."""
    amax = _block_amax(w, (128, 128))
    if float32_scale:
        scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
        stored_scale = ("F32", scale)
    else:
        k = _pow2_exponent(amax, 448.0)
        scale = np.exp2(k).astype(np.float32)
        stored_scale = ("F8_E8M0", (k + 127).astype(np.uint8))
    x = (w.astype(np.float32) / _expand(scale, w.shape, (128, 128))).astype(np.float32)
    code = _nearest_code(x, E4M3_POS)
    deq = np.where(x < 0, -E4M3_POS[code], E4M3_POS[code]) * _expand(scale.astype(np.float64), w.shape, (128, 128))
    code = code | np.where(x < 0, 0x80, 0).astype(np.uint8)
    return ("F8_E4M3", code), stored_scale, deq.astype(np.float32)


def quant_fp4(w: np.ndarray):
    """fp32 [out, in] -> (packed bytes [out, in/2], e8m0 bytes [out, in/32], dequantized fp32)."""
    k = _pow2_exponent(_block_amax(w, (1, 32)), 6.0)
    scale = np.exp2(k)
    x = w.astype(np.float64) / _expand(scale, w.shape, (1, 32))
    code = _nearest_code(x, E2M1_POS)
    deq = np.where(x < 0, -E2M1_POS[code], E2M1_POS[code]) * _expand(scale, w.shape, (1, 32))
    code = code | np.where(x < 0, 8, 0).astype(np.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return ("I8", packed), ("F8_E8M0", (k + 127).astype(np.uint8)), deq.astype(np.float32)


# ---- files -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Raw:
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # as the header declares it
    data: bytes


def raw(dtype: str, a: np.ndarray, shape=None) -> Raw:
    return Raw(dtype, tuple(a.shape if shape is None else shape), np.ascontiguousarray(a).tobytes())


def _plain(a: np.ndarray) -> Raw:
    return raw({np.float32: "F32", np.int64: "I64"}[a.dtype.type], a)


def officialize(tensors: dict[str, np.ndarray], experts: str = "fp4") -> tuple[dict[str, Raw], dict[str, np.ndarray]]:
    """fp32 / int64 official-spelling tensors -> (the release's stored tensors with scales, what each
    stored tensor means in fp32: the reference)."""
    out: dict[str, Raw] = {}
    ref: dict[str, np.ndarray] = {}
    for name, a in tensors.items():
        if FP8_NAMES.search(name) or (EXPERT_NAMES.search(name) and experts == "fp8"):
            q, s, deq = quant_fp8(a, float32_scale=bool(EXPERT_NAMES.search(name)))
        elif EXPERT_NAMES.search(name):
            q, s, deq = quant_fp4(a)
        elif name.endswith(".weight"):  # embedding, head, norms, router, compressors: BF16
            b = a.astype(ml_dtypes.bfloat16)
            out[name], ref[name] = raw("BF16", b.view(np.uint16)), b.astype(np.float32)
            continue
        else:
            out[name], ref[name] = _plain(a), a
            continue
        out[name] = raw(q[0], q[1])
        out[name[: -len("weight")] + "scale"] = raw(s[0], s[1])
        ref[name] = deq
    return out, ref


def hf_spelling(name: str) -> str:
    """Official -> transformers save_pretrained spelling (scales as weight_scale_inv)."""
    if name.endswith(".scale"):
        name = name[: -len("scale")] + "weight_scale_inv"
    if name == "head.weight" or name.startswith("mtp."):
        return name
    name = {"embed.weight": "embed_tokens.weight", "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
            "hc_head_scale": "hc_head.hc_scale"}.get(name, name)
    return "model." + re.sub(r"^(layers\.\d+\.attn)\.kv_norm\.weight$", r"\1.norm.weight", name)


def write_file(filename: str, tensors: dict[str, Raw]) -> None:
    header, offset = {}, 0
    for k, t in tensors.items():
        header[k] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    blob = json.dumps(header).encode()
    with open(filename, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for t in tensors.values():
            f.write(t.data)


def write_folder(path: str, config: dict, tensors: dict[str, Raw], shards: int = 3) -> dict[str, str]:
    """config.json + `shards` files model-0000k-of-0000n.safetensors + the index; -> weight_map."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, file in enumerate(files):
        part = {n: tensors[n] for n in names[i::shards]}
        write_file(os.path.join(path, file), part)
        weight_map.update(dict.fromkeys(part, file))
    write_index(path, weight_map)
    return weight_map


def write_index(path: str, weight_map: dict[str, str]) -> None:
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def read_plain(path: str) -> dict[str, np.ndarray]:
    """The F32 / I64 tensors of an unquantized folder (safetensors' own numpy reader)."""
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


# ---- V4-Flash as released, headers only ----------------------------------------------------------------
def flash_tensor(name: str, kind: str) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of a V4-Flash tensor as the release stores it (reference doc section 3.7,
    the release's headers): d 4096, 64 heads x 512, q rank 1024, 8 groups x 1024, 256 experts of
    2048, indexer 64 x 128, hc 4, CSA 4 / HCA 128. `kind`: the block's "sliding", "csa" or "hca"."""
    d, v, e, inter = 4096, 129280, 256, 2048
    m = re.search(r"attn\.compressor\.(wkv|wgate|ape)", name)
    if m:  # the main compressor: CSA's overlapping windows are two halves (coff 2), HCA's one
        coff, ratio = (2, 4) if kind == "csa" else (1, 128)
        return ("F32", (ratio, coff * 512)) if m.group(1) == "ape" else ("BF16", (coff * 512, d))
    rules = [
        (r"^(embed|head)\.weight$", "BF16", (v, d)),
        (r"hc_head_fn$", "F32", (4, 4 * d)), (r"hc_head_base$", "F32", (4,)), (r"hc_head_scale$", "F32", (1,)),
        (r"hc_(attn|ffn)_fn$", "F32", (24, 4 * d)), (r"hc_(attn|ffn)_base$", "F32", (24,)),
        (r"hc_(attn|ffn)_scale$", "F32", (3,)),
        (r"attn\.wq_a\.weight$", "F8_E4M3", (1024, d)), (r"attn\.wq_a\.scale$", "F8_E8M0", (8, 32)),
        (r"indexer\.wq_b\.weight$", "F8_E4M3", (8192, 1024)), (r"indexer\.wq_b\.scale$", "F8_E8M0", (64, 8)),
        (r"attn\.wq_b\.weight$", "F8_E4M3", (32768, 1024)), (r"attn\.wq_b\.scale$", "F8_E8M0", (256, 8)),
        (r"attn\.wkv\.weight$", "F8_E4M3", (512, d)), (r"attn\.wkv\.scale$", "F8_E8M0", (4, 32)),
        (r"attn\.wo_a\.weight$", "F8_E4M3", (8192, d)), (r"attn\.wo_a\.scale$", "F8_E8M0", (64, 32)),
        (r"attn\.wo_b\.weight$", "F8_E4M3", (d, 8192)), (r"attn\.wo_b\.scale$", "F8_E8M0", (32, 64)),
        (r"attn\.q_norm\.weight$", "BF16", (1024,)), (r"attn\.kv_norm\.weight$", "BF16", (512,)),
        (r"attn\.attn_sink$", "F32", (64,)),
        (r"indexer\.weights_proj\.weight$", "BF16", (64, d)),
        (r"indexer\.compressor\.(wkv|wgate)\.weight$", "BF16", (256, d)),
        (r"indexer\.compressor\.ape$", "F32", (4, 256)), (r"indexer\.compressor\.norm\.weight$", "BF16", (128,)),
        (r"compressor\.norm\.weight$", "BF16", (512,)),
        (r"ffn\.gate\.weight$", "BF16", (e, d)), (r"ffn\.gate\.bias$", "F32", (e,)),
        (r"ffn\.gate\.tid2eid$", "I64", (v, 6)),
        (r"experts\.\d+\.w[13]\.weight$", "I8", (inter, d // 2)),
        (r"experts\.\d+\.w[13]\.scale$", "F8_E8M0", (inter, d // 32)),
        (r"experts\.\d+\.w2\.weight$", "I8", (d, inter // 2)),
        (r"experts\.\d+\.w2\.scale$", "F8_E8M0", (d, inter // 32)),
        (r"shared_experts\.w[13]\.weight$", "F8_E4M3", (inter, d)),
        (r"shared_experts\.w[13]\.scale$", "F8_E8M0", (16, 32)),
        (r"shared_experts\.w2\.weight$", "F8_E4M3", (d, inter)), (r"shared_experts\.w2\.scale$", "F8_E8M0", (32, 16)),
        (r"(e_proj|h_proj)\.weight$", "F8_E4M3", (d, d)), (r"(e_proj|h_proj)\.scale$", "F8_E8M0", (32, 32)),
        (r"(^|\.)(norm|attn_norm|ffn_norm|enorm|hnorm)\.weight$", "BF16", (d,)),
    ]
    for pattern, dtype, shape in rules:
        if re.search(pattern, name):
            return dtype, shape
    raise KeyError(name)


def write_sparse(filename: str, entries: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file with these headers and all-zero data, as a sparse file (no data written)."""
    sizes = {"BF16": 2, "F32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1}
    header, offset = {}, 0
    for k, (dtype, shape) in entries.items():
        n = math.prod(shape) * sizes[dtype]
        header[k] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    with open(filename, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)
