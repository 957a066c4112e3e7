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
