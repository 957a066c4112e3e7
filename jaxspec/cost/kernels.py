"""Kernel launches per unit pass counted from the GPU program itself, for the latency model's launch
term (`latency.Latency.kernels`; `jaxspec cost --kernels counted`).

`gpu_export.launch_estimate` walks the jaxpr of one `model.block` of each layer kind (and of the
head) as lowered for CUDA: a launch per matmul, reduction, sort / top-k, scatter and Pallas kernel,
loop bodies counted per iteration. The hand-counted defaults (`latency.DEFAULT_KERNELS`) assume a
fused program; the count says what the program holds (docs/gpu.md, "Kernels per layer").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.core.config import ModelConfig
from jaxspec.core.gpu_export import launch_estimate
from jaxspec.model import network as model
from jaxspec.model import state as state_lib


@functools.lru_cache(maxsize=8)
def counted_kernels(cfg: ModelConfig, tokens: int = 1) -> dict[str, int]:
    """{"sliding" | "csa" | "hca" | "head": launches of one pass of `tokens` tokens} for `cfg` as lowered
    for CUDA (its kernels decides which Pallas kernels replace XLA ops)."""
    params = model.abstract_params(cfg)
    state = jax.eval_shape(lambda: state_lib.init_state(cfg, 1, 256))
    streams = jax.ShapeDtypeStruct((1, tokens, cfg.hc_mult, cfg.hidden_size), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    committed = jax.ShapeDtypeStruct((1,), jnp.int32)
    out: dict[str, int] = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind in out:
            continue

        def block(p, x, t, layer_state, length, kind=kind):
            return model.block(p, cfg, kind, x, t, layer_state, model.causal_context(length, jnp.ones(t.shape, bool)))

        out[kind] = sum(launch_estimate(block, params.layers[i], streams, ids, state.layers[i], committed).values())
    out["head"] = sum(launch_estimate(lambda p, x: model.head_logits(p, cfg, x), params, streams).values())
    return out
