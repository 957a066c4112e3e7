"""Parameter transformations for tests, benchmarks and notebooks (random weights that exercise
every mechanism, and a draft that agrees with its target)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model import network as model_lib
from jaxspec.model.network import ModelParams
from jaxspec.model.state import init_state


def randomize(params: ModelParams, key: jax.Array, scale: float = 0.05) -> ModelParams:
    """Perturb every float leaf, so zero-initialised sinks, APE, biases and hc bases matter."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for leaf, k in zip(leaves, keys, strict=True):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            leaf = leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def high_acceptance(params: ModelParams, mix: float = 0.05) -> ModelParams:
    """Params whose MTP draft agrees with the target most of the time.

    Sub-layer outputs are scaled by `mix`, so the target's next token is mostly a function of the
    current token (through the embedding) with context-dependent perturbations; the MTP block is
    made to compute the same function of the token it consumes. Every mechanism still runs and
    still moves logits, so exactness tests stay meaningful; rejections happen at every depth.
    """
    if params.mtp is None:
        raise ValueError("high_acceptance needs params with an MTP block")

    def damp(block):
        ffn = block.ffn
        shared = ffn.shared.replace(w2=ffn.shared.w2 * mix) if ffn.shared is not None else None
        ffn = ffn.replace(experts=ffn.experts.replace(w2=ffn.experts.w2 * mix), shared=shared)
        return block.replace(attn=block.attn.replace(wo_b=block.attn.wo_b * mix), ffn=ffn)

    d = params.embed.shape[1]
    mtp = params.mtp
    mtp = mtp.replace(
        inputs=mtp.inputs.replace(
            h_proj=jnp.zeros_like(mtp.inputs.h_proj),
            e_proj=jnp.eye(d, dtype=mtp.inputs.e_proj.dtype),
            enorm=jnp.ones_like(mtp.inputs.enorm),
        ),
        block=damp(mtp.block),
        hc_head=params.hc_head,
        # sharper than the target (same argmax): confident drafts make trees grow deep
        norm=params.norm * 30.0,
    )
    return params.replace(layers=tuple(damp(b) for b in params.layers), mtp=mtp)


def mixed_acceptance(params: ModelParams, mix: float = 0.05, gap: float = 0.1, skew: float = 0.5) -> ModelParams:
    """Params whose MTP draft is right about half the time at every depth, and whose second choice is
    often the target's token (sibling accepts): the case exactness claims rest on, between `params`
    (random: almost nothing accepted) and `high_acceptance` (almost everything on the first branch).

    Deterministic, on top of `high_acceptance(params, mix)` (target and draft both follow the token-only
    function rms_norm(embed[v]) * norm @ head, context moving it a little):
    - near-tied pairs: the head's odd column 2j+1 is pulled to `gap` of its distance from column 2j,
      so after any token the two tokens of the winning pair have nearly equal logits and the target
      picks between them by a small margin that the context moves;
    - a skewed draft: the draft's final norm is scaled by 1 + skew on even and 1 - skew on odd
      dimensions, so within a pair the draft ranks by a differently weighted margin; where the two
      disagree the target's token is the draft's rank-1 child.
    Everything that the target computes is unchanged in kind (only the head's values move), so the
    greedy identity and the committed state still test every mechanism.
    """
    p = high_acceptance(params, mix)
    head = p.head  # [d, V]
    pairs = head.shape[1] // 2
    even, odd = head[:, 0 : 2 * pairs : 2], head[:, 1 : 2 * pairs : 2]
    odd = even + gap * (odd - even)
    head = head.at[:, 1 : 2 * pairs : 2].set(odd.astype(head.dtype))
    d = head.shape[0]
    pattern = jnp.where(jnp.arange(d) % 2 == 0, 1.0 + skew, 1.0 - skew).astype(p.mtp.norm.dtype)
    return p.replace(head=head, mtp=p.mtp.replace(norm=p.mtp.norm * pattern))


def sharpened(params: ModelParams, factor: float = 8.0) -> ModelParams:
    """The target's logits scaled by `factor` (its final norm), the argmax kept: on `high_acceptance`
    params, whose target is near uniform at temperature 1 (top token ~2%), sampled trees then get
    accepted. The chi-square tests' `confident_params`."""
    return params.replace(norm=params.norm * factor)


def one_shot_greedy(params: ModelParams, cfg: Any, prompt: Any, max_new_tokens: int) -> np.ndarray:
    """Greedy continuation of one prompt by the one-shot program: the whole prompt in one dense
    `extend` (no chunks, no bands), then one-token decode steps -> [max_new_tokens] int32. The
    reference the chunked `generate` is held to."""
    prompt = np.asarray(prompt, np.int32)[None]
    step = jax.jit(lambda p, st, t: model_lib.extend(p, cfg, st, t, jnp.ones(t.shape, bool), banded=False))
    out, state = step(params, init_state(cfg, 1, prompt.shape[1] + max_new_tokens), jnp.asarray(prompt))
    tokens = [int(jnp.argmax(out.logits[0, -1]))]
    for _ in range(max_new_tokens - 1):
        out, state = step(params, state, jnp.asarray([[tokens[-1]]], jnp.int32))
        tokens.append(int(jnp.argmax(out.logits[0, -1])))
    return np.asarray(tokens, np.int32)


# ---- one cycle's stages on the MTP draft of `params` (tests, benchmarks, notebooks) ---------------


def mtp_models(params: ModelParams) -> Any:
    """`Models` of params holding an MTP block: the target and that block as its draft."""
    from jaxspec.model.network import Models

    if params.mtp is None:
        raise ValueError("these params have no MTP block")
    return Models(target=params.replace(mtp=None), draft=params.mtp)


def mtp_speculator(cfg: Any, spec: Any, rule: str = "greedy", values: Any = None) -> Any:
    """The static `Speculator` of a cycle of the MTP draft (rule and values: `speculation/policy.py`)."""
    from jaxspec.core.spec import SpecConfig
    from jaxspec.speculation.cycle import Speculator
    from jaxspec.speculation.mtp import MTPDrafter
    from jaxspec.speculation.policy import Policy

    spec = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    return Speculator(cfg, spec, MTPDrafter(), Policy(rule, values))


def mtp_prefill(params: ModelParams, cfg: Any, tokens: Any, lengths: Any, max_len: int, sampling: Any = None,
                spec: Any = "s1_k1_d2") -> Any:
    """The `SpecState` a speculative loop of the MTP draft starts from (jitted prefill; `spec` sizes its stats)."""
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation import stages

    sampling = Sampling.create() if sampling is None else sampling
    return stages.prefill(mtp_speculator(cfg, spec), mtp_models(params), jnp.asarray(tokens, jnp.int32),
                          jnp.asarray(lengths, jnp.int32), max_len, sampling)


def mtp_tree(params: ModelParams, cfg: Any, spec: Any, state: Any, rule: str = "greedy", values: Any = None,
             sampling: Any = None) -> Any:
    """The tree the MTP drafter grows from `state` in a cycle of `spec` (jitted `draft_stage`)."""
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation import stages

    sampling = Sampling.create() if sampling is None else sampling
    return stages.draft(mtp_speculator(cfg, spec, rule, values), mtp_models(params), state, sampling)


def agreeing_dspark(params: ModelParams, cfg: Any, dcfg: Any, key: jax.Array, sharpness: float = 30.0) -> Any:
    """DSpark parameters whose drafts agree with `high_acceptance` params most of the time.

    Those targets' next token is mostly a function of the current one: rms_norm(embed[v]) * norm @ head.
    Here the block's base logits are switched off (a zero final norm) and the Markov head computes that
    function of the previous drafted token (W1[v] = rms_norm(embed[v]) * norm * sharpness, W2 = head: rank
    = hidden width), so every position's draft follows the target's argmax up to the context's
    perturbations; the confidence head stays random. Every mechanism still runs."""
    from jaxspec.model.dspark import init_dspark_params
    from jaxspec.ops.norms import rms_norm

    if dcfg.markov_rank != cfg.hidden_size:
        raise ValueError(f"agreeing_dspark needs markov_rank = hidden_size = {cfg.hidden_size}, got {dcfg.markov_rank}")
    dp = randomize(init_dspark_params(cfg, dcfg, key), jax.random.fold_in(key, 1))
    w1 = rms_norm(params.embed.astype(jnp.float32), params.norm, cfg.rms_norm_eps) * sharpness
    return dp.replace(norm=jnp.zeros_like(dp.norm), markov_w1=w1.astype(dp.markov_w1.dtype),
                      markov_w2=params.head.astype(dp.markov_w2.dtype))
