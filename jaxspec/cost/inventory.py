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
from jaxspec.model.network import abstract_params
from jaxspec.model.placement import _path_str, param_specs, state_specs
from jaxspec.model.state import abstract_state, layer_state
from jaxspec.sharding.active import as_tuple
from jaxspec.sharding.rules import DATA, TENSOR

# Leaves a pass reads by row (a gather), not whole: the embedding, the hash layers' token -> expert
# table and the compressor's in-block position bias.
GATHERED = ("embed", "tid2eid", "ape")


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
    if parts[0] in ("embed", "head"):
        return "embed" if parts[0] == "embed" else "vocab"
    return "head"  # the main hc_head and final norm


# What the commit stage's MTP refresh keeps: it needs only the window kv rows of the MTP block, so
# the compiled program drops its queries, output projections, FFN and head (dead code).
_MTP_KV = ("mtp.inputs.", "mtp.block.hc_attn.", "mtp.block.attn_norm", "mtp.block.attn.wkv", "mtp.block.attn.kv_norm")


def _leaves(cfg: ModelConfig, sizes: dict[str, int], weights: str, experts: str):
    params = abstract_params(cfg, weights, experts)
    specs = jax.tree.leaves(param_specs(cfg, sizes, None, params), is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(_path_str(path), x, spec) for (path, x), spec in zip(flat, specs, strict=True)]


@functools.lru_cache(maxsize=32)
def weight_units(cfg: ModelConfig, mesh: tuple[int, int, int], weights: str = "plain",
                 experts: str = "fp4") -> dict[str, Unit]:
    """Per device: {"layers.i" / "mtp" / "mtp_head" / "head" / "vocab" / "embed": Unit}. Bytes from the stored
    tree (`weights` "fp8": as the release stores them), elements from the plain one."""
    sizes = dict(zip((DATA, TENSOR, "expert"), mesh, strict=True))
    acc: dict[str, dict[str, Any]] = {}

    def slot(path: str, name: str | None = None) -> dict[str, Any]:
        name = name or _unit_name(path)
        return acc.setdefault(name, {"dense_bytes": 0.0, "dense_elems": 0.0, "expert_bytes": 0.0,
                                     "expert_elems": 0.0, "expert_groups": 1, "hash_routed": False,
                                     "row_bytes": 0.0, "heads": 0})

    for path, x, spec in _leaves(cfg, sizes, weights, experts):
        shard, ways = _shard(x.shape, spec, sizes)
        nbytes = math.prod(shard) * np.dtype(x.dtype).itemsize
        u = slot(path)
        name = path.rsplit(".", 1)[-1]
        if name in ("data", "scale"):
            name = path.rsplit(".", 2)[-2]
        if name in GATHERED:
            u["row_bytes"] += math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize / ways[0]  # mean device
            if name == "tid2eid":
                u["hash_routed"] = True
        elif ".ffn.experts." in path:
            per_device = shard[0]
            u["expert_bytes"] += nbytes / per_device
            u["expert_groups"] = ways[0]
        else:
            u["dense_bytes"] += nbytes
            if path.startswith(_MTP_KV):
                slot(path, "mtp_kv")["dense_bytes"] += nbytes
    for path, x, spec in _leaves(cfg, sizes, "plain", experts):
        if len(x.shape) < 2 or path.rsplit(".", 1)[-1] in GATHERED:
            continue
        shard, _ = _shard(x.shape, spec, sizes)
        u = slot(path)
        if ".ffn.experts." in path:
            u["expert_elems"] += math.prod(shard[1:])
        else:
            # h_proj maps each of the hc residual streams (docs/cost_model.md): hc x the tokens
            elems = math.prod(shard) * (cfg.hc_mult if path == "mtp.inputs.h_proj" else 1)
            u["dense_elems"] += elems
            if path.startswith(_MTP_KV):
                slot(path, "mtp_kv")["dense_elems"] += elems
        if path.endswith("attn.wq_b") and ".indexer." not in path:
            u["heads"] = cfg.num_heads * shard[1] // x.shape[1]
    kinds = {f"layers.{i}": k for i, k in enumerate(cfg.layer_types)}
    kinds.update(mtp="mtp", mtp_kv="mtp", mtp_head="head", head="head", vocab="head", embed="embed")
    return {name: Unit(kind=kinds[name], **v) for name, v in acc.items()}


LAYOUTS = ("rules", "even")


@functools.lru_cache(maxsize=64)
def layout_units(cfg: ModelConfig, mesh: tuple[int, int, int], weights: str, experts: str,
                 layout: str, moe_groups: int | None = None) -> dict[str, Unit]:
    """`weight_units` under the sharding rules ("rules": jaxspec's layout, some leaves replicated)
    or "even": every non-routed weight split evenly over "tensor" (replicated over "data" and
    "expert", as tensor-parallel attention is) and the routed experts over tensor x expert: the
    issue's hand count, and how the serving stacks behind the published points place V4.
    `moe_groups` (even only): the experts split into that many expert-parallel groups, each expert
    tensor-split over the group's devices (TensorRT-LLM's TP4 x EP2 on 8 GPUs: moe_groups 2)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "rules":
        if moe_groups is not None:
            raise ValueError("moe_groups needs layout 'even'")
        return weight_units(cfg, mesh, weights, experts)
    t, ways = mesh[1], mesh[1] * mesh[2]
    groups = ways if moe_groups is None else moe_groups
    if groups < 1 or ways % groups or cfg.n_routed_experts % groups:
        raise ValueError(f"moe_groups must divide the {ways} devices and {cfg.n_routed_experts} experts, got {groups}")
    split = ways // groups  # devices one expert is split over
    whole = weight_units(cfg, (1, 1, 1), weights, experts)
    return {name: dataclasses.replace(u, dense_bytes=u.dense_bytes / t, dense_elems=u.dense_elems / t,
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
    """The states a cycle reads, by unit: the target's layers and the MTP draft's ring."""

    layers: tuple[Any, ...]
    mtp: Any


@functools.lru_cache(maxsize=64)
def state_layers(cfg: ModelConfig, mesh: tuple[int, int, int], batch: int, context: int) -> dict[str, LayerState]:
    """Per device: {"layers.i" / "mtp": LayerState} from `abstract_state` and the state's rules."""
    sizes = dict(zip((DATA, TENSOR, "expert"), mesh, strict=True))
    target = abstract_state(cfg, batch, context)
    # the MTP draft keeps its own window ring beside the target's state
    mtp = jax.eval_shape(lambda: layer_state(cfg, "sliding", batch, context)) if cfg.has_mtp else None
    state = _States(layers=target.layers, mtp=mtp)
    specs = jax.tree.leaves(state_specs(cfg, state, sizes), is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    acc: dict[str, dict[str, float]] = {}
    for (path, x), spec in zip(flat, specs, strict=True):
        p = _path_str(path)
        if not (p.startswith("layers.") or p.startswith("mtp.")):
            continue
        unit = "mtp" if p.startswith("mtp.") else ".".join(p.split(".")[:2])
        field = p.rsplit(".", 1)[-1]
        kind = "sliding" if unit == "mtp" else cfg.layer_types[int(unit.split(".")[1])]
        g = cfg.geometry(kind)
        ratio = g.ratio or 1  # a window row is written per token
        shard, _ = _shard(x.shape, spec, sizes)
        nbytes = math.prod(shard) * np.dtype(x.dtype).itemsize
        rows_per_seq = shard[1]
        per_seq_row = nbytes / shard[0] / rows_per_seq  # one row of one sequence
        a = acc.setdefault(unit, {"read_bytes": 0.0, "entry_bytes": 0.0, "entries": 0, "write_row_bytes": 0.0})
        if field == "comp_kv":
            a["entries"] = x.shape[1]
            a["entry_bytes"] = per_seq_row
            if not g.indexed:  # HCA reads every entry; CSA what its indexer picks (terms.layer_pass)
                a["read_bytes"] += nbytes
        else:
            a["read_bytes"] += nbytes
        written = per_seq_row / ratio if field in ("comp_kv", "idx_kv") else per_seq_row
        a["write_row_bytes"] += written
    return {k: LayerState(**v) for k, v in acc.items()}
