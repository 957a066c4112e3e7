"""Load a DeepSeek-V4 safetensors checkpoint (official or HF spelling, plain or FP8 / FP4
block-scaled) into ModelParams, reading per device only the slice that device holds.

Every leaf is read by regions: a leaf's index (a tuple of slices, what
`jax.make_array_from_callback` asks for per device) maps onto the checkpoint tensors it comes from
(transposed, regrouped for `wo_a`, one tensor per expert for stacked experts), and only those
rows / columns (and their scale blocks) are copied out of the memory-mapped files and dequantized.
Under a multi-process mesh each process therefore reads the experts and head / group slices its
own devices hold, and nothing else; replicated leaves are read once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoint import errors
from jaxspec.checkpoint.keys import Spec, ckpt_shape, draft_kind, key_table, normalize_key, scale_key
from jaxspec.checkpoint.native import CONFIG, leaves_by_path
from jaxspec.checkpoint.quant import FP4_BLOCK, FP8_BLOCK, apply_scale, scale_grid, unpack_fp4
from jaxspec.checkpoint.safetensors_io import INDEX, SUPPORTED, Reader, TensorInfo, open_folder
from jaxspec.core.config import DTYPES, ModelConfig
from jaxspec.model.network import WEIGHTS, ModelParams, abstract_params
from jaxspec.model.placement import param_shardings
from jaxspec.ops.quant import BlockScaled, group_scale_rows
from jaxspec.sharding.rules import map_declared

_FLOAT = ("F32", "BF16", "F16", "F64")
_FP8 = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
_FP4 = ("I8", "U8", "F4")  # packed e2m1: I8 / U8 [out, in/2] (DeepSeek's files), F4 [out, in]
_INT = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")
_SCALE = ("F8_E8M0", "F32", "BF16")
DRAFTS = ("auto", "mtp", "none")


@dataclasses.dataclass
class LoadStats:
    """What a `load_hf_checkpoint` call read (pass one in to have it filled)."""

    bytes_read: dict[str, int] = dataclasses.field(default_factory=dict)  # file tensor name -> bytes copied
    bytes_in_files: int = 0  # stored size of every tensor the model uses (weights and scales)

    @property
    def total_read(self) -> int:
        return sum(self.bytes_read.values())


@dataclasses.dataclass(frozen=True)
class _Source:
    """One checkpoint tensor of a leaf: its header entry, storage format and scale."""

    spec: Spec
    info: TensorInfo
    fmt: str  # "plain", "fp8", "fp4"
    scale: TensorInfo | None = None
    block: tuple[int, int] | None = None


def _dims(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _source(spec: Spec, info: TensorInfo, scale: TensorInfo | None, want: tuple[int, ...],
            fp8_block: tuple[int, int]) -> _Source:
    """Check one tensor's dtype, shape and scale against the shape the model needs (checkpoint
    orientation); -> how to read it. One-line ValueErrors name the tensor as the file spells it."""
    name, dtype, got = info.name, info.dtype, tuple(info.shape)
    if dtype not in SUPPORTED:
        raise ValueError(f"tensor {name!r} has unsupported dtype {dtype!r} (supported: {', '.join(SUPPORTED)})")
    if spec.kind == "int":
        fmt = "plain" if dtype in _INT else None
    elif dtype in _FLOAT:
        fmt = "plain"
    elif dtype in _FP8:
        fmt = "fp8"
    elif dtype in _FP4:
        fmt = "fp4"
        got = (*got[:-1], 2 * got[-1]) if dtype != "F4" and got else got  # bytes -> elements
    else:
        fmt = None
    if fmt is None or (fmt != "plain" and len(want) != 2):
        raise ValueError(f"tensor {name!r} has dtype {dtype}, which cannot hold this {len(want)}-d weight")
    if got != want:
        stored = f" ({dtype} {_dims(info.shape)}: packed FP4, two values per byte)" if fmt == "fp4" else ""
        raise ValueError(f"tensor {name!r} has shape {_dims(got)}{stored}, expected {_dims(want)}")
    if fmt == "plain":
        if scale is not None:
            raise ValueError(f"unexpected tensor {scale.name!r}: its weight {name!r} is {dtype}, not quantized")
        return _Source(spec, info, fmt)
    label = "FP8" if fmt == "fp8" else "FP4"
    if scale is None:
        raise ValueError(f"{label} weight {name!r} has no scale tensor ({name.rsplit('.', 1)[0]}.scale "
                         "or .weight_scale_inv)")
    if scale.dtype not in _SCALE:
        raise ValueError(f"scale {scale.name!r} has dtype {scale.dtype}, expected one of {_SCALE}")
    block = fp8_block if fmt == "fp8" else FP4_BLOCK
    grid = scale_grid(want, block)
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"scale {scale.name!r} has shape {_dims(scale.shape)}, expected {_dims(grid)} for the {label} "
            f"weight {name!r} {_dims(want)} in {block[0]} x {block[1]} blocks"
        )
    return _Source(spec, info, fmt, scale, block)


def _read_region(reader: Reader, src: _Source, region: Sequence[tuple[int, int]]) -> np.ndarray:
    """Rows / columns [start, stop) per dim of one tensor (checkpoint orientation), dequantized to fp32."""
    index = tuple(slice(a, b) for a, b in region)
    if src.fmt == "plain":
        return reader.read(src.info, index)
    (r0, r1), (c0, c1) = region
    br, bc = src.block
    scale = reader.read(src.scale, (slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc))))
    if src.fmt == "fp8":
        values = reader.read(src.info, index).astype(np.float32)
    else:  # the whole bytes that hold columns c0..c1
        b0, b1 = c0 // 2, -(-c1 // 2)
        values = unpack_fp4(reader.read(src.info, (slice(r0, r1), slice(b0, b1))))[:, c0 - 2 * b0 : c1 - 2 * b0]
    return apply_scale(values, scale.astype(np.float32), r0, c0, src.block)


def _read_part(reader: Reader, src: _Source, bounds: Sequence[tuple[int, int]], shape: Sequence[int]) -> np.ndarray:
    """Region `bounds` of our (one-expert) leaf of `shape` from its checkpoint tensor."""
    if src.spec.kind == "T":  # ours [in, out] = ckpt [out, in].T
        (a0, a1), (b0, b1) = bounds
        return _read_region(reader, src, ((b0, b1), (a0, a1))).T
    if src.spec.kind == "wo_a":  # ours [g, in, do]; ckpt [g*do, in], group j = rows j*do..(j+1)*do
        (g0, g1), (i0, i1), (d0, d1) = bounds
        do = shape[2]
        parts = [_read_region(reader, src, ((j * do + d0, j * do + d1), (i0, i1))).T for j in range(g0, g1)]
        return np.stack(parts) if parts else np.zeros((0, i1 - i0, d1 - d0), np.float32)
    return _read_region(reader, src, bounds)


def _read_leaf(reader: Reader, sources: dict[int | None, _Source], shape: tuple[int, ...], dtype: Any,
               index: tuple[slice, ...], cfg: ModelConfig) -> np.ndarray:
    """Our leaf's `index` (what one device holds) -> host array of the leaf's dtype."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise AssertionError(f"strided shard index {index}")
        bounds.append((start, stop))
    if None in sources:
        src = sources[None]
        x = _read_part(reader, src, bounds, shape)
        if src.spec.kind == "int" and x.size and (x.min() < 0 or x.max() >= cfg.n_routed_experts):
            raise ValueError(f"tensor {src.info.name!r} holds expert ids outside [0, {cfg.n_routed_experts})")
    else:  # stacked experts [E, ...]: read only the experts in this index, one at a time
        (e0, e1), inner = bounds[0], bounds[1:]
        x = np.empty((e1 - e0, *(b - a for a, b in inner)), dtype)
        for e in range(e0, e1):
            x[e - e0] = _read_part(reader, sources[e], inner, shape[1:])
    return np.asarray(x).astype(dtype, copy=False)


# ---- weights kept as stored (weights="fp8"): values and scales in our orientation ----------------------
def _stored_block(src: _Source, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Block of our (one-expert) leaf of `shape` from the checkpoint's (out, in) block."""
    br, bc = src.block
    if src.spec.kind == "wo_a":  # [g, in, d_o]: per group, output blocks that never cross a release block
        return (1, bc, math.gcd(shape[2], br))
    return (bc, br)


def _read_stored_part(reader: Reader, src: _Source, part: str, bounds: Sequence[tuple[int, int]],
                      weight_shape: tuple[int, ...], block: tuple[int, ...]) -> np.ndarray:
    """Region `bounds` of the stored values (`part` "data": FP8, or FP4 bytes packed along our
    input axis) or of the scales ("scale") of our (one-expert) leaf, as stored, not dequantized."""
    info = src.info if part == "data" else src.scale

    def raw(rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        x = reader.read(info, (slice(*rows), slice(*cols)))
        return x.view(np.uint8) if part == "data" and src.fmt == "fp4" else x

    if src.spec.kind == "T":  # ours [in, out] = ckpt [out, in].T, for values, bytes and scale grids alike
        (a0, a1), (b0, b1) = bounds
        return raw((b0, b1), (a0, a1)).T
    (g0, g1), (i0, i1), (r0, r1) = bounds  # wo_a: ours [g, in, d_o]; ckpt rows j*d_o + r
    do = weight_shape[2]
    parts = []
    for j in range(g0, g1):
        if part == "data":
            parts.append(raw((j * do + r0, j * do + r1), (i0, i1)).T)
        else:  # our output block r of group j lies in one release block (non-decreasing in r)
            rows = group_scale_rows([j], np.arange(r0, r1), do, block[2], src.block[0])[0]
            lo, hi = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)
            parts.append(raw((lo, hi), (i0, i1))[rows - lo].T)
    return np.stack(parts) if parts else np.zeros((0, i1 - i0, r1 - r0), reader.view(info).dtype)


def _stored_leaf(sources: dict[int | None, _Source], shape: tuple[int, ...], dtype: Any) -> BlockScaled | None:
    """Abstract BlockScaled of a leaf whose every tensor is stored FP8 / FP4 alike; None if it is stored
    plain. One-line ValueError if the experts of a stack are stored in different formats."""
    srcs = list(sources.values())
    if all(s.fmt == "plain" for s in srcs):
        return None
    inner = shape if None in sources else shape[1:]
    first = srcs[0]
    kinds = {(s.fmt, s.info.dtype, s.scale.dtype if s.scale else None, s.block) for s in srcs}
    if len(kinds) > 1:
        raise ValueError(f"tensors {first.info.name!r} and others of one stacked leaf are stored in different formats "
                         f"({sorted(map(str, kinds))}); load with weights='plain'")
    block = _stored_block(first, inner)
    lead = () if None in sources else (shape[0],)
    block = (1,) * len(lead) + block
    scale_dtype = first.scale.storage_dtype()
    if first.fmt == "fp4":
        if inner[-2] % 2:
            raise ValueError(f"FP4 tensor {first.info.name!r} packs an odd input width {inner[-2]}")
        data = jax.ShapeDtypeStruct((*shape[:-2], shape[-2] // 2, shape[-1]), np.uint8)
    else:
        data = jax.ShapeDtypeStruct(shape, first.info.storage_dtype())
    scale = jax.ShapeDtypeStruct(tuple(-(-n // b) for n, b in zip(shape, block, strict=True)), scale_dtype)
    return BlockScaled(data=data, scale=scale, block=block, dtype=np.dtype(dtype).name)


def _read_stored(reader: Reader, sources: dict[int | None, _Source], w: BlockScaled, part: str,
                 index: tuple[slice, ...]) -> np.ndarray:
    """Our stored leaf's `part` ("data" / "scale") at `index` (what one device holds)."""
    target = w.data if part == "data" else w.scale
    shape = tuple(target.shape)
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    if None in sources:
        return _read_stored_part(reader, sources[None], part, bounds, w.shape, w.block)
    (e0, e1), inner = bounds[0], bounds[1:]
    x = np.empty((e1 - e0, *(b - a for a, b in inner)), target.dtype)
    for e in range(e0, e1):
        x[e - e0] = _read_stored_part(reader, sources[e], part, inner, w.shape[1:], w.block[1:])
    return x


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=False))


def _fp8_block(config: dict[str, Any]) -> tuple[int, int]:
    q = config.get("quantization_config") or {}
    block = q.get("weight_block_size", FP8_BLOCK)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return tuple(block)


def _default_dtype(config: dict[str, Any]) -> str:
    for k in ("dtype", "torch_dtype"):
        v = config.get(k)
        if isinstance(v, str) and v in DTYPES:
            return v
    return "float32"


@dataclasses.dataclass
class HFCheckpoint:
    """A checked, not yet read, checkpoint folder: its config and where every leaf comes from.

    `read(leaf, index)` returns any region of a leaf (its dequantized host array in the leaf's
    dtype), copying only the bytes that region needs; `reader.bytes_read` counts them per tensor.
    """

    path: str
    cfg: ModelConfig
    leaves: dict[str, jax.ShapeDtypeStruct]  # keystr path -> abstract leaf
    sources: dict[str, dict[int | None, _Source]]  # keystr path -> {expert slot or None: source}
    reader: Reader
    abstract: Any = None  # the plain abstract tree the leaves come from (default: abstract_params(cfg))
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # config.json
    where: dict[str, TensorInfo] = dataclasses.field(default_factory=dict)  # every tensor, official spelling
    draft: str | None = None  # the draft the folder holds: "mtp", "dspark" or None (`keys.draft_kind`)
    folder: Any = None  # safetensors_io.Folder: the shards and their index

    def read(self, leaf: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        x = self.leaves[leaf]
        return _read_leaf(self.reader, self.sources[leaf], tuple(x.shape), x.dtype, index, self.cfg)

    @functools.cached_property
    def stored(self) -> dict[str, BlockScaled]:
        """keystr path -> abstract BlockScaled of every leaf that stays quantized under weights="fp8":
        those the model contracts through `ops.quant` (declared with a `quant` tag beside the field)
        and the file stores FP8 / FP4. Other leaves quantized in the file are dequantized."""
        tree = abstract_params(self.cfg) if self.abstract is None else self.abstract
        tags = leaves_by_path(map_declared(tree, lambda x, names, tag, path: tag or ""))
        out = {}
        for leaf, x in self.leaves.items():
            if tags[leaf]:
                w = _stored_leaf(self.sources[leaf], tuple(x.shape), x.dtype)
                if w is not None:
                    out[leaf] = w
        return out

    def read_stored(self, leaf: str, part: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """Region `index` of a stored leaf's values (`part` "data") or scales ("scale"), as stored."""
        return _read_stored(self.reader, self.sources[leaf], self.stored[leaf], part, index)

    def stats(self) -> LoadStats:
        stored = sum(s.info.nbytes + (s.scale.nbytes if s.scale else 0)
                     for srcs in self.sources.values() for s in srcs.values())
        return LoadStats(dict(self.reader.bytes_read), stored)


def open_hf_checkpoint(path: str | os.PathLike, dtype: str | None = None, draft: str = "auto") -> HFCheckpoint:
    """Check a DeepSeek-V4 checkpoint folder from its config.json and the shards' headers (no
    tensor data is read): names, shapes, dtypes, scales. See `load_hf_checkpoint` (`draft`)."""
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint folder {path!r} does not exist")
    cfg_path = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"checkpoint folder {path!r} has no {CONFIG}")
    config = errors.read_json(cfg_path)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")
    folder = open_folder(path)

    # official key -> TensorInfo
    where: dict[str, TensorInfo] = {}
    for name, info in folder.tensors.items():
        key = normalize_key(name)
        if key in where:
            raise ValueError(f"tensor {name!r} duplicates {where[key].name!r} (both are {key!r})")
        where[key] = info
    kind = draft_kind(config, where)
    if draft == "mtp" and kind != "mtp":
        held = ("a DSpark draft (mtp.0.main_proj, Markov / confidence heads): load it with load_hf_dspark"
                if kind == "dspark" else "no draft (no mtp.* tensors)")
        raise ValueError(f"draft='mtp' asks for the MTP block, but {path!r} holds {held}")
    with_mtp = kind == "mtp" and draft != "none"
    cfg = ModelConfig.from_hf_config(config, num_mtp_layers=int(with_mtp), dtype=dtype or _default_dtype(config))
    table = key_table(cfg)
    abstract = abstract_params(cfg)
    # Tensors of a draft this load leaves out are checked by the load that reads them (load_hf_dspark).
    foreign = (lambda key: key.startswith("mtp.")) if kind is not None and not with_mtp else (lambda key: False)
    sources = table_sources(folder, where, table, leaves_by_path(abstract), config, foreign)
    return HFCheckpoint(path, cfg, leaves_by_path(abstract), sources, Reader(), abstract, config, where, kind, folder)


def table_sources(folder: Any, where: dict[str, TensorInfo], table: dict[str, Spec],
                  leaves: dict[str, jax.ShapeDtypeStruct], config: dict[str, Any],
                  foreign: Any) -> dict[str, dict[int | None, _Source]]:
    """Every leaf's sources (keystr path -> {expert slot or None: source}) from the folder's tensors
    `where` (official key -> TensorInfo) by the key `table`; one-line ValueErrors on an unexpected
    tensor (unless `foreign(key)`: another load reads it), a missing one or a misshaped one."""
    fp8_block = _fp8_block(config)
    if {s.ours for s in table.values()} != set(leaves):  # internal consistency of the key table
        raise AssertionError(f"key table mismatch: {sorted({s.ours for s in table.values()} ^ set(leaves))}")
    scales = {scale_key(k) for k in table}
    for key, info in sorted(where.items()):
        if key not in table and key not in scales and not foreign(key):
            raise ValueError(f"unexpected tensor {info.name!r} in {os.path.basename(info.file)} "
                             "(not part of this model config)")
    missing = [k for k in table if k not in where]
    if missing:
        unlisted = {normalize_key(k): f for k, f in folder.unlisted.items()}
        if missing[0] in unlisted:
            raise ValueError(f"tensor {missing[0]!r} is missing from {INDEX} (it is in {unlisted[missing[0]]})")
        where_from = f"{INDEX} of {folder.path!r}" if folder.indexed else repr(folder.path)
        raise ValueError(f"missing tensor {missing[0]!r} in {where_from} ({len(missing)} missing in all)")

    sources: dict[str, dict[int | None, _Source]] = {}
    for key, spec in table.items():
        leaf = leaves[spec.ours]
        shape = tuple(leaf.shape) if spec.slot is None else tuple(leaf.shape[1:])
        src = _source(spec, where[key], where.get(scale_key(key)), ckpt_shape(spec.kind, shape), fp8_block)
        sources.setdefault(spec.ours, {})[spec.slot] = src
    return sources


def load_hf_checkpoint(
    path: str | os.PathLike,
    dtype: str | None = None,
    mesh: Any = None,
    rules: dict[str, Any] | None = None,
    stats: LoadStats | None = None,
    weights: str = "plain",
    draft: str = "auto",
) -> tuple[ModelConfig, ModelParams]:
    """Read a DeepSeek-V4 checkpoint folder (config.json + *.safetensors) -> (cfg, params).

    Key spelling official or HF; shards through `model.safetensors.index.json` when present.
    Weights may be plain (F32 / BF16 / F16) or block-scaled FP8 (e4m3 + `.scale`, 128 x 128 blocks
    or the config's `quantization_config.weight_block_size`) or FP4 (packed e2m1 + `.scale` per
    1 x 32 block); scales UE8M0 or float32. Quantized weights are dequantized per block to `dtype`.
    `dtype` ("float32" / "bfloat16") sets cfg.dtype, the dtype of the matrix weights (default: the
    config's `dtype` / `torch_dtype`, else float32); norms, hyper-connections, sinks, APE, gate
    biases and the compressor / indexer-weight projections stay fp32 as `init_params` lays out.
    draft: which draft to load beside the target (docs/dspark.md, "What a release holds", tells them apart).
    "auto": the April MTP block when the folder holds one (num_mtp_layers=1), else none
    (num_mtp_layers=0, params.mtp=None): a folder without `mtp.*` tensors, or a DSpark folder (its
    target loads alone; `load_hf_dspark` reads the drafter). "mtp": the MTP block, a one-line
    ValueError naming what the folder holds otherwise. "none": the target alone, whatever the folder holds.
    Raises a one-line ValueError naming the tensor on a missing, unexpected, misshaped or
    unsupported tensor, a missing or misshaped scale, or a missing shard.
    With `mesh` (also multi-process, under `jax.distributed`), each leaf is placed in its parameter
    sharding (`placement.param_shardings`) and this process reads only the slices its own
    devices hold, each once. `stats`, when given, records the bytes read per tensor.

    weights "fp8" keeps the weights the file stores FP8 / FP4 that the model contracts through
    `ops.quant` (attention, indexer query, shared and routed experts, MTP projections) as
    `BlockScaled` leaves, values and scales as stored (transposed / regrouped to our orientation):
    the matmuls dequantize them per block (`ops.quant.matmul`), with the same result as the default
    "plain" (dequantized once, here). Everything else loads as with "plain". A folder that stores
    none of those weights quantized (a plain F32 / BF16 export) is a one-line ValueError under
    "fp8": there is nothing to keep, and silently loading it plain would hide a wrong folder.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    ck = open_hf_checkpoint(path, dtype, draft)
    if weights == "fp8" and not ck.stored:
        raise ValueError(f"weights='fp8' keeps the FP8 / FP4 weights of a release, but {ck.path!r} stores none of "
                         "the quantizable weights quantized; load it with weights='plain'")
    params = read_params(ck, weights, mesh, rules)
    if stats is not None:
        read_stats = ck.stats()
        stats.bytes_read, stats.bytes_in_files = read_stats.bytes_read, read_stats.bytes_in_files
    return ck.cfg, params


def read_params(ck: HFCheckpoint, weights: str, mesh: Any = None, rules: dict[str, Any] | None = None) -> Any:
    """The tree of `ck` (its `abstract`), every leaf read (and placed on `mesh`); `weights` as in
    `load_hf_checkpoint`."""
    stored = ck.stored if weights == "fp8" else {}
    abstract = _with_stored(abstract_params(ck.cfg) if ck.abstract is None else ck.abstract, stored)
    shardings = leaves_by_path(param_shardings(ck.cfg, mesh, rules, abstract)) if mesh is not None else {}
    placed: dict[str, jax.Array] = {}
    for ours in ck.leaves:
        # (key of the placed array, its shape, reader of a region): one per leaf, two for a stored one
        parts = [(ours, tuple(ck.leaves[ours].shape), functools.partial(ck.read, ours))]
        if ours in stored:
            parts = [(f"{ours}.{part}", tuple(getattr(stored[ours], part).shape),
                      functools.partial(ck.read_stored, ours, part)) for part in ("data", "scale")]
        for key, shape, read in parts:
            placed[key] = jnp.asarray(read(())) if mesh is None else place_region(read, shape, shardings[key])
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    return jax.tree_util.tree_unflatten(treedef, [placed[jax.tree_util.keystr(p)] for p, _ in flat])


def _with_stored(abstract: Any, stored: dict[str, BlockScaled]) -> Any:
    """`abstract` with the leaves of `stored` (keystr paths) replaced by their BlockScaled."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    return jax.tree_util.tree_unflatten(treedef, [stored.get(jax.tree_util.keystr(p), x) for p, x in flat])


def place_region(read: Any, shape: tuple[int, ...], sharding: Any) -> jax.Array:
    """A global array of `shape` in `sharding`, reading each distinct slice held by this process's
    devices once (replicas share it)."""
    held: dict[Any, np.ndarray] = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        k = _index_key(index, shape)
        if k not in held:
            held[k] = read(index)
    return jax.make_array_from_callback(shape, sharding, lambda i: held[_index_key(i, shape)])
