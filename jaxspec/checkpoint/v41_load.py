"""DeepSeek-V4.1 release folders (docs/v41.md, "Loading a release"): config.json with the text model under
`text_config`, official tensor names, FP8 e4m3 weights with one UE8M0 scale per 32 x 32 block, MXFP4
routed experts (1 x 32), the Engram tables in FP8 with one scale per 32 columns of a row.

The dense weights are dequantized to the run dtype at load (weights "plain"), or, with weights "fp8", every
leaf the model declares quantized (`quant=` beside its field) stays as the release
stores it (a `BlockScaled` in our orientation: FP8 32 x 32, MXFP4 experts) and is dequantized right before
the contraction that reads it; the rest is dequantized either way. The Engram tables always stay FP8,
because at V4.1-Flash's size they are 196 GB: a step gathers its 24 rows per token and dequantizes only
those (`layers.engram.table_rows`). The vision tower's tensors are skipped with one printed line (the
text model is what jaxspec runs); the DSpark stages (`mtp.*`) load as V4.1's DSpark drafter
(`model.dspark_v41`); any other tensor the model has no place for is a one-line error.

Leaves are placed on the default device, or over a mesh with each device given only its shard
(`jax.make_array_from_callback`: with several processes, each places the shards its own devices hold). The
large ones, the routed experts and the Engram tables (~95% of V4.1-Flash's bytes), are read leaf by leaf as
they are placed and only for the regions this process's devices hold (an expert shard: its experts, each
read whole; a table shard: its rows); the other leaves are assembled in host memory first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.checkpoint import quant as ckpt_quant
from jaxspec.checkpoint.hf_load import place_region
from jaxspec.checkpoint.safetensors_io import Folder, Reader, open_folder
from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.v41 import v41_text_config
from jaxspec.layers.engram import EngramParams
from jaxspec.layers.mhc import HyperConnParams
from jaxspec.layers.moe import MLPParams, MoEParams
from jaxspec.layers.v41_attention import PoolAttentionParams, PoolCompressorParams, PoolIndexerParams
from jaxspec.model.dspark_v41 import V41DSparkParams
from jaxspec.model.network import WEIGHTS
from jaxspec.model.placement import param_shardings
from jaxspec.model.v41 import V41BlockParams, V41Params
from jaxspec.ops.quant import BlockScaled, group_scale_rows

FP8_BLOCK = (32, 32)  # V4.1's weight_block_size
ROW_BLOCK = (1, 32)  # MXFP4 experts and the Engram tables
_SKIPPED = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def engram_token_map(path: str, cfg: ModelConfig) -> np.ndarray | None:
    """[V] int32 Engram class of every token id: `engram_token_map.json` when the folder has it, else
    derived from `tokenizer.json` (`derive_token_map`); None when the model has no Engram layers."""
    v = cfg.v41
    if not v.engram_layers:
        return None
    mapped = os.path.join(path, "engram_token_map.json")
    if os.path.isfile(mapped):
        with open(mapped) as f:
            table = np.asarray(json.load(f), np.int64)
    elif os.path.isfile(os.path.join(path, "tokenizer.json")):
        table = derive_token_map(os.path.join(path, "tokenizer.json"))
    else:
        raise ValueError(f"{path!r} has Engram layers but neither engram_token_map.json nor tokenizer.json "
                         "to map token ids to Engram's normalized classes")
    if table.ndim != 1 or len(table) > cfg.vocab_size or table.min() < 0:
        raise ValueError(f"the Engram token map must be one class >= 0 per token id (<= {cfg.vocab_size}), "
                         f"got shape {table.shape}")
    if int(table.max()) + 1 != v.engram_compressed_vocab:
        raise ValueError(f"the Engram token map has {int(table.max()) + 1} classes, the config says "
                         f"engram_compressed_vocab_size={v.engram_compressed_vocab}")
    full = np.full((cfg.vocab_size,), table[v.engram_pad_id] if v.engram_pad_id < len(table) else 0, np.int32)
    full[: len(table)] = table
    return full


def derive_token_map(tokenizer_json: str) -> np.ndarray:
    """Engram's classes from a tokenizer: each id's decoded text, NFKC -> NFD -> strip accents ->
    lowercase -> whitespace runs to one space -> a lone space kept, others stripped; ids whose text
    holds U+FFFD (a partial byte sequence) keep their token string. Classes are numbered in id order."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(tokenizer_json)
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    classes: dict[str, int] = {}
    out = np.zeros((tok.get_vocab_size(),), np.int64)
    for i in range(len(out)):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out[i] = classes.setdefault(key, len(classes))
    return out


class _Tensors:
    """The folder's tensors by official name; `used` collects every name the model takes (whatever is left
    must be the vision tower's, or the load fails)."""

    def __init__(self, folder: Folder, dtype: str, weights: str = "plain"):
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        self.folder, self.reader, self.dtype = folder, Reader(), jnp.dtype(dtype)
        self.keep = weights == "fp8"
        self.used: set[str] = set()

    def raw(self, name: str) -> np.ndarray:
        if name not in self.folder.tensors:
            raise ValueError(f"{self.folder.path!r} is missing tensor {name!r}")
        self.used.add(name)
        return self.reader.read(self.folder.tensors[name])

    def has(self, name: str) -> bool:
        return name in self.folder.tensors

    def scale(self, name: str) -> np.ndarray:
        """`name`'s UE8M0 scales (`_e8m0`)."""
        return _e8m0(self.raw(name), name)

    def weight(self, name: str, block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
        """`name.weight` [out, in] as float32, dequantized with `name.scale` when it has one."""
        q = self.raw(f"{name}.weight")
        if self.has(f"{name}.scale"):
            return ckpt_quant.dequantize(q, self.scale(f"{name}.scale").astype(np.float32), block)
        return q.astype(np.float32)

    def linear(self, name: str, dtype: Any = None, block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
        """An [out, in] linear as our [in, out], dequantized."""
        return _host(self.weight(name, block).T, dtype or self.dtype)

    def quantized(self, name: str, block: tuple[int, int] = FP8_BLOCK) -> np.ndarray | BlockScaled:
        """A leaf the model declares quantized: `linear`'s, or under weights "fp8" (and stored with a
        scale) the release's values and scales transposed into our [in, out] (FP4 bytes stay packed along
        the input axis, which is the release's last axis too)."""
        if not (self.keep and self.has(f"{name}.scale")):
            return self.linear(name, block=block)
        q, s = _as_bytes(self.raw(f"{name}.weight")), self.scale(f"{name}.scale")
        return BlockScaled(data=_host(q.T), scale=_host(s.T), block=block[::-1], dtype=str(self.dtype))

    def vector(self, name: str, dtype: Any = jnp.float32) -> np.ndarray:
        return _host(self.raw(name).astype(np.float32), dtype)


def _e8m0(s: np.ndarray, name: str = "an Engram table's scale") -> np.ndarray:
    """UE8M0 scales. A writer without the F8_E8M0 tag may store them as U8: the same bytes (exponent + 127),
    read as such; any other dtype is a one-line error."""
    if s.dtype == np.uint8:
        s = s.view(ml_dtypes.float8_e8m0fnu)
    if s.dtype != ml_dtypes.float8_e8m0fnu:
        raise ValueError(f"{name} is {s.dtype}; a V4.1 release stores UE8M0 scales (F8_E8M0, or their bytes as U8)")
    return s


@dataclasses.dataclass(frozen=True)
class _Lazy:
    """A large leaf (routed experts, Engram tables) read region by region when placed (`_placed`), so that a
    device's shard is all this process reads of it and the whole tree is never in host memory at once."""

    shape: tuple[int, ...]
    dtype: Any
    read: Callable[[tuple[slice, ...]], np.ndarray]  # index -> that region of the leaf, in `dtype`


def _host(x: np.ndarray, dtype: Any = None) -> np.ndarray:
    """A leaf in host memory (in `dtype`), placed once the whole tree is built (`_placed`)."""
    return np.ascontiguousarray(x if dtype is None else np.asarray(x, jnp.dtype(dtype)))


def _placed(tree: Any, cfg: ModelConfig, mesh: Any, rules: dict[str, Any] | None) -> Any:
    """`tree` of host arrays and `_Lazy` leaves on the default device, or over `mesh` by the params' declared
    axes, each distinct region read once per process (`place_region`)."""
    def reader(x: Any) -> Callable[[tuple[slice, ...]], np.ndarray]:
        return x.read if isinstance(x, _Lazy) else (lambda index: x[index])

    if mesh is None:
        return jax.tree.map(lambda x: jnp.asarray(reader(x)(())), tree)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    shardings = param_shardings(cfg, mesh, rules, abstract)
    return jax.tree.map(lambda x, s: place_region(reader(x), x.shape, s), tree, shardings)


def _grouped(t: _Tensors, name: str, g: int, ol: int) -> np.ndarray | BlockScaled:
    """wo_a: release [g * o_lora, H*c/g] (group j's rows are its output projection) -> ours [g, H*c/g, o_lora].
    Kept stored, a group's output axis is blocked by b = gcd(o_lora, 32), so each of our blocks lies inside
    one release block (`ops.quant.release_layout`, "fp8_32_groups"): its scale is that block's."""
    if not (t.keep and t.has(f"{name}.scale")):
        w = t.weight(name)
        return _host(w.reshape(g, ol, -1).transpose(0, 2, 1), t.dtype)
    q, s = t.raw(f"{name}.weight"), t.scale(f"{name}.scale")
    b = math.gcd(ol, FP8_BLOCK[0])
    rows = group_scale_rows(np.arange(g), np.arange(ol // b), ol, b, FP8_BLOCK[0])  # [g, ol/b]
    return BlockScaled(data=_host(q.reshape(g, ol, -1).transpose(0, 2, 1)), scale=_host(s[rows].transpose(0, 2, 1)),
                       block=(1, FP8_BLOCK[1], b), dtype=str(t.dtype))


def _attention(t: _Tensors, cfg: ModelConfig, prefix: str, layer: int | None) -> PoolAttentionParams:
    """`prefix`.attn of main layer `layer`, or of a DSpark stage (None: window only)."""
    v, a = cfg.v41, f"{prefix}.attn"
    g, ol = cfg.o_groups, cfg.o_lora_rank
    wo_a = _grouped(t, f"{a}.wo_a", g, ol)
    compressor = indexer = None
    if layer is not None and layer in v.kv_sources:
        compressor = PoolCompressorParams(
            wkv=t.linear(f"{a}.compressor.wkv"),
            wgate=t.linear(f"{a}.compressor.wgate") if v.ratios[layer] == 2 else None,
            norm=t.vector(f"{a}.compressor.norm.weight"), wk=t.linear(f"{a}.indexer.wk"),
            k_norm=t.vector(f"{a}.indexer.k_norm.weight"))
    if layer is not None and layer in v.index_sources:
        indexer = PoolIndexerParams(wq_b=t.quantized(f"{a}.indexer.wq_b"),
                                    weights_proj=t.linear(f"{a}.indexer.weights_proj"))
    return PoolAttentionParams(
        wq_a=t.quantized(f"{a}.wq_a"), q_norm=t.vector(f"{a}.q_norm.weight"), wq_b=t.quantized(f"{a}.wq_b"),
        wkv=t.quantized(f"{a}.wkv"), kv_norm=t.vector(f"{a}.kv_norm.weight"), wo_a=wo_a,
        wo_b=t.quantized(f"{a}.wo_b"), sink=t.vector(f"{a}.attn_sink"), compressor=compressor, indexer=indexer)


def _moe(t: _Tensors, cfg: ModelConfig, prefix: str) -> MoEParams:
    """`prefix`.ffn with `cfg`'s expert count (a DSpark stage: `DSparkConfig.stage_config`)."""
    f = f"{prefix}.ffn"
    t.used.add(f"{f}.gate.bias_vl")  # image-span tokens only (text model: never read)
    shared = None
    if cfg.n_shared_experts:
        shared = MLPParams(*(t.quantized(f"{f}.shared_experts.{w}") for w in ("w1", "w3", "w2")))
    return MoEParams(
        gate=_host(t.weight(f"{f}.gate").T, jnp.float32), gate_bias=t.vector(f"{f}.gate.bias"), tid2eid=None,
        experts=MLPParams(*(_stacked(t, [f"{f}.experts.{e}.{w}" for e in range(cfg.n_routed_experts)])
                            for w in ("w1", "w3", "w2"))), shared=shared)


def _stacked(t: _Tensors, names: list[str]) -> _Lazy | BlockScaled:
    """One routed-expert weight of every expert [E, in, out], each stored MXFP4 (1 x 32): read when placed,
    only the experts of the region asked for (a device's expert shard), each whole and then cut."""
    t.used.update(k for n in names for k in (f"{n}.weight", f"{n}.scale") if t.has(k))
    info = t.folder.tensors[f"{names[0]}.weight"]
    out, cols = info.storage_shape
    packed = info.storage_dtype() in (np.dtype(np.int8), np.dtype(np.uint8))
    shape = (len(names), 2 * cols if packed else cols, out)

    def experts(index: tuple[slice, ...], one: Any) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (3 - len(index))
        return np.stack([one(names[e])[index[1:]] for e in range(len(names))[index[0]]])

    if t.keep and t.has(f"{names[0]}.scale"):  # the layout of the values and scales, from the headers
        grid = t.folder.tensors[f"{names[0]}.scale"].shape  # [out, in/32]
        data = _Lazy((len(names), cols, out), np.dtype(np.uint8) if packed else info.storage_dtype(),
                     lambda index: experts(index, lambda n: _as_bytes(t.raw(f"{n}.weight")).T))
        scale = _Lazy((len(names), grid[1], grid[0]), np.dtype(ml_dtypes.float8_e8m0fnu),
                      lambda index: experts(index, lambda n: t.scale(f"{n}.scale").T))
        return BlockScaled(data=data, scale=scale, block=(1, *ROW_BLOCK[::-1]), dtype=str(t.dtype))
    return _Lazy(shape, t.dtype, lambda index: experts(
        index, lambda n: np.asarray(t.weight(n, ROW_BLOCK).T, t.dtype)))


def _as_bytes(q: np.ndarray) -> np.ndarray:
    """Packed FP4 (stored I8 / U8) as uint8; FP8 as it is."""
    return q.view(np.uint8) if q.dtype in (np.int8, np.uint8) else q


def _hyper(t: _Tensors, prefix: str) -> HyperConnParams:
    return HyperConnParams(fn=_host(t.raw(f"{prefix}_fn").astype(np.float32).T),
                           base=t.vector(f"{prefix}_base"), scale=t.vector(f"{prefix}_scale"))


def _engram(t: _Tensors, cfg: ModelConfig, layer: int) -> EngramParams:
    """The table is read when placed, only the rows of the region asked for (a device's row shard); rows past
    the stored ones (padding, so that rows split evenly over a mesh) are zero bytes and never looked up."""
    e = f"layers.{layer}.engram"
    rows = cfg.v41.engram_table_rows(layer)

    def region(name: str, dtype: Any, as_stored: Any) -> _Lazy:
        info = t.folder.tensors[name]
        t.used.add(name)

        def read(index: tuple[slice, ...]) -> np.ndarray:
            r0, r1, _ = (index[0] if index else slice(None)).indices(rows)
            cols = index[1] if len(index) > 1 else slice(None)
            stored = min(r1, info.shape[0])
            x = as_stored(t.reader.read(info, (slice(min(r0, stored), stored),)))[:, cols]
            pad = np.zeros((r1 - r0 - len(x), x.shape[1]), np.uint8).view(x.dtype)
            return np.concatenate([x, pad])

        return _Lazy((rows, info.shape[1]), dtype, read)

    if not t.has(f"{e}.embed.weight") or not t.has(f"{e}.embed.scale"):
        raise ValueError(f"{t.folder.path!r} is missing tensor {e}.embed.weight / .scale")
    table = BlockScaled(data=region(f"{e}.embed.weight", np.dtype(ml_dtypes.float8_e4m3fn), lambda x: x),
                        scale=region(f"{e}.embed.scale", np.dtype(ml_dtypes.float8_e8m0fnu), _e8m0),
                        block=ROW_BLOCK, dtype=str(t.dtype))
    return EngramParams(table=table, wkv=t.quantized(f"{e}.wkv"), q_weight=t.vector(f"{e}.q_weight", t.dtype),
                        k_weight=t.vector(f"{e}.k_weight", t.dtype))


def _block(t: _Tensors, cfg: ModelConfig, prefix: str, layer: int | None) -> V41BlockParams:
    """Main layer `layer` (`layers.L`) or a DSpark stage (`mtp.s`, layer None, `cfg` its stage config)."""
    v = cfg.v41
    return V41BlockParams(
        attn_norm=t.vector(f"{prefix}.attn_norm.weight"), attn=_attention(t, cfg, prefix, layer),
        ffn_norm=t.vector(f"{prefix}.ffn_norm.weight"), ffn=_moe(t, cfg, prefix),
        hc_attn=_hyper(t, f"{prefix}.hc_attn"), hc_ffn=_hyper(t, f"{prefix}.hc_ffn"),
        engram=_engram(t, cfg, layer) if layer is not None and layer in v.engram_layers else None)


def _dspark(t: _Tensors, cfg: ModelConfig, config: dict[str, Any]) -> tuple[V41DSparkParams, DSparkConfig] | None:
    """The DSpark drafter of `mtp.0..S-1` (docs/dspark.md, "V4.1's drafter"); None when the folder has none.
    Stage 0 holds main_proj / main_norm, the last stage the norm and the Markov and confidence heads."""
    stages = 0
    while t.has(f"mtp.{stages}.attn.wkv.weight"):
        stages += 1
    if not stages:
        return None
    rank = t.folder.tensors[f"mtp.{stages - 1}.markov_head.embed.weight"].shape[1] \
        if t.has(f"mtp.{stages - 1}.markov_head.embed.weight") else None
    dcfg = DSparkConfig.from_hf_config(config, stages, rank)
    dcfg.validate_for(cfg)
    scfg = dcfg.stage_config(cfg)
    last = f"mtp.{stages - 1}"
    params = V41DSparkParams(
        main_proj=t.quantized("mtp.0.main_proj"), main_norm=t.vector("mtp.0.main_norm.weight"),
        stages=tuple(_block(t, scfg, f"mtp.{s}", None) for s in range(stages)),
        norm=t.vector(f"{last}.norm.weight"),
        markov_w1=_host(t.weight(f"{last}.markov_head.embed"), t.dtype),
        markov_w2=t.linear(f"{last}.markov_head.head"),
        confidence=_host(t.weight(f"{last}.confidence_head.proj").T, jnp.float32))
    return params, dcfg


def load_v41(
    path: str | os.PathLike, config: dict[str, Any], dtype: str | None = None, with_draft: bool = True,
    mesh: Any = None, rules: dict[str, Any] | None = None, weights: str = "plain",
) -> tuple[ModelConfig, V41Params, tuple[V41DSparkParams, DSparkConfig] | None]:
    """(cfg, params, (draft params, DSpark config) or None) of a V4.1 release folder whose config.json is
    `config` (see the module docstring); `with_draft` False leaves the `mtp.*` tensors unread; `mesh` /
    `rules` place both trees over a mesh (as `shard_params` would, without a whole copy on one device);
    `weights` "fp8" keeps the leaves declared quantized as the release stores them (module docstring)."""
    path = os.fspath(path)
    cfg = ModelConfig.from_hf_config(config)
    cfg = cfg.replace(dtype=dtype or cfg.dtype)
    t = _Tensors(open_folder(path), cfg.dtype, weights)
    layers = [_block(t, cfg, f"layers.{i}", i) for i in range(cfg.num_layers)]
    token_map = engram_token_map(path, cfg)
    params = V41Params(
        embed=_host(t.weight("embed"), t.dtype), layers=tuple(layers), norm=t.vector("norm.weight"),
        head=_host(t.weight("head").T, t.dtype),
        engram_token_map=None if token_map is None else _host(token_map))
    draft = _dspark(t, cfg, v41_text_config(config)) if with_draft else None
    left = sorted(set(t.folder.tensors) - t.used)
    vision = [k for k in left if k.startswith(_SKIPPED)]
    stages = [k for k in left if k.startswith("mtp.") and not with_draft]
    unknown = [k for k in left if k not in vision and k not in stages]
    if unknown:
        raise ValueError(f"{path!r} holds {len(unknown)} tensors the V4.1 model has no place for, e.g. {unknown[0]!r}")
    if vision:
        print(f"load_release: skipped the vision tower ({len(vision)} tensors): jaxspec runs the text model")
    params = _placed(params, cfg, mesh, rules)
    if draft is not None:
        draft = (_placed(draft[0], cfg, mesh, rules), draft[1])
    return cfg, params, draft
