"""Logical axes, sharding rules and meshes: the part of sharding the layers may use.

Layers never name mesh axes. Every parameter and decode-state field declares its logical axes where
it is declared (`axes("embed", "q_lora")` as the dataclass field, `stacked("experts")` on a field
holding a stack of sub-trees); `logical_axes(tree)` reads them back. `rules` map logical names to
mesh axes (`DEFAULT_RULES`: batch -> data, heads -> tensor, experts -> expert x tensor, ...). A
dimension whose size (in units: heads, groups, experts) does not divide by the mesh axes a rule
names keeps only the leading axes that do divide, else stays replicated, so every rule set works on
every mesh.

Mesh axes: "data" is `AxisType.Explicit` (batch rows are placed on their data shard by
`jax.reshard` and are a manual axis inside a sharded program); "tensor" and "expert" are
`AxisType.Auto`: Explicit there would make the layers annotate every contraction over a split axis
with an `out_sharding`, for no change in the partitioning. Multi-host: `initialize_distributed` on
every host, then the same program.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxspec.core.checks import positive_int
from jaxspec.core.config import ModelConfig
from jaxspec.ops.quant import BlockScaled

DATA, TENSOR, EXPERT = "data", "tensor", "expert"
MESH_AXES = (DATA, TENSOR, EXPERT)

# logical axis -> mesh axes it may be split over, in order of preference.
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": (DATA,),
    "heads": (TENSOR,),
    "o_groups": (TENSOR,),
    # Experts take every non-data device (EP over expert x tensor, as DeepSeek serves V4 with TP
    # attention + EP MoE on the same GPUs); expert_hidden takes "tensor" only where experts could not.
    "experts": (EXPERT, TENSOR),
    "expert_hidden": (TENSOR,),
    "vocab": (TENSOR,),
    # Indexer heads stay whole: their scores are summed over heads before a top-k, and a sharded
    # sum may reorder near-ties of the selection (the indexer is small next to the experts).
    "index_heads": (),
    # V4.1's Engram tables (196 GB at FP8) are split by rows over every non-data device, as the experts:
    # a step gathers its 24 rows per token and layer from wherever they live.
    "engram_rows": (EXPERT, TENSOR),
}

# Devices -> (data, tensor, expert) when the caller gives only a device count.
DEFAULT_MESH_SHAPES: dict[int, tuple[int, int, int]] = {
    1: (1, 1, 1),
    2: (1, 2, 1),
    4: (1, 4, 1),
    8: (1, 8, 1),
}


# ---------------------------------------------------------------------------------------------
# meshes
# ---------------------------------------------------------------------------------------------
# "data" is Explicit: a batch array's split is part of its type outside the per-shard loop (and is
# manual inside it). "tensor" and "expert" are Auto: the layers carry no out_sharding annotations.
MESH_AXIS_TYPES = (AxisType.Explicit, AxisType.Auto, AxisType.Auto)


def make_mesh(
    data: int = 1, tensor: int = 1, expert: int = 1, *, devices: Sequence[Any] | None = None
) -> jax.sharding.Mesh:
    """A ("data", "tensor", "expert") mesh over the first data*tensor*expert devices.

    "data" is an Explicit axis (batch rows are placed by `jax.reshard`); "tensor" and "expert" are
    Auto: parameters are placed by `NamedSharding`s and the model's einsums are partitioned by the
    compiler, so the layers carry no `out_sharding` annotations.
    """
    shape = (positive_int("data", data), positive_int("tensor", tensor), positive_int("expert", expert))
    available = list(jax.devices() if devices is None else devices)
    need = math.prod(shape)
    if need > len(available):
        raise ValueError(
            f"mesh data={shape[0]} x tensor={shape[1]} x expert={shape[2]} needs {need} devices, "
            f"{len(available)} available"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=MESH_AXIS_TYPES, devices=available[:need])


def default_mesh_shape(num_devices: int, cfg: ModelConfig | None = None) -> tuple[int, int, int]:
    """(data, tensor, expert) for `num_devices`: `DEFAULT_MESH_SHAPES` (all on "tensor"), adapted
    to `cfg` so tensor divides heads and o_groups (the rest goes to "expert", then "data")."""
    n = positive_int("num_devices", num_devices)
    if cfg is None:
        if n in DEFAULT_MESH_SHAPES:
            return DEFAULT_MESH_SHAPES[n]
        return (n, 1, 1)
    tensor = max(t for t in range(1, min(n, 8) + 1) if n % t == 0 and math.gcd(cfg.num_heads, cfg.o_groups) % t == 0)
    rest = n // tensor
    expert = max(e for e in range(1, rest + 1) if rest % e == 0 and cfg.n_routed_experts % e == 0)
    return (rest // expert, tensor, expert)


def mesh_shape(mesh: Any) -> dict[str, int]:
    """{"data": n, "tensor": n, "expert": n} of a Mesh, AbstractMesh, dict or (d, t, e) tuple."""
    if isinstance(mesh, Mapping):
        shape = dict(mesh)
    elif isinstance(mesh, (tuple, list)):
        if len(mesh) != 3:
            raise ValueError(f"a mesh shape tuple must be (data, tensor, expert), got {mesh!r}")
        shape = dict(zip(MESH_AXES, mesh, strict=True))
    elif hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        shape = dict(mesh.shape)
    else:
        raise ValueError(f"mesh must be a jax Mesh (see jaxspec.make_mesh) or a shape, got {type(mesh).__name__}")
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh axes must be among {MESH_AXES}, got extra axes {unknown}")
    return {a: positive_int(a, shape.get(a, 1)) for a in MESH_AXES}


def check_mesh(mesh: Any) -> jax.sharding.Mesh:
    """ValueError unless `mesh` is a concrete jax Mesh whose axes are among MESH_AXES."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (see jaxspec.make_mesh), got {type(mesh).__name__}")
    mesh_shape(mesh)
    return mesh


def check_rules(rules: Mapping[str, Any] | None) -> dict[str, tuple[str, ...]]:
    """DEFAULT_RULES updated by `rules` (logical name -> mesh axis, tuple of axes, or None)."""
    out = dict(DEFAULT_RULES)
    for name, axes in (rules or {}).items():
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        axes = tuple(axes)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad or len(set(axes)) != len(axes):
            raise ValueError(f"rule {name!r}: mesh axes must be distinct names among {MESH_AXES}, got {axes!r}")
        out[name] = axes
    return out


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Multi-host start-up: call once per host, before any other jax use.

    Every host runs the same program; `jax.devices()` then lists all hosts' devices and a mesh from
    `make_mesh` spans them (keep "tensor" x "expert" within a host: their collectives run per layer).
    Without arguments jax reads the cluster from the environment (SLURM, Open MPI, Cloud TPU).
    """
    if coordinator is not None and not re.fullmatch(r"[^\s:]+:\d+", coordinator):
        raise ValueError(f"coordinator must look like HOST:PORT, got {coordinator!r}")
    if (num_processes is None) != (process_id is None):
        raise ValueError("give both num_processes and process_id, or neither")
    if num_processes is not None and not (
        isinstance(process_id, int) and 0 <= process_id < positive_int("num_processes", num_processes)
    ):
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )

# ---------------------------------------------------------------------------------------------
# logical axes, declared beside the arrays
# ---------------------------------------------------------------------------------------------
def axes(*names: str | None, default: Any = dataclasses.MISSING, quant: str | None = None) -> Any:
    """A dataclass field of an array whose dimensions are the logical axes `names`, e.g.
    `wq_b: jax.Array = axes("q_lora", "heads", quant="fp8")  # [q_lora_rank, H*c]`. `quant` says how
    DeepSeek's release stores the matrix (`ops.quant.QUANT_TAGS`); such a field may hold a
    `BlockScaled` (values and scales share the field's axes)."""
    metadata: dict[str, Any] = {"axes": tuple(names)}
    if quant is not None:
        metadata["quant"] = quant
    return dataclasses.field(default=default, metadata=metadata)


def stacked(*names: str, default: Any = dataclasses.MISSING, quant: str | None = None) -> Any:
    """A field holding a sub-tree whose every array carries extra leading logical axes `names`
    (a stack of experts: `experts: MLPParams = stacked("experts", quant="expert")`); `quant`, when
    given, replaces the quantization tag of every quantizable array in the sub-tree."""
    metadata: dict[str, Any] = {"stack": tuple(names)}
    if quant is not None:
        metadata["quant"] = quant
    return dataclasses.field(default=default, metadata=metadata)


def map_declared(tree: Any, fn: Any, _path: str = "", _prefix: tuple[str, ...] = (), _quant: str | None = None) -> Any:
    """Replace every array (or BlockScaled) of a params or decode-state tree by
    `fn(value, axes, quant_tag, path)`, from the declarations of the dataclass fields holding them."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type) and not isinstance(tree, BlockScaled):
        changes = {}
        for f in dataclasses.fields(tree):
            value = getattr(tree, f.name)
            if not f.metadata.get("pytree_node", True) or value is None:
                continue
            path = f"{_path}.{f.name}" if _path else f.name
            if "axes" in f.metadata:
                names = _prefix + f.metadata["axes"]
                if np.ndim(value) != len(names) and getattr(value, "ndim", None) != len(names):
                    raise ValueError(f"{path} has {np.ndim(value)} dims but declares {len(names)} axes: {names}")
                quant = (_quant or f.metadata["quant"]) if "quant" in f.metadata else None
                changes[f.name] = fn(value, names, quant, path)
            else:
                changes[f.name] = map_declared(value, fn, path, _prefix + f.metadata.get("stack", ()),
                                               f.metadata.get("quant", _quant))
        return dataclasses.replace(tree, **changes)
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_declared(v, fn, f"{_path}.{i}", _prefix, _quant) for i, v in enumerate(tree))
    raise ValueError(
        f"no logical-axis rule for {_path or 'the tree'} ({type(tree).__name__}): declare its field with "
        "jaxspec.sharding.axes(...) where it is declared"
    )


def logical_axes(tree: Any) -> Any:
    """The tree of logical-axis tuples of a params or decode-state tree (concrete or abstract):
    same structure, each array replaced by the axes its field declares (a BlockScaled by a
    BlockScaled holding those axes for both its values and its scales)."""

    def names_of(value, names, quant, path):
        return value.replace(data=names, scale=names) if isinstance(value, BlockScaled) else names

    return map_declared(tree, names_of)


def is_axes(a: Any) -> bool:
    """A logical-axes tuple: a leaf of a `logical_axes` tree."""
    return isinstance(a, tuple) and all(x is None or isinstance(x, str) for x in a)


# ---------------------------------------------------------------------------------------------
# logical axes -> partition specs
# ---------------------------------------------------------------------------------------------
def _units(cfg: ModelConfig | None) -> dict[str, int]:
    """Logical axes split in whole units (a head, a group, an expert) rather than elements."""
    if cfg is None:
        return {}
    return {
        "heads": cfg.num_heads,
        "o_groups": cfg.o_groups,
        "experts": cfg.n_routed_experts,
        "index_heads": cfg.index_n_heads,
    }


def spec_for(
    shape: Sequence[int],
    axes: Sequence[str | None],
    mesh: Any,
    rules: Mapping[str, Sequence[str]] | None = None,
    cfg: ModelConfig | None = None,
) -> P:
    """PartitionSpec of an array of `shape` with logical `axes` on `mesh` under `rules`.

    Each mesh axis is used once per array, by the first dimension that claims it; a dimension keeps
    the longest prefix of its rule's axes (size-1 axes skipped) whose product divides it.
    """
    sizes = mesh_shape(mesh)
    rules = check_rules(rules)
    units = _units(cfg)
    used: set[str] = set()
    entries: list[Any] = []
    for dim, name in zip(shape, axes, strict=True):
        candidates = [a for a in rules.get(name, ()) if sizes[a] > 1 and a not in used] if name else []
        count = units.get(name, dim)
        if count and dim % count:  # a rule's unit must tile the dimension (H*c, g*do, E)
            count = dim
        while candidates and count % math.prod(sizes[a] for a in candidates):
            candidates.pop()
        used.update(candidates)
        entries.append(None if not candidates else candidates[0] if len(candidates) == 1 else tuple(candidates))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)

def quantized_spec(
    w: BlockScaled, names: Sequence[str | None], mesh: Any, rules: Mapping[str, Sequence[str]] | None = None,
    cfg: ModelConfig | None = None,
) -> BlockScaled:
    """PartitionSpecs of a BlockScaled's values and scales: the weight's spec (`spec_for` on its
    logical shape), except that a dimension stays whole unless every shard holds whole blocks
    (and whole bytes of packed FP4), so a shard's values and its scales are the same blocks."""
    sizes = mesh_shape(mesh)
    entries = list(spec_for(w.shape, names, mesh, rules, cfg))
    entries += [None] * (len(w.shape) - len(entries))
    for i, entry in enumerate(entries):
        parts = math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))
        unit = math.lcm(w.block[i], 2 if w.packed and i == len(w.shape) - 2 else 1)
        if parts > 1 and (w.shape[i] // parts) % unit:
            entries[i] = None
    while entries and entries[-1] is None:
        entries.pop()
    return w.replace(data=P(*entries), scale=P(*entries))


def tree_specs(tree: Any, mesh: Any, rules: Mapping[str, Any] | None = None, cfg: ModelConfig | None = None) -> Any:
    """Tree of PartitionSpecs of a params or decode-state tree (concrete or abstract) on `mesh`."""
    rules = check_rules(rules)

    def spec(names, x):
        if isinstance(x, BlockScaled):
            return quantized_spec(x, names.data, mesh, rules, cfg)
        return spec_for(np.shape(x), names, mesh, rules, cfg)

    return jax.tree.map(spec, logical_axes(tree), tree, is_leaf=lambda a: is_axes(a) or isinstance(a, BlockScaled))


def parse_mesh(text: str) -> tuple[int, int, int]:
    """"2,4,1" -> (data, tensor, expert)."""
    parts = str(text).replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"a mesh must be three positive ints data,tensor,expert (e.g. 1,8,1), got {text!r}")
    return shape  # type: ignore[return-value]
