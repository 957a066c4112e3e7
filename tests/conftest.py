import jax
import pytest

import jaxspec as js
from jaxspec.testing import high_acceptance, randomize  # noqa: F401  (tests import them from here)


@pytest.fixture(scope="session")
def test_cfg():
    return js.ModelConfig.preset("test")


@pytest.fixture(scope="session")
def test_params(test_cfg):
    return randomize(js.init_params(test_cfg, jax.random.key(0)), jax.random.key(1))


@pytest.fixture(scope="session")
def agreeing_params(test_params):
    return high_acceptance(test_params)
