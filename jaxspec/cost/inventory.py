"""What one device holds, read off the model's own trees: per unit (a main layer, the MTP block,
the output head, the embedding) the bytes of its weights at stored precision and the matmul
elements behind them, split into the weights a pass reads whole and the routed-expert stacks it
reads per touched expert; and the decode state's bytes per layer. Shapes come from
`abstract_params` / `abstract_state` and the per-device split from the sharding rules, so nothing
here restates a shape by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.model.dspark import abstract_dspark_params
from jaxspec.model.network import abstract_params
from jaxspec.model.placement import _path_str, param_specs, state_specs
from jaxspec.model.state import abstract_state, layer_state
from jaxspec.sharding.active import as_tuple
from jaxspec.sharding.rules import DATA, TENSOR

# Leaves a pass reads by row (a gather), not whole: the embedding, the hash layers' token -> expert
# table, the compressor's in-block position bias, and V4.1's Engram tables (each token reads
# (N-1) x H rows of each, `V41Layout.engram_hash_columns`) and its token -> Engram class map.
GATHERED = ("embed", "tid2eid", "ape", "table", "engram_token_map")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit's weights on one device."""

    kind: str  # "sliding" / "csa" / "hca" (a main layer), "mtp", "head", "embed"
    dense_bytes: float = 0.0  # read whole by every pass through the unit
    dense_elems: float = 0.0  # matmul weight elements of those (2 FLOPs per token each)
    expert_bytes: float = 0.0  # one routed expert's bytes on this device (values + scales)
    expert_elems: float = 0.0  # one routed expert's matmul elements on this device
    expert_groups: int = 1  # devices the expert stack is split over (expert parallelism)
    hash_routed: bool = False
    row_bytes: float = 0.0  # gathered leaves: bytes of the rows one token reads
    heads: int = 0  # attention heads on this device


def _shard(shape: tuple[int, ...], spec: P, sizes: dict[str, int]) -> tuple[list[int], list[int]]:
    """-> (shard shape, ways each dim is split)."""
    ways = [1] * len(shape)
    for i, entry in enumerate(spec):
        ways[i] = math.prod(sizes[a] for a in as_tuple(entry))
    return [-(-n // w) for n, w in zip(shape, ways, strict=True)], ways


def _unit_name(path: str) -> str:
    parts = path.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}"
    if parts[0] == "mtp":
        return "mtp_head" if parts[1] in ("hc_head", "norm") else "mtp"
    if parts[0] in ("embed", "head", "engram_token_map"):
        return "vocab" if parts[0] == "head" else "embed"
    return "head"  # the main hc_head and final norm


# What the commit stage's MTP refresh keeps: it needs only the window kv rows of the MTP block, so
# the compiled program drops its queries, output projections, FFN and head (dead code).
_MTP_KV = ("mtp.inputs.", "mtp.block.hc_attn.", "mtp.block.attn_norm", "mtp.block.attn.wkv", "mtp.block.attn.kv_norm")


def _leaves(cfg: ModelConfig, sizes: dict[str, int], weights: str, experts: str):
    params = abstract_params(cfg, weights, experts)
    specs = jax.tree.leaves(param_specs(cfg, sizes, None, params), is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(_path_str(path), x, spec) for (path, x), spec in zip(flat, specs, strict=True)]


def _accumulate(cfg: ModelConfig, sizes: dict[str, int], stored: list, plain: list,
                unit_of: Any, elem_scale: Any = None) -> dict[str, dict[str, Any]]:
    """Per unit the byte / element tallies of (path, leaf, spec) lists (`stored`: at stored precision,
    `plain`: the plain tree, for matmul elements); `unit_of(path)` names the units a leaf counts toward
    (a leaf may count toward more than one: the commit's kv projections are also a stage's)."""
    acc: dict[str, dict[str, Any]] = {}

    def slot(name: str) -> dict[str, Any]:
        return acc.setdefault(name, {"dense_bytes": 0.0, "dense_elems": 0.0, "expert_bytes": 0.0,
                                     "expert_elems": 0.0, "expert_groups": 1, "hash_routed": False,
                                     "row_bytes": 0.0, "heads": 0})

    for path, x, spec in stored:
        shard, ways = _shard(x.shape, spec, sizes)
        nbytes = math.prod(shard) * np.dtype(x.dtype).itemsize
        name = path.rsplit(".", 1)[-1]
        if name in ("data", "scale"):
            name = path.rsplit(".", 2)[-2]
        for unit in unit_of(path):
            u = slot(unit)
            if name in GATHERED:
                rows = cfg.v41.engram_hash_columns if name == "table" else 1  # rows one token reads
                u["row_bytes"] += rows * math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize / ways[0]  # mean device
                if name == "tid2eid":
                    u["hash_routed"] = True
            elif ".ffn.experts." in path:
                per_device = shard[0]
                u["expert_bytes"] += nbytes / per_device
                u["expert_groups"] = ways[0]
            else:
                u["dense_bytes"] += nbytes
    for path, x, spec in plain:
        if len(x.shape) < 2 or path.rsplit(".", 1)[-1] in GATHERED:
            continue
        shard, _ = _shard(x.shape, spec, sizes)
        for unit in unit_of(path):
            u = slot(unit)
            if ".ffn.experts." in path:
                u["expert_elems"] += math.prod(shard[1:])
            else:
                u["dense_elems"] += math.prod(shard) * (elem_scale(path) if elem_scale else 1)
            if path.endswith("attn.wq_b") and ".indexer." not in path:
                u["heads"] = cfg.num_heads * shard[1] // x.shape[1]
    return acc


@functools.lru_cache(maxsize=32)
def weight_units(cfg: ModelConfig, mesh: tuple[int, int, int], weights: str = "plain",
                 experts: str = "fp4") -> dict[str, Unit]:
    """Per device: {"layers.i" / "mtp" / "mtp_head" / "head" / "vocab" / "embed": Unit}. Bytes from the stored
    tree (`weights` "fp8": as the release stores them), elements from the plain one."""
    sizes = dict(zip((DATA, TENSOR, "expert"), mesh, strict=True))

    def unit_of(path: str) -> tuple[str, ...]:
        name = _unit_name(path)
        return (name, "mtp_kv") if path.startswith(_MTP_KV) else (name,)

    # h_proj maps each of the hc residual streams (docs/cost_model.md): hc x the tokens
    acc = _accumulate(cfg, sizes, _leaves(cfg, sizes, weights, experts), _leaves(cfg, sizes, "plain", experts),
                      unit_of, lambda path: cfg.hc_mult if path == "mtp.inputs.h_proj" else 1)
    kinds = {f"layers.{i}": k for i, k in enumerate(cfg.layer_types)}
    kinds.update(mtp="mtp", mtp_kv="mtp", mtp_head="head", head="head", vocab="head", embed="embed")
    return {name: Unit(kind=kinds[name], **v) for name, v in acc.items()}


# DSpark units: "dspark.stage.i" (a full V4 block, sliding-window attention), "dspark.kv.i" (its wkv and
# kv_norm: what the commit runs over the committed rows), "dspark.context" (main_proj, main_norm: once
# per committed row), "dspark.head" (its hc_head and norm before the target's head), "dspark.markov"
# (W2 read whole per step, W1 rows gathered) and "dspark.confidence".
_DSPARK_KV = (".attn.wkv", ".attn.kv_norm")
# Read by every device in the `even` layout: the engines replicate the Markov head across tensor ranks,
# so its per-step logits need no all-gather (docs/cost_model.md, "DSpark"); the confidence head is 17 KB.
DSPARK_REPLICATED = ("dspark.markov", "dspark.confidence")


def _dspark_unit_of(path: str) -> tuple[str, ...]:
    parts = path.split(".")
    if parts[0] == "stages":
        stage = f"dspark.stage.{parts[1]}"
        return (stage, f"dspark.kv.{parts[1]}") if any(k in path for k in _DSPARK_KV) else (stage,)
    if parts[0] in ("main_proj", "main_norm"):
        return ("dspark.context",)
    if parts[0] in ("hc_head", "norm"):
        return ("dspark.head",)
    if parts[0].startswith("markov"):
        return ("dspark.markov",)
    return ("dspark.confidence",)


def _dspark_leaves(cfg: ModelConfig, dcfg: DSparkConfig, sizes: dict[str, int], weights: str, experts: str):
    params = abstract_dspark_params(cfg, dcfg, weights, experts)
    specs = jax.tree.leaves(param_specs(cfg, sizes, None, params), is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(_path_str(path), x, spec) for (path, x), spec in zip(flat, specs, strict=True)]


@functools.lru_cache(maxsize=32)
def dspark_weight_units(cfg: ModelConfig, dcfg: DSparkConfig, mesh: tuple[int, int, int], weights: str = "plain",
                        experts: str = "fp4") -> dict[str, Unit]:
    """Per device, a DSpark drafter's units (above) as jaxspec's sharding rules place them; the
    Markov head's W1 counts as gathered rows (one [r] row per drafted slot), like the embedding."""
    dcfg.validate_for(cfg)
    sizes = dict(zip((DATA, TENSOR, "expert"), mesh, strict=True))
    stored = [(p.replace("markov_w1", "markov.embed"), x, s) for p, x, s in
              _dspark_leaves(cfg, dcfg, sizes, weights, experts)]
    plain = [(p.replace("markov_w1", "markov.embed"), x, s) for p, x, s in
             _dspark_leaves(cfg, dcfg, sizes, "plain", experts)]
    acc = _accumulate(cfg, sizes, stored, plain, _dspark_unit_of)
    return {name: Unit(kind="sliding" if name.startswith("dspark.stage.") else "head" if name == "dspark.head"
                       else "dspark", **v) for name, v in acc.items()}


LAYOUTS = ("rules", "even")


@functools.lru_cache(maxsize=64)
def layout_units(cfg: ModelConfig, mesh: tuple[int, int, int], weights: str, experts: str,
                 layout: str, moe_groups: int | None = None, draft: DSparkConfig | None = None) -> dict[str, Unit]:
    """`weight_units` under the sharding rules ("rules": jaxspec's layout, some leaves replicated)
    or "even": every non-routed weight split evenly over "tensor" (replicated over "data" and
    "expert", as tensor-parallel attention is) and the routed experts over tensor x expert: the
    issue's hand count, and how the serving stacks behind the published points place V4.
    `moe_groups` (even only): the experts split into that many expert-parallel groups, each expert
    tensor-split over the group's devices (TensorRT-LLM's TP4 x EP2 on 8 GPUs: moe_groups 2).
    `draft`: a DSpark drafter's units join the target's ("dspark.*"; `even` keeps the Markov and
    confidence heads whole on every device, `DSPARK_REPLICATED`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "rules":
        if moe_groups is not None:
            raise ValueError("moe_groups needs layout 'even'")
        units = weight_units(cfg, mesh, weights, experts)
        return units if draft is None else {**units, **dspark_weight_units(cfg, draft, mesh, weights, experts)}
    t, ways = mesh[1], mesh[1] * mesh[2]
    groups = ways if moe_groups is None else moe_groups
    if groups < 1 or ways % groups or cfg.n_routed_experts % groups:
        raise ValueError(f"moe_groups must divide the {ways} devices and {cfg.n_routed_experts} experts, got {groups}")
    split = ways // groups  # devices one expert is split over
    whole = weight_units(cfg, (1, 1, 1), weights, experts)
    if draft is not None:
        whole = {**whole, **dspark_weight_units(cfg, draft, (1, 1, 1), weights, experts)}
    return {name: u if name in DSPARK_REPLICATED else
            dataclasses.replace(u, dense_bytes=u.dense_bytes / t, dense_elems=u.dense_elems / t,
                                expert_bytes=u.expert_bytes / split, expert_elems=u.expert_elems / split,
                                expert_groups=groups if u.expert_bytes else 1, row_bytes=u.row_bytes / t,
                                heads=u.heads // t)
            for name, u in whole.items()}


@dataclasses.dataclass(frozen=True)
class LayerState:
    """One layer's decode state on one device (rows of its data shard)."""

    read_bytes: float  # read whole by a pass (window ring, compressor rows, HCA entries, index keys)
    entry_bytes: float  # one compressed entry (CSA: read per selected entry, not whole)
    entries: int  # compressed entries per sequence (ceil(context / ratio)); 0 on sliding layers
    write_row_bytes: float  # bytes one committed token writes (ring rows; entries every `ratio`)


@struct.dataclass
class _States:
    """The states a cycle reads, by unit: the target's layers, the MTP draft's ring and one window ring
    of a draft block (a DSpark stage's context ring: the same [B, W, c] rows, `model.dspark`)."""

    layers: tuple[Any, ...]
    mtp: Any
    ring: Any


@functools.lru_cache(maxsize=64)
def state_layers(cfg: ModelConfig, mesh: tuple[int, int, int], batch: int, context: int) -> dict[str, LayerState]:
    """Per device: {"layers.i" / "mtp" / "ring": LayerState} from `abstract_state` and the state's rules
    ("ring": one draft block's window ring, what each DSpark stage keeps)."""
    sizes = dict(zip((DATA, TENSOR, "expert"), mesh, strict=True))
    target = abstract_state(cfg, batch, context)
    # the MTP draft keeps its own window ring beside the target's state
    ring = jax.eval_shape(lambda: layer_state(cfg, "sliding", batch, context))
    state = _States(layers=target.layers, mtp=ring if cfg.has_mtp else None, ring=ring)
    specs = jax.tree.leaves(state_specs(cfg, state, sizes), is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    acc: dict[str, dict[str, float]] = {}
    index_bytes: dict[str, float] = {}  # V4.1 owners: their index keys (read whole by each index source)
    for (path, x), spec in zip(flat, specs, strict=True):
        p = _path_str(path)
        if not p.startswith(("layers.", "mtp.", "ring.")):
            continue
        unit = p.split(".")[0] if p.startswith(("mtp.", "ring.")) else ".".join(p.split(".")[:2])
        field = p.rsplit(".", 1)[-1]
        kind = "sliding" if unit in ("mtp", "ring") else cfg.layer_types[int(unit.split(".")[1])]
        g = cfg.geometry(kind)
        ratio = g.ratio or 1  # a window row is written per token
        shard, _ = _shard(x.shape, spec, sizes)
        nbytes = math.prod(shard) * np.dtype(x.dtype).itemsize
        rows_per_seq = shard[1]
        per_seq_row = nbytes / shard[0] / rows_per_seq  # one row of one sequence
        a = acc.setdefault(unit, {"read_bytes": 0.0, "entry_bytes": 0.0, "entries": 0, "write_row_bytes": 0.0})
        if cfg.v41 is not None and field in ("comp_kv", "idx_kv"):  # an owner's pool: read by role, below
            if field == "comp_kv":
                a["entries"], a["entry_bytes"] = x.shape[1], per_seq_row
            else:
                index_bytes[unit] = nbytes
        elif field == "comp_kv":
            a["entries"] = x.shape[1]
            a["entry_bytes"] = per_seq_row
            if not g.indexed:  # HCA reads every entry; CSA what its indexer picks (terms.layer_pass)
                a["read_bytes"] += nbytes
        else:
            a["read_bytes"] += nbytes
        written = per_seq_row / ratio if field in ("comp_kv", "idx_kv") else per_seq_row
        a["write_row_bytes"] += written
    if cfg.v41 is not None:
        _v41_reads(cfg, acc, index_bytes)
    return {k: LayerState(**v) for k, v in acc.items()}


def _v41_reads(cfg: ModelConfig, acc: dict[str, dict[str, float]], index_bytes: dict[str, float]) -> None:
    """V4.1's shared pools: only the kv sources hold a pool and its index keys; every compressed layer
    reads its owner's pool by the entries its top-k picks (entries / entry_bytes: the owner's), and each
    index source scores all of the owner's index keys (read whole). The layers between keep a ring only."""
    v = cfg.v41
    for i, ratio in enumerate(v.ratios):
        if not ratio:
            continue
        owner, a = acc[f"layers.{v.owner(i)}"], acc[f"layers.{i}"]
        a["entries"], a["entry_bytes"] = owner["entries"], owner["entry_bytes"]
        if i in v.index_sources:
            a["read_bytes"] += index_bytes[f"layers.{v.owner(i)}"]
