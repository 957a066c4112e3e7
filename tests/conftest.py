import jax
import jax.numpy as jnp
import pytest

import jaxspec as js


def randomize(params, key, scale=0.05):
    """Perturb every float leaf, so zero-initialised sinks, APE, biases and hc bases matter."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for leaf, k in zip(leaves, keys, strict=False):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            leaf = leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


@pytest.fixture(scope="session")
def test_cfg():
    return js.ModelConfig.preset("test")


@pytest.fixture(scope="session")
def test_params(test_cfg):
    return randomize(js.init_params(test_cfg, jax.random.key(0)), jax.random.key(1))


def high_acceptance(params, mix=0.05):
    """Params whose MTP draft agrees with the target most of the time.

    Sub-layer outputs are scaled by `mix`, so the target's next token is mostly a function of the
    current token (through the embedding) with context-dependent perturbations; the MTP block is
    made to compute the same function of the token it consumes. Every mechanism still runs and
    still moves logits, so exactness tests stay meaningful; rejections happen at every depth.
    """
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


@pytest.fixture(scope="session")
def agreeing_params(test_params):
    return high_acceptance(test_params)
