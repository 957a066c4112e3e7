"""What the chunked prefill costs per device, from XLA on abstract shapes (nothing is allocated).

`prefill_memory` compiles the target prefill program (`prefill.chunked_prefill`, the decode state
donated, sharded as `memory_plan` places it) for ShapeDtypeStructs and reads XLA's memory analysis:
the temporaries are what a prefill needs beside the parameters and the decode state. Under a mesh
the devices must exist (`jax_num_cpu_devices` simulates them on CPU, as `jaxspec plan --prefill`
does before jax starts its backends).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.core.checks import positive_int
from jaxspec.core.config import ModelConfig
from jaxspec.model import prefill
from jaxspec.model.network import abstract_params
from jaxspec.model.placement import param_shardings, state_specs
from jaxspec.model.state import abstract_state
from jaxspec.sharding.active import activate
from jaxspec.sharding.rules import check_mesh, check_rules


@dataclasses.dataclass(frozen=True)
class PrefillMemory:
    chunk: int  # tokens per chunk the program runs
    batch: int
    context: int  # positions the decode state holds (the prompt may fill them all)
    temp_bytes: int  # per device: XLA's temporaries of the prefill program
    argument_bytes: int  # per device: parameters + decode state + prompt
    output_bytes: int  # per device: the state written back (aliased to the donated one) + last logits
    alias_bytes: int  # per device: output bytes that reuse donated argument buffers
    flops_per_chunk: float  # XLA cost analysis of the program (a while loop's body counts once)


def _prefill_fn(cfg: ModelConfig, banded: bool):
    def run(params, state, tokens, lengths):
        out, state = prefill.chunked_prefill(params, cfg, state, tokens, lengths, banded=banded)
        return out.last_logits, state

    return run


def prefill_memory(
    cfg: ModelConfig,
    batch: int,
    context: int,
    chunk: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Mapping[str, Any] | None = None,
    weights: str = "plain",
    experts: str = "fp4",
    prompt: int | None = None,
    banded: bool = True,
) -> PrefillMemory:
    """Per-device memory of prefilling `batch` prompts of `context` tokens into a state of `context`
    positions, `chunk` tokens at a time (default `prefill.prefill_chunk(cfg)`), on `mesh` or one device.
    `prompt`: the prompt width when shorter than the state (default `context`). `banded` False: the
    dense [chunk, chunk] reference path (`prefill.chunked_prefill`).

    On CPU a bf16 config is compiled as its float32 twin (see below): then only `temp_bytes` and
    `flops_per_chunk` speak for the model; its parameter and state bytes are `memory_plan`'s."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    batch, context = positive_int("batch", batch), positive_int("context", context)
    if context > cfg.max_position_embeddings:
        raise ValueError(f"context must be <= max_position_embeddings={cfg.max_position_embeddings}, got {context}")
    prompt = context if prompt is None else positive_int("prompt", prompt)
    if prompt > context:
        raise ValueError(f"prompt ({prompt}) must be <= context ({context}): the state holds the prompt")
    chunk = prefill.prefill_chunk(cfg) if chunk is None else prefill.check_chunk(chunk)
    cfg = cfg.replace(prefill_chunk=chunk)
    if jax.default_backend() == "cpu" and cfg.dtype != "float32":
        # XLA:CPU converts every bf16 dot operand to f32 and hoists the weights' converts out of the
        # loop, so a bf16 program's temporaries would hold an f32 copy of every weight. The float32
        # twin has none; its activations are twice the bf16 ones (an upper bound).
        cfg = cfg.replace(dtype="float32")
    params = abstract_params(cfg, weights, experts)
    state = abstract_state(cfg, batch, context)
    tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = _prefill_fn(cfg, banded)
    if mesh is None:
        compiled = jax.jit(fn, donate_argnums=(1,)).lower(params, state, tokens, lengths).compile()
    else:
        mesh, rules = check_mesh(mesh), check_rules(rules)
        rep = NamedSharding(mesh, P())
        state_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(cfg, state, mesh, rules),
                                is_leaf=lambda x: isinstance(x, P))
        jitted = jax.jit(fn, in_shardings=(param_shardings(cfg, mesh, rules, params), state_sh, rep, rep),
                         out_shardings=(rep, state_sh), donate_argnums=(1,))
        with activate(mesh, rules, cfg):
            compiled = jitted.lower(params, state, tokens, lengths).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
        cost = cost[0]
    return PrefillMemory(
        chunk=prefill.effective_chunk(cfg, prompt, chunk),
        batch=batch,
        context=context,
        temp_bytes=int(mem.temp_size_in_bytes),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        flops_per_chunk=float((cost or {}).get("flops", 0.0)),
    )
