"""Where the model's parameters and decode state live on a mesh, and how many bytes that is per
device (the memory plan). Above the model: it places `model.abstract_params`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.core.checks import positive_int
from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.model.dspark import abstract_dspark_params, init_dspark_state
from jaxspec.model.network import WEIGHTS, abstract_params  # noqa: F401  (the placement of these shapes)
from jaxspec.model.state import abstract_state, init_mtp_state
from jaxspec.sharding.active import as_tuple
from jaxspec.sharding.rules import DATA, check_mesh, check_rules, mesh_shape, tree_specs


def param_specs(cfg: ModelConfig, mesh: Any, rules: Mapping[str, Any] | None = None, params: Any = None) -> Any:
    """ModelParams-shaped tree of PartitionSpecs (shapes from `params` or from `cfg`)."""
    return tree_specs(abstract_params(cfg) if params is None else params, mesh, rules, cfg)


def state_specs(cfg: ModelConfig, state: Any, mesh: Any, rules: Mapping[str, Any] | None = None) -> Any:
    """DecodeState-shaped tree of PartitionSpecs for `state` (concrete or abstract)."""
    return tree_specs(state, mesh, rules, cfg)


def _named(mesh: jax.sharding.Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None,
                    params: Any = None) -> Any:
    """ModelParams-shaped tree of NamedShardings on `mesh` (of `params`' structure when given: a
    BlockScaled leaf gets one for its values and one for its scales)."""
    return _named(check_mesh(mesh), param_specs(cfg, mesh, rules, params))


def shard_params(
    params: Any, cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None
) -> Any:
    """Place `params` on `mesh` (leaves already placed that way are left alone)."""
    shardings = param_shardings(cfg, mesh, rules, params)

    def place(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        return jax.device_put(x, s)

    return jax.tree.map(place, params, shardings)


def sharded_abstract(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `abstract` carrying `shardings` (orbax restores straight into them)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


# ---------------------------------------------------------------------------------------------
# memory plan
# ---------------------------------------------------------------------------------------------
def _path_str(path: tuple[Any, ...]) -> str:
    """Dotted form of a pytree path: "layers.3.attn.wq_b"."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k).strip(".[]'\""))
    return ".".join(parts)


def _shard_bytes(shape: Sequence[int], dtype: Any, spec: P, sizes: Mapping[str, int]) -> int:
    shard = list(shape)
    for i, entry in enumerate(spec):
        shard[i] = -(-shard[i] // math.prod(sizes[a] for a in as_tuple(entry)))
    return math.prod(shard) * np.dtype(dtype).itemsize


def _param_group(path: str) -> str:
    if path.startswith("drafter."):
        return "DSpark draft"
    path = path.removeprefix("target.")
    if path in ("embed", "head"):
        return "embed + head"
    if ".engram.table" in path:
        return "Engram tables"
    if ".engram." in path:
        return "Engram projections"
    if ".ffn.experts." in path:
        return "routed experts"
    if ".ffn." in path:
        return "shared expert + router"
    if ".attn." in path:
        return "attention"
    return "norms + hyper-connections + MTP inputs"


def _state_group(path: str) -> str:
    name = path.rsplit(".", 1)[-1]
    if path.startswith("drafter.") and name != "length":
        return "draft state"
    if name == "swa_kv":
        return "window kv"
    if name in ("comp_kv", "idx_kv"):
        return "compressed entries + index keys"
    if name == "length":
        return "lengths"
    if name == "ngram_ids":
        return "Engram n-gram history"
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
    weights: str = "plain"  # "plain" (cfg.dtype) or "fp8" (as the release stores them)

    @property
    def bytes_per_device(self) -> int:
        return self.param_bytes + self.state_bytes


@struct.dataclass
class _Pair:
    """A target's tree and its drafter's (parameters, or states), tallied together."""

    target: Any
    drafter: Any


def memory_plan(
    cfg: ModelConfig,
    mesh: Any,
    batch: int,
    context: int,
    rules: Mapping[str, Any] | None = None,
    weights: str = "plain",
    experts: str = "fp4",
    draft: DSparkConfig | None = None,
) -> MemoryPlan:
    """Per-device bytes of parameters and of the decode state (`init_state(cfg, batch, context)`)
    on `mesh` (a Mesh, or a (data, tensor, expert) shape: no devices needed), from abstract shapes;
    the draft's own too: the MTP block and its window ring (cfg.num_mtp_layers), or with `draft` a
    DSpark drafter's stages and per-stage context rings.
    weights "fp8": parameters as the release stores them, values and scales (`abstract_params`).

    Activations and the speculation scratch (a few tokens per sequence) are not included.
    """
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    sizes = mesh_shape(mesh)
    batch, context = positive_int("batch", batch), positive_int("context", context)
    if context > cfg.max_position_embeddings:
        raise ValueError(f"context must be <= max_position_embeddings={cfg.max_position_embeddings}, got {context}")
    batch = -(-batch // sizes[DATA]) * sizes[DATA]
    rules = check_rules(rules)
    params = abstract_params(cfg, weights, experts)
    state = _Pair(abstract_state(cfg, batch, context), None)
    if draft is not None:
        draft.validate_for(cfg)
        params = _Pair(params, abstract_dspark_params(cfg, draft, weights, experts))
        state = state.replace(drafter=jax.eval_shape(lambda: init_dspark_state(cfg, draft, batch)))
    elif cfg.has_mtp:
        state = state.replace(drafter=jax.eval_shape(lambda: init_mtp_state(cfg, batch, context)))
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
        weights=weights,
    )
