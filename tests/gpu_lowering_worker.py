"""Runs in its own process with 8 simulated CPU devices (see tests/test_gpu_lowering.py): the sharded
greedy speculative cycle (attention "pallas") on a (1, 8, 1) and a (1, 1, 8) mesh, exported for
CUDA. With jax >= 0.11 the export runs under an abstract mesh of 8 H200s of the same axes.

    python tests/gpu_lowering_worker.py OUT.json [--meshes 1,8,1 1,1,8] [--batch 8]

Writes per mesh the Pallas kernels found and any XLA matmul over a whole local expert stack.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

import jaxspec as js  # noqa: E402
from jaxspec.core.gpu_export import TRITON_CALL, cuda_target, expert_stack_dots, kernel_calls  # noqa: E402
from jaxspec.model import runner  # noqa: E402
from jaxspec.model.sampling import Sampling  # noqa: E402
from jaxspec.sharding.active import activate  # noqa: E402
from jaxspec.sharding.rules import MESH_AXES, check_rules  # noqa: E402
from jaxspec.speculation.cycle import speculative_cycle  # noqa: E402
from jaxspec.testing import mtp_models, mtp_prefill, mtp_speculator  # noqa: E402

# 8 heads, 8 o_groups, 8 experts of 384: every axis of both meshes divides them, a shard of the
# hidden width (48) is a multiple of the kernel's 16-wide tiles, and no other weight has its shape.
CFG = js.ModelConfig.preset("test").replace(num_heads=8, o_groups=8, n_routed_experts=8, moe_intermediate_size=384,
                                            kernels="pallas")


def export_cycle(shape, batch):
    mesh = js.make_mesh(*shape)
    S = jax.ShapeDtypeStruct
    params = jax.eval_shape(lambda: js.init_params(CFG, jax.random.key(0)))
    state = jax.eval_shape(lambda p, t, n: mtp_prefill(p, CFG, t, n, 128, spec="s3_k2_d6"), params,
                           S((batch, 16), jnp.int32), S((batch,), jnp.int32))
    args = [mtp_speculator(CFG, "s3_k2_d6"), mtp_models(params), state, jax.eval_shape(Sampling.create),
            S((batch,), jnp.bool_)]
    rules = check_rules(None)
    static = tuple(i for i, a in enumerate(args) if not runner.is_dynamic(a))
    program, _ = runner._build_program(speculative_cycle, mesh, rules, CFG, args, static, batch)
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    with activate(mesh, rules, CFG), cuda_target(shape, MESH_AXES):
        exported = export.export(program, platforms=("cuda",), disabled_checks=checks)(
            *[a for i, a in enumerate(args) if i not in static])
    text = exported.mlir_module()
    local_e = CFG.n_routed_experts // (shape[2] if shape[2] > 1 else 1)
    e_hidden = CFG.moe_intermediate_size // (shape[1] if shape[1] > 1 else 1)
    return {"kernels": dict(kernel_calls(text)), "devices": exported.nr_devices,
            "dense_expert_dots": expert_stack_dots(text, local_e, CFG.hidden_size, e_hidden)
            + expert_stack_dots(text, CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size)}


def main(argv):
    out = argv[0]
    meshes = [(1, 8, 1), (1, 1, 8)]
    batch = 8
    if "--meshes" in argv:
        i = argv.index("--meshes") + 1
        meshes = [tuple(int(v) for v in m.split(",")) for m in argv[i:] if "," in m]
    if "--batch" in argv:
        batch = int(argv[argv.index("--batch") + 1])
    result = {"jax": jax.__version__}
    for shape in meshes:
        try:
            result[",".join(map(str, shape))] = export_cycle(shape, batch)
        except Exception as e:  # reported, and failed on, by the test
            result[",".join(map(str, shape))] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
