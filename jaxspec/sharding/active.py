"""The mesh of the sharded program being traced, and the per-shard helpers the layers call.

While `runner` traces a program on a mesh, `activate` records the mesh, rules and config;
without one every helper here is the identity, so the layers run unchanged on one device.
Explicit collectives live here: the expert-parallel MoE (`routed_experts`, shard_map + psum) and
kernels run once per shard (`shard_kernel`, check_vma=False).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxspec.core.config import ModelConfig
from jaxspec.ops.quant import BlockScaled
from jaxspec.sharding.rules import DATA, mesh_shape, spec_for, tree_specs


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
def activate(
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
    specs = tree_specs(state, active.sizes, active.rules, active.cfg)
    return jax.lax.with_sharding_constraint(state, specs)


# ---------------------------------------------------------------------------------------------
# explicit collectives: expert-parallel MoE and per-shard kernels
# ---------------------------------------------------------------------------------------------
def routed_experts(
    ffn: Callable[..., jax.Array],
    experts: Any,  # MLPParams, w1/w3 [E, d, I], w2 [E, I, d]
    cfg: ModelConfig,
    x: jax.Array,  # [N, d] tokens
    indices: jax.Array,  # [N, k] int32 selected experts
    weights: jax.Array,  # [N, k] fp32 routing weights
) -> jax.Array:
    """`ffn(experts, cfg, x, indices, weights)` -> [N, d] fp32, expert-parallel when the active mesh
    splits experts (or their hidden width).

    Dispatch: a device holds a slice of the experts and of their hidden width, and the tokens of its
    data shard, which are replicated over "tensor" and "expert", so at decode sizes no all-to-all
    is needed; it runs only the assignments of its own experts (indices shifted to its slice, the
    rest marked as elsewhere: index >= its expert count). Combine: one fp32 psum of the partial
    outputs over the expert-holding axes.
    """
    active = _ACTIVE.get()
    if active is None:
        return ffn(experts, cfg, x, indices, weights)
    sizes = active.sizes
    w1_spec = tuple(spec_for(experts.w1.shape, ("experts", "embed", "expert_hidden"), sizes, active.rules, cfg))
    w1_spec += (None,) * (3 - len(w1_spec))
    experts_entry, hidden_entry = w1_spec[0], w1_spec[2]
    if hidden_entry is not None and not _whole_blocks(experts, hidden_entry, sizes):
        hidden_entry = None  # a shard of quantized weights must hold whole scale blocks
    reduce_axes = as_tuple(experts_entry) + as_tuple(hidden_entry)
    if not reduce_axes:
        return ffn(experts, cfg, x, indices, weights)
    data = DATA if sizes[DATA] > 1 and x.shape[0] % sizes[DATA] == 0 else None

    def spec(w, entries):  # a BlockScaled's values and scales split alike (blocks are whole, see above)
        return w.replace(data=P(*entries), scale=P(*entries)) if isinstance(w, BlockScaled) else P(*entries)

    specs = type(experts)(
        w1=spec(experts.w1, (experts_entry, None, hidden_entry)),
        w3=spec(experts.w3, (experts_entry, None, hidden_entry)),
        w2=spec(experts.w2, (experts_entry, hidden_entry, None)),
    )
    expert_axes = as_tuple(experts_entry)

    def local(experts_shard, x_shard, indices_shard, weights_shard):
        held = experts_shard.w1.shape[0]
        if expert_axes:
            first = jax.lax.axis_index(expert_axes) * held
            shifted = indices_shard - first
            indices_shard = jnp.where((shifted >= 0) & (shifted < held), shifted, held)
        return jax.lax.psum(ffn(experts_shard, cfg, x_shard, indices_shard, weights_shard), reduce_axes)

    return jax.shard_map(
        local,
        in_specs=(specs, P(data, None), P(data, None), P(data, None)),
        out_specs=P(data, None),
        # "data" is manual too (split or replicated): inside, no axis is left for the compiler to
        # infer shardings over (ragged_dot has no inference rule for explicit axes).
        axis_names=set(reduce_axes) | {DATA},
        # The CUDA branch (traced on every platform) is a pallas_call, whose outputs carry no
        # varying-axes type; the psum above is the only collective and is written explicitly.
        check_vma=False,
    )(experts, x, indices, weights)


def _whole_blocks(experts: Any, hidden_entry: Any, sizes: Mapping[str, int]) -> bool:
    """Whether splitting the experts' hidden width over `hidden_entry` leaves every shard of a
    BlockScaled w1 / w3 / w2 with whole scale blocks (and whole bytes of packed FP4)."""
    parts = int(np.prod([sizes[a] for a in as_tuple(hidden_entry)]))
    for w, axis in ((experts.w1, 2), (experts.w3, 2), (experts.w2, 1)):
        if isinstance(w, BlockScaled):
            unit = np.lcm(w.block[axis], 2 if w.packed and axis == w.ndim - 2 else 1)
            if (w.shape[axis] // parts) % unit:
                return False
    return True


def as_tuple(entry: Any) -> tuple[str, ...]:
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
        static = {k: v for k, v in kwargs.items() if not is_dynamic(v)}
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
                 for entry in sp for a in as_tuple(entry)}
        if not names:
            return local(tuple(args), arrays)
        return jax.shard_map(
            local, in_specs=in_specs, out_specs=out_specs, axis_names=names, check_vma=False
        )(tuple(args), arrays)

    return call


def is_dynamic(arg: Any) -> bool:
    """An argument that holds arrays (or their abstract shapes), as opposed to a static config."""
    leaves = jax.tree.leaves(arg)
    return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))
                                for x in leaves)
