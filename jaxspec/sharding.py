"""Sharding: logical axis names on every parameter and decode-state array, rules mapping them onto
a ("data", "tensor", "expert") mesh, placement, and the sharded jitted entry points.

Layers never name mesh axes. A parameter's logical axes come from its pytree path (`PARAM_AXES`:
`layers.3.attn.wq_b` -> ("q_lora", "heads")), a state array's from its field name (`STATE_AXES`);
`rules` map logical names to mesh axes (`DEFAULT_RULES`: batch -> data, heads -> tensor, experts ->
expert x tensor, ...). A dimension whose size (in units: heads, groups, experts) does not divide
by the mesh axes a rule names keeps only the leading axes that do divide, else stays replicated,
so every rule set works on every mesh.

Programs (`run_sharded`) are `jax.jit` with explicit in/out shardings: parameters keep their
placement, batch-leading arrays are split over "data". Inside, "data" is a manual `jax.shard_map`
axis: each data shard runs its own sequences (its own while loop), so the decode state, the verify
scratch and the commit can never be resharded across the batch. "tensor" and "expert" are
partitioned by the compiler (GSPMD) from the parameter placement, except where the collective is
explicit: the expert-parallel MoE (`routed_experts`, shard_map + psum) and kernels run per shard
(`shard_kernel`, check_vma=False).

Mesh axes: "data" is `AxisType.Explicit` (`jax.make_mesh`, `jax.set_mesh`): batch rows are placed
on their data shard by `jax.reshard` before a program runs and are a manual axis inside it.
"tensor" and "expert" are `AxisType.Auto`: Explicit there would make the layers annotate every
contraction over a split axis (e.g. the grouped output projection over tensor-split groups) with
an `out_sharding`, for no change in the partitioning. Multi-host: `initialize_distributed` on
every host, then the same program; nothing else changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.config import ModelConfig

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
}

# Full-path regex -> logical axes of a parameter leaf (dotted paths: "layers.3.attn.wq_b", "mtp.norm").
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed", ("vocab", "embed")),
    (r"head", ("embed", "vocab")),
    (r"(mtp\.)?norm", ("embed",)),
    (r"(.+\.)?hc_head\.fn", ("hc_embed", "streams")),
    (r"(.+\.)?hc_head\.base", ("streams",)),
    (r"(.+\.)?hc_(head|attn|ffn)\.scale", (None,)),
    (r".+\.hc_(attn|ffn)\.fn", ("hc_embed", "hc_mix")),
    (r".+\.hc_(attn|ffn)\.base", ("hc_mix",)),
    (r".+\.(attn_norm|ffn_norm)", ("embed",)),
    (r".+\.attn\.wq_a", ("embed", "q_lora")),
    (r".+\.attn\.q_norm", ("q_lora",)),
    (r".+\.attn\.wq_b", ("q_lora", "heads")),  # [q_lora, H*c], head-major
    (r".+\.attn\.wkv", ("embed", "kv")),  # one shared K=V head (MQA): never split
    (r".+\.attn\.kv_norm", ("kv",)),
    (r".+\.attn\.wo_a", ("o_groups", "group_width", "o_lora")),
    (r".+\.attn\.wo_b", ("o_groups", "embed")),  # [g*o_lora, d], group-major
    (r".+\.attn\.sink", ("heads",)),
    (r".+\.compressor\.(wkv|wgate)", ("embed", "compress")),
    (r".+\.compressor\.ape", ("ratio", "compress")),
    (r".+\.compressor\.norm", ("kv",)),
    (r".+\.indexer\.wq_b", ("q_lora", "index_heads")),
    (r".+\.indexer\.weights_proj", ("embed", "index_heads")),
    (r".+\.ffn\.gate", ("embed", "router")),
    (r".+\.ffn\.gate_bias", ("router",)),
    (r".+\.ffn\.tid2eid", ("hash_vocab", "topk")),
    (r".+\.ffn\.experts\.(w1|w3)", ("experts", "embed", "expert_hidden")),
    (r".+\.ffn\.experts\.w2", ("experts", "expert_hidden", "embed")),
    (r".+\.ffn\.shared\.(w1|w3)", ("embed", "expert_hidden")),
    (r".+\.ffn\.shared\.w2", ("expert_hidden", "embed")),
    (r"mtp\.inputs\.(e_proj|h_proj)", ("embed", "embed_out")),
    (r"mtp\.inputs\.(enorm|hnorm)", ("embed",)),
)
_PARAM_AXES = tuple((re.compile(pattern), axes) for pattern, axes in PARAM_AXES)

# Field name -> logical axes of a decode-state leaf (DecodeState / LayerState).
STATE_AXES: dict[str, tuple[str | None, ...]] = {
    "swa_kv": ("batch", "window", "kv"),
    "comp_kv": ("batch", "entries", "kv"),
    "comp_rows_kv": ("batch", "rows", "compress"),
    "comp_rows_gate": ("batch", "rows", "compress"),
    "idx_kv": ("batch", "entries", "index_kv"),
    "idx_rows_kv": ("batch", "rows", "index_compress"),
    "idx_rows_gate": ("batch", "rows", "index_compress"),
    "length": ("batch",),
    "mtp_length": ("batch",),
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


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def make_mesh(
    data: int = 1, tensor: int = 1, expert: int = 1, *, devices: Sequence[Any] | None = None
) -> jax.sharding.Mesh:
    """A ("data", "tensor", "expert") mesh over the first data*tensor*expert devices.

    "data" is an Explicit axis (batch rows are placed by `jax.reshard`); "tensor" and "expert" are
    Auto: parameters are placed by `NamedSharding`s and the model's einsums are partitioned by the
    compiler, so the layers carry no `out_sharding` annotations.
    """
    shape = (_size("data", data), _size("tensor", tensor), _size("expert", expert))
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
    n = _size("num_devices", num_devices)
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
    return {a: _size(a, shape.get(a, 1)) for a in MESH_AXES}


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
        isinstance(process_id, int) and 0 <= process_id < _size("num_processes", num_processes)
    ):
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


# ---------------------------------------------------------------------------------------------
# logical axes -> partition specs
# ---------------------------------------------------------------------------------------------
def _path_str(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k).strip(".[]'\""))
    return ".".join(parts)


def param_axes_for(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at dotted `path` (e.g. "layers.3.attn.wq_b")."""
    for pattern, axes in _PARAM_AXES:
        if pattern.fullmatch(path):
            if len(axes) != ndim:
                raise ValueError(f"params.{path} has {ndim} dims but its rule names {len(axes)}: {axes}")
            return axes
    raise ValueError(f"no logical-axis rule for params.{path}; add one to jaxspec.sharding.PARAM_AXES")


def logical_axes(params: Any) -> Any:
    """The tree of logical-axis tuples of a ModelParams (or abstract) tree."""
    return jax.tree_util.tree_map_with_path(lambda p, x: param_axes_for(_path_str(p), np.ndim(x)), params)


def _state_axes_for(path: tuple[Any, ...]) -> tuple[str | None, ...]:
    name = _path_str(path).rsplit(".", 1)[-1]
    if name not in STATE_AXES:
        raise ValueError(f"no logical-axis rule for state field {name!r}; add one to jaxspec.sharding.STATE_AXES")
    return STATE_AXES[name]


def state_logical_axes(state: Any) -> Any:
    """The tree of logical-axis tuples of a DecodeState (or abstract) tree."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _state_axes_for(p), state)


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


def param_specs(cfg: ModelConfig, mesh: Any, rules: Mapping[str, Any] | None = None, params: Any = None) -> Any:
    """ModelParams-shaped tree of PartitionSpecs (shapes from `params` or from `cfg`)."""
    rules = check_rules(rules)
    tree = abstract_params(cfg) if params is None else params
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(x.shape, param_axes_for(_path_str(p), x.ndim), mesh, rules, cfg), tree
    )


def state_specs(cfg: ModelConfig, state: Any, mesh: Any, rules: Mapping[str, Any] | None = None) -> Any:
    """DecodeState-shaped tree of PartitionSpecs for `state` (concrete or abstract)."""
    rules = check_rules(rules)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(x.shape, _state_axes_for(p), mesh, rules, cfg), state
    )


def _named(mesh: jax.sharding.Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None) -> Any:
    """ModelParams-shaped tree of NamedShardings on `mesh`."""
    return _named(check_mesh(mesh), param_specs(cfg, mesh, rules))


def state_shardings(
    cfg: ModelConfig, batch: int, max_len: int, mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None
) -> Any:
    """DecodeState-shaped tree of NamedShardings for `init_state(cfg, batch, max_len)`."""
    from jaxspec.state import abstract_state

    return _named(check_mesh(mesh), state_specs(cfg, abstract_state(cfg, batch, max_len), mesh, rules))


@functools.lru_cache(maxsize=16)
def abstract_params(cfg: ModelConfig) -> Any:
    from jaxspec.model import init_params

    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def shard_params(
    params: Any, cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None
) -> Any:
    """Place `params` on `mesh` (leaves already placed that way are left alone)."""
    shardings = param_shardings(cfg, mesh, rules)

    def place(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        return jax.device_put(x, s)

    return jax.tree.map(place, params, shardings)


# ---------------------------------------------------------------------------------------------
# the active mesh while a sharded program is traced
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Active:
    mesh: jax.sharding.Mesh
    rules: dict[str, tuple[str, ...]]
    cfg: ModelConfig | None
    data_manual: bool  # tracing the per-data-shard body: "data" is already split off

    @property
    def sizes(self) -> dict[str, int]:
        """Mesh axis sizes still to be split inside the traced body."""
        sizes = mesh_shape(self.mesh)
        if self.data_manual:
            sizes[DATA] = 1
        return sizes


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("jaxspec_sharding", default=None)


@contextlib.contextmanager
def _activate(
    mesh: jax.sharding.Mesh, rules: dict[str, tuple[str, ...]], cfg: ModelConfig | None, data_manual: bool = False
) -> Iterator[None]:
    token = _ACTIVE.set(_Active(mesh, rules, cfg, data_manual))
    try:
        if data_manual:  # entered while tracing the shard_map body, inside the outer set_mesh
            yield
        else:
            with jax.set_mesh(mesh):
                yield
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> jax.sharding.Mesh | None:
    """The mesh of the sharded program being traced, or None (single device)."""
    active = _ACTIVE.get()
    return None if active is None else active.mesh


def resolve(axes: Sequence[str | None], shape: Sequence[int]) -> P:
    """PartitionSpec for logical `axes` under the active mesh and rules (P() without one).

    Inside the per-data-shard body "data" is never named: that split is already done.
    """
    active = _ACTIVE.get()
    if active is None:
        return P()
    return spec_for(shape, axes, active.sizes, active.rules, active.cfg)


def global_rows(local_batch: int) -> jax.Array:
    """[local_batch] int32 global batch-row ids of this shard's rows (arange without a mesh).

    For per-row randomness that must not depend on the mesh: fold these into the key.
    """
    rows = jax.numpy.arange(local_batch, dtype=jax.numpy.int32)
    active = _ACTIVE.get()
    if active is None or not active.data_manual:
        return rows
    return rows + jax.lax.axis_index(DATA).astype(jax.numpy.int32) * local_batch


def constrain_state(state: Any) -> Any:
    """Pin a decode state (or any tree with state field names) to its sharding; no-op unsharded.

    The loops call it on the initial state, so the while-loop carry, the verify scratch derived
    from it and the commit stay as the committed state is laid out: nothing is resharded per cycle.
    """
    active = _ACTIVE.get()
    if active is None:
        return state
    specs = state_specs(active.cfg, state, active.sizes, active.rules)
    return jax.lax.with_sharding_constraint(state, specs)


# ---------------------------------------------------------------------------------------------
# explicit collectives: expert-parallel MoE and per-shard kernels
# ---------------------------------------------------------------------------------------------
def routed_experts(
    ffn: Callable[..., jax.Array],
    experts: Any,  # MLPParams, w1/w3 [E, d, I], w2 [E, I, d]
    cfg: ModelConfig,
    x: jax.Array,  # [N, d] tokens
    combine: jax.Array,  # [N, E] fp32 routing weights (0 for unselected experts)
) -> jax.Array:
    """`ffn(experts, cfg, x, combine)` -> [N, d] fp32, expert-parallel when the active mesh splits
    experts (or their hidden width).

    Dispatch: a device holds a slice of the experts and of their hidden width, and the tokens of its
    data shard, which are replicated over "tensor" and "expert", so at decode sizes no all-to-all
    is needed; it runs its local experts on them with its columns of `combine`. Combine: one fp32
    psum of the partial outputs over the expert-holding axes.
    """
    active = _ACTIVE.get()
    if active is None:
        return ffn(experts, cfg, x, combine)
    sizes = active.sizes
    w1_spec = tuple(spec_for(experts.w1.shape, ("experts", "embed", "expert_hidden"), sizes, active.rules, cfg))
    w1_spec += (None,) * (3 - len(w1_spec))
    experts_entry, hidden_entry = w1_spec[0], w1_spec[2]
    reduce_axes = _as_tuple(experts_entry) + _as_tuple(hidden_entry)
    if not reduce_axes:
        return ffn(experts, cfg, x, combine)
    data = DATA if sizes[DATA] > 1 and x.shape[0] % sizes[DATA] == 0 else None
    specs = type(experts)(
        w1=P(experts_entry, None, hidden_entry),
        w3=P(experts_entry, None, hidden_entry),
        w2=P(experts_entry, hidden_entry, None),
    )

    def local(experts_shard, x_shard, combine_shard):
        return jax.lax.psum(ffn(experts_shard, cfg, x_shard, combine_shard), reduce_axes)

    return jax.shard_map(
        local,
        in_specs=(specs, P(data, None), P(data, experts_entry)),
        out_specs=P(data, None),
        axis_names=set(reduce_axes) | ({DATA} if data else set()),
    )(experts, x, combine)


def _as_tuple(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _is_axes(a: Any) -> bool:
    return a is None or isinstance(a, tuple) and all(x is None or isinstance(x, str) for x in a)


def shard_kernel(
    kernel: Callable[..., Any],
    in_axes: Sequence[Any],
    out_axes: Any,
    kw_axes: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Run `kernel` (e.g. a `pallas_call` wrapper) once per shard under the active mesh; as is
    without one.

    `in_axes` (one entry per positional argument), `kw_axes` (per array keyword argument) and
    `out_axes` give logical axes as tuples, e.g. ("batch", None, "heads", None) for [B, T, H, c]
    queries, or None for a replicated array or a whole replicated pytree (e.g. an AttentionContext).
    Keyword arguments that hold no arrays (window, scale, kind) are passed through as static. The
    kernel must not reduce over a split axis. Pallas kernels carry no varying-manual-axes types,
    hence `check_vma=False`.
    """

    def call(*args, **kwargs):
        active = _ACTIVE.get()
        if active is None:
            return kernel(*args, **kwargs)
        # Batch is split by the data shard_map around the program, never here: a None-axes pytree
        # argument then always holds the same rows as the split arrays.
        sizes, rules, cfg = {**active.sizes, DATA: 1}, active.rules, active.cfg
        static = {k: v for k, v in kwargs.items() if not _is_dynamic(v)}
        arrays = {k: v for k, v in kwargs.items() if k not in static}
        if len(in_axes) != len(args):
            raise ValueError(f"shard_kernel: in_axes has {len(in_axes)} entries for {len(args)} positional args")

        def spec(a, x):
            if a is None:
                return jax.tree.map(lambda _: P(), x)
            return spec_for(np.shape(x), a, sizes, rules, cfg)

        def local(a, kw):
            return kernel(*a, **kw, **static)

        # Per argument: its axes apply to the array, None to the whole (pytree) argument.
        in_specs = (
            tuple(spec(a, x) for a, x in zip(in_axes, args, strict=True)),
            {k: spec((kw_axes or {}).get(k), x) for k, x in arrays.items()},
        )
        out_shapes = jax.eval_shape(local, tuple(args), arrays)
        out_specs = jax.tree.map(spec, out_axes, out_shapes, is_leaf=_is_axes)
        names = {a for sp in jax.tree.leaves((in_specs, out_specs), is_leaf=lambda x: isinstance(x, P))
                 for entry in sp for a in _as_tuple(entry)}
        if not names:
            return local(tuple(args), arrays)
        return jax.shard_map(
            local, in_specs=in_specs, out_specs=out_specs, axis_names=names, check_vma=False
        )(tuple(args), arrays)

    return call


# ---------------------------------------------------------------------------------------------
# sharded programs
# ---------------------------------------------------------------------------------------------
def _is_dynamic(arg: Any) -> bool:
    leaves = jax.tree.leaves(arg)
    return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)


_PROGRAMS: dict[Any, Any] = {}


def _program(
    jitted: Any, mesh: Any, args: Sequence[Any], batch: int, cfg: ModelConfig, rules: Mapping[str, Any] | None
) -> tuple[Any, list[Any], Any]:
    """-> (jitted program over the dynamic args, those args placed, output post-processing)."""
    from jaxspec.model import ModelParams

    mesh = check_mesh(mesh)
    rules = check_rules(rules)
    raw = getattr(jitted, "__wrapped__", jitted)
    args = list(args)
    static = tuple(i for i, a in enumerate(args) if not _is_dynamic(a))
    dynamic = [i for i in range(len(args)) if i not in static]
    data_split = mesh.shape[DATA] > 1 and batch % mesh.shape[DATA] == 0
    rows = NamedSharding(mesh, P(DATA))
    for i in dynamic:
        if isinstance(args[i], ModelParams):
            args[i] = shard_params(args[i], cfg, mesh, rules)
        elif data_split:
            # Batch rows go to their data shard before the call (an explicit-axis reshard); inside,
            # the loop never moves them again.
            args[i] = jax.tree.map(
                lambda x: jax.reshard(x, rows) if np.ndim(x) and np.shape(x)[0] == batch else x, args[i]
            )
    dyn_args = [args[i] for i in dynamic]
    avals = tuple(
        (jax.tree.structure(a), tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(a))) for a in dyn_args
    )
    key = (raw, mesh, tuple(sorted(rules.items())), tuple((i, args[i]) for i in static), avals, batch)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _build_program(raw, mesh, rules, cfg, args, static, batch)
    program, post = _PROGRAMS[key]
    return program, dyn_args, post


def _build_program(raw, mesh, rules, cfg, args, static, batch):
    """jit(shard_map over "data" of the loop) with explicit in/out shardings.

    The batch is split by a manual "data" axis: every data shard runs its own sequences (its own
    while loop, no per-step cross-shard collective), so nothing batch-indexed can be resharded;
    "tensor" and "expert" stay automatic inside, plus the explicit MoE shard_map.
    """
    from jaxspec.model import ModelParams

    dyn_args = [a for i, a in enumerate(args) if i not in static]
    static_values = {i: args[i] for i in static}  # the program must not keep the arrays alive
    num_args = len(args)

    def fn(*dyn):
        it = iter(dyn)
        return raw(*[static_values[i] if i in static_values else next(it) for i in range(num_args)])

    def batch_spec(x):
        shape = np.shape(x)
        return P(DATA) if shape and shape[0] == batch else P()

    data_manual = mesh.shape[DATA] > 1 and batch % mesh.shape[DATA] == 0
    # Global shapes, as traced without a mesh (the unsharded types: no data-split inputs).
    out_shapes = jax.eval_shape(fn, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), dyn_args))
    if data_manual:
        in_specs = tuple(P() if isinstance(a, ModelParams) else jax.tree.map(batch_spec, a) for a in dyn_args)
        # Scalars (step counters) come back per shard, [data], and are reduced by `post`.
        out_specs = jax.tree.map(lambda s: P(DATA) if s.ndim == 0 else batch_spec(s), out_shapes)

        def local(*dyn):
            with _activate(mesh, rules, cfg, data_manual=True):
                return jax.tree.map(lambda x: x[None] if x.ndim == 0 else x, fn(*dyn))

        body = jax.shard_map(local, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False)

        def post(out):
            return jax.tree.map(lambda x, s: x.max() if s.ndim == 0 else x, out, out_shapes)
    else:
        out_specs = jax.tree.map(lambda s: P(), out_shapes)
        body = fn

        def post(out):
            return out

    in_shardings = tuple(
        param_shardings(cfg, mesh, rules) if isinstance(a, ModelParams)
        else jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(x) if data_manual else P()), a)
        for a in dyn_args
    )
    out_shardings = jax.tree.map(lambda sp: NamedSharding(mesh, sp), out_specs, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(body, in_shardings=in_shardings, out_shardings=out_shardings), post


def run_sharded(
    jitted: Any,
    mesh: jax.sharding.Mesh,
    args: Sequence[Any],
    *,
    batch: int,
    cfg: ModelConfig,
    rules: Mapping[str, Any] | None = None,
) -> Any:
    """Call the program of `jitted` (a `jax.jit` function) on `mesh` with explicit in/out shardings.

    Arguments that hold arrays are dynamic, everything else (configs, python ints) is static.
    ModelParams keep their parameter shardings (call `shard_params` once to avoid a transfer per
    call); other arrays, and outputs, whose leading dim is `batch` are split over "data" (when it
    divides `batch`); the rest is replicated, and scalar outputs are per-shard counters reduced by
    max. One jitted program per (function, mesh, rules, static args, argument shapes).
    """
    program, dyn_args, post = _program(jitted, mesh, args, batch, cfg, rules)
    with _activate(mesh, check_rules(rules), cfg):
        return post(program(*dyn_args))


def lower_sharded(
    jitted: Any,
    mesh: jax.sharding.Mesh,
    args: Sequence[Any],
    *,
    batch: int,
    cfg: ModelConfig,
    rules: Mapping[str, Any] | None = None,
) -> Any:
    """The `jax.stages.Lowered` program `run_sharded` runs for these arguments (HLO inspection)."""
    program, dyn_args, _ = _program(jitted, mesh, args, batch, cfg, rules)
    with _activate(mesh, check_rules(rules), cfg):
        return program.lower(*dyn_args)


def sharded_compile_count() -> int:
    """Compiled sharded programs so far (one per mesh x bucket x config, like compile_count)."""
    return sum(program._cache_size() for program, _ in _PROGRAMS.values())


def pad_batch(batch: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """A PromptBatch whose bucket is padded up to a multiple of the mesh's "data" size."""
    if mesh is None:
        return batch
    data = check_mesh(mesh).shape[DATA]
    rows = batch.tokens.shape[0]
    target = -(-rows // data) * data
    if target == rows:
        return batch
    tokens = np.zeros((target, batch.tokens.shape[1]), batch.tokens.dtype)
    tokens[:rows] = batch.tokens
    lengths = np.ones((target,), batch.lengths.dtype)
    lengths[:rows] = batch.lengths
    return dataclasses.replace(batch, tokens=tokens, lengths=lengths)


def on_mesh(jitted: Any, mesh: jax.sharding.Mesh | None, batch: int, rules: Mapping[str, Any] | None = None) -> Any:
    """`jitted` itself without a mesh; else a callable running it through `run_sharded` (the
    ModelConfig among the call's arguments supplies head / expert counts)."""
    if mesh is None:
        return jitted

    def call(*args):
        cfg = next((a for a in args if isinstance(a, ModelConfig)), None)
        if cfg is None:
            raise ValueError("a sharded program needs a ModelConfig among its arguments")
        return run_sharded(jitted, mesh, args, batch=batch, cfg=cfg, rules=rules)

    return call


def sharded_abstract(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `abstract` carrying `shardings` (orbax restores straight into them)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def prefill_logits(params: Any, cfg: ModelConfig, tokens: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """`model.prefill_logits` on `mesh`: tokens [B, S] (rows padded to a multiple of "data") -> [B, S, V]."""
    from jaxspec.model import _prefill_logits

    data = check_mesh(mesh).shape[DATA]
    b = tokens.shape[0]
    padded = np.zeros((-(-b // data) * data, tokens.shape[1]), np.int32)
    padded[:b] = np.asarray(tokens)
    logits = run_sharded(_prefill_logits, mesh, (params, cfg, jax.numpy.asarray(padded)), batch=len(padded), cfg=cfg)
    return logits[:b]


# ---------------------------------------------------------------------------------------------
# memory plan
# ---------------------------------------------------------------------------------------------
def _shard_bytes(shape: Sequence[int], dtype: Any, spec: P, sizes: Mapping[str, int]) -> int:
    shard = list(shape)
    for i, entry in enumerate(spec):
        shard[i] = -(-shard[i] // math.prod(sizes[a] for a in _as_tuple(entry)))
    return math.prod(shard) * np.dtype(dtype).itemsize


def _param_group(path: str) -> str:
    if path in ("embed", "head"):
        return "embed + head"
    if ".ffn.experts." in path:
        return "routed experts"
    if ".ffn." in path:
        return "shared expert + router"
    if ".attn." in path:
        return "attention"
    return "norms + hyper-connections + MTP inputs"


def _state_group(path: str) -> str:
    name = path.rsplit(".", 1)[-1]
    if name == "swa_kv":
        return "window kv"
    if name in ("comp_kv", "idx_kv"):
        return "compressed entries + index keys"
    if name in ("length", "mtp_length"):
        return "lengths"
    return "compressor / indexer rows"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    mesh: dict[str, int]
    batch: int  # padded to a multiple of "data"
    context: int
    param_bytes: int  # per device
    state_bytes: int  # per device
    param_groups: dict[str, int]
    state_groups: dict[str, int]
    total_param_bytes: int  # all devices together, unreplicated (the checkpoint's size)
    total_state_bytes: int

    @property
    def bytes_per_device(self) -> int:
        return self.param_bytes + self.state_bytes


def memory_plan(
    cfg: ModelConfig,
    mesh: Any,
    batch: int,
    context: int,
    rules: Mapping[str, Any] | None = None,
) -> MemoryPlan:
    """Per-device bytes of parameters and of the decode state (`init_state(cfg, batch, context)`)
    on `mesh` (a Mesh, or a (data, tensor, expert) shape: no devices needed), from abstract shapes.

    Activations and the speculation scratch (a few tokens per sequence) are not included.
    """
    from jaxspec.state import abstract_state

    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    sizes = mesh_shape(mesh)
    batch, context = _size("batch", batch), _size("context", context)
    if context > cfg.max_position_embeddings:
        raise ValueError(f"context must be <= max_position_embeddings={cfg.max_position_embeddings}, got {context}")
    batch = -(-batch // sizes[DATA]) * sizes[DATA]
    rules = check_rules(rules)
    params = abstract_params(cfg)
    state = abstract_state(cfg, batch, context)
    p_specs = param_specs(cfg, sizes, rules, params)
    s_specs = state_specs(cfg, state, sizes, rules)

    def tally(tree, specs, group):
        groups: dict[str, int] = {}
        total = 0
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, x), spec in zip(flat, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)), strict=True):
            name = group(_path_str(path))
            groups[name] = groups.get(name, 0) + _shard_bytes(x.shape, x.dtype, spec, sizes)
            total += math.prod(x.shape) * np.dtype(x.dtype).itemsize
        return groups, total

    param_groups, total_params = tally(params, p_specs, _param_group)
    state_groups, total_state = tally(state, s_specs, _state_group)
    return MemoryPlan(
        mesh=sizes,
        batch=batch,
        context=context,
        param_bytes=sum(param_groups.values()),
        state_bytes=sum(state_groups.values()),
        param_groups=param_groups,
        state_groups=state_groups,
        total_param_bytes=total_params,
        total_state_bytes=total_state,
    )


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
