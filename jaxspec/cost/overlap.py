"""The routing overlap rho of a checkpoint on real text: how much fewer distinct experts n
consecutive tokens touch than independent routing says (`routing.expected_distinct`).

The target runs a causal prefill of each prompt from an empty state, layer by layer as
`model.block` does, and keeps every learned-router layer's top-k choice; over each window of n
consecutive tokens the distinct experts are counted, and rho solves
distinct = k + (union - k)(1 - rho) for the mean count (hash-routed layers are left out: their
table is fixed, the independent formula is theirs). n consecutive tokens are what a chain's verify
routes; a tree's siblings at one depth are not consecutive, so this is an estimate for trees.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import ModelConfig
from jaxspec.cost import routing
from jaxspec.layers.attention import attention
from jaxspec.layers.mhc import hc_post, hc_pre
from jaxspec.layers.moe import moe, route
from jaxspec.model.network import ModelParams, causal_context
from jaxspec.model.state import init_state
from jaxspec.ops.norms import rms_norm


def layer_choices(params: ModelParams, cfg: ModelConfig,
                  tokens: jax.Array) -> tuple[list[jax.Array], jax.Array]:  # tokens [1, T]
    """-> (expert indices [T, k] of every main layer, final streams [1, T, hc, d]) of one prompt's
    causal prefill (the streams equal `network.forward`'s hidden: tested)."""
    state = init_state(cfg, 1, tokens.shape[1])
    ctx = causal_context(jnp.zeros((1,), jnp.int32), jnp.ones(tokens.shape, bool))
    streams = jnp.broadcast_to(params.embed[tokens][:, :, None, :], (*tokens.shape, cfg.hc_mult, cfg.hidden_size))
    out = []
    for i, kind in enumerate(cfg.layer_types):
        p = params.layers[i]
        collapsed, post, comb = hc_pre(p.hc_attn, cfg, streams)
        attn_out, _ = attention(p.attn, cfg, kind, rms_norm(collapsed, p.attn_norm, cfg.rms_norm_eps),
                                state.layers[i], ctx)
        streams = hc_post(attn_out, streams, post, comb)
        collapsed, post, comb = hc_pre(p.hc_ffn, cfg, streams)
        x = rms_norm(collapsed, p.ffn_norm, cfg.rms_norm_eps)
        indices, _ = route(p.ffn, cfg, x.reshape(-1, cfg.hidden_size), tokens.reshape(-1))
        out.append(indices)
        streams = hc_post(moe(p.ffn, cfg, x, tokens), streams, post, comb)
    return out, streams


# One compile per prompt length (and config), shared by every caller.
jitted_layer_choices = jax.jit(layer_choices, static_argnums=(1,))


def measure(params: ModelParams, cfg: ModelConfig, prompts: Sequence[Sequence[int]], n: int) -> dict[str, float]:
    """-> {"distinct": mean distinct experts per n-token window (learned layers), "independent": the
    union formula's, "overlap": rho (clipped to [0, 0.99])}."""
    if n < 2:
        raise ValueError(f"n must be >= 2 (one token touches exactly k experts), got {n}")
    learned = [i for i in range(cfg.num_layers) if i >= cfg.num_hash_layers]
    if not learned:
        raise ValueError("every layer of this model is hash-routed: no learned router to measure")
    counts = []
    for prompt in prompts:
        if len(prompt) < n:
            continue
        choices, _ = jitted_layer_choices(params, cfg, jnp.asarray([list(prompt)], jnp.int32))
        for i in learned:
            idx = np.asarray(choices[i])
            counts += [len(np.unique(idx[s:s + n])) for s in range(0, len(prompt) - n + 1, n)]
    if not counts:
        raise ValueError(f"no prompt has >= {n} tokens")
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    union = routing.expected_distinct(e, k, n)
    distinct = float(np.mean(counts))
    rho = 1.0 - (distinct - k) / (union - k)
    return {"distinct": distinct, "independent": union, "overlap": float(min(max(rho, 0.0), 0.99)),
            "windows": len(counts)}
