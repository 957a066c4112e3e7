"""Sharding below the layers: `rules` (logical axes declared beside the arrays, rules mapping them
onto a ("data", "tensor", "expert") mesh, meshes) and `active` (the mesh of the program being
traced, the expert-parallel MoE and per-shard kernels). What places the model's arrays and runs
its programs on a mesh sits above the model: `jaxspec.model.placement` and `jaxspec.model.runner`.
"""

from jaxspec.sharding.active import constrain_state, global_rows, routed_experts, shard_kernel
from jaxspec.sharding.rules import (
    DATA,
    DEFAULT_MESH_SHAPES,
    DEFAULT_RULES,
    EXPERT,
    MESH_AXES,
    TENSOR,
    axes,
    check_mesh,
    check_rules,
    default_mesh_shape,
    initialize_distributed,
    logical_axes,
    make_mesh,
    mesh_shape,
    parse_mesh,
    spec_for,
    stacked,
    tree_specs,
)

__all__ = [
    "DATA", "DEFAULT_MESH_SHAPES", "DEFAULT_RULES", "EXPERT", "MESH_AXES", "TENSOR", "axes", "check_mesh",
    "check_rules", "constrain_state", "default_mesh_shape", "global_rows", "initialize_distributed",
    "logical_axes", "make_mesh", "mesh_shape", "parse_mesh", "routed_experts", "shard_kernel", "spec_for",
    "stacked", "tree_specs",
]
