import os

import jax
import pytest

import jaxspec as js
from jaxspec.testing import high_acceptance, randomize  # noqa: F401  (tests import them from here)

# Checks too long for CI's 20 minutes (each covered there by a cheaper test of the same mechanism):
# `JAXSPEC_LONG_TESTS=1 ./test.sh` runs them.
long_test = pytest.mark.skipif(os.environ.get("JAXSPEC_LONG_TESTS") != "1",
                               reason="long: JAXSPEC_LONG_TESTS=1 ./test.sh runs it")


@pytest.fixture(scope="session")
def test_cfg():
    return js.ModelConfig.preset("test")


@pytest.fixture(scope="session")
def test_params(test_cfg):
    return randomize(js.init_params(test_cfg, jax.random.key(0)), jax.random.key(1))


@pytest.fixture(scope="session")
def agreeing_params(test_params):
    return high_acceptance(test_params)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep each `xdist_group` on one worker. pytest-xdist's `--dist loadgroup` tags a grouped test's
    node id with "@group" and schedules by that tag; under pytest 9 its tag no longer reaches the id
    (pytest keeps ids in `_id`), so the groups were spread over both workers and the 8-device and
    2-process subprocesses ran once per worker. Tag them here where xdist's tag is missing."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest < 9: xdist's own tag works
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
