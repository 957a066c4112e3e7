"""The GPU program without a GPU: export a function for CUDA from this host and inspect what it holds.

`export_for_cuda` runs `jax.export` with `platforms=("cuda",)`. jax >= 0.11 needs to be told
which GPU the Triton lowering targets when no GPU is attached: it is given an abstract mesh of
`AbstractDevice`s ("NVIDIA H200", sm_90) for the duration of the export. `kernel_calls` counts the
Pallas kernels by name in the exported text, `expert_stack_dots` finds any XLA matmul that reads a
routed-expert weight stack whole (the dense per-expert rewrite the GPU path must never contain).
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax import export

TRITON_CALL = "__gpu$xla.gpu.triton"
H200 = ("NVIDIA H200", 132)  # device kind, SMs


@contextlib.contextmanager
def cuda_target(axis_sizes: Sequence[int] = (1,), axis_names: Sequence[str] = ("x",)) -> Iterator[Any]:
    """An abstract mesh of H200s on jax >= 0.11 (where lowering Pallas for CUDA needs one); nothing on
    older jax, whose Triton lowering falls back to sm_90 without a device. Yields the mesh or None."""
    device_cls = getattr(jax.sharding, "AbstractDevice", None)
    if device_cls is None or not hasattr(jax.sharding, "use_abstract_mesh"):
        yield None
        return
    device = device_cls(device_kind=H200[0], num_cores=H200[1], platform="cuda")
    auto = (jax.sharding.AxisType.Auto,) * len(axis_sizes)  # Explicit axes would demand out_sharding of ragged_dot
    mesh = jax.sharding.AbstractMesh(tuple(axis_sizes), tuple(axis_names), axis_types=auto, abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield mesh


def export_for_cuda(fn: Callable, *args: Any, static_argnums: Sequence[int] = ()) -> str:
    """StableHLO text of jit(fn)(*args) lowered for CUDA (args may be ShapeDtypeStructs)."""
    jitted = jax.jit(fn, static_argnums=tuple(static_argnums))
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    with cuda_target():
        exported = export.export(jitted, platforms=("cuda",), disabled_checks=checks)(*args)
    return exported.mlir_module()


def kernel_calls(text: str) -> Counter:
    """Pallas kernels in exported text by name (`name=` of each pallas_call), Triton calls only."""
    names = Counter()
    for line in text.splitlines():
        if f"@{TRITON_CALL}" in line or f'@"{TRITON_CALL}"' in line:
            found = re.search(r'name = \\?"([A-Za-z_0-9]+)', line)
            names[found.group(1) if found else "?"] += 1
    return names


# Primitives XLA:GPU launches a kernel around (elementwise ops fuse into them or into one loop fusion
# between them): an estimate of launches, not XLA's fusion decisions, which need a GPU to compile.
KERNEL_PRIMITIVES = {
    "dot_general", "pallas_call", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
    "reduce_or", "argmax", "argmin", "cumsum", "cummax", "cumlogsumexp", "sort", "top_k", "scatter",
    "scatter-add", "scatter_add", "dynamic_update_slice", "conv_general_dilated", "ragged_dot", "all_reduce",
    "psum", "all_to_all", "all_gather",
}


def launch_estimate(fn: Callable, *args: Any, platform: str = "cuda") -> Counter:
    """Kernel launches of one call of `fn(*args)` as lowered for `platform`, estimated from its jaxpr:
    one per primitive in KERNEL_PRIMITIVES, the branches of `platform_dependent` resolved to
    `platform`'s, loop bodies (`scan`) counted `length` times, `while` bodies once (their trip count
    is not static). -> Counter by primitive name ("pallas_call:<kernel>" for kernels)."""
    return _launches(jax.make_jaxpr(fn)(*args).jaxpr, platform)


def _launches(jaxpr: Any, platform: str) -> Counter:
    counts: Counter = Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        params = eqn.params
        if name == "cond":
            branches, chosen = params["branches"], None
            platforms = params.get("branches_platforms")
            if platforms:
                chosen = next((i for i, p in enumerate(platforms) if p is not None and platform in p), None)
                if chosen is None:
                    chosen = next(i for i, p in enumerate(platforms) if p is None)  # the default branch
            taken = [branches[chosen]] if chosen is not None else branches
            for branch in taken:  # a data-dependent cond: every branch counts (an upper bound)
                counts += _launches(branch.jaxpr, platform)
            continue
        if name == "scan":
            body = _launches(params["jaxpr"].jaxpr, platform)
            counts += Counter({k: v * int(params["length"]) for k, v in body.items()})
            continue
        if name == "pallas_call":
            kernel = getattr(params.get("name_and_src_info"), "name", None) or params.get("name", "kernel")
            counts[f"pallas_call:{kernel}"] += 1
            continue
        if name in KERNEL_PRIMITIVES:
            counts[name] += 1
        for key in ("jaxpr", "call_jaxpr", "body_jaxpr", "cond_jaxpr"):  # pjit, custom_vjp, while, ...
            inner = params.get(key)
            if inner is not None:
                counts += _launches(getattr(inner, "jaxpr", inner), platform)
    return counts


def expert_stack_dots(text: str, num_experts: int, hidden: int, inter: int) -> list[str]:
    """dot_general / ragged_dot lines (not Pallas calls) with a whole [E, d, I] or [E, I, d] expert
    stack as an operand: the 3-D type exactly, its element type right after the dims."""
    stack = re.compile(rf"tensor<{num_experts}x({hidden}x{inter}|{inter}x{hidden})x[a-z]")
    return [line.strip()[:200] for line in text.splitlines()
            if "custom_call" not in line and ("dot_general" in line or "ragged_dot" in line) and stack.search(line)]
